"""The committed gRPC stubs are what the protos generate (grpcio-tools 1.84, the GPU machine's grpcio)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def test_committed_stubs_match_the_protos(tmp_path):
    pytest.importorskip("grpc_tools")
    import grpc_tools
    from importlib.metadata import version

    if version("grpcio-tools") != "1.84.0":
        pytest.skip("stubs are generated with grpcio-tools 1.84.0 (the dev extra pins it)")
    gen_proto = importlib.import_module("gen_proto")
    gen_proto.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.is_file(), f"{rel} is not committed: run python scripts/gen_proto.py"
        assert committed.read_text() == (tmp_path / rel).read_text(), f"{rel} drifted: run python scripts/gen_proto.py"


def test_stubs_import_and_declare_the_services():
    from tandem.rpc.drafter.v1 import drafter_pb2, drafter_pb2_grpc
    from tandem.rpc.generation.v1 import generation_pb2_grpc
    from tandem.rpc.verifier.v1 import verifier_pb2_grpc

    assert drafter_pb2.DESCRIPTOR.package == "tandem.rpc.drafter.v1"
    assert hasattr(drafter_pb2_grpc, "DrafterStub")
    assert hasattr(verifier_pb2_grpc, "VerifierServicer")
    assert hasattr(generation_pb2_grpc, "add_GenerationServicer_to_server")
    assert drafter_pb2_grpc.GRPC_GENERATED_VERSION == "1.84.0"
