"""DeepSeek-V3's mixture of experts: noaux_tc routing, routed SwiGLU experts and shared experts.

Two paths for the routed experts. The reference (CPU): tokens are grouped by expert and each expert
runs on its own tokens, which needs the routing on the host. The GPU: one fused kernel
(tandem/kernels/fused_moe.py) groups the tokens by expert on the device and runs every expert in two
grouped GEMMs, no host synchronisation, so a MoE layer can be captured in a CUDA graph. It reads the
experts' weights as one stack per tensor (``[E, ...]``): the experts' parameters are views into stacks
allocated once when the layer is built, so the checkpoint loads through each expert's own names and
both paths read the same memory. Under tensor parallelism
every rank holds every expert with 1/TP of its intermediate dimension; the routed and shared partial
sums are all-reduced once per layer. The router and its routing: tandem/layers/moe_router.py.

Quantized checkpoints: each expert's linears take the format its checkpoint name gets (routed experts
INT4 or FP8, shared experts and dense MLPs FP8 or unquantized), held packed and dequantized per call by
the reference path, per tile by the fused kernel; the router stays float32.

Shared experts on a side stream (the default, on the GPU): their two GEMVs depend on nothing the router and the
routed experts compute, so they run on a second stream (tandem/layers/side_stream.py), forked before the routing (after
the router's GEMV where that applies the layer's norm: ``forward_normed``) and joined before the launch that adds
them; the routed chain's small, latency-bound kernels no longer wait behind them.
At batch-1 decode on an H100 (docs/benchmarks.md) this made DeepSeek-V2-Lite with INT4 routed experts (bf16 shared
ones, as Kimi-K2.5 ships them) 1869-1879 µs a token against 2066-2076 in the chain, and the bf16 model 2377-2384
against 2430-2432 as slots (below).

Shared experts as slots (``SHARED_AS_SLOTS``, off: measured slower than the side stream, and a copy of the shared
experts a layer): where the shared experts are stored as the routed ones are (same format, and
``n_shared_experts`` pieces each shaped as one routed expert), a copy of them, cut into those pieces, is
stacked behind the routed experts once the weights are loaded (``weights_loaded``; each piece an SwiGLU expert
of ``moe_intermediate_size``: the intermediate units are independent, the down projection sums them). A decode
step that goes slot by slot then routes every token to its top-k experts plus the pieces, weight 1: the shared
experts' GEMVs are the routed ones' launches, not two more a layer (DeepSeek-V2-Lite: 16.5 kernels a layer at
batch 1). The pieces cost ``n_shared_experts`` experts' memory a layer; their products are rounded and summed as
the routed slots' are, not apart and added.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.distributed import all_reduce
from tandem.layers.fast_path import use_triton
from tandem.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tandem.layers.moe_router import NoAuxRouter
from tandem.layers.quantized_linear import Fp8BlockFormat, Int4GroupFormat, linear_format
from tandem.layers.side_stream import side_stream
from tandem.configs.deepseek import MoeConfig
from tandem.configs.quantization import QuantConfig

# The shared experts as slots where they can be (see the module); off: apart, on the side stream (an A/B:
# bench/profile_deepseek.py --shared-slots)
SHARED_AS_SLOTS = False


def _same_format(a, b) -> bool:
    """Two linears' formats (None: unquantized) store their weights alike."""
    if a is None or b is None:
        return a is b
    return type(a) is type(b) and all(getattr(a, k, None) == getattr(b, k, None) for k in ("block", "group_size"))


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
        return self.down_proj.partial(self.gate_up_proj(x), swiglu=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), swiglu=True)


class MoE(nn.Module):
    def __init__(self, hidden_size: int, cfg: MoeConfig, quant: QuantConfig | None = None, prefix: str = ""):
        super().__init__()
        self.gate = NoAuxRouter(hidden_size, cfg)
        self.experts = nn.ModuleList(SwiGLUMLP(hidden_size, cfg.moe_intermediate_size, quant, f"{prefix}experts.{e}.")
                                     for e in range(cfg.n_routed_experts))
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = SwiGLUMLP(hidden_size, shared, quant, f"{prefix}shared_experts.") if shared else None
        self.shared_pieces = cfg.n_shared_experts if self._shared_stackable(cfg.n_shared_experts) else 0
        self.shared_slots_ready = False  # the pieces copied behind the routed experts (weights_loaded)
        self._stacks: dict[str, torch.Tensor] = {}
        self._stack_experts()

    def _names(self, proj: str) -> list[str]:
        layer = getattr(self.experts[0], proj)
        return list(layer.quant.tensors) if layer.quant is not None else ["weight"]

    def _shared_stackable(self, pieces: int) -> bool:
        """Whether the shared experts cut into ``pieces`` experts shaped and stored as the routed ones: gate/up rows
        (and their scales) 2 x pieces times a routed expert's, down columns pieces times."""
        if self.shared_experts is None or pieces < 1 or not SHARED_AS_SLOTS:
            return False
        for proj, dim in (("gate_up_proj", 0), ("down_proj", -1)):
            routed, shared = getattr(self.experts[0], proj), getattr(self.shared_experts, proj)
            if not _same_format(routed.quant, shared.quant):
                return False
            for name in self._names(proj):
                r, s = getattr(routed, name), getattr(shared, name)
                want = list(r.shape)
                want[dim] *= pieces
                if r.dim() != 2 or list(s.shape) != want or r.dtype != s.dtype or (dim == 0 and r.shape[0] % 2):
                    return False  # (odd gate/up rows: a scale block spans the gate and up halves)
        return True

    def _shared_piece(self, proj: str, name: str, j: int) -> torch.Tensor:
        """Piece ``j`` of the shared experts' tensor ``name``: rows j of the gate half and of the up half
        (gate_up), columns j (down), each as wide as a routed expert's."""
        t = getattr(getattr(self.shared_experts, proj), name).data
        if proj == "down_proj":
            return t.chunk(self.shared_pieces, dim=-1)[j]
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(self.shared_pieces, dim=0)[j], up.chunk(self.shared_pieces, dim=0)[j]])

    def _stack_experts(self) -> None:
        """Gather each expert tensor (``gate_up_proj.weight_packed``, ...) into one ``[E, ...]`` stack (``[E +
        shared pieces, ...]``, see the module) and make every expert's parameter a view of its row."""
        for proj in ("gate_up_proj", "down_proj"):
            for name in self._names(proj):
                first = getattr(getattr(self.experts[0], proj), name)
                rows = len(self.experts) + self.shared_pieces
                stack = torch.empty((rows, *first.shape), dtype=first.dtype, device=first.device)
                for e, expert in enumerate(self.experts):  # copy_, not torch.stack: fp8 included everywhere
                    stack[e].copy_(getattr(getattr(expert, proj), name).data)
                    setattr(getattr(expert, proj), name, nn.Parameter(stack[e], requires_grad=False))
                self._stacks[f"{proj}.{name}"] = stack
        if self.shared_slots_ready:
            self._copy_shared_pieces()

    def _copy_shared_pieces(self) -> None:
        for key, stack in self._stacks.items():
            proj, name = key.split(".")
            for j in range(self.shared_pieces):
                stack[len(self.experts) + j].copy_(self._shared_piece(proj, name, j))

    @torch.no_grad()
    def weights_loaded(self) -> None:
        """The checkpoint (or random weights) is in: copy the shared experts' pieces behind the routed experts."""
        if self.shared_pieces:
            self._stacked()
            self._copy_shared_pieces()
            self.shared_slots_ready = True

    def _stacked(self) -> dict[str, torch.Tensor]:
        """The stacks, gathered again if the experts' parameters stopped being their views (a ``.to()``
        after construction replaces every parameter's storage)."""
        last = len(self.experts) - 1
        for key, stack in self._stacks.items():
            proj, name = key.split(".")
            for e in (0, last):
                p = getattr(getattr(self.experts[e], proj), name)
                if p.device != stack.device or p.dtype != stack.dtype or p.data_ptr() != stack[e].data_ptr():
                    self._stacks.clear()
                    self._stack_experts()
                    return self._stacks
        return self._stacks

    def expert_weights(self):
        """The stacked gate/up and down projections in the fused kernel's terms (``ExpertWeights``)."""
        from tandem.kernels.fused_moe import ExpertWeights

        stacks, out = self._stacked(), []
        for proj in ("gate_up_proj", "down_proj"):
            fmt = getattr(self.experts[0], proj).quant
            if isinstance(fmt, Int4GroupFormat):
                out.append(ExpertWeights(stacks[f"{proj}.weight_packed"], stacks[f"{proj}.weight_scale"],
                                         (1, fmt.group_size)))
            elif isinstance(fmt, Fp8BlockFormat):
                out.append(ExpertWeights(stacks[f"{proj}.weight"], stacks[f"{proj}.weight_scale_inv"], fmt.block))
            else:
                out.append(ExpertWeights(stacks[f"{proj}.weight"]))
        return tuple(out)

    def routed_reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the routed experts' sum, one expert at a time (reads the routing on the host)."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e].partial(x[token])
            out.index_add_(0, token, (y.float() * weights[token, slot, None]).to(x.dtype))
        return out

    def routed_fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     add: torch.Tensor | None = None, experts=None, join=None) -> torch.Tensor:
        """The same share from the fused kernel (device-side grouping, no host synchronisation), plus ``add``;
        ``experts``: ``expert_weights()`` where the caller has them; ``join``: see fused_moe."""
        from tandem.kernels.fused_moe import fused_moe

        gate_up, down = experts or self.expert_weights()
        return fused_moe(x, gate_up, down, weights, ids, add=add, join=join)

    def _shared_as_slots(self, x: torch.Tensor, experts) -> bool:
        """Whether this step routes the shared experts' pieces as slots (see the module): a step the slots take."""
        from tandem.kernels.moe_slots import slots_apply

        slots = x.shape[0] * (self.gate.cfg.num_experts_per_tok + self.shared_pieces)
        return self.shared_slots_ready and slots_apply(slots, *experts)

    def forward_normed(self, h: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(forward(x), h + residual)`` for ``x, _ = norm(h, residual)``: the norm inside the router's launch where it
        can be (NoAuxRouter.logits_normed; the shared experts' side stream forks after it)."""
        fused = self.gate.logits_normed(h, residual, norm)
        if fused is None:
            x, stream = norm(h, residual)
            return self.forward(x), stream
        logits, stream, x = fused
        return self.forward(x, logits), stream

    def forward(self, x: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """``logits``: the router's for x, where computed already (``forward_normed``)."""
        experts = self.expert_weights() if use_triton(x) else None
        if experts is not None and self._shared_as_slots(x, experts):
            weights, ids = self.gate(x, extra=self.shared_pieces, logits=logits)
            return all_reduce(self.routed_fused(x, weights, ids, experts=experts))
        side = side_stream(x) if experts is not None and self.shared_experts is not None else None
        join = None
        if side is not None:  # the shared experts beside the routing and the routed experts (side_stream.py)
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared = self.shared_experts.partial(x)
            join = lambda: main.wait_stream(side)  # noqa: E731
        weights, ids = self.gate(x, logits=logits)
        if side is None:
            shared = self.shared_experts.partial(x) if self.shared_experts is not None else None
        if experts is not None:  # the shared experts' share added in the kernel's last step
            return all_reduce(self.routed_fused(x, weights, ids, add=shared, experts=experts, join=join))
        out = self.routed_reference(x, weights, ids)
        return all_reduce(out if shared is None else out + shared)
