"""Generate the Python stubs of the contracts: `python -m pagedserve.proto.generate` (or `make proto`).

The stubs are committed so a fresh clone works without grpcio-tools; tests/test_proto.py regenerates
them into a temporary folder and fails when the committed ones are stale.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ["common.proto", "engine.proto", "text_generation.proto", "worker.proto"]
# The .proto files import each other as "pagedserve/proto/<name>.proto" so that the generated code
# imports `pagedserve.proto.<name>_pb2`, the package this folder is installed as.
IMPORT_PREFIX = "pagedserve/proto"


def generate(out_dir: Path) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every contract into out_dir."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{IMPORT_PREFIX}={PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(PROTO_DIR / name) for name in PROTO_FILES),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for path in sorted((Path(tmp) / IMPORT_PREFIX).iterdir()):
            shutil.copyfile(path, out_dir / path.name)
            written.append(out_dir / path.name)
        return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
