#!/usr/bin/env python3
"""Host cost of one service round's messages, on any machine: the verifier building and serializing a
Round (an extend of 3 tokens and a draft request per request), the drafter parsing it and building
and serializing the Drafts (chains of 4 nodes), and the verifier parsing the Drafts into DraftTrees —
the Python work of drafter_client.py and drafter/service.py around the transport, at batch 1, 8 and 64.
Best of 300 (noise only adds).

    python bench/round_messages.py [--out round_messages.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from host_timing import best_seconds  # noqa: E402
from tandem.rpc.drafter.v1 import drafter_pb2 as pb  # noqa: E402
from tandem.speculative.tree import DraftTree  # noqa: E402
from tandem.speculative.tree_wire import pack_trees, unpack_trees  # noqa: E402

CHAIN = ([5, 6, 7, 8], [-1, 0, 1, 2], [0.0, -0.1, -0.2, -0.3])  # tokens, parents, scores of one drafted tree


def verifier_round(batch: int) -> bytes:
    params = pb.SpecParams(num_steps=3, topk=1, num_draft_tokens=4)
    r = pb.Round(seq=1, extend=[pb.Extend(request_id=f"req-{i}", token_ids=[1, 2, 3], ring_offset=3 * i, ring_rows=3)
                                for i in range(batch)],
                 draft=[pb.DraftRequest(request_id=f"req-{i}", spec=params) for i in range(batch)])
    return pb.VerifierMessage(round=r).SerializeToString()


def drafter_reply(data: bytes) -> bytes:
    message = pb.VerifierMessage.FromString(data)
    _ = [(e.request_id, list(e.token_ids)) for e in message.round.extend]
    drafts = pb.Drafts(seq=message.round.seq)
    pack_trees(drafts, [DraftTree(*CHAIN) for _ in message.round.draft])  # as drafter/service.py packs them
    return pb.DrafterMessage(drafts=drafts).SerializeToString()


def verifier_trees(data: bytes, batch: int):
    return unpack_trees(pb.DrafterMessage.FromString(data).drafts, batch)


def best_us(fn, repeat: int = 300) -> float:
    return best_seconds(fn, repeat) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for batch in (1, 8, 64):
        round_bytes = verifier_round(batch)
        reply = drafter_reply(round_bytes)
        row = {"batch": batch, "round_bytes": len(round_bytes), "drafts_bytes": len(reply),
               "verifier_build_us": best_us(lambda: verifier_round(batch)),
               "drafter_us": best_us(lambda: drafter_reply(round_bytes)),
               "verifier_unpack_us": best_us(lambda: verifier_trees(reply, batch))}
        rows.append(row)
        print(f"batch {batch:2d}: verifier builds the Round {row['verifier_build_us']:6.0f} us, drafter parses it and "
              f"packs the Drafts {row['drafter_us']:6.0f} us, verifier unpacks the trees "
              f"{row['verifier_unpack_us']:6.0f} us ({len(round_bytes)} / {len(reply)} bytes)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                              "python": platform.python_version(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
