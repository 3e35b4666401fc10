"""The quantized linear kernels and the fused MoE on a real GPU at serving shapes (Kimi-K2.5's experts: hidden
7168, intermediate 2048, 384 experts top-8, and their TP 8 share; Llama-3.1-8B's MLP: 4096 x 14336), bf16
activations (fp16 and float32 too for the linears), against dequantize-then-matmul references in float32:
INT4 unpacked by ``compressed-tensors``' own ``unpack_from_int32``, FP8 blocks multiplied out here. Then
each kernel captured in a CUDA graph and replayed with new inputs (new activations, new routing).
Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before importing triton kernels: nothing here may run on the CPU
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized.base import unpack_from_int32  # noqa: E402
from helpers import capture_graph, norm_rel_err  # noqa: E402

from tandem.kernels.dequant_configs import mma_config, mma_sync_config  # noqa: E402
from tandem.kernels.dequant_gemm import fp8_block_linear, int4_linear  # noqa: E402
from tandem.kernels.fused_moe import ExpertWeights, fused_moe  # noqa: E402

pytestmark = pytest.mark.gpu
GROUP, BLOCK = 32, (128, 128)
# (N, K): Kimi gate/up and down of one expert, their TP 8 share, the 8B shape's fused gate/up and down
SHAPES = [(4096, 7168), (7168, 2048), (512, 7168), (7168, 256), (28672, 4096), (4096, 14336)]
ROWS = [1, 4, 8, 64, 256]  # 4 and 8: the mma_sync kernel by default



def random_int4(n: int, k: int, seed: int, leading: tuple[int, ...] = ()):
    """Random packed words (every bit pattern is a valid packing) and scales of a ~0.02-std weight, in bf16 as
    compressed-tensors stores a bf16 model's."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randint(-2**31, 2**31 - 1, (*leading, n, -(-k // 8)), generator=g, device="cuda", dtype=torch.int32)
    scale = torch.rand(*leading, n, -(-k // GROUP), generator=g, device="cuda") * 0.008 + 0.001
    return packed, scale.bfloat16()


@pytest.mark.parametrize("rows,config", [(1, None), (4, None), (8, None), (16, "mma"), (64, None)],
                         ids=["gemv", "mma-sync-4", "mma-sync-8", "mma", "tiles"])
@pytest.mark.parametrize("n,k", [(4096, 7168), (1000, 4100)])
def test_int4_kernels_give_the_same_output_for_scales_held_in_any_float_dtype(n, k, rows, config):
    """Scales held as the checkpoint stores them (bf16) and widened as read: the same values held in float32 or
    fp16 give bit-identical outputs from every INT4 kernel."""
    packed, scale = random_int4(n, k, seed=n + rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    cfg = mma_config(rows, n, k) if config == "mma" else None
    held = int4_linear(x, packed, scale, GROUP, config=cfg)
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(int4_linear(x, packed, scale.to(dtype), GROUP, config=cfg), held), dtype


def int4_reference_weight(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    n, k = packed.shape[0], packed.shape[1] * 8
    q = unpack_from_int32(packed, 4, torch.Size((n, k))).float()
    return (q * scale.repeat_interleave(GROUP, -1)[:, :k]).to(dtype)  # (K past the last word: sliced by the caller)


def fp8_reference_weight(w: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    n, k = w.shape
    scale = scale_inv.repeat_interleave(BLOCK[0], 0)[:n].repeat_interleave(BLOCK[1], 1)[:, :k]
    return (w.float() * scale).to(dtype)


def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().t()  # float32, no tf32 (torch's default for matmul)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_linear(n, k, rows):
    packed, scale = random_int4(n, k, seed=n + k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    y = int4_linear(x, packed, scale, GROUP)
    assert y.dtype == torch.bfloat16 and norm_rel_err(y, product(x, int4_reference_weight(packed, scale))) < 5e-3


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_fp8_block_linear(n, k, rows):
    w = (torch.randn(n, k, device="cuda") * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    y = fp8_block_linear(x, w, scale_inv, BLOCK)
    assert norm_rel_err(y, product(x, fp8_reference_weight(w, scale_inv))) < 5e-3


MMA_SHAPES = [(4096, 4096), (28672, 4096), (512, 7168), (4096, 14336)]  # the last two split K


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n,k", MMA_SHAPES)
def test_int4_mma_kernel(n, k, rows):
    """The tensor-core kernel (tandem/kernels/dequant_mma.py, its PTX unpack) against the unrounded dequantized
    weight in float32: the kernel multiplies exact integers and scales in float32, so only the output rounds."""
    packed, scale = random_int4(n, k, seed=n + k + rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    y = int4_linear(x, packed, scale, GROUP, config=mma_config(rows, n, k))
    assert norm_rel_err(y, product(x, int4_reference_weight(packed, scale, torch.float32))) < 4e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_int4_mma_kernel_unpacks_every_nibble_exactly(dtype):
    """Unit rows of x pick single columns of W: with scales of 1 each output is one ``q - 8`` (an integer, exact in
    either dtype), so every nibble's position and value is checked bit for bit, 16 columns a call."""
    n, k = 192, 512
    packed, _ = random_int4(n, k, seed=3)
    scale = torch.ones(n, k // GROUP, device="cuda")
    w = int4_reference_weight(packed, scale, torch.float32)
    eye = torch.eye(k, device="cuda", dtype=dtype)
    for k0 in range(0, k, 16):
        y = int4_linear(eye[k0:k0 + 16], packed, scale, GROUP, config=mma_config(16, n, k))
        assert torch.equal(y.float(), w[:, k0:k0 + 16].t()), k0


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("block_n,split", [(64, 1), (128, 8), (128, 5), (64, 40)])  # 40: splits past K
# 4000: whole groups masked; 4008: a partial word's group; 4100: a partial group; 96: K under one step of 128
@pytest.mark.parametrize("n,k", [(4096, 14336), (1000, 4000), (512, 7168), (1000, 4008), (1000, 4100), (256, 96)])
def test_int4_mma_sync_kernel(n, k, rows, block_n, split):
    """The register-fed mma.sync kernel (tandem/kernels/dequant_mma_sync.py: the dot's K order permuted, 128 + q
    unpacked, the offset by a constant-A mma) against the unrounded dequantized weight in float32, uneven N and K,
    split K, rows of x past one program's 8, with a bias."""
    packed, scale = random_int4(n, k, seed=n + k + rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = int4_linear(x, packed, scale, GROUP, bias=bias, config=mma_sync_config(rows, n, k, block_n, split))
    want = product(x, int4_reference_weight(packed, scale, torch.float32)[:, :k]) + bias.float()
    assert y.dtype == torch.bfloat16 and norm_rel_err(y, want) < 4e-3


def test_int4_mma_sync_kernel_unpacks_every_nibble_exactly():
    """Unit rows of x pick single columns of W: with a power of two for each group's scale (1/4 to 2, in a
    different order on every row) each output is ``q * scale`` exactly, so every nibble's place in the permuted K
    order and every group's scale are checked bit for bit, 8 columns a call."""
    n, k = 192, 512
    packed, _ = random_int4(n, k, seed=5)
    rows, groups = torch.arange(n, device="cuda")[:, None], torch.arange(k // GROUP, device="cuda")[None, :]
    scale = torch.exp2(((rows + groups) % 4 - 2).float())
    w = int4_reference_weight(packed, scale, torch.float32)
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    for k0 in range(0, k, 8):
        y = int4_linear(eye[k0:k0 + 8], packed, scale, GROUP, config=mma_sync_config(8, n, k, 64, 2))
        assert torch.equal(y.float(), w[:, k0:k0 + 8].t()), k0


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("n", [4096, 512], ids=["n4096", "n512-split-k"])
def test_int4_mma_kernel_replays_in_a_cuda_graph(rows, n):
    k = 7168
    packed, scale = random_int4(n, k, seed=7)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    config = mma_config(rows, n, k)
    graph, y = capture_graph(lambda: int4_linear(x, packed, scale, GROUP, bias, config=config))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, int4_linear(x, packed, scale, GROUP, bias, config=config))
        ref = product(x, int4_reference_weight(packed, scale, torch.float32)) + bias.float()
        assert norm_rel_err(y, ref) < 4e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 64])
def test_linear_kernels_take_fp16_and_fp32_activations(dtype, rows):
    n, k = 4096, 7168
    packed, scale = random_int4(n, k, seed=9)
    w8 = (torch.randn(n, k, device="cuda") * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(n // 128, k // 128, device="cuda") * 1e-3
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    y4 = int4_linear(x, packed, scale, GROUP)
    assert y4.dtype == dtype and norm_rel_err(y4, product(x, int4_reference_weight(packed, scale, dtype))) < tol
    y8 = fp8_block_linear(x, w8, scale_inv, BLOCK)
    assert norm_rel_err(y8, product(x, fp8_reference_weight(w8, scale_inv, dtype))) < tol


@pytest.mark.parametrize("n,k", [(4096, 7168), (4096, 14336)])
def test_int4_gemv_keeps_tiny_and_large_activations(n, k):
    """The one-row INT4 GEMV reads nibbles as subnormal floats (tandem/kernels/dequant_gemv.py): on the GPU too
    nothing may flush them. Float32 activations of 2^-40 .. 2^40 in thirds of K, each third's product to 1e-5."""
    packed, scale = random_int4(n, k, seed=31)
    w = int4_reference_weight(packed, scale, torch.float32)
    x = torch.randn(1, k, device="cuda")
    third = k // 3 // GROUP * GROUP
    for lo, exponent in ((0, -40), (third, 0), (2 * third, 40)):
        cols = slice(lo, lo + third)
        xs = x[:, cols].contiguous() * 2.0**exponent
        y = int4_linear(xs, packed[:, lo // 8:(lo + third) // 8].contiguous(),
                        scale[:, lo // GROUP:(lo + third) // GROUP].contiguous(), GROUP)
        ref = xs.double() @ w[:, cols].double().t()
        assert norm_rel_err(y, ref) < 1e-5, exponent


def moe_reference(x, gate_up_w, down_w, route, ids):
    """Float32 loop over the experts the tokens chose; ``*_w(e)`` give expert e's bf16 weights."""
    out = torch.zeros(x.shape, dtype=torch.float32, device="cuda")
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = product(x[token], gate_up_w(e)).to(x.dtype).float().chunk(2, dim=-1)
        act = (F.silu(gate).to(x.dtype).float() * up).to(x.dtype)
        out.index_add_(0, token, product(act, down_w(e)).to(x.dtype).float() * route[token, slot, None])
    return out


def routing(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g, device="cuda").topk(top_k, dim=-1).indices
    return torch.rand(tokens, top_k, generator=g, device="cuda"), ids


@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("experts,inter", [(384, 2048), (384, 256)], ids=["kimi", "kimi-tp8"])
def test_fused_moe_int4_kimi_experts(experts, inter, tokens):
    hidden, top_k = 7168, 8
    gate_up = ExpertWeights(*random_int4(2 * inter, hidden, seed=1, leading=(experts,)), (1, GROUP))
    down = ExpertWeights(*random_int4(hidden, inter, seed=2, leading=(experts,)), (1, GROUP))
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    route, ids = routing(tokens, experts, top_k, seed=tokens)
    y = fused_moe(x, gate_up, down, route, ids)
    ref = moe_reference(x, lambda e: int4_reference_weight(gate_up.weight[e], gate_up.scale[e]),
                        lambda e: int4_reference_weight(down.weight[e], down.scale[e]), route, ids)
    assert norm_rel_err(y, ref) < 1e-2


# 1 and 2 tokens x 8 slots go slot by slot (moe_slots.PLAIN_SLOTS_MAX), 300 x 8: grouped by torch ops, not the
# one-program kernel; V2-Lite's intermediate 1408 leaves the down GEMV a partial last K step
@pytest.mark.parametrize("tokens", [1, 2, 8, 64, 300])
@pytest.mark.parametrize("hidden,inter,top_k", [(7168, 2048, 8), (2048, 1408, 6)], ids=["kimi", "v2-lite"])
def test_fused_moe_bf16_experts(tokens, hidden, inter, top_k):
    experts = 64
    gate_up = ExpertWeights(torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02)
    down = ExpertWeights(torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    route, ids = routing(tokens, experts, top_k, seed=tokens)
    y = fused_moe(x, gate_up, down, route, ids)
    ref = moe_reference(x, lambda e: gate_up.weight[e], lambda e: down.weight[e], route, ids)
    assert norm_rel_err(y, ref) < 1e-2


@pytest.mark.parametrize("tokens", [1, 16])  # 8 slots go slot by slot (tandem/kernels/moe_slots.py), 128 grouped
def test_fused_moe_fp8_experts(tokens):
    experts, hidden, inter, top_k = 32, 7168, 2048, 8
    def fp8(n, k):
        return ExpertWeights((torch.randn(experts, n, k, device="cuda") * 50).to(torch.float8_e4m3fn),
                             torch.rand(experts, n // 128, k // 128, device="cuda") * 2e-4, BLOCK)
    gate_up, down = fp8(2 * inter, hidden), fp8(hidden, inter)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    route, ids = routing(tokens, experts, top_k, seed=3)
    y = fused_moe(x, gate_up, down, route, ids)
    ref = moe_reference(x, lambda e: fp8_reference_weight(gate_up.weight[e], gate_up.scale[e]),
                        lambda e: fp8_reference_weight(down.weight[e], down.scale[e]), route, ids)
    assert norm_rel_err(y, ref) < 1e-2



@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("n", [4096, 512], ids=["n4096", "n512-split-k"])
def test_linear_kernels_replay_in_a_cuda_graph(rows, n):
    k = 7168
    packed, scale = random_int4(n, k, seed=5)
    w8 = (torch.randn(n, k, device="cuda") * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(n // 128, k // 128, device="cuda") * 1e-3
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    graph, (y4, y8) = capture_graph(lambda: (int4_linear(x, packed, scale, GROUP),
                                        fp8_block_linear(x, w8, scale_inv, BLOCK)))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y4, int4_linear(x, packed, scale, GROUP))
        assert torch.equal(y8, fp8_block_linear(x, w8, scale_inv, BLOCK))


@pytest.mark.parametrize("tokens", [1, 8])
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing(tokens):
    experts, hidden, inter, top_k = 384, 7168, 256, 8
    gate_up = ExpertWeights(*random_int4(2 * inter, hidden, seed=1, leading=(experts,)), (1, GROUP))
    down = ExpertWeights(*random_int4(hidden, inter, seed=2, leading=(experts,)), (1, GROUP))
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    route, ids = routing(tokens, experts, top_k, seed=0)
    graph, y = capture_graph(lambda: fused_moe(x, gate_up, down, route, ids))
    for seed in range(1, 4):
        new_route, new_ids = routing(tokens, experts, top_k, seed=seed)
        x.copy_(torch.randn_like(x))
        route.copy_(new_route)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, fused_moe(x, gate_up, down, route, ids))


def random_moe(hidden: int, std: float, **routing):
    """A bf16 MoE layer on CUDA with DeepSeek-V3's normalised, scaled routing (``routing``: experts, top-k, groups,
    shared experts, their width) and normal random weights of ``std``."""
    from tandem.configs.deepseek import MoeConfig
    from tandem.layers.moe import MoE
    from tandem.models.loader import default_dtype

    cfg = MoeConfig(first_k_dense_replace=0, moe_layer_freq=1, norm_topk_prob=True, routed_scaling_factor=2.5, **routing)
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        moe = MoE(hidden, cfg, None, "model.layers.1.mlp.")
    for p in moe.parameters():
        p.data.normal_(0, std)
    return moe


def test_moe_layer_takes_the_fused_path_on_the_gpu():
    """The layer on CUDA (fused kernel) against its own reference loop, DeepSeek-V3-style grouped routing."""
    moe = random_moe(2048, 0.02, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                     moe_intermediate_size=1408, n_group=8, topk_group=3)
    x = torch.randn(32, 2048, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe.gate(x)
    assert norm_rel_err(moe.routed_fused(x, weights, ids), moe.routed_reference(x, weights, ids)) < 1e-2
    assert moe.experts[3].down_proj.weight.data_ptr() == moe.expert_weights()[1].weight[3].data_ptr()


@pytest.mark.parametrize("case", ["deepseek-int4", "deepseek-fp8", "llama-int4"])
def test_quantized_engines_on_the_gpu_equal_their_float32_twins_on_the_cpu(case, tmp_path):
    """Whole models through the kernels: tiny quantized checkpoints (INT4 packed by compressed-tensors, FP8
    block-wise) served on the GPU in float32 (the kernels' full-precision products; the fused MoE for the
    DeepSeek experts) against a CPU engine on the dequantized float32 twin: prompt logits and greedy output."""
    pytest.importorskip("transformers")
    from helpers import random_prompt
    from quantized_checkpoints import write_quantized_llama
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.models.random_checkpoint import LlamaShape
    from tandem.sampling import SamplingParams

    family, method = case.split("-")
    if family == "deepseek":
        from deepseek_checkpoints import write_deepseek
        from quantized_deepseek_checkpoints import write_quantized_deepseek

        write_deepseek(tmp_path / "src", seed=5, num_hidden_layers=3)
        write_quantized_deepseek(tmp_path / "src", tmp_path / "q", tmp_path / "twin", method)
        vocab = 512
    else:
        shape = LlamaShape(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                           num_kv_heads=2)
        write_quantized_llama(tmp_path / "q", tmp_path / "twin", shape, method, seed=4)
        vocab = 256
    prompt = random_prompt(92, 13, vocab)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    results = []
    for folder, kw in ((tmp_path / "q", {"device": "cuda", "dtype": "float32"}), (tmp_path / "twin", {})):
        with LLMEngine(EngineConfig(model=str(folder), page_size=8, **kw)) as eng:
            greedy = eng.generate([prompt], params)[0].output_token_ids
            results.append((eng.prompt_logits(prompt).float().cpu(), greedy))
    (gpu_logits, gpu_greedy), (cpu_logits, cpu_greedy) = results
    assert norm_rel_err(gpu_logits, cpu_logits) < 1e-4
    assert gpu_greedy == cpu_greedy


def test_shared_experts_on_the_side_stream_equal_one_chain_however_late_they_finish(monkeypatch):
    """The shared experts' GEMVs on the side stream (tandem/layers/side_stream.py), held back ~1 ms there, against the
    same layer with side streams off, bit for bit, eagerly and replayed from a graph on new inputs. The control: with
    fused_moe's join dropped, the main chain completes while the side stream still sleeps (~25 ms), so the join is
    what orders them. (A first control compared the unjoined sums with the right ones and found them equal on an H100,
    cause not established: stale memory or an implicit wait; this one asks the streams.)"""
    import time

    from tandem.kernels import fused_moe as fused_moe_module
    from tandem.layers import side_stream

    moe = random_moe(512, 0.05, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2,
                     moe_intermediate_size=256, n_group=1, topk_group=1)
    moe.weights_loaded()
    partial, held = moe.shared_experts.partial, [2_000_000]

    def late(x):
        torch.cuda._sleep(held[0])  # (cycles: ~1 ms, where the routed chain takes tens of µs)
        return partial(x)

    monkeypatch.setattr(moe.shared_experts, "partial", late)
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(1, 512, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    monkeypatch.setattr(side_stream, "SIDE_STREAMS", False)
    want = [moe(x) for x in xs]
    monkeypatch.setattr(side_stream, "SIDE_STREAMS", True)
    side = side_stream.side_stream(xs[0])
    assert side is not None
    assert all(torch.equal(moe(x), w) for x, w in zip(xs, want))
    static = xs[0].clone()
    graph, out = capture_graph(lambda: moe(static))
    for x, w in zip(xs[::-1], want[::-1]):
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, w)
    real = fused_moe_module.fused_moe
    monkeypatch.setattr(fused_moe_module, "fused_moe", lambda *a, join=None, **k: real(*a, **k))
    torch.cuda.synchronize()
    held[0] = 50_000_000  # (~25 ms)
    moe(xs[0])
    main_done = torch.cuda.Event()
    main_done.record()
    deadline = time.monotonic() + 0.02
    while not main_done.query() and time.monotonic() < deadline:
        time.sleep(1e-4)
    assert main_done.query() and not side.query(), "without the join the main chain still waited for the side stream"
    torch.cuda.synchronize()
