"""Compile every kernel for Hopper (sm_90) on a machine without a GPU and report what the H200 would run.

``python -m tandem.kernels.compile_check [bfloat16|float16] [PART/PARTS] [--sass attention]`` prints, per kernel and shape: registers,
stack (non-zero means spills to local memory), shared memory, 16-byte global loads (``LDG.E.128``),
16-byte async copies (``LDGSTS...128``, the software-pipelined K/V loads) and which matrix
instruction the attention uses (``HGMMA`` = wgmma, ``HMMA`` = mma.sync); ``--sass attention`` disassembles only the
attention kernels (the SASS, ~0.4 s a kernel, is what the load counts and the matrix instruction come from; registers
and stack come from the resource usage: the test's run). The interpreter tests never
compile anything, so this is what catches errors on the compiled path (for example a global a kernel
may not read) before a GPU run. Exits non-zero if a kernel fails to compile or spills.

It stands in a fake CUDA driver that only answers "sm_90" and launches nothing: kernels are compiled
through ``JITFunction.warmup`` with the same arguments the wrappers pass, using the ptxas and
cuobjdump shipped inside the triton wheel. It leans on triton 3.6 internals (the driver class).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("compile_check compiles real kernels: run it without TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver  # noqa: E402
from triton.runtime import driver  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _Hopper(CudaDriver):
    def __init__(self):  # no libcuda: nothing here may touch the GPU
        pass

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True


_compiled: list[tuple[str, object]] = []
# Each report closes a unit (the kernels compiled since the one before); ``PART/PARTS`` compiles only the units
# whose index is PART modulo PARTS, so that PARTS processes share the work (the test runs two at once).
_unit, _part, _parts = 0, 0, 1
_sass_only: str | None = None  # --sass NAME: disassemble only the kernels whose name holds NAME


class _CompileOnly:
    """Replaces a module's ``kernel[grid](...)`` with a compile (warmup) that records the result."""

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            if _unit % _parts == _part:
                _compiled.append((self.jit_fn.fn.__name__, self.jit_fn.warmup(*args, grid=grid, **kwargs)))
        return call


# cubin → (regs, stack, mma, LDG.128, LDGSTS.128): a kernel that two shapes compile to the same binary (the same
# specialization: triton's in-memory cache returns it) is disassembled once (cuobjdump -sass takes ~0.4 s a kernel)
_usage: dict[bytes, tuple[int, int, str, int, int]] = {}


def _resources(name: str, cubin: bytes) -> tuple[int, int, str, int, int]:
    """→ (registers, stack bytes, matrix instructions, LDG.128, LDGSTS.128); the last three -1/"-" when not disassembled."""
    if cubin not in _usage:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            usage = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
            sass = None
            if _sass_only is None or _sass_only in name:
                sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", path], capture_output=True, text=True).stdout
        regs, stack = int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))
        if sass is None:
            _usage[cubin] = (regs, stack, "-", -1, -1)
        else:
            _usage[cubin] = (regs, stack, ",".join(sorted({m.split(".")[0] for m in re.findall(r"\b(H[G]?MMA\.\S+)", sass)})),
                             len(re.findall(r"LDG\.E[.A-Z]*\.128", sass)), len(re.findall(r"LDGSTS\.E[.A-Z]*\.128", sass)))
    return _usage[cubin]


def _report(tag: str, failures: list[str]) -> None:
    global _unit
    _unit += 1
    for name, kernel in _compiled:
        regs, stack, mma, ldg, ldgsts = _resources(name, kernel.asm["cubin"])
        print(f"{tag:34s} {name:24s} regs={regs:3d} stack={stack:3d} smem={kernel.metadata.shared:6d} "
              f"LDG.128={ldg:3d} LDGSTS.128={ldgsts:3d} warps={kernel.metadata.num_warps} {mma}")
        if stack:
            failures.append(f"{tag} {name}: {stack} bytes of stack (spills)")
    _compiled.clear()


def main(dtype_name: str = "bfloat16", part: str = "0/1", *flags: str) -> int:
    global _part, _parts, _sass_only
    _part, _parts = (int(x) for x in part.split("/"))
    if flags:
        if len(flags) != 2 or flags[0] != "--sass":
            sys.exit(f"unknown arguments {flags}: [--sass NAME]")
        _sass_only = flags[1]
    driver.set_active(_Hopper())
    dt = getattr(torch, dtype_name)
    names = ("paged_attention", "rotary_kv", "norm", "activation", "gemv", "round_glue", "chain_pick", "dequant_gemm",
             "fused_moe", "mla_attention", "mla_prologue", "moe_route", "moe_slots", "mla_absorb")
    mods = {m: importlib.import_module(f"tandem.kernels.{m}") for m in names}
    # compile the programmatic-dependent-launch variants the GPU runs
    importlib.import_module("tandem.kernels.pdl").use_pdl = lambda x: True
    for mod in mods.values():
        for attr in dir(mod):
            if attr.startswith("_") and attr.endswith("_kernel"):
                setattr(mod, attr, _CompileOnly(getattr(mod, attr)))
    pa, rk, nm, ac, gv, rg, cp, dq, fm, mla, mlp, mr, _, mab = mods.values()
    ms = importlib.import_module("tandem.kernels.dequant_mma_sync")
    dc = importlib.import_module("tandem.kernels.dequant_configs")
    ms._dequant_mma_sync_kernel = _CompileOnly(ms._dequant_mma_sync_kernel)
    failures: list[str] = []

    def attention(batch, q_len, group, kv_heads, head_dim, page, width=None, splits=1):
        q = torch.empty(batch * q_len, group * kv_heads, head_dim, dtype=dt)
        pool = torch.empty(64, page, kv_heads, head_dim, dtype=dt)
        mask = torch.ones(batch, q_len, width, dtype=torch.bool) if width else None
        pa.paged_attention(q, pool, pool, torch.zeros(batch, 16, dtype=torch.int32), torch.ones(batch, dtype=torch.int32),
                           0.1, mask=mask, num_splits=splits)
        _report(f"attn b{batch} q{q_len} g{group} h{kv_heads} d{head_dim} p{page} w{width} s{splits}", failures)

    attention(8, 1, 4, 8, 128, 16)  # Llama-3-8B decode
    attention(1, 1, 4, 8, 128, 16, splits=16)  # batch-1 decode, split-K
    attention(8, 8, 4, 8, 128, 16, width=8)  # verify 8-node trees
    attention(8, 16, 8, 1, 128, 16, width=16)  # verify 16 nodes, GQA 8 (128 rows per program)
    attention(8, 1, 1, 8, 64, 16)  # MHA, head_dim 64
    attention(1, 256, 4, 8, 128, 16)  # prefill-like width
    def latent_attention(batch, q_len, heads, page, width=None, splits=1, tiles=None):
        # Kimi's latent: kv_lora 512 + rope 64 in one entry per token
        q = torch.empty(batch * q_len, heads, 576, dtype=dt)
        mask = torch.ones(batch, q_len, width, dtype=torch.bool) if width else None
        widths = torch.full((batch,), width or 0, dtype=torch.int32) if width else None
        cu = torch.arange(0, batch + 1, dtype=torch.int32) * q_len
        mla.mla_paged_attention(q[..., :512], q[..., 512:], torch.empty(64, page, 1, 576, dtype=dt),
                                torch.zeros(batch, 16, dtype=torch.int32), torch.ones(batch, dtype=torch.int32), cu,
                                q_len, 0.1, mask=mask, mask_widths=widths, num_splits=splits,
                                tiles=tiles and mla.LatentTiles(*tiles))
        _report(f"mla b{batch} q{q_len} h{heads} p{page} w{width} s{splits} t{tiles or ''}", failures)

    latent_attention(8, 1, 8, 64)  # Kimi decode at TP 8
    latent_attention(1, 1, 8, 64, splits=16)  # batch-1 decode, split-K
    latent_attention(8, 4, 8, 16, width=16)  # verify 4-node trees at TP 8
    latent_attention(8, 1, 64, 64)  # TP 1: 64 heads in blocks of 32
    latent_attention(8, 8, 64, 16, width=16, splits=2)  # TP 1 tree verify
    for tiles in ((16, 16, 4, 2), (16, 32, 4, 3), (32, 32, 8, 3), (32, 64, 8, 2), (64, 32, 8, 2)):  # bench's sweep
        for heads, q_len in ((8, 4), (64, 1)):  # the most registers of each tile (h8 q1, h64 q4: no more)
            latent_attention(8, q_len, heads, 64, tiles=tiles)
    for heads, lora in ((16, 512), (64, 512), (8, 512)):  # V2-Lite, Kimi at TP 1 and TP 8: 128 nope + 64 rope
        table = torch.empty(4096, 32)
        mlp.mla_prologue(torch.empty(8, heads, 192, dtype=dt), torch.empty(8, lora + 64, dtype=dt),
                         torch.empty(lora, dtype=dt), 1e-6, table, table, torch.zeros(8, dtype=torch.int64),
                         torch.empty(64, 64, 1, lora + 64, dtype=dt), torch.zeros(8, dtype=torch.int64), True)
        _report(f"mla_prologue h{heads} kv_lora {lora}", failures)
    for heads, tokens in ((16, 1), (64, 16), (8, 4)):  # V2-Lite, Kimi at TP 1 and TP 8: 128 nope + 64 rope, v 128
        kv_b = torch.empty(heads * 256, 512, dtype=dt)
        w_uk, w_uv = kv_b.view(heads, 256, 512).split([128, 128], 1)
        mab.absorb_q(torch.empty(tokens, heads, 192, dtype=dt), w_uk, 512)
        mab.absorb_out(torch.empty(tokens, heads, 512, dtype=dt), w_uv)
        _report(f"mla_absorb h{heads} t{tokens}", failures)
        table, at = torch.empty(4096, 32), torch.zeros(tokens, dtype=torch.int64)
        mab.absorb_q(torch.empty(tokens, heads, 192, dtype=dt), w_uk, 512, mlp.Prologue(
            torch.empty(tokens, 576, dtype=dt), torch.empty(512, dtype=dt), 1e-6, table, table, at,
            torch.empty(64, 64, 1, 576, dtype=dt), at, True))
        _report(f"mla_absorb with the prologue h{heads} t{tokens}", failures)
        for per_head in (4, 8, 16):  # splits merged in absorb_out (MERGE_SPLITS_HERE), value rows cut so (2: spills)
            mab.SPLIT_PROGRAMS_PER_HEAD = per_head
            mab.absorb_out(mla.LatentSplits(torch.empty(8, tokens, heads, 512), torch.empty(8, tokens, heads), dt), w_uv)
            _report(f"mla_absorb merging h{heads} t{tokens} {per_head}/head", failures)
        mab.SPLIT_PROGRAMS_PER_HEAD = 4
    for experts, groups, kept, k in ((64, 1, 1, 6), (256, 8, 4, 8), (384, 1, 1, 8)):  # V2-Lite, V3, Kimi
        mr.noaux_route(torch.empty(8, experts), torch.empty(experts), groups, kept, k, True, 2.5)
        _report(f"noaux_route {experts} experts, {groups} groups, top {k}", failures)
    tokens = 64
    qkv = torch.empty(tokens, 48 * 128, dtype=dt)
    q, k, v = (t.view(tokens, -1, 128) for t in qkv.split([32 * 128, 8 * 128, 8 * 128], -1))
    table, pool, slots = torch.empty(1000, 128), torch.empty(64, 16, 8, 128, dtype=dt), torch.zeros(tokens, dtype=torch.int64)
    rk.rotary_and_store(q, k, v, table, table, slots, pool, pool, slots)
    _report("rotary_and_store 32/8 heads", failures)
    rk.store_kv(k, v, pool, pool, slots)
    _report("store_kv", failures)
    x, w = torch.empty(tokens, 4096, dtype=dt), torch.empty(4096, dtype=dt)
    nm.rms_norm(x, w, 1e-6)
    _report("rms_norm 4096", failures)
    nm.rms_norm(x, w, 1e-6, residual=x.clone())
    _report("rms_norm + residual 4096", failures)
    nm.rms_norm(q, torch.empty(128, dtype=dt), 1e-6)
    _report("rms_norm per head 128", failures)
    ac.silu_and_mul(torch.empty(tokens, 2 * 14336, dtype=dt))
    _report("silu_and_mul 14336", failures)
    for rows, n, k in ((1, 6144, 4096), (1, 4096, 14336), (4, 6144, 4096), (16, 4096, 14336)):
        gv.gemv(torch.empty(rows, k, dtype=dt), torch.empty(n, k, dtype=dt),
                config=gv.default_config(rows, n, k))
        _report(f"gemv {rows}x{k} -> {n}", failures)
    for n, k, steps, swiglu in ((3648, 2048, 4, False), (2048, 2816, 6, True), (4096, 4096, 8, False)):
        gv.gemv(torch.empty(1, k * (2 if swiglu else 1), dtype=dt), torch.empty(n, k, dtype=dt), swiglu=swiglu,
                config=gv.GemvConfig("rows", 4, 512, 4, prefetch_steps=steps))  # a whole slice read before the wait
        _report(f"gemv 1x{k} -> {n}, {steps} tiles ahead", failures)
    gv.gemv(torch.empty(1, 2 * 14336, dtype=dt), torch.empty(4096, 14336, dtype=dt),  # the down projection of SwiGLU
            config=gv.default_config(1, 4096, 14336), swiglu=True)
    _report("gemv swiglu 1x14336 -> 4096", failures)
    for n, k in ((3648, 2048), (2112, 7168)):  # MLA's fused q_proj / q_a_proj + kv_a at batch 1 (V2-Lite, Kimi)
        gv.gemv(torch.empty(1, k, dtype=dt), torch.empty(n, k, dtype=dt), config=gv.default_config(1, n, k))
        _report(f"gemv 1x{k} -> {n} (MLA q + kv_a)", failures)
        row = lambda: torch.empty(1, k, dtype=dt)  # noqa: E731
        gv.gemv(row(), torch.empty(n, k, dtype=dt), config=gv.default_config(1, n, k),
                norm=gv.InputNorm(row(), torch.empty(k, dtype=dt), 1e-6, row()))
        _report(f"gemv 1x{k} -> {n} (MLA q + kv_a) applying its input norm", failures)
        dq.fp8_block_linear(torch.empty(1, k, dtype=dt), torch.empty(n, k, dtype=torch.float8_e4m3fn),
                            torch.empty(-(-n // 128), k // 128), (128, 128))
        _report(f"fp8_block_linear 1x{k} -> {n} (MLA q + kv_a)", failures)
    for rows, n, k in ((1, 64, 2048), (16, 384, 7168)):  # the MoE router's float32 logits (V2-Lite, Kimi)
        gv.router_logits(torch.empty(rows, k, dtype=dt), torch.empty(n, k, dtype=torch.float32))
        _report(f"router logits {rows}x{k} -> {n}", failures)
    row = lambda: torch.empty(1, 2048, dtype=dt)  # noqa: E731
    gv.router_logits(row(), torch.empty(64, 2048, dtype=torch.float32),
                     gv.InputNorm(row(), torch.empty(2048, dtype=dt), 1e-6, row(), row()))
    _report("router logits 1x2048 -> 64 applying its input norm, writing the normalised row", failures)
    # a chain of 4 at batch 8 on the 8B shape (features 3 x 4096, draft state 4096, top-k width 8)
    n, nd, w, feat, hid = 8, 4, 6, 3 * 4096, 4096
    rows, broken = torch.empty(n, 3 * nd + 1, dtype=torch.float64), torch.empty(n, dtype=torch.bool)
    i64 = lambda *shape: torch.empty(*shape, dtype=torch.int64)  # noqa: E731
    rg.advance(rows, broken, i64(n), i64(n * nd), i64(n * nd), torch.empty(n, dtype=torch.int32), i64(n * nd),
               torch.empty(n, 512, dtype=torch.int32), 16, nd)
    _report("round_glue.advance", failures)
    rg.advance(None, None, 1, i64(n), i64(n), torch.empty(n, dtype=torch.int32), i64(n),
               torch.empty(n, 512, dtype=torch.int32), 16, 1, chains=i64(n, 1))  # a queued decode step's inputs
    _report("round_glue.advance (decode step)", failures)
    rg.accept(i64(n, nd), i64(n, nd), broken, torch.empty(n * nd, feat, dtype=dt), i64(n, nd + 2), i64(n * w),
              torch.empty(n * w, feat, dtype=dt), i64(n), w, roots=i64(n))
    _report("round_glue.accept", failures)
    rg.settle(i64(n), i64(n * w), w, i64(n), i64(n), torch.empty(n, hid, dtype=dt), torch.empty(n, hid, dtype=dt),
              torch.empty(n, 8), torch.empty(n, 8), i64(n, 8), i64(n, 8))
    _report("round_glue.settle", failures)
    cp.chain_pick(torch.empty(n, 32000, dtype=dt), i64(32000), torch.empty(n, 8)[:, 0])  # the 8B head's draft vocabulary
    _report("chain_pick 32000", failures)
    for rows, n, k in ((1, 4096, 7168), (4, 7168, 2048), (1, 512, 7168), (64, 4096, 7168), (256, 28672, 4096)):
        x = torch.empty(rows, k, dtype=dt)
        dq.int4_linear(x, torch.empty(n, k // 8, dtype=torch.int32), torch.empty(n, k // 32), 32)
        _report(f"int4_linear {rows}x{k} -> {n}", failures)
        dq.fp8_block_linear(x, torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(n // 128, k // 128), (128, 128))
        _report(f"fp8_block_linear {rows}x{k} -> {n}", failures)
    x = torch.empty(1, 2 * 14336, dtype=dt)  # [gate | up]: the quantized down projections of SwiGLU at decode
    dq.int4_linear(x, torch.empty(4096, 14336 // 8, dtype=torch.int32), torch.empty(4096, 14336 // 32), 32, swiglu=True)
    dq.fp8_block_linear(x, torch.empty(4096, 14336, dtype=torch.float8_e4m3fn), torch.empty(32, 112), (128, 128),
                        swiglu=True)
    _report("int4/fp8 swiglu 1x14336 -> 4096", failures)
    x = torch.empty(1, 14336, dtype=dt)  # the GEMV tiles bench/sections_quant.py tries
    for tile in ((16, 32, 128, 4, 4), (16, 16, 512, 4, 3), (16, 32, 256, 4, 4), (16, 64, 128, 4, 4),
                 (1, 4, 512, 4, 3, 1, "rows"), (1, 8, 512, 4, 3, 1, "rows"), (1, 4, 1024, 4, 3, 1, "rows")):
        cfg = dc.DequantConfig(*tile)
        dq.int4_linear(x, torch.empty(4096, 14336 // 8, dtype=torch.int32), torch.empty(4096, 14336 // 32), 32, config=cfg)
        dq.fp8_block_linear(x, torch.empty(4096, 14336, dtype=torch.float8_e4m3fn), torch.empty(32, 112), (128, 128),
                            config=cfg)
        _report(f"int4/fp8 GEMV tile {tile}", failures)
    for rows in (1, 2, 3, 4):  # the gemv kernel's tiles bench/sections_quant.py tries (16 rows of W: one row only)
        x = torch.empty(rows, 7168, dtype=dt)
        for bn, bk, warps in ((8, 1024, 4), (8, 512, 4), (16, 1024, 4), (4, 1024, 4), (8, 2048, 8)):
            if rows > 1 and bn > 8 or rows in (2, 3) and (bn, bk) != (8, 1024):
                continue
            cfg = dc.DequantConfig(rows, bn, bk, warps, 1, kernel="gemv")
            dq.int4_linear(x, torch.empty(4096, 7168 // 8, dtype=torch.int32), torch.empty(4096, 7168 // 32), 32,
                           config=cfg)
            dq.fp8_block_linear(x, torch.empty(4096, 7168, dtype=torch.float8_e4m3fn), torch.empty(32, 56), (128, 128),
                                config=cfg)
            _report(f"int4/fp8 gemv {rows} rows, tile {bn}x{bk} w{warps}", failures)
    for rows, n, k in ((1, 28672, 4096), (4, 4096, 14336), (16, 4096, 7168), (16, 512, 7168)):  # the mma kernel's tiles
        cfg = dc.mma_config(rows, n, k)  # (bench/sections_quant.py's shapes; 8 and 16 rows of x a program)
        dq.int4_linear(torch.empty(rows, k, dtype=dt), torch.empty(n, k // 8, dtype=torch.int32), torch.empty(n, k // 32),
                       32, config=cfg)
        _report(f"int4 mma {rows}x{k} -> {n} split {cfg.split_k}", failures)
    x = torch.empty(1, 14336, dtype=dt)  # the mma tiles bench/sections_quant.py tries (MMA_TILES)
    for bm, bn, bk, warps in ((16, 64, 128, 4), (8, 64, 256, 4), (16, 128, 256, 8)):
        cfg = dc.DequantConfig(bm, bn, bk, warps, 1, split_k=2, kernel="mma")
        dq.int4_linear(x, torch.empty(4096, 14336 // 8, dtype=torch.int32), torch.empty(4096, 14336 // 32), 32, config=cfg)
        _report(f"int4 mma tile {bm}x{bn}x{bk} w{warps}", failures)
    for rows, n, k, bn, split in ((1, 4096, 14336, 128, 8), (4, 28672, 4096, 128, 2), (8, 1000, 4000, 64, 3),
                                  (1, 4096, 4096, 64, 30)):
        cfg = dc.mma_sync_config(rows, n, k, bn, split)  # register-fed mma.sync (Gluon)
        dq.int4_linear(torch.empty(rows, k, dtype=torch.bfloat16), torch.empty(n, k // 8, dtype=torch.int32),
                       torch.empty(n, k // 32), 32, config=cfg)
        _report(f"int4 mma_sync {rows}x{k} -> {n} {bn} rows", failures)
    # Kimi-K2.5's routed experts (hidden 7168, intermediate 2048) with 8 of their 384 experts held here
    experts, hid, inter = 8, 7168, 2048
    plain = (fm.ExpertWeights(torch.empty(experts, 2 * inter, hid, dtype=dt)),
             fm.ExpertWeights(torch.empty(experts, hid, inter, dtype=dt)))
    int4 = (fm.ExpertWeights(torch.empty(experts, 2 * inter, hid // 8, dtype=torch.int32),
                             torch.empty(experts, 2 * inter, hid // 32), (1, 32)),
            fm.ExpertWeights(torch.empty(experts, hid, inter // 8, dtype=torch.int32),
                             torch.empty(experts, hid, inter // 32), (1, 32)))
    fp8 = (fm.ExpertWeights(torch.empty(experts, 2 * inter, hid, dtype=torch.float8_e4m3fn),
                            torch.empty(experts, 2 * inter // 128, hid // 128), (128, 128)),
           fm.ExpertWeights(torch.empty(experts, hid, inter, dtype=torch.float8_e4m3fn),
                            torch.empty(experts, hid // 128, inter // 128), (128, 128)))
    # 256 x 8 slots: the most the one-program grouping takes; 8192 tokens (a prefill): 64-row blocks
    for tokens, tiles_for in ((1, 1), (64, 64), (256, 256), (512, 8192)):
        for name, (gate_up, down) in (("bf16", plain), ("int4", int4), ("fp8", fp8)):
            cfg = fm.default_config(tiles_for * 8, 384, dt)
            fm.fused_moe(torch.empty(tokens, hid, dtype=dt), gate_up, down, torch.empty(tokens, 8),
                         torch.zeros(tokens, 8, dtype=torch.int64), cfg)
            _report(f"fused_moe {name} {tokens} tokens top-8 m{cfg.block_m}", failures)
    # a decode step's experts go slot by slot (tandem/kernels/moe_slots.py): plain ones up to 2 tokens at top-8
    for tokens, names in ((1, ("bf16", "int4", "fp8")), (8, ("int4", "fp8"))):
        for name in names:
            gate_up, down = {"bf16": plain, "int4": int4, "fp8": fp8}[name]
            fm.fused_moe(torch.empty(tokens, hid, dtype=dt), gate_up, down, torch.empty(tokens, 8),
                         torch.zeros(tokens, 8, dtype=torch.int64))
            _report(f"moe slots {name} {tokens} tokens top-8", failures)
    # DeepSeek-V2-Lite's plain experts (hidden 2048, intermediate 1408: the down GEMV's K is no multiple of its step)
    fm.fused_moe(torch.empty(1, 2048, dtype=dt), fm.ExpertWeights(torch.empty(64, 2 * 1408, 2048, dtype=dt)),
                 fm.ExpertWeights(torch.empty(64, 2048, 1408, dtype=dt)), torch.empty(1, 6),
                 torch.zeros(1, 6, dtype=torch.int64))
    _report("moe slots bf16 V2-Lite 1 token top-6", failures)
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
