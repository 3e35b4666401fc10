"""The Triton kernels on a real GPU: the checks of tests/test_kernels.py at serving shapes, in bf16 and
fp16, then each kernel captured in a CUDA graph and replayed with new inputs copied into the static
buffers (new token values, new kv lengths, new block tables, new masks), every replay compared with
a fresh reference. Skipped without a GPU. A timing table (not a check) is printed by the last test
with ``-s``.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # before importing triton kernels: nothing here may run on the CPU
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from helpers import capture_graph, norm_rel_err  # noqa: E402
from test_kernels import (  # noqa: E402  (tests/ is on sys.path: tests/conftest.py)
    _qkv_views, attention_case, rms_norm_reference, rotary_reference, rotary_tables, silu_and_mul_reference,
)

from tandem.kernels import paged_attention, rms_norm, rotary_and_store, silu_and_mul  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]

# (batch, q_len, group, kv heads, head_dim, page_size, mask width, max prefix, splits; None = default)
CASES = [
    (32, 1, 4, 8, 128, 16, None, 1500, None),  # Llama-3-8B decode
    (1, 1, 4, 8, 128, 16, None, 5000, 16),  # batch-1 long context, split-K
    (8, 16, 4, 8, 128, 16, 16, 700, None),  # verify 16-node trees
    (5, 7, 8, 2, 128, 32, 7, 300, 2),  # verify 7 nodes, GQA 8, page 32
    (6, 4, 1, 4, 64, 16, 10, 200, 1),  # multi-step draft: 4 new nodes see 6 older ones, MHA, D 64
    (4, 1, 8, 1, 64, 64, None, 900, 4),  # TP-sharded (one kv head), page 64
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-q{}-g{}-h{}-d{}-p{}-w{}-len{}-s{}".format(*c))
def test_paged_attention(case, dtype):
    batch, q_len, group, hkv, head_dim, page, width, max_prefix, splits = case
    c = attention_case(batch, q_len, group, hkv, head_dim, page, dtype, "cuda", seed=CASES.index(case),
                       mask_width=width, max_prefix=max_prefix, pad_last=batch > 1)
    out = torch.full_like(c["q"], float("nan"))
    paged_attention(c["q"], c["k_pool"], c["v_pool"], c["block_tables"], c["kv_lens"], c["scale"],
                    mask=c["mask"], out=out, num_splits=splits)
    assert not out.isnan().any()
    assert norm_rel_err(out[: c["t_real"]], c["ref"]) < 1e-2



@pytest.mark.parametrize("width,splits", [(None, 1), (None, 8), (8, 1), (8, 4)])
def test_paged_attention_cuda_graph_replay(width, splits):
    q_len = 1 if width is None else width
    shape = dict(batch=4, q_len=q_len, group=4, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16,
                 device="cuda", mask_width=width, max_prefix=600, pad_last=True, num_pages=400, max_pages=48)
    cases = [attention_case(seed=s, **shape) for s in range(3)]
    static = {k: v.clone() for k, v in cases[0].items() if isinstance(v, torch.Tensor) and k != "ref"}
    graph, out = capture_graph(lambda: paged_attention(
        static["q"], static["k_pool"], static["v_pool"], static["block_tables"], static["kv_lens"],
        cases[0]["scale"], mask=static.get("mask"), num_splits=splits))
    for c in cases[1:] + cases[:1]:  # new lengths, tables, pages, masks; then back to the first
        for k, buf in static.items():
            buf.copy_(c[k])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any() and norm_rel_err(out[: c["t_real"]], c["ref"]) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_and_store_and_graph(dtype):
    tokens, hq, hkv, head_dim, page, pages = 48, 32, 8, 128, 16, 64
    cos, sin = rotary_tables(4096, head_dim, "cuda")

    def inputs(seed):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = _qkv_views(tokens, hq, hkv, head_dim, dtype, gen)
        pos = torch.randint(0, 4096, (tokens,), generator=gen).cuda()
        slots = torch.randperm(pages * page, generator=gen)[:tokens].cuda()
        return q, k, v, pos, slots

    k_pool = torch.randn(pages, page, hkv, head_dim, device="cuda", dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    static = [t.clone() for t in inputs(0)]  # q, k, v as plain (contiguous) buffers here
    graph, _ = capture_graph(lambda: rotary_and_store(static[0], static[1], static[2], cos, sin, static[3],
                                                 k_pool, v_pool, static[4]))
    for seed in (1, 2):
        q, k, v, pos, slots = inputs(seed)
        want_q, want_k = rotary_reference(q, k, cos, sin, pos)
        for buf, new in zip(static, (q, k, v, pos, slots)):
            buf.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert norm_rel_err(static[0], want_q) < 1e-2
        assert norm_rel_err(k_pool.view(-1, hkv, head_dim)[slots], want_k) < 1e-2
        assert torch.equal(v_pool.view(-1, hkv, head_dim)[slots], v)
    # eager, on the strided views of a fused QKV output
    q, k, v, pos, slots = inputs(3)
    want_q, want_k = rotary_reference(q, k, cos, sin, pos)
    rotary_and_store(q, k, v, cos, sin, pos, k_pool, v_pool, slots)
    assert norm_rel_err(q, want_q) < 1e-2 and norm_rel_err(k_pool.view(-1, hkv, head_dim)[slots], want_k) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_and_silu_and_graphs(dtype):
    tokens, hidden, inter = 40, 4096, 14336
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    x, res = torch.randn(tokens, hidden, device="cuda", dtype=dtype), torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    normed, h = rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(h, x + res)  # the GPU rounds h to nearest, as torch does
    assert norm_rel_err(normed, rms_norm_reference(x + res, w, 1e-5)) < 1e-2
    head_w = torch.randn(128, device="cuda", dtype=dtype)
    q, _, _ = _qkv_views(tokens, 32, 8, 128, dtype, torch.Generator().manual_seed(1))
    assert norm_rel_err(rms_norm(q, head_w, 1e-6), rms_norm_reference(q, head_w, 1e-6)) < 1e-2
    gate_up = 2 * torch.randn(tokens, 2 * inter, device="cuda", dtype=dtype)
    assert norm_rel_err(silu_and_mul(gate_up), silu_and_mul_reference(gate_up)) < 1e-2

    sx, sres, sgu = x.clone(), res.clone(), gate_up.clone()
    graph, (n_out, h_out, act) = capture_graph(lambda: (*rms_norm(sx, w, 1e-5, residual=sres), silu_and_mul(sgu)))
    for _ in range(2):
        for buf in (sx, sres, sgu):
            buf.copy_(torch.randn_like(buf))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h_out, sx + sres)
        assert norm_rel_err(n_out, rms_norm_reference(sx + sres, w, 1e-5)) < 1e-2
        assert norm_rel_err(act, silu_and_mul_reference(sgu)) < 1e-2


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 200)])
def test_gemv_serving_shapes(rows, n, k):
    """The Triton GEMV with the configurations the linear layers pick, against cuBLAS, in bf16."""
    from tandem.kernels.gemv import default_config, gemv

    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert norm_rel_err(gemv(x, w, b, default_config(rows, n, k)), ref) < 1e-2


@pytest.mark.parametrize("n,k", [(4096, 14336), (2048, 1408), (2048, 2816)])
def test_gemv_swiglu_equals_the_activation_kernel_then_the_gemv(n, k):
    """The down projection reading [gate | up] (8B, V2-Lite's expert and shared widths): bit for bit the separate
    activation kernel then the GEMV (the same roundings, the same sums), and torch's silu * up within bf16."""
    from tandem.kernels.gemv import default_config, gemv

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    fused = gemv(gate_up, w, config=default_config(1, n, k), swiglu=True)
    assert torch.equal(fused, gemv(silu_and_mul(gate_up), w, config=default_config(1, n, k)))
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.linear((torch.nn.functional.silu(gate) * up).float(), w.float())
    assert norm_rel_err(fused, ref) < 1e-2


def test_gemv_default_routes():
    """The tiles the linear layers route these few-row products to, against cuBLAS, in bf16."""
    from tandem.kernels.gemv import GemvConfig, gemv
    from tandem.layers.gemv_routes import DEFAULT_ROUTES

    for (rows, n, k), cfg in DEFAULT_ROUTES.items():
        gen = torch.Generator(device="cuda").manual_seed(rows + n + k)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        ref = torch.nn.functional.linear(x.float(), w.float())
        assert norm_rel_err(gemv(x, w, None, GemvConfig(**cfg)), ref) < 1e-2, (n, k)


@pytest.mark.parametrize("rows", [1, 4])
def test_pdl_chain_in_a_graph_keeps_every_dependency(rows):
    """Forty kernels in one graph, each reading the previous one's output (each norm also reads the
    residual written three kernels back), launched with programmatic dependent launch: every replay
    with new inputs must equal the same chain launched plainly, bit for bit, and track a float32
    reference. A kernel that read its input before its predecessor had finished would make replays
    differ. Four rows take the tensor-core GEMV, which reads its first weight tile before its wait."""
    from tandem.kernels.gemv import default_config, gemv
    from tandem.kernels.pdl import set_pdl, use_pdl

    x0 = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    if not use_pdl(x0):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    gen = torch.Generator(device="cuda").manual_seed(0)
    mats = [(torch.randn(2 * 2048, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02,
             torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02) for _ in range(10)]
    norm_w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5

    def chain():
        h, res = x0, torch.zeros_like(x0)
        for up, down in mats:
            normed, res = rms_norm(h, norm_w, 1e-5, residual=res)
            gate_up = gemv(normed, up, config=default_config(rows, *up.shape))
            h = gemv(silu_and_mul(gate_up), down, config=default_config(rows, *down.shape))
        return h + res

    def reference():
        h = x0.float()
        for up, down in mats:
            h32 = h
            normed = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)) * norm_w.float()
            g, u = (normed @ up.float().t()).chunk(2, dim=-1)
            h = h32 + (torch.nn.functional.silu(g) * u) @ down.float().t()
        return h

    graph_pdl, out_pdl = capture_graph(chain)
    set_pdl(False)
    try:
        graph_plain, out_plain = capture_graph(chain)
    finally:
        set_pdl(True)
    for _ in range(5):
        x0.copy_(torch.randn_like(x0))
        graph_pdl.replay()
        graph_plain.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_pdl, out_plain)
        assert norm_rel_err(out_pdl, reference()) < 5e-2


@pytest.mark.slow
def test_print_timings():
    """Not a check: bandwidth of decode attention (bytes of K/V read over time) at Llama-3-8B shapes."""
    from triton.testing import do_bench

    rows = []
    for batch, ctx, q_len, width, splits in [(1, 4096, 1, None, None), (1, 4096, 1, None, 1), (32, 2048, 1, None, None),
                                            (64, 4096, 1, None, None), (8, 2048, 8, 8, None), (32, 1024, 16, 16, None)]:
        c = attention_case(batch, q_len, 4, 8, 128, 16, torch.bfloat16, "cuda", seed=0, mask_width=width,
                           max_prefix=ctx)
        args = (c["q"], c["k_pool"], c["v_pool"], c["block_tables"], c["kv_lens"], c["scale"])
        ms = do_bench(lambda: paged_attention(*args, mask=c["mask"], num_splits=splits), return_mode="median")
        kv_bytes = int(c["kv_lens"].sum()) * 2 * 8 * 128 * 2
        rows.append(f"b={batch:3d} ctx<={ctx:5d} q={q_len:2d} splits={splits}: {ms * 1e3:8.1f} us "
                    f"{kv_bytes / ms / 1e6:7.0f} GB/s of K/V")
    print("\n" + "\n".join(rows))
