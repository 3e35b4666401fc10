"""cProfile of the arrivals closed loop (bench/sections_arrivals.py) on the shipped demo pair's target, target-only
at concurrency 64: host time per function. Extra arguments go to the verifier's parser (e.g.
--prefill-graph-tokens 0).
  usage: python3 bench/profile_arrivals.py [verifier flags...]"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    import torch

    from sections_arrivals import _closed_loop
    from tandem.training.demo import SHIPPED
    from tandem.training.demo_pair import demo_eval_prompts
    from verifier.__main__ import build_parser
    from verifier.config import VerifierConfig
    from verifier.metrics import VerifierMetrics
    from verifier.serve import build_engine

    folder = Path(SHIPPED)
    saved = folder / "prompts.json"
    prompts = json.loads(saved.read_text()) if saved.is_file() else demo_eval_prompts(str(folder / "target"), 64)
    device, dtype = ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")
    args = build_parser().parse_args(["--model", str(folder / "target"), "--device", device, "--dtype", dtype,
                                      "--kv-pages", "12288", *sys.argv[1:]])
    engine, _, _ = build_engine(VerifierConfig.from_args(args, args.model), VerifierMetrics())
    _closed_loop(engine, prompts, 64, 2.0)  # warm
    profile = cProfile.Profile()
    profile.enable()
    result = _closed_loop(engine, prompts, 64, 4.0)
    profile.disable()
    print("tok/s", round(result["tok_s"]), json.dumps(result["steps"]))
    pstats.Stats(profile).sort_stats("tottime").print_stats(35)
    pstats.Stats(profile).sort_stats("cumtime").print_stats(45)


if __name__ == "__main__":
    main()
