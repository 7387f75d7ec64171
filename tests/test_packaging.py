"""A fresh install works the way the README says, and our package names never shadow anyone's."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
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
    import pagedserve.v1
    import pagedserve.worker_svc

    for module, folder in [
        (pagedserve.kernels, "kernels"),
        (pagedserve.gateway, "gateway"),
        (pagedserve.proto, "proto"),
        (pagedserve.v1, "proto/pagedserve/v1"),
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


def test_editable_install_serves_the_contracts_stubs_from_beside_their_proto_files():
    code = (
        "import pathlib, pagedserve.v1\n"
        "from pagedserve.v1 import common_pb2, engine_pb2_grpc, text_generation_pb2_grpc, worker_pb2_grpc\n"
        "print(pathlib.Path(pagedserve.v1.__file__).parent)\n"
    )
    result = _run(*python_command("-c", code), cwd=Path("/"))
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == REPO / "proto" / "pagedserve" / "v1"


def test_pip_install_ships_pagedserve_v1_with_its_proto_files(tmp_path: Path):
    # Built from a copy of what the container images copy, so the build leaves nothing in the working tree.
    source = tmp_path / "source"
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in {Path(d).parts[0] for d in package_dirs.values()}:
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(REPO / name, source / name)
    target = tmp_path / "site"
    result = _run(
        str(BIN / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
        "--target", str(target), str(source),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # The worker builds its C++ step inputs from their source where it runs.
    assert (target / "pagedserve" / "worker_svc" / "csrc" / "step_inputs.cpp").is_file()
    installed = target / "pagedserve" / "v1"
    for name in ("common", "engine", "text_generation", "worker"):
        for suffix in (".proto", "_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (installed / f"{name}{suffix}").is_file(), f"{name}{suffix} not installed"
    code = (
        "import pathlib, pagedserve.v1\n"
        "from pagedserve.v1 import text_generation_pb2_grpc\n"
        "print(pathlib.Path(pagedserve.v1.__file__).parent)\n"
    )
    result = subprocess.run(
        python_command("-c", code),
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == installed
