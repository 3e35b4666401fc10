"""DeepSeek-V3's mixture of experts: noaux_tc routing, routed SwiGLU experts and shared experts.

The reference implementation (CPU, and GPU until a fused kernel lands): tokens are grouped by expert
and each expert runs on its own tokens, which needs the routing on the host. Under tensor parallelism
every rank holds every expert with 1/TP of its intermediate dimension; the routed and shared partial
sums are all-reduced once per layer. Routing follows transformers' DeepseekV3TopkRouter
(../shared/reference/deepseek_v3_kimi.md §3).

Quantized checkpoints: each expert's linears take the format its checkpoint name gets (routed experts
INT4 or FP8, shared experts and dense MLPs FP8 or unquantized), held packed and dequantized per call by
the reference path; the router stays float32.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.distributed import all_reduce
from tandem.layers.activation import silu_mul
from tandem.layers.linear import MergedColumnParallelLinear, RowParallelLinear, check_shape
from tandem.layers.quantized_linear import linear_format
from tandem.models.deepseek_config import MoeConfig
from tandem.models.quantization import QuantConfig


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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return noaux_tc_route(torch.nn.functional.linear(x.float(), self.weight), self.e_score_correction_bias, self.cfg)


class SwiGLUMLP(nn.Module):
    """A SwiGLU MLP: a routed or shared expert, or a dense layer's MLP. ``partial`` is this rank's
    share of the output before the all-reduce (MoE sums its experts' shares and reduces once).
    ``prefix`` is its checkpoint module name (``...mlp.``, ``...mlp.experts.7.``), for ``quant``."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant: QuantConfig | None = None, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       quant=linear_format(quant, prefix, ("gate_proj", "up_proj")))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size,
                                           quant=linear_format(quant, prefix, ("down_proj",)))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.partial(silu_mul(self.gate_up_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class MoE(nn.Module):
    def __init__(self, hidden_size: int, cfg: MoeConfig, quant: QuantConfig | None = None, prefix: str = ""):
        super().__init__()
        self.gate = NoAuxRouter(hidden_size, cfg)
        self.experts = nn.ModuleList(SwiGLUMLP(hidden_size, cfg.moe_intermediate_size, quant, f"{prefix}experts.{e}.")
                                     for e in range(cfg.n_routed_experts))
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = SwiGLUMLP(hidden_size, shared, quant, f"{prefix}shared_experts.") if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e].partial(x[token])
            out.index_add_(0, token, (y.float() * weights[token, slot, None]).to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts.partial(x)
        return all_reduce(out)
