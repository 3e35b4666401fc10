"""DeepSeek-V3's noaux_tc routing after the router's logits, in one launch: sigmoid, the correction bias,
group-limited selection, top-k, the unbiased weights, their normalisation and the scaling factor —
tandem.layers.moe_router.noaux_tc_route's arithmetic (float32), where torch spends about ten small kernels
per layer (sigmoid, add, topk and its sort, gather, sum, add, divide, multiply).

One program per token holds its expert scores as [groups, experts per group], both padded to powers of two
with -inf (Kimi's 384 experts, DeepSeek-V3's 8 groups of 32). A group's score is the sum of its two best
biased scores; the ``topk_group`` best groups are kept; then ``k`` times the best remaining expert is taken
(ties to the lower index), so the ids come out best first, as torch.topk's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _noaux_route_kernel(
    logits_ptr, bias_ptr, w_ptr, id_ptr, stride_lt, stride_wt, stride_it, scale,
    GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
    TOPK_GROUP: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, NORMALISE: tl.constexpr,
    EXTRA: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_P)
    ok = (g < GROUPS)[:, None] & (j < PER_GROUP)[None, :]
    at = g[:, None] * PER_GROUP + j[None, :]
    e = tl.where(ok, at, -1)  # padding is no expert (its offset may be the next group's first)
    score = tl.sigmoid(tl.load(logits_ptr + t * stride_lt + at, mask=ok, other=0.0).to(tl.float32))
    choice = tl.where(ok, score + tl.load(bias_ptr + at, mask=ok, other=0.0), float("-inf"))
    if GROUPS > 1:
        best = tl.max(choice, axis=1)
        first = tl.argmax(choice, axis=1)
        second = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), choice), axis=1)
        group_score = tl.where(g < GROUPS, best + second, float("-inf"))
        kept = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.argmax(group_score, axis=0)
            kept = kept | (g == top)
            group_score = tl.where(g == top, float("-inf"), group_score)
        choice = tl.where(kept[:, None], choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        idx = tl.min(tl.min(tl.where(choice == top, e, 1 << 30), axis=1), axis=0)
        w = tl.sum(tl.sum(tl.where(e == idx, score, 0.0), axis=1), axis=0)
        ids = tl.where(slots == k, idx.to(tl.int64), ids)
        weights = tl.where(slots == k, w, weights)
        choice = tl.where(e == idx, float("-inf"), choice)
    if NORMALISE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    # the always-chosen slots after the routed ones: experts GROUPS * PER_GROUP + i, weight 1 (the shared experts)
    extra = (slots >= K) & (slots < K + EXTRA)
    ids = tl.where(extra, GROUPS * PER_GROUP + slots - K, ids)
    tl.store(w_ptr + t * stride_wt + slots, tl.where(extra, 1.0, weights * scale), mask=slots < K + EXTRA)
    tl.store(id_ptr + t * stride_it + slots, ids, mask=slots < K + EXTRA)


def noaux_route(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, k: int,
                normalise: bool, scale: float, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32) and the correction bias [E] → (weights [T, k + extra] float32, ids [T, k +
    extra] int64); ``extra`` slots after the routed ones hold experts E, E + 1, ... with weight 1 (the shared experts
    stacked behind the routed ones: tandem.layers.moe)."""
    tokens, experts = logits.shape
    per_group = experts // n_group if n_group > 0 and experts % n_group == 0 else 0
    if (bias.shape != (experts,) or not per_group or not 0 < topk_group <= n_group
            or k > topk_group * per_group or (n_group > 1 and per_group < 2)):  # (a group scores its best two)
        raise ValueError(f"routing does not fit: logits {tuple(logits.shape)}, bias {tuple(bias.shape)}, "
                         f"{n_group} groups, {topk_group} kept, top {k}")
    if logits.stride(-1) != 1 or bias.stride(-1) != 1:
        raise ValueError("noaux_route needs a contiguous last dimension")
    weights = torch.empty(tokens, k + extra, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, k + extra, dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    _noaux_route_kernel[(tokens,)](
        logits, bias, weights, ids, logits.stride(0), weights.stride(0), ids.stride(0), scale,
        GROUPS=n_group, PER_GROUP=per_group, BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_P=triton.next_power_of_2(per_group), TOPK_GROUP=topk_group, K=k, BLOCK_K=triton.next_power_of_2(k + extra),
        NORMALISE=normalise, EXTRA=extra, num_warps=4, **pdl_launch(logits),
    )
    return weights, ids
