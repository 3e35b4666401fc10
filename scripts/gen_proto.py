#!/usr/bin/env python3
"""Generate the gRPC stubs under tandem/rpc/ from proto/.

The stubs are committed (the GPU machine has no grpcio-tools, and stubs made by a newer grpcio-tools
refuse to import on its grpcio 1.84), so run this with grpcio-tools==1.84.0 after editing a .proto;
tests/test_proto_stubs.py fails when the committed stubs drift from the protos.
Usage: python scripts/gen_proto.py [OUT_DIR]   (default: the repository root)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted((ROOT / "proto").rglob("*.proto"))
    args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *map(str, protos)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for proto in protos:  # every generated folder is a regular package
        rel = proto.relative_to(ROOT / "proto").parent
        for depth in range(1, len(rel.parts) + 1):
            init = out_dir / Path(*rel.parts[:depth]) / "__init__.py"
            if not init.exists() and rel.parts[:depth] != ("tandem",):
                init.write_text("")
    return protos


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
