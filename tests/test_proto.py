"""The contracts: generated stubs are current, every field says what it holds."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from google.protobuf import descriptor_pb2

from pagedserve.proto import generate

grpc_tools = pytest.importorskip("grpc_tools")

REPO = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_the_proto_files(tmp_path: Path):
    fresh = generate.generate(tmp_path)
    assert fresh, "nothing generated"
    stale = [
        path.name for path in fresh if not filecmp.cmp(path, generate.STUB_DIR / path.name, shallow=False)
    ]
    assert not stale, f"stale generated stubs (run `make proto`): {stale}"


def _descriptor_set_with_comments() -> descriptor_pb2.FileDescriptorSet:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        assert protoc.main(generate.protoc_args("--include_source_info", f"--descriptor_set_out={out}")) == 0
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _uncommented_fields(file: descriptor_pb2.FileDescriptorProto) -> list[str]:
    commented = {
        tuple(loc.path)
        for loc in file.source_code_info.location
        if loc.leading_comments.strip() or loc.trailing_comments.strip()
    }
    missing = []

    def walk(message: descriptor_pb2.DescriptorProto, path: tuple[int, ...], name: str) -> None:
        if message.options.map_entry:
            return
        for i, field in enumerate(message.field):
            # DescriptorProto.field is field number 2.
            if (*path, 2, i) not in commented:
                missing.append(f"{name}.{field.name}")
        for i, nested in enumerate(message.nested_type):
            walk(nested, (*path, 3, i), f"{name}.{nested.name}")

    for i, message in enumerate(file.message_type):
        # FileDescriptorProto.message_type is field number 4.
        walk(message, (4, i), message.name)
    return missing


def test_every_field_of_every_contract_is_commented():
    files = _descriptor_set_with_comments().file
    assert {f.name for f in files} == set(generate.PROTO_FILES)
    missing = [field for f in files for field in _uncommented_fields(f)]
    assert not missing, f"fields without a comment saying what they hold: {missing}"


def test_each_contract_lies_in_the_folder_of_its_package():
    # What lets `protoc -I proto`, buf and any language's loader resolve the imports with proto/ as the root.
    for f in _descriptor_set_with_comments().file:
        assert str(Path(f.name).parent) == f.package.replace(".", "/"), (f.name, f.package)
        assert (generate.PROTO_ROOT / f.name).is_file()
        assert all(Path(dep).parent == Path(f.name).parent for dep in f.dependency), f.dependency


def test_step_plan_carries_per_request_fields_as_packed_arrays():
    from pagedserve.v1 import worker_pb2

    plan = worker_pb2.StepPlan(step_id=1, slots=[0, 1, 2], num_scheduled_tokens=[1, 1, 7])
    wire = plan.SerializeToString()
    # Packed repeated scalars: one tag and length for each array, not one per element.
    assert len(wire) < 16
    assert worker_pb2.StepPlan.FromString(wire) == plan


def test_buf_lints_with_the_standard_rules_and_no_exceptions():
    config = yaml.safe_load((REPO / "proto" / "buf.yaml").read_text())
    assert config["version"] == "v2"
    assert config["lint"] == {"use": ["STANDARD"]}, "no except or ignore entries"


def _buf() -> str | None:
    """The buf that `npm ci` in examples/node installs (a node launcher), else one on PATH."""
    local = REPO / "examples" / "node" / "node_modules" / ".bin" / "buf"
    if local.exists() and shutil.which("node"):
        return str(local)
    return shutil.which("buf")


@pytest.mark.parametrize("command", [["lint"], ["build", "-o", os.devnull]], ids=["lint", "build"])
def test_buf_passes_on_proto(command: list[str]):
    buf = _buf()
    if buf is None:
        pytest.skip("no buf here (`npm ci` in examples/node installs one)")
    result = subprocess.run([buf, *command], cwd=REPO / "proto", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
