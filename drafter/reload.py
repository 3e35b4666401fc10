"""Ask a running drafter to serve another EAGLE-3 checkpoint (``tandem reload-drafter``)."""

from __future__ import annotations

import os

import grpc

from tandem.errors import TandemError
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.rpc.drafter.v1 import drafter_pb2_grpc as pb_grpc


def reload_drafter(address: str, draft_model: str, timeout_s: float = 600.0) -> pb.ReloadReply:
    """→ the drafter's reply; raises TandemError with the drafter's reason when it refuses or is unreachable.
    The path is made absolute here: the drafter resolves it in its own working directory."""
    with grpc.insecure_channel(address) as channel:
        try:
            return pb_grpc.DrafterStub(channel).Reload(pb.ReloadRequest(draft_model=os.path.abspath(draft_model)),
                                                       timeout=timeout_s)
        except grpc.RpcError as e:
            raise TandemError(f"the drafter at {address} did not reload: {e.code().name}: {e.details()}") from None


def add_arguments(p) -> None:
    p.add_argument("--drafter", required=True, help="the drafter service, host:port")
    p.add_argument("--model", "--draft-model", dest="draft_model", required=True, help="the EAGLE-3 folder to serve")
    p.add_argument("--timeout-s", type=float, default=600.0, help="loading and graph capture included")


def run(args) -> int:
    reply = reload_drafter(args.drafter, args.draft_model, args.timeout_s)
    print(f"drafter at {args.drafter}: generation {reply.generation} serves {reply.draft_model} "
          f"(loaded in {reply.load_seconds:.2f} s; {reply.requests_on_previous} running requests finish on the previous head)")
    return 0
