#!/usr/bin/env python3
"""Host cost of staging a forward's inputs, on any machine (CPU is fine): the graph path's
``TargetGraphRunner.prepare`` (one verify step of a batch: token ids, positions, slots, whole block
tables, masks, packed into the pinned buffer) and the eager path's ``to_device`` (a long prefill),
with block tables given as Python lists (as before) and as ``SequenceKV.page_table()`` arrays (now).
Every step restages each sequence's whole block table, so this is the part that grows with context.

    python bench/staging.py [--batch 64] [--pages 160 2000] [--out staging.json]
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from host_timing import best_seconds  # noqa: E402


def best_ms(fn, repeat: int = 30) -> float:
    return best_seconds(fn, repeat) * 1e3


def main() -> int:
    from tandem.forward_batch import ForwardBatch, SequenceChunk, to_device
    from tandem.engine.config import EngineConfig
    from tandem.engine.cuda_graph import TargetGraphRunner
    from tandem.engine.llm_engine import LLMEngine
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--pages", type=int, nargs="+", default=[160, 2000], help="pages per sequence (x16 tokens)")
    p.add_argument("--width", type=int, default=4, help="verify width (num_draft_tokens)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    page_size, width = 16, args.width
    context = max(args.pages) * page_size + 64
    rng = np.random.default_rng(0)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
              "torch": torch.__version__, "batch": args.batch, "width": width, "page_size": page_size, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        target = write_random_llama(Path(tmp) / "t", LlamaShape(vocab_size=256, hidden_size=64, intermediate_size=96,
                                                                 num_layers=1, num_heads=2, num_kv_heads=1,
                                                                 max_position_embeddings=context))
        with LLMEngine(EngineConfig(model=str(target), page_size=page_size, kv_pages=64)) as eng:
            graphs = TargetGraphRunner(eng.executor.runner, widths=(width,), max_bs=args.batch)
            for pages in args.pages:
                tables = [rng.integers(1, 1 << 20, pages).astype(np.int32) for _ in range(args.batch)]
                prefix = pages * page_size - width

                def verify_batch(as_list: bool) -> ForwardBatch:
                    return ForwardBatch([SequenceChunk(list(range(width)), prefix, t.tolist() if as_list else t.copy(),
                                                       logits="all") for t in tables])

                prompt = ForwardBatch([SequenceChunk(list(range(pages * page_size)), 0, tables[0], logits="last")])
                row = {"pages_per_sequence": pages,
                       "graph_prepare_ms_lists": best_ms(lambda: graphs.prepare(verify_batch(True))),
                       "graph_prepare_ms_arrays": best_ms(lambda: graphs.prepare(verify_batch(False))),
                       "eager_prefill_to_device_ms": best_ms(lambda: to_device(prompt, page_size, torch.device("cpu")), 10)}
                result["rows"].append(row)
                print(f"batch {args.batch} x {pages} pages: graph prepare {row['graph_prepare_ms_lists']:.3f} ms with "
                      f"lists, {row['graph_prepare_ms_arrays']:.3f} ms with page tables; eager to_device of a "
                      f"{pages * page_size}-token prefill {row['eager_prefill_to_device_ms']:.3f} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
