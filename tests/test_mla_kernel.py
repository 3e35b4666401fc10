"""The Triton MLA kernel (tandem/kernels/mla_attention.py) under the interpreter, against the torch
MLA backend's absorbed form on the same pool and metadata (that backend is itself tested against
transformers: tests/test_deepseek_v3.py): decode, chains, a branching tree, a multi-step draft's tree,
a batch mixing all of them with fresh and chunked sequences, every split count, bf16. The engine-level
check (a whole tiny DeepSeek-V3 on the kernel route) is tests/test_mla_kernel_route.py."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests; on a GPU: tests/gpu/test_mla_kernel_gpu.py", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton.jit
pytest.importorskip("triton")

from helpers import norm_rel_err  # noqa: E402
from mla_cases import branching_tree, latent_case, torch_reference  # noqa: E402
from tandem.attention.mla_triton_backend import TritonMLABackend  # noqa: E402
from tandem.kernels.mla_attention import LatentTiles, mla_paged_attention  # noqa: E402

HEADS, KV_LORA, ROPE, PAGE = 4, 32, 16, 4
TREE = branching_tree([-1, 0, 0, 1, 2])  # root; its children a, b; a's child; b's child
CASES = {
    "decode": [(0, 1, None), (4, 1, None), (16, 1, None), (29, 1, None)],
    "chain verify": [(3, 4, None), (12, 4, None), (21, 4, None)],
    "tree verify": [(7, 5, TREE), (18, 5, TREE)],
    "multi-step draft": [(9, 3, branching_tree([-1, 0, 0], older=3))],  # 3 new nodes see 3 older ones
    "mixed batch": [(13, 1, None), (0, 6, None), (9, 7, None), (21, 5, TREE), (10, 3, branching_tree([-1, -1, 1], 2))],
}


def kernel_through_backend(case: dict) -> torch.Tensor:
    backend = TritonMLABackend()
    backend.plan(case["meta"])
    return backend.forward_absorbed(case["q"], case["pool"], case["meta"], case["scale"], case["kv_lora"])


@pytest.mark.parametrize("name", CASES)
def test_the_kernel_equals_the_torch_backend(name):
    case = latent_case(CASES[name], HEADS, KV_LORA, ROPE, PAGE, seed=len(name))
    ref = torch_reference(case)
    out = kernel_through_backend(case)
    assert out.shape == ref.shape == (case["q"].shape[0], HEADS, KV_LORA)
    assert norm_rel_err(out, ref) < 1e-4, name


@pytest.mark.parametrize("splits,tiles", [(1, None), (2, None), (4, None), (2, LatentTiles(16, 16, 4, 3))])
def test_every_split_count_and_tile_gives_the_reference_and_repeats_bit_for_bit(splits, tiles):
    case = latent_case(CASES["mixed batch"], HEADS, KV_LORA, ROPE, PAGE, seed=3)
    backend = TritonMLABackend()
    backend.plan(case["meta"])
    m, q = case["meta"], case["q"]

    def run():
        return mla_paged_attention(q[..., :KV_LORA], q[..., KV_LORA:], case["pool"], m.block_tables, m.kv_lens,
                                   m.cu_q_lens, backend._max_q_len, case["scale"], mask=backend._mask,
                                   mask_widths=backend._mask_widths, num_splits=splits, tiles=tiles)

    first = run()
    assert norm_rel_err(first, torch_reference(case)) < 1e-4
    assert torch.equal(first, run())


def test_split_merges_of_a_wide_latent_take_it_in_column_blocks():
    """A latent wider than a merge program's columns (two blocks of MERGE_D_BLOCK), split four ways: the merged output
    is the reference's in every column."""
    from tandem.kernels.paged_attention import MERGE_D_BLOCK

    lora = 2 * MERGE_D_BLOCK
    case = latent_case(CASES["mixed batch"], HEADS, lora, ROPE, PAGE, seed=8)
    backend = TritonMLABackend()
    backend.plan(case["meta"])
    m, q = case["meta"], case["q"]
    out = mla_paged_attention(q[..., :lora], q[..., lora:], case["pool"], m.block_tables, m.kv_lens, m.cu_q_lens,
                              backend._max_q_len, case["scale"], mask=backend._mask, mask_widths=backend._mask_widths,
                              num_splits=4)
    assert norm_rel_err(out, torch_reference(case)) < 1e-4


def test_the_merge_reads_no_output_of_a_split_that_saw_no_key():
    """Graphs size the splits for the longest context, so at a short one most splits see no key and store only their
    log-sum-exp: whatever their output slots hold (NaN here) stays out of the merge; a row no split saw stays 0."""
    from tandem.kernels.paged_attention import merge_splits
    from tandem.kernels.pdl import pdl_launch

    g = torch.Generator().manual_seed(3)
    splits, tokens, heads, dim = 8, 2, 3, 64
    part_o = torch.full((splits, tokens, heads, dim), float("nan"))
    part_lse = torch.full((splits, tokens, heads), -1.0e30)
    live = torch.randn(2, tokens, heads, dim, generator=g)
    lse = torch.randn(2, tokens, heads, generator=g)
    part_o[:2], part_lse[:2] = live, lse
    part_lse[:, 1, 2] = -1.0e30  # token 1, head 2: no split saw a key (its outputs stay NaN too)
    part_o[:, 1, 2] = float("nan")
    out = torch.empty(tokens, heads, dim)
    merge_splits(part_o, part_lse, out, pdl_launch(out))
    w = torch.softmax(lse * torch.log(torch.tensor(2.0)), dim=0)  # base-2 log-sum-exps
    expected = (w[..., None] * live).sum(0)
    expected[1, 2] = 0.0
    assert torch.allclose(out, expected, atol=1e-6)


def test_heads_that_fill_no_power_of_two_and_a_narrow_rope():
    """6 heads (a partial head block) and rope 8 (padded to the 16 a dot needs): the tiny model's shape."""
    case = latent_case(CASES["mixed batch"], 6, 16, 8, 8, seed=5)
    assert norm_rel_err(kernel_through_backend(case), torch_reference(case)) < 1e-4


def test_bfloat16_pool_and_queries():
    case = latent_case(CASES["mixed batch"], HEADS, KV_LORA, ROPE, PAGE, dtype=torch.bfloat16, seed=6)
    out = kernel_through_backend(case)
    assert out.dtype == torch.bfloat16
    assert norm_rel_err(out, torch_reference(case)) < 2e-2


def test_a_tree_wider_than_64_keys_falls_back_to_the_reference():
    case = latent_case([(2, 66, branching_tree(list(range(-1, 65))))], 2, 16, 16, 16, seed=7)
    backend = TritonMLABackend()
    backend.plan(case["meta"])
    assert not backend._kernel_fits
    out = backend.forward_absorbed(case["q"], case["pool"], case["meta"], case["scale"], case["kv_lora"])
    assert torch.equal(out, torch_reference(case))


def test_shapes_the_kernel_cannot_take_are_refused():
    case = latent_case([(3, 1, None)], 2, 24, 8, 4)  # kv_lora 24: not a power of two
    m, q = case["meta"], case["q"]
    with pytest.raises(ValueError, match="power of two"):
        mla_paged_attention(q[..., :24], q[..., 24:], case["pool"], m.block_tables, m.kv_lens, m.cu_q_lens, 1, 0.1)


def test_a_tree_mask_that_does_not_fit_its_sequence_is_refused():
    case = latent_case([(2, 3, branching_tree([-1, 0, 1, 2]))], 2, 16, 16, 4)  # 4 rows for 3 new tokens
    with pytest.raises(ValueError, match="does not fit"):
        TritonMLABackend().plan(case["meta"])
