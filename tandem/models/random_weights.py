"""Random benchmark weights (``load_format="random"``), drawn on the device in place of a checkpoint read.

The one home for how they look: floating matrices normal(0, ``std``), norms 1, vectors (biases, the
router's correction bias) 0; a quantized layer's tensors in its own format (tandem/layers/quantized_linear.py)
such that the dequantized weight has about the same ``std``, so a quantized benchmark model computes on
values of the same size as its bf16 twin:

- INT4 groups: the packed words uniform over all 32 bits (every nibble uniform over q + 8 = 0..15, i.e.
  q over -8..7, root mean square sqrt(21.5) ≈ 4.64), every group's scale ``std`` / 4.64;
- FP8 blocks: the e4m3 values normal(0, 1) (drawn in bf16 and cast: no generator draws float8), every
  block's ``scale_inv`` = ``std``;
- ``weight_shape``: the loader checks the checkpoint's record against the layer and drops it (the
  parameter keeps its zeros), so it is left as it is here too.
"""

from __future__ import annotations

import math

import torch

from tandem.layers.quantized_linear import Fp8BlockFormat, Int4GroupFormat, QuantFormat

INT4_RMS = math.sqrt(21.5)  # of q uniform over -8..7: E[q²] = var 21.25 + mean² 0.25


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Benchmark weights: normal(0, std) matrices, unit norms, quantized layers in their format."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    done: set[int] = set()
    for module in model.modules():
        fmt = getattr(module, "quant", None)
        if isinstance(fmt, QuantFormat):
            _randomize_quantized(module, fmt, gen, std)
            done.update(id(getattr(module, name)) for name in (*fmt.tensors, "weight_shape") if hasattr(module, name))
    for name, p in model.named_parameters():
        if id(p) in done or not p.dtype.is_floating_point:  # integer metadata: as the loader leaves it
            continue
        if p.dim() == 1:
            p.fill_(1.0 if "norm" in name else 0.0)
        else:
            p.normal_(0.0, std, generator=gen)


def _randomize_quantized(layer: torch.nn.Module, fmt: QuantFormat, gen: torch.Generator, std: float) -> None:
    if isinstance(fmt, Int4GroupFormat):
        layer.weight_packed.random_(-2**31, 2**31, generator=gen)  # all 32 bits: eight uniform nibbles
        layer.weight_scale.fill_(std / INT4_RMS)
    elif isinstance(fmt, Fp8BlockFormat):
        w = layer.weight
        w.copy_(torch.randn(w.shape, generator=gen, dtype=torch.bfloat16, device=w.device).to(w.dtype))
        layer.weight_scale_inv.fill_(std)
    else:
        raise NotImplementedError(f"random weights for {type(fmt).__name__}")
