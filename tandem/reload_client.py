"""A client of the drafter service's Reload: ask a running drafter to serve another EAGLE-3 checkpoint
(``tandem reload-drafter``, ``python -m drafter.train --reload-drafter``). Torch-free; the core's, not the
service's, so the app and the trainer need not import a service."""

from __future__ import annotations

import os

import grpc

from tandem import args as shared
from tandem import internal_secret
from tandem.errors import TandemError
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.rpc.drafter.v1 import drafter_pb2_grpc as pb_grpc


def reload_drafter(address: str, draft_model: str, timeout_s: float = 600.0,
                   secret: str | None = None) -> pb.ReloadReply:
    """→ the drafter's reply; raises TandemError with the drafter's reason when it refuses or is unreachable.
    The path is made absolute here: the drafter resolves it in its own working directory. ``secret``: the
    internal plane's (default: $TANDEM_INTERNAL_SECRET)."""
    secret = secret if secret is not None else internal_secret.load()
    with grpc.insecure_channel(address) as channel:
        try:
            return pb_grpc.DrafterStub(channel).Reload(pb.ReloadRequest(draft_model=os.path.abspath(draft_model)),
                                                       timeout=timeout_s, metadata=internal_secret.metadata(secret))
        except grpc.RpcError as e:
            hint = (" (give --internal-secret-file: tandem up prints the path of its stack's secret)"
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED and not secret else "")
            raise TandemError(f"the drafter at {address} did not reload: {e.code().name}: {e.details()}{hint}") from None


def add_arguments(p) -> None:
    p.add_argument("--drafter", required=True, help="the drafter service, host:port")
    p.add_argument("--model", "--draft-model", dest="draft_model", required=True, help="the EAGLE-3 folder to serve")
    p.add_argument("--timeout-s", type=float, default=600.0, help="loading and graph capture included")
    shared.add(p, shared.INTERNAL_SECRET_FILE)


def run(args) -> int:
    reply = reload_drafter(args.drafter, args.draft_model, args.timeout_s, internal_secret.load(args.internal_secret_file))
    print(f"drafter at {args.drafter}: generation {reply.generation} serves {reply.draft_model} "
          f"(loaded in {reply.load_seconds:.2f} s; {reply.requests_on_previous} running requests finish on the previous head)")
    return 0
