"""The ``quant_kernels`` benchmark section (bench/sections_quant.py) run through on the CPU at tiny shapes, the
kernels under the Triton interpreter and the GPU timers replaced by a wall clock: every row it reports is
produced, and the fused MoE agrees with the loop it is timed against. (The real run is on a GPU:
``python bench/bench.py --sections quant_kernels``.)"""

from __future__ import annotations

import os

import pytest
import torch
from bench_modules import import_bench, wall_ms

if torch.cuda.is_available():
    pytest.skip("on a GPU the section itself runs: bench/bench.py --sections quant_kernels", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit
pytest.importorskip("triton")
(sections_quant,) = import_bench("sections_quant")


def test_the_section_reports_every_row_on_tiny_shapes(monkeypatch):
    sq = sections_quant
    for name, value in {"DEVICE": "cpu", "L2_BYTES": 1, "ROWS": (1, 20), "MOE_HIDDEN": 64, "MOE_TOP_K": 2,
                        "MOE_BATCHES": (1, 3), "MOE_CASES": ((16, 32, True), (8, 32, False)),
                        "LINEAR_SHAPES": {"kimi expert gate_up": (32, 256), "8B down": (16, 128)},
                        "GEMV_TILES": [(16, 16, 64, 4, 2, 2)], "ROW_TILES": [(1, 8, 64, 4, 2, 1, "rows")],
                        "GEMV_PATH_TILES": [(8, 64, 4, 1, 2)],  # one tile of each kernel
                        "MMA_ROWS": (1,), "MMA_TILES": [(8, 64, 128, 4)],
                        "graph_ms": wall_ms, "free_gpu": lambda: None,
                        "events_ms": lambda fn, iters, warmup=3: wall_ms([fn])}.items():
        monkeypatch.setattr(sq, name, value)
    result = sq.quant_kernels({"copy_tbps": 4.0})
    linear = result["linear"]
    assert len(linear) == 2 * 2 * 2  # shapes x rows x formats
    assert all(r["ms"] > 0 and r["cublas_bf16_ms"] > 0 and r["limit_ms_measured_copy"] > 0 for r in linear)
    swept = [r for r in linear if r["shape"] == "kimi expert gate_up" and r["rows"] == 1]
    assert all(r["best_ms"] <= min(r["ms"], r["old_default_ms"], r["best_gemv_ms"]) for r in swept)
    assert all(r["default_kernel"] == "gemv" for r in linear if r["rows"] == 1)
    mma = [r for r in linear if r["format"] == "int4" and r["rows"] == 1]
    assert all(r["mma_ms"] > 0 and r["best_mma_ms"] <= r["mma_ms"] for r in mma) and len(mma) == 2
    moe = result["moe"]
    assert [(r["experts"], r["batch"]) for r in moe] == [(16, 1), (16, 3), (8, 1), (8, 3)]
    # bf16 through the interpreter, which truncates where the GPU rounds (float32 agreement: test_fused_moe.py)
    assert all(r["rel_err_vs_loop"] < 5e-2 and 1 <= r["experts_touched"] <= 6 for r in moe)
    assert all(r["slots_ms"] > 0 and r["grouped_ms"] > 0 for r in moe)  # both MoE routes timed at batch <= 8
