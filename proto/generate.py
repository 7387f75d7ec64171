"""Generate the Python stubs of the contracts: `python -m pagedserve.proto.generate` (or `make proto`).

The .proto files live in proto/pagedserve/v1/, their folder matching their package, and import each
other relative to proto/ (`import "pagedserve/v1/common.proto";`), so any protoc, buf or gRPC client
given proto/ as its include root compiles them. Generated from that root, the Python stubs import
`pagedserve.v1.<name>_pb2`, the package that folder is installed as, and sit next to their .proto files.

The stubs are committed so a fresh clone works without grpcio-tools; tests/test_proto.py regenerates
them into a temporary folder and fails when the committed ones are stale.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pagedserve.v1

# The folder of pagedserve.v1 (proto/pagedserve/v1 in the repository) and the include root two levels up.
STUB_DIR = Path(pagedserve.v1.__file__).resolve().parent
PROTO_ROOT = STUB_DIR.parents[1]
# Paths relative to PROTO_ROOT, as the files import each other.
PROTO_FILES = [f"pagedserve/v1/{name}.proto" for name in ("common", "engine", "text_generation", "worker")]


def protoc_args(*outputs: str) -> list[str]:
    """grpc_tools.protoc's arguments for every contract: PROTO_ROOT and grpc_tools' own well-known types
    as the include path, then `outputs` (e.g. --python_out=DIR)."""
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    return ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", *outputs, *PROTO_FILES]


def generate(out_dir: Path) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every contract into out_dir."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        args = protoc_args(f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}")
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for path in sorted((Path(tmp) / "pagedserve" / "v1").iterdir()):
            shutil.copyfile(path, out_dir / path.name)
            written.append(out_dir / path.name)
        return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else STUB_DIR):
        print(path)
