"""Builds a C++ extension of torch for this machine, once, and loads it (torch.utils.cpp_extension: g++ and
ninja), for C++ that lives beside the Python it serves (worker_svc/csrc).

The build is named after this CPU's model and feature flags, the sources, the flags and the sources'
folder, so that an extension cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions) shared by
several CPUs or checkouts never loads another's build, nor rebuilds it each time the other loads it (the
build's ninja file names the source paths).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch


def extension_name(prefix: str, sources: Sequence[Path], flags: Sequence[str]) -> str:
    """prefix and a short hash of this CPU, the sources (names and contents), the flags and the folder."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join([line for line in lines if line.startswith(("flags", "model name"))][:2])
    except OSError:
        cpu = ""
    files = [f"{path.name}\0{path.read_text()}" for path in sources]
    folders = sorted({str(path.resolve().parent) for path in sources})
    key = "\0".join([cpu or torch.backends.cpu.get_cpu_capability(), *files, *flags, *folders])
    return f"{prefix}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def load_extension(prefix: str, sources: Sequence[Path], flags: Sequence[str]) -> ModuleType:
    """The extension built from sources with flags, built first where this machine has none. Raises when it
    cannot be built (no C++ compiler, no ninja, a compile error)."""
    from torch.utils import cpp_extension

    from pagedserve.logging import get_logger

    log = get_logger(__name__)
    name = extension_name(prefix, sources, flags)
    started = time.monotonic()
    log.info("extension_loading", name=name, note="compiled once per machine, the first time")
    module = cpp_extension.load(
        name=name, sources=[str(path) for path in sources], extra_cflags=list(flags), verbose=False
    )
    log.info("extension_ready", name=name, seconds=round(time.monotonic() - started, 1))
    return module
