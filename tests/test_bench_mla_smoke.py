"""The ``mla`` benchmark section (bench/sections_mla.py) run through on the CPU at tiny shapes, the kernel
under the Triton interpreter and the GPU timers replaced by a wall clock: every row it reports is
produced and the kernels agree with the torch routes they are timed against (the latent attention with the
torch backend, the absorbed projections with the einsums). (The real run is on a GPU:
``python bench/bench.py --sections mla``.)"""

from __future__ import annotations

import os

import pytest
import torch
from bench_modules import import_bench, wall_ms

if torch.cuda.is_available():
    pytest.skip("on a GPU the section itself runs: bench/bench.py --sections mla", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit
pytest.importorskip("triton")
section_index, sections_mla = import_bench("section_index", "sections_mla")


def test_the_section_reports_every_row_on_tiny_shapes(monkeypatch):
    sm = sections_mla
    for name, value in {"DEVICE": "cpu", "L2_BYTES": 1, "KV_LORA": 32, "ROPE": 16, "PAGE": 4, "BATCHES": (1, 3),
                        "KV_LENS": (9, 30), "TP1_BATCHES": (2,), "SPLITS_TRIED": (2,), "TILES_TRIED": ((16, 16, 4, 2),),
                        "TILE_SWEEP": {"batches": (3,), "kv_len": 30}, "ABSORB_HEADS": 4, "NOPE": 16, "V_HEAD": 24,
                        "graph_ms": wall_ms,
                        "free_gpu": lambda: None, "events_ms": lambda fn, iters, warmup=3: wall_ms([fn])}.items():
        monkeypatch.setattr(sm, name, value)
    report = sm.mla({"copy_tbps": 4.0})
    rows = report["rows"]
    assert [(r["heads"], r["batch"], r["kv_len"], r["q_len"]) for r in rows] == [
        (h, b, kv, q) for h, bs in ((8, (1, 3)), (64, (2,))) for b in bs for kv in (9, 30) for q in (1, 4)]
    assert all(r["ms"] > 0 and r["torch_ms"] > 0 and r["limit_ms_measured_copy"] > 0 for r in rows)
    assert all(r["best_ms"] <= r["ms"] for r in rows)
    assert all(r["rel_err_vs_torch"] < 2e-2 for r in rows)  # bf16
    absorb = report["absorb_rows"]
    assert [(r["op"], r["tokens"]) for r in absorb] == [(op, t) for t in (1, 8) for op in ("absorb_q", "absorb_out")]
    assert all(r["ms"] > 0 and r["einsum_ms"] > 0 and r["limit_ms_measured_copy"] > 0 for r in absorb)
    assert all(r["rel_err_vs_einsum"] < 1e-2 for r in absorb)  # bf16, the summation order aside


def test_the_section_is_registered():
    assert section_index.SECTIONS["mla"] is sections_mla.mla
