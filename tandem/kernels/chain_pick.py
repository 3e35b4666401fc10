"""One step of a chain draft's choice in one kernel: from the head's logits, the best draft token (the
first maximum), mapped to the target's vocabulary, and its log-probability added to the chain's score.

The torch ops it replaces (tandem.speculative.draft_static._static_chain) cast the logits to float32,
take log_softmax, clamp it at 0, select the top 1 (a radix select of four kernels over the draft
vocabulary), gather the draft→target offset and add twice: a large share of a chain draft's kernel
time beyond its weight reads (bench/graph_kernels.py). Here each
row is read once: every lane keeps a running maximum, the index where it first reached it, and the sum
of exp(x - max) rescaled as the maximum grows (online softmax); the lanes are combined at the end.

The log-probability of the chosen token is x_max - logsumexp = -log(sum of exp(x - x_max)), clamped at
0 as the torch path clamps it. A row holding a NaN gets a NaN score, which the draft's NaN flag reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.pdl import pdl_enter, pdl_launch

BLOCK = 2048  # logits per lane group per step; a 32000-token draft vocabulary takes 16 steps
# (the vocabulary size is a compile-time constant: one model has one, and the loop's trip count is known)


@triton.jit
def _chain_pick_kernel(logits_ptr, d2t_ptr, score_in_ptr, score_out_ptr, token_ptr, stride_row, stride_score,
                       V: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    row = logits_ptr + b * stride_row
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
    lane_first = tl.zeros([BLOCK], dtype=tl.int32)
    nans = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(row + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        nans += (x != x).to(tl.int32)
        lane_first = tl.where(x > lane_max, idx, lane_first)  # strictly greater: the first index stays
        grown = tl.maximum(lane_max, x)
        pivot = tl.where(grown == float("-inf"), 0.0, grown)  # a lane with no finite logit yet sums 0
        lane_sum = lane_sum * tl.exp(lane_max - pivot) + tl.exp(x - pivot)
        lane_max = grown
    best = tl.max(lane_max, 0)
    total = tl.sum(lane_sum * tl.exp(lane_max - best), 0)
    first = tl.minimum(tl.min(tl.where(lane_max == best, lane_first, V), 0), V - 1)  # (V: a NaN row's max)
    logp = tl.minimum(-tl.log(total), 0.0)
    logp = tl.where(tl.sum(nans, 0) > 0, float("nan"), logp)
    tl.store(score_out_ptr + b, tl.load(score_in_ptr + b * stride_score) + logp)
    tl.store(token_ptr + b, first.to(tl.int64) + tl.load(d2t_ptr + first))


def chain_pick(logits: torch.Tensor, d2t: torch.Tensor, score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [B, V] (any float dtype, last dim contiguous), ``d2t`` int64 [V] (target id = draft id
    + d2t[draft id]), ``score`` float32 [B] (any stride) the chain's score so far → (the chosen target
    ids, int64 [B]; the score plus the chosen token's log-probability, float32 [B])."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"chain_pick takes logits [B, V] with a contiguous last dim, got {tuple(logits.shape)}")
    B, V = logits.shape
    if d2t.shape != (V,) or d2t.dtype != torch.int64:
        raise ValueError(f"d2t must be int64 [{V}], got {d2t.dtype} {tuple(d2t.shape)}")
    if score.shape != (B,) or score.dtype != torch.float32:
        raise ValueError(f"score must be float32 [{B}], got {score.dtype} {tuple(score.shape)}")
    token = torch.empty(B, dtype=torch.int64, device=logits.device)
    score_out = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        _chain_pick_kernel[(B,)](logits, d2t, score, score_out, token, logits.stride(0), score.stride(0),
                                 V=V, BLOCK=BLOCK, num_warps=8, **pdl_launch(logits))
    return token, score_out
