"""DeepSeek-V3's router (``mlp.gate``) and its noaux_tc routing: the float32 router weight and selection bias, the
logits of a layer's rows, the reference routing on the CPU and, on the GPU, one kernel after the logits
(tandem/kernels/moe_route.py). Routing follows transformers' DeepseekV3TopkRouter (../shared/reference/
deepseek_v3_kimi.md §3). At batch-1 decode the router's GEMV can apply the layer's post-attention norm itself
(``logits_normed``, tandem/layers/linear.py's norm_gemv_applies)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.configs.deepseek import MoeConfig
from tandem.layers.fast_path import use_triton
from tandem.layers.linear import check_shape, norm_gemv_applies


def noaux_tc_route(logits: torch.Tensor, bias: torch.Tensor, cfg: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32) → (weights [T, k] float32, expert ids [T, k]).

    The correction bias only chooses: groups are ranked by the sum of their two best biased scores,
    the best ``topk_group`` groups kept, the top ``k`` biased scores among them chosen; the weights
    are the unbiased sigmoid scores there, normalised when ``norm_topk_prob``, times the scaling factor."""
    scores = logits.sigmoid()
    choice = scores + bias
    tokens, experts = choice.shape
    if cfg.n_group > 1:
        grouped = choice.view(tokens, cfg.n_group, experts // cfg.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(tokens, experts)
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class NoAuxRouter(nn.Module):
    """``mlp.gate``: the router weight and the selection bias, kept in float32 whatever the model's dtype."""

    def __init__(self, hidden_size: int, cfg: MoeConfig):
        super().__init__()
        self.cfg = cfg
        experts = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32), requires_grad=False)

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        target = getattr(self, param)
        check_shape(tensor, tuple(target.shape))
        target.data.copy_(tensor)

    def forward(self, x: torch.Tensor, extra: int = 0,
                logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids); ``extra`` (GPU only): that many slots more, experts E, E + 1, ... at weight 1; ``logits``:
        ``self.logits(x)`` where computed already (``logits_normed``)."""
        logits = self.logits(x) if logits is None else logits
        if use_triton(x):  # the routing in one launch instead of ~10 (tandem/kernels/moe_route.py)
            from tandem.kernels.moe_route import noaux_route

            c = self.cfg
            return noaux_route(logits, self.e_score_correction_bias, c.n_group, c.topk_group, c.num_experts_per_tok,
                               c.norm_topk_prob, c.routed_scaling_factor, extra)
        if extra:
            raise ValueError("shared experts as routing slots are the GPU path's")
        return noaux_tc_route(logits, self.e_score_correction_bias, self.cfg)

    def logits_normed(self, h: torch.Tensor, residual: torch.Tensor, norm):
        """``(logits(x), h + residual, x)`` for ``x, _ = norm(h, residual)`` (an RMSNorm) in one launch where the
        router's GEMV can apply the norm (linear.norm_gemv_applies: a batch-1 decode), writing x for the experts; else
        None."""
        from tandem.kernels.activation import fold_norm

        if not (norm_gemv_applies(h, residual, norm.weight) and fold_norm(self.weight.numel() // 4)):
            return None  # (fold_norm: the router GEMV's programs cover its weight 4 rows each, each reading all of h)
        from tandem.kernels.gemv import InputNorm, router_logits

        stream, x = torch.empty_like(h), torch.empty_like(h)
        return router_logits(h, self.weight, InputNorm(residual, norm.weight, norm.eps, stream, x)), stream, x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``linear(x.float(), weight)`` [T, experts] in float32. A few rows on the GPU: one GEMV launch that reads x
        in its dtype and multiplies and sums in float32, where torch pays a cast and cuBLAS's float32 GEMV and its
        reduction (three kernels a MoE layer at decode)."""
        from tandem.kernels.gemv import MAX_ROWS

        if not use_triton(x) or x.shape[0] > MAX_ROWS or x.stride(-1) != 1:
            return torch.nn.functional.linear(x.float(), self.weight)
        from tandem.kernels.gemv import router_logits

        return router_logits(x, self.weight)
