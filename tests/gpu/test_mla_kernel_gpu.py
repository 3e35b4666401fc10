"""The Triton MLA kernel on a real GPU at Kimi-K2.5's latent shape (kv_lora 512, rope 64; 8 heads a rank
at TP 8, 64 at TP 1), pages of 16 and 64, up to 8k cached entries, decode, chains, branching trees and a
mixed batch, against the torch MLA backend run in float32 on the same (bf16-rounded) pool; then the
kernel captured in a CUDA graph and replayed over new lengths, block tables and masks. Skipped without
a GPU."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # before importing triton kernels: nothing here may run on the CPU
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from helpers import capture_graph, norm_rel_err  # noqa: E402
from mla_cases import branching_tree, latent_case, torch_reference  # noqa: E402

from tandem.attention.mla_triton_backend import TritonMLABackend  # noqa: E402
from tandem.kernels.mla_attention import mla_paged_attention  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
KV_LORA, ROPE = 512, 64
TREE8 = branching_tree([-1, 0, 0, 1, 1, 2, 3, 5])
CASES = {  # name: (heads, page_size, sequences as (prefix_len, q_len, tree mask or None))
    "tp8-decode-p64": (8, 64, [(p, 1, None) for p in (8191, 4000, 1023, 17, 0, 2500, 7000, 100)]),
    "tp8-decode-b1-8k": (8, 64, [(8191, 1, None)]),
    "tp8-chain4-p16": (8, 16, [(p, 4, None) for p in (8188, 3000, 511, 60)]),
    "tp8-tree8-p16": (8, 16, [(8000, 8, TREE8), (1200, 8, TREE8), (33, 8, TREE8)]),
    "tp8-multistep-draft-p16": (8, 16, [(4000, 3, branching_tree([-1, 0, 0], older=5)),
                                        (70, 3, branching_tree([-1, 0, 1], older=2))]),
    "tp1-decode-p64": (64, 64, [(8191, 1, None), (2047, 1, None), (5, 1, None)]),
    "tp1-mixed-p16": (64, 16, [(6000, 8, TREE8), (4000, 4, None), (900, 1, None), (2000, 100, None), (0, 37, None)]),
}


def _case(name: str, dtype=torch.bfloat16, seed: int = 0) -> dict:
    heads, page, seqs = CASES[name]
    return latent_case(seqs, heads, KV_LORA, ROPE, page, dtype=dtype, device=DEVICE, seed=seed)


def _float32_reference(case: dict) -> torch.Tensor:
    return torch_reference({**case, "q": case["q"].float(), "pool": case["pool"].float()})


def _kernel(case: dict, num_splits=None) -> torch.Tensor:
    backend = TritonMLABackend()
    backend.plan(case["meta"])
    m, q = case["meta"], case["q"]
    return mla_paged_attention(q[..., :KV_LORA], q[..., KV_LORA:], case["pool"], m.block_tables, m.kv_lens,
                               m.cu_q_lens, backend._max_q_len, case["scale"], mask=backend._mask,
                               mask_widths=backend._mask_widths, num_splits=num_splits)


@pytest.mark.parametrize("splits", [None, 1, 4], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("name", CASES)
def test_bf16_kernel_equals_the_float32_reference(name, splits):
    case = _case(name, seed=len(name))
    out = _kernel(case, splits)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert norm_rel_err(out, _float32_reference(case)) < 1e-2
    assert torch.equal(out, _kernel(case, splits))  # deterministic: the same bits twice


@pytest.mark.parametrize("name", ["tp8-tree8-p16", "tp1-mixed-p16"])
def test_float32_kernel_equals_the_reference_closely(name):
    case = _case(name, dtype=torch.float32, seed=1)
    assert norm_rel_err(_kernel(case), torch_reference(case)) < 1e-4


def test_the_backend_route_equals_the_torch_backend_in_bf16():
    case = _case("tp1-mixed-p16", seed=2)
    backend = TritonMLABackend()
    backend.plan(case["meta"])
    out = backend.forward_absorbed(case["q"], case["pool"], case["meta"], case["scale"], KV_LORA)
    assert norm_rel_err(out, torch_reference(case)) < 1e-2


@pytest.mark.parametrize("tree,splits", [(False, 1), (False, 8), (True, 1), (True, 4)])
def test_cuda_graph_replay_over_new_lengths_tables_and_masks(tree, splits):
    """Fixed batch 4 and width (the graphs' shape): each replay sees other lengths, pages and trees."""
    q_len = 8 if tree else 1
    masks = [TREE8, branching_tree([-1, 0, 1, 2, 3, 4, 5, 6]), branching_tree([-1, -1, 0, 1, 2, 3, 4, 5])]
    cases = [latent_case([(p, q_len, masks[(s + i) % 3] if tree else None) for i, p in enumerate(prefixes)],
                         8, KV_LORA, ROPE, 16, dtype=torch.bfloat16, device=DEVICE, seed=s, num_pages=1200)
             for s, prefixes in enumerate([(3000, 20, 700, 4000), (100, 5000, 1, 2222), (4090, 4090, 0, 64)])]
    plans = []
    for c in cases:
        backend = TritonMLABackend()
        backend.plan(c["meta"])
        tables = torch.zeros(4, 320, dtype=torch.int32, device=DEVICE)  # one width for every case
        meta = c["meta"]
        tables[:, : meta.block_tables.shape[1]] = meta.block_tables
        plan = {"q": c["q"], "pool": c["pool"], "tables": tables, "kv_lens": meta.kv_lens, "cu": meta.cu_q_lens}
        if tree:
            plan.update(mask=backend._mask, widths=backend._mask_widths)
        plans.append(plan)
    static = {k: v.clone() for k, v in plans[0].items()}
    q = static["q"]

    def launch():
        return mla_paged_attention(q[..., :KV_LORA], q[..., KV_LORA:], static["pool"], static["tables"],
                                   static["kv_lens"], static["cu"], q_len, cases[0]["scale"], mask=static.get("mask"),
                                   mask_widths=static.get("widths"), num_splits=splits)

    graph, out = capture_graph(launch)
    for c, plan in zip(cases[1:] + cases[:1], plans[1:] + plans[:1]):
        for k, buf in static.items():
            buf.copy_(plan[k])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any() and norm_rel_err(out, _float32_reference(c)) < 1e-2


def test_a_deepseek_engine_on_the_gpu_kernel_route_equals_the_cpu_reference(tmp_path):
    """A tiny DeepSeek-V3 served on the GPU in float32 (``auto``: the MLA kernel for every absorbed forward)
    against the same checkpoint on the CPU's torch route: decode logits, greedy tokens of a chunked batch."""
    pytest.importorskip("transformers")
    from deepseek_checkpoints import write_deepseek
    from helpers import manual_greedy_logits, random_prompt
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams

    write_deepseek(tmp_path, seed=21, num_hidden_layers=3)
    prompts = [random_prompt(10 + n, n, 512) for n in (3, 17, 40)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    results = []
    for kw in ({"device": "cuda", "dtype": "float32"}, {}):
        cfg = EngineConfig(model=str(tmp_path), page_size=4, page_shuffle_seed=3, chunked_prefill_size=24, **kw)
        with LLMEngine(cfg) as eng:
            assert eng.executor.runner.backend.name == ("triton-mla" if kw else "torch-mla")
            _, rows = manual_greedy_logits(eng, prompts[1], 8)
            results.append((rows.float().cpu(), [r.output_token_ids for r in eng.generate(prompts, params)]))
    (gpu_rows, gpu_tokens), (cpu_rows, cpu_tokens) = results
    assert norm_rel_err(gpu_rows, cpu_rows) < 1e-4
    assert gpu_tokens == cpu_tokens


@pytest.mark.parametrize("spec", [None, (3, 1, 4), (3, 2, 6)], ids=["target-only", "chain", "tree"])
def test_a_deepseek_engine_on_cuda_graphs_equals_it_eager(tmp_path, spec):
    """MLA + MoE captured in CUDA graphs (decode, and verify for speculation with a random EAGLE-3 head):
    the same greedy tokens as with --disable-cuda-graph, float32."""
    pytest.importorskip("transformers")
    from deepseek_checkpoints import write_deepseek
    from draft_checkpoints import make_draft
    from helpers import random_prompt
    from proposers import always_speculate
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.configs.model import ModelConfig
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig
    from tandem.engine.speculative_setup import speculative_engine

    write_deepseek(tmp_path / "target", seed=21, num_hidden_layers=6)
    make_draft(tmp_path / "draft", ModelConfig.from_dir(tmp_path / "target"), seed=3, num_heads=4, num_kv_heads=4,
               head_dim=16)
    prompts = [random_prompt(10 + n, n, 512) for n in (3, 17, 40)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    outputs = []
    for graphs in (True, False):
        cfg = EngineConfig(model=str(tmp_path / "target"), device="cuda", dtype="float32", page_size=16,
                           disable_cuda_graph=not graphs, cuda_graph_max_bs=4)
        eng = (LLMEngine(cfg) if spec is None else
               speculative_engine(cfg, str(tmp_path / "draft"), SpecConfig(*spec), policy=always_speculate()))
        with eng:
            assert (eng.executor.runner.graphs is not None) == graphs
            outputs.append([r.output_token_ids for r in eng.generate(prompts, params)])
    assert outputs[0] == outputs[1]
