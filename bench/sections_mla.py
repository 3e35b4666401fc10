"""Benchmark section ``mla``: the Triton MLA kernel (tandem/kernels/mla_attention.py, absorbed form) at
Kimi-K2.5's latent (kv_lora 512 + rope 64 per token, bf16, pages of 64), 8 heads (a TP 8 rank) and at
batch 1 and 8 also 64 heads (TP 1), batch 1/8/64, every sequence 1k/4k/8k entries long, decode (1 new
token) and chain verify (4), against the torch MLA backend on the same pool and against the read limit:
the latent bytes the batch attends to ÷ 4.8 TB/s (H200 peak; the measured copy rate when the ceilings
section ran first is shown beside it). Kernel timings replay a CUDA graph of calls that rotate through
enough pool copies to miss the 50 MB L2; at batch 1 a few split counts are tried besides the default,
at batch 8 and 64 with 4k entries a few launch tiles (heads x tokens per program, keys per step, warps,
stages; the ones compile_check finds spill-free on sm_90).
Each row also gives the kernel's relative error against the reference (bf16: ~1e-3).

``absorb_rows``: the absorbed projections (tandem/kernels/mla_absorb.py) at DeepSeek-V2-Lite's shapes (16
heads, nope 128, v 128, the latent above) for 1 and 8 tokens, each against the einsums (and the concatenation)
it replaces, both replayed in a CUDA graph over enough weight copies to miss the L2, with the read limit:
the weight and activation bytes read ÷ 4.8 TB/s, and ÷ the measured copy rate where known."""

from __future__ import annotations

import torch

from measure import events_ms, free_gpu, read_seconds
from sections_quant import graph_ms

DEVICE = "cuda"  # (tests/test_bench_mla_smoke.py runs the section on the CPU at tiny shapes)
PEAK_TBPS = 4.8
L2_BYTES = 50 << 20
KV_LORA, ROPE, PAGE = 512, 64, 64
BATCHES, KV_LENS, Q_LENS = (1, 8, 64), (1024, 4096, 8192), (1, 4)
TP1_BATCHES = (1, 8)  # 64 heads: the TP 1 shape, where a latent tile serves two head blocks
SPLITS_TRIED = (1, 4, 8, 16, 32)  # at batch 1, besides the default
TILES_TRIED = ((16, 16, 4, 2), (16, 32, 4, 3), (32, 32, 8, 3), (32, 64, 8, 2), (64, 32, 8, 2))  # LatentTiles
TILE_SWEEP = {"batches": (8, 64), "kv_len": 4096}
ABSORB_HEADS, NOPE, V_HEAD, ABSORB_TOKENS = 16, 128, 128, (1, 8)  # DeepSeek-V2-Lite (kv_lora and rope: above)


def _problem(batch: int, kv_len: int, q_len: int, heads: int, copies: int) -> dict:
    """``copies`` pools of ``batch`` sequences of ``kv_len`` entries (the last ``q_len`` new), one block table."""
    from tandem.attention.metadata import AttentionMetadata

    pages = -(-kv_len // PAGE)
    gen = torch.Generator(device=DEVICE).manual_seed(batch * kv_len + q_len)
    tables = (1 + torch.randperm(batch * pages, generator=gen, device=DEVICE)).view(batch, pages).to(torch.int32)
    pools = [torch.randn(1 + batch * pages, PAGE, 1, KV_LORA + ROPE, device=DEVICE, dtype=torch.bfloat16,
                         generator=gen) for _ in range(copies)]
    q = torch.randn(batch * q_len, heads, KV_LORA + ROPE, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.5
    ends = torch.arange(kv_len - q_len, kv_len, device=DEVICE).expand(batch, q_len)  # the new entries' keys
    slots = (tables.long().gather(1, ends // PAGE) * PAGE + ends % PAGE).flatten()
    meta = AttentionMetadata(
        q_lens=[q_len] * batch, prefix_lens=[kv_len - q_len] * batch,
        cu_q_lens=torch.arange(0, batch + 1, device=DEVICE, dtype=torch.int32) * q_len,
        kv_lens=torch.full((batch,), kv_len, device=DEVICE, dtype=torch.int32), block_tables=tables,
        slot_mapping=slots, tree_masks=[None] * batch, page_size=PAGE)
    return {"q": q, "pools": pools, "meta": meta, "scale": (128 + 64) ** -0.5 * 2.0047}


def _row(batch: int, kv_len: int, q_len: int, heads: int, copy_tbps: float | None) -> dict:
    from tandem.attention.mla_torch_backend import TorchMLABackend
    from tandem.kernels.mla_attention import LatentTiles, mla_paged_attention

    nbytes = batch * kv_len * (KV_LORA + ROPE) * 2
    p = _problem(batch, kv_len, q_len, heads, max(2, -(-4 * L2_BYTES // nbytes)))
    q, m = p["q"], p["meta"]

    def kernel(pool, splits=None, tiles=None):
        return mla_paged_attention(q[..., :KV_LORA], q[..., KV_LORA:], pool, m.block_tables, m.kv_lens, m.cu_q_lens,
                                   q_len, p["scale"], num_splits=splits, tiles=tiles)

    ms = graph_ms([lambda pool=pool: kernel(pool) for pool in p["pools"]])
    best, best_splits = ms, "default"
    if batch == 1:
        for splits in SPLITS_TRIED:
            t = graph_ms([lambda pool=pool, s=splits: kernel(pool, s) for pool in p["pools"]])
            if t < best:
                best, best_splits = t, splits
    best_tiles = "default"
    if batch in TILE_SWEEP["batches"] and kv_len == TILE_SWEEP["kv_len"]:
        for tile in TILES_TRIED:
            t = graph_ms([lambda pool=pool, c=LatentTiles(*tile): kernel(pool, tiles=c) for pool in p["pools"]])
            if t < best:
                best, best_tiles = t, tile
    reference = TorchMLABackend()
    reference.plan(m)
    pool = p["pools"][0]
    torch_ms = events_ms(lambda: reference.forward_absorbed(q, pool, m, p["scale"], KV_LORA), 3, warmup=1)
    ref = reference.forward_absorbed(q, pool, m, p["scale"], KV_LORA).float()
    rel = ((kernel(pool).float() - ref).norm() / ref.norm()).item()
    limit_ms = nbytes / (PEAK_TBPS * 1e12) * 1e3
    row = {"heads": heads, "batch": batch, "kv_len": kv_len, "q_len": q_len, "latent_bytes": nbytes, "ms": ms,
           "best_ms": best, "best_splits": best_splits, "best_tiles": best_tiles, "torch_ms": torch_ms,
           "limit_ms_4.8TBps": limit_ms, "of_limit": limit_ms / best, "default_of_limit": limit_ms / ms,
           "speedup_vs_torch": torch_ms / ms, "rel_err_vs_torch": rel}
    if copy_tbps:
        row["limit_ms_measured_copy"] = read_seconds(nbytes, copy_tbps) * 1e3
    print(f"MLA h{heads:2d} batch {batch:2d} kv {kv_len:5d} q {q_len}: {1e3 * ms:8.1f} us (best {1e3 * best:8.1f}, "
          f"splits {best_splits}, tiles {best_tiles}), torch {1e3 * torch_ms:9.1f} us, "
          f"limit {1e3 * limit_ms:7.1f} us = {100 * row['of_limit']:5.1f} %, rel err {rel:.1e}", flush=True)
    return row


def _absorb_rows(copy_tbps: float | None) -> list[dict]:
    from tandem.kernels.mla_absorb import absorb_out, absorb_q

    rows, h = [], ABSORB_HEADS
    weight_bytes = h * NOPE * KV_LORA * 2  # W_UK or W_UV, bf16
    for tokens in ABSORB_TOKENS:
        gen = torch.Generator(device=DEVICE).manual_seed(tokens)
        kv_bs = [torch.randn(h * (NOPE + V_HEAD), KV_LORA, device=DEVICE, generator=gen).bfloat16() * 0.05
                 for _ in range(max(2, -(-4 * L2_BYTES // (2 * weight_bytes))))]
        ws = [kv_b.view(h, NOPE + V_HEAD, KV_LORA).split([NOPE, V_HEAD], 1) for kv_b in kv_bs]
        q = torch.randn(tokens, h, NOPE + ROPE, device=DEVICE, generator=gen).bfloat16()
        attended = torch.randn(tokens, h, KV_LORA, device=DEVICE, generator=gen).bfloat16()
        ops = {  # name: (kernel, einsum route, bytes read)
            "absorb_q": (lambda w: absorb_q(q, w[0], KV_LORA),
                         lambda w: torch.cat([torch.einsum("thn,hnc->thc", q[..., :NOPE], w[0]), q[..., NOPE:]], -1),
                         weight_bytes + q.numel() * 2),
            "absorb_out": (lambda w: absorb_out(attended, w[1]), lambda w: torch.einsum("thc,hvc->thv", attended, w[1]),
                           h * V_HEAD * KV_LORA * 2 + attended.numel() * 2)}
        for name, (kernel, einsum, nbytes) in ops.items():
            ms = graph_ms([lambda w=w: kernel(w) for w in ws])
            einsum_ms = graph_ms([lambda w=w: einsum(w) for w in ws])
            ref = einsum(ws[0]).float()
            rel = ((kernel(ws[0]).float() - ref).norm() / ref.norm()).item()
            limit_ms = nbytes / (PEAK_TBPS * 1e12) * 1e3
            row = {"op": name, "heads": h, "tokens": tokens, "bytes_read": nbytes, "ms": ms, "einsum_ms": einsum_ms,
                   "limit_ms_4.8TBps": limit_ms, "of_limit": limit_ms / ms, "speedup_vs_einsum": einsum_ms / ms,
                   "rel_err_vs_einsum": rel}
            if copy_tbps:
                row["limit_ms_measured_copy"] = read_seconds(nbytes, copy_tbps) * 1e3
            print(f"MLA {name:10s} h{h} tokens {tokens}: {1e3 * ms:6.1f} us, einsum {1e3 * einsum_ms:6.1f} us, "
                  f"limit {1e3 * limit_ms:5.1f} us = {100 * row['of_limit']:5.1f} %, rel err {rel:.1e}", flush=True)
            rows.append(row)
        free_gpu()
    return rows


def mla(ctx: dict) -> dict:
    rows = []
    for heads, batches in ((8, BATCHES), (64, TP1_BATCHES)):
        for batch in batches:
            for kv_len in KV_LENS:
                for q_len in Q_LENS:
                    rows.append(_row(batch, kv_len, q_len, heads, ctx.get("copy_tbps")))
                free_gpu()
    return {"rows": rows, "absorb_rows": _absorb_rows(ctx.get("copy_tbps"))}
