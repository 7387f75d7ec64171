"""A fresh install works the way the README says, and our package names never shadow anyone's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pagedserve
from pagedserve.launcher import python_command

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
    # From the repository root, where a bare `import kernels` could find our folder, as the launcher
    # starts the services: transformers' hub integration imports the Hugging Face package of that name
    # when it is installed (as transformers 5 requires), and must get that package or none.
    code = (
        "import importlib.util, pathlib, sys\n"
        "import transformers.integrations.hub_kernels\n"
        "spec = importlib.util.find_spec('kernels')\n"
        f"assert spec is None or pathlib.Path(spec.origin).parent != pathlib.Path({str(REPO / 'kernels')!r}), spec\n"
        "assert 'pagedserve.kernels' not in sys.modules\n"
    )
    result = _run(*python_command("-c", code))
    assert result.returncode == 0, result.stderr


def test_version_is_exposed():
    result = _run(str(BIN / "pagedserve"), "--version")
    assert result.stdout.strip() == pagedserve.__version__
