#!/usr/bin/env python3
"""The service boundary's cost per round, on any machine (CPU is fine): tiny random models, the real
``python -m drafter`` and ``python -m verifier`` on loopback, every round speculating, and the
verifier's tandem:drafter_round_seconds split into the drafter's own work and the rest of the round
trip (gRPC stream, event loops, the shared-memory ring). The models are so small that the rest is
nearly all boundary — what one message each way per round costs on this host, on the round lane
(a local socket, the default) and on the gRPC stream (the protocol's original transport, ``--disable-round-lane``).
The verifier runs with ``--disable-round-prefetch``: a prefetched Round's trip would also hold the
engine's own work after the send, so only rounds sent and awaited in one go measure the boundary.

    python bench/boundary.py [--tokens 256] [--transports lane stream] [--out boundary.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from service_pair import round_parts, round_parts_ms, service_pair  # noqa: E402

# Where the rounds travel: the round lane (tandem/round_lane.py, the default) or the gRPC stream.
TRANSPORTS = {"lane": ["--disable-round-prefetch"], "stream": ["--disable-round-lane", "--disable-round-prefetch"]}


def tiny_pair(folder: Path) -> tuple[Path, Path]:
    from tandem.configs.model import ModelConfig
    from tandem.models.eagle3_checkpoint import write_random_eagle3
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama

    target = write_random_llama(folder / "target", LlamaShape(num_layers=6), seed=0)
    draft = folder / "draft"
    # Capture layers [2, 3, 3] of 6 by default: outputs of layers 1, 2, 2 (eagle ids name outputs).
    capture = ModelConfig.from_dir(target).default_capture_layers()
    write_random_eagle3(draft, ModelConfig.from_dir(target), draft_vocab_size=512, seed=1,
                        aux_layer_ids=tuple(k - 1 for k in capture))
    return target, draft


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--transports", nargs="+", choices=list(TRANSPORTS), default=list(TRANSPORTS))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    flags = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "tokens": args.tokens, "transports": {}}
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = tiny_pair(Path(tmp))
        prompt = list(range(5, 69))
        for transport in args.transports:
            with service_pair(target, draft, "cpu", "float32", flags, TRANSPORTS[transport]) as (generate, m_port):
                generate(prompt, 16)  # warm-up
                before = round_parts(m_port)
                started = time.perf_counter()
                last = generate(prompt, args.tokens)
                seconds = time.perf_counter() - started
                parts = round_parts_ms(before, round_parts(m_port))
            result["transports"][transport] = {
                "seconds": seconds, "rounds": parts["rounds"], "drafter_ms_per_round": parts["drafter"],
                "boundary_ms_per_round": parts["boundary"], "wait_ms_per_round": parts["wait"], "drafter_phases_ms": {
                    k: parts[k] for k in ("extend", "draft")}, "accept_length": last.spec.accept_length_mean}
            print(f"{transport}: {parts['rounds']:.0f} rounds: drafter work {parts['drafter']:.3f} ms (extend "
                  f"{parts['extend']:.3f}, draft {parts['draft']:.3f}), rest of the "
                  f"round trip {parts['boundary']:.3f} ms per round, engine waited {parts['wait']:.3f} ms "
                  f"({args.tokens / seconds:.0f} tok/s end to end)",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
