"""A fresh install works the way the README says, and our package names never shadow anyone's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pagedserve

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_console_script_lists_every_subcommand():
    result = _run(str(BIN / "pagedserve"), "--help")
    assert result.returncode == 0, result.stderr
    for command in ("serve", "worker", "scheduler", "gateway", "bench"):
        assert f"  {command} " in result.stdout


def test_unknown_subcommand_is_refused_with_usage():
    result = _run(str(BIN / "pagedserve"), "frobnicate")
    assert result.returncode == 2
    assert "unknown command" in result.stderr and "usage:" in result.stderr


def test_layers_import_from_their_top_level_folders():
    import pagedserve.gateway
    import pagedserve.kernels
    import pagedserve.proto
    import pagedserve.scheduler_svc
    import pagedserve.worker_svc

    for module, folder in [
        (pagedserve.kernels, "kernels"),
        (pagedserve.gateway, "gateway"),
        (pagedserve.proto, "proto"),
        (pagedserve.scheduler_svc, "scheduler_svc"),
        (pagedserve.worker_svc, "worker_svc"),
    ]:
        assert Path(module.__file__).parent == REPO / folder


def test_transformers_never_takes_our_kernels_for_the_hub_package():
    # Run from the repository root, where a bare `import kernels` could find our folder.
    code = (
        "from transformers.utils import is_kernels_available\n"
        "import sys\n"
        "assert not is_kernels_available(), 'transformers believes the kernels hub is installed'\n"
        "assert 'pagedserve.kernels' not in sys.modules\n"
    )
    result = _run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr


def test_version_is_exposed():
    result = _run(str(BIN / "pagedserve"), "--version")
    assert result.stdout.strip() == pagedserve.__version__
