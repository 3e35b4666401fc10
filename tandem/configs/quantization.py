"""QuantConfig: the frozen view of a checkpoint's ``quantization_config``, read once with the model config.

Two weight-only schemes are supported (deepseek_v3_kimi.md §5):

- **FP8 block-wise** (``quant_method: fp8``, DeepSeek-V3 / Kimi-K2): e4m3 ``weight`` plus a float32
  ``weight_scale_inv`` per ``weight_block_size`` block; every linear except ``lm_head`` and
  ``modules_to_not_convert``. ``activation_scheme: dynamic`` is accepted: activations stay in the
  model dtype here (W8A16), which a per-token dynamic scheme only approximates.
- **INT4 compressed-tensors** (``quant_method: compressed-tensors``, ``format: pack-quantized``,
  Kimi-K2-Thinking / K2.5): symmetric int4 per group of ``group_size`` input columns; ``weight_packed``
  / ``weight_scale`` / ``weight_shape``; the linears the config groups' ``targets`` name minus the
  ``ignore`` list (exact names or ``re:`` patterns on the checkpoint's module names).

Anything else is refused here, before a weight is read, with one line naming what is unsupported.
Torch-free, like tandem/configs/model.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Sequence

from tandem.errors import CheckpointError

SUPPORTED = "fp8 block-wise (e4m3) or compressed-tensors pack-quantized int4 (symmetric, grouped, weights only)"


@dataclass(frozen=True)
class Fp8Block:
    """e4m3 weight, one float32 ``scale_inv`` per ``block = (rows, cols)``: ``W = w * scale_inv``."""

    block: tuple[int, int]


@dataclass(frozen=True)
class Int4Group:
    """int4 packed eight to an int32 (low nibble first, stored as q + 8), one scale per ``group_size``
    input columns of a row: ``W = (nibble - 8) * scale``. ``scale_dtype``: the float type the scales are held
    in, the one the checkpoint stores (compressed-tensors writes a bf16 model's scales in bf16); the kernels
    widen each to float32 as they read it, so holding them as stored is exact and reads no byte more. Its source,
    first found: the checkpoint's tensors, the config's ``scale_dtype``, the model's dtype (ModelConfig)."""

    group_size: int
    scale_dtype: str | None = None

    @property
    def held_scale_dtype(self) -> str:
        """The dtype the scales are held in (float32 where nothing named one: exact for any stored float)."""
        return self.scale_dtype or "float32"


LinearScheme = Fp8Block | Int4Group
SCALE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8" or "compressed-tensors"
    scheme: LinearScheme
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors: "Linear" means every linear
    ignore: tuple[str, ...] = ()

    def describe(self) -> str:
        """One phrase for a start-up log line: the scheme and what it covers."""
        if isinstance(self.scheme, Fp8Block):
            what = f"fp8 block-wise {self.scheme.block[0]}x{self.scheme.block[1]}"
        else:
            what = f"int4 group {self.scheme.group_size}, {self.scheme.held_scale_dtype} scales"
        covers = "every linear" if self.method == "fp8" or "Linear" in self.targets else "the targeted linears"
        return f"{what} on {covers}" + (f" but {len(self.ignore)} ignored" if self.ignore else "")

    def scheme_for(self, names: Sequence[str]) -> LinearScheme | None:
        """The scheme of the linear whose checkpoint module names are ``names`` (several for a fused
        projection: they must agree), or None where it stays unquantized."""
        chosen = [self._quantized(n) for n in names]
        if any(chosen) and not all(chosen):
            odd = [n for n, c in zip(names, chosen) if c != chosen[0]]
            raise CheckpointError(
                f"quantization_config quantizes {names[0]} but not {odd[0]} (or the reverse); "
                "projections fused into one matmul must be quantized alike"
            )
        return self.scheme if chosen and chosen[0] else None

    def _quantized(self, name: str) -> bool:
        if self.method == "fp8":  # HF's fp8 format never converts the LM head
            return name.rpartition(".")[2] != "lm_head" and not any(_under(name, m) for m in self.ignore)
        targeted = "Linear" in self.targets or any(_match(name, t) for t in self.targets)
        return targeted and not any(_match(name, i) for i in self.ignore)


def _match(name: str, target: str) -> bool:
    """compressed-tensors' rule: ``re:`` + a pattern matched at the start of the name, else the exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _under(name: str, module: str) -> bool:
    """HF's modules_to_not_convert rule: the module itself, a module inside it, or a name ending in it."""
    return name == module or name.startswith(module + ".") or name.endswith("." + module)


def with_scale_dtype(quant: QuantConfig | None, dtype: str, unless_named: bool = False) -> QuantConfig | None:
    """``quant`` with its INT4 scales held in ``dtype`` (a torch dtype name; ``unless_named``: only where the config
    names none); FP8 keeps float32 ``scale_inv``."""
    if quant is None or not isinstance(quant.scheme, Int4Group) or dtype not in SCALE_DTYPES:
        return quant
    if unless_named and quant.scheme.scale_dtype is not None:
        return quant
    return replace(quant, scheme=replace(quant.scheme, scale_dtype=dtype))


def find_quantization_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    """Top level, or inside ``text_config`` for a multimodal wrapper (Kimi-K2.5)."""
    for where in (raw, raw.get("text_config") or {}):
        for key in ("quantization_config", "compression_config"):
            if where.get(key):
                return where[key]
    return None


def parse_quantization(raw: dict[str, Any], source: str = "config.json") -> QuantConfig | None:
    q = find_quantization_config(raw)
    if q is None:
        return None

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{source}: quantization_config: {what} is not supported (supported: {SUPPORTED})")

    if not isinstance(q, dict):
        raise refuse(f"a {type(q).__name__} instead of an object")
    method = q.get("quant_method")
    if method == "fp8":
        cfg = _parse_fp8(q, refuse)
    elif method == "compressed-tensors":
        cfg = _parse_compressed_tensors(q, refuse)
    else:
        raise refuse(f"quant_method '{method}'")
    # The LM head stays unquantized: named plainly in the ignore list, or as a multimodal wrapper's checkpoint names it.
    heads = ("lm_head", "language_model.lm_head") if raw.get("text_config") else ("lm_head",)
    if all(cfg.scheme_for([head]) is not None for head in heads):
        raise refuse("a quantized lm_head (add it to the ignore list)")
    return cfg


def _parse_fp8(q: dict[str, Any], refuse) -> QuantConfig:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise refuse(f"fp8 fmt '{fmt}'")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse(f"fp8 activation_scheme '{q.get('activation_scheme')}' (static activation scales)")
    block = q.get("weight_block_size")
    if block is None:
        raise refuse("fp8 without weight_block_size (per-tensor fp8)")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(_positive_int(b) for b in block)):
        raise refuse(f"fp8 weight_block_size {block!r} (want two positive integers)")
    ignore = tuple(q.get("modules_to_not_convert") or ()) + tuple(q.get("ignored_layers") or ())
    return QuantConfig("fp8", Fp8Block((int(block[0]), int(block[1]))), ignore=ignore)


def _parse_compressed_tensors(q: dict[str, Any], refuse) -> QuantConfig:
    fmt = q.get("format")
    if fmt != "pack-quantized":
        raise refuse(f"compressed-tensors format '{fmt}'")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(f"quantization_status '{status}' (only compressed checkpoints)")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        # (a "dense" sparsity format is no sparsity: some llm-compressor versions write it into W4A16 checkpoints)
        if q.get(key) and not (key == "sparsity_config" and (q[key] or {}).get("format") == "dense"):
            raise refuse(key)
    groups = q.get("config_groups") or {}
    if not groups:
        raise refuse("compressed-tensors without config_groups")
    targets: list[str] = []
    weights_seen = None
    for name, group in groups.items():
        if not isinstance(group, dict):  # a preset name (e.g. "W4A16") instead of a scheme
            raise refuse(f"config group '{name}' given as {group!r}")
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise refuse(f"activation quantization ({key} in group '{name}')")
        if group.get("format") not in (None, "pack-quantized"):
            raise refuse(f"group '{name}' format '{group['format']}'")
        weights = _int4_weights(group.get("weights"), name, refuse)
        if weights_seen is not None and weights != weights_seen:
            raise refuse(f"config groups with different weight schemes ('{name}')")
        weights_seen = weights
        targets += list(group.get("targets") or [])
    return QuantConfig("compressed-tensors", Int4Group(*weights_seen), tuple(targets), tuple(q.get("ignore") or ()))


def _int4_weights(w: Any, group: str, refuse) -> tuple[int, str | None]:
    """The group size and the named scale dtype (None: not named) of a supported weight scheme; refuses everything
    else."""
    if not isinstance(w, dict):
        raise refuse(f"group '{group}' without weights")
    checks = [
        ("num_bits", 4, f"{w.get('num_bits')}-bit weights"),
        ("type", "int", f"weight type '{w.get('type')}'"),
        ("symmetric", True, "asymmetric weights (zero points)"),
        ("strategy", "group", f"weight strategy '{w.get('strategy')}'"),
        ("dynamic", False, "dynamic weight quantization"),
    ]
    for key, want, what in checks:
        if w.get(key, want if key in ("symmetric", "dynamic") else None) != want:
            raise refuse(f"{what} in group '{group}'")
    if w.get("actorder"):
        raise refuse(f"activation-ordered groups (actorder '{w['actorder']}', g_idx) in group '{group}'")
    if w.get("block_structure"):
        raise refuse(f"block_structure in group '{group}'")
    size = w.get("group_size")
    if not _positive_int(size) or size % 8:
        raise refuse(f"group_size {size!r} in group '{group}' (want a positive multiple of 8)")
    named = w.get("scale_dtype")  # compressed-tensors writes "torch.bfloat16"
    scale_dtype = None if named is None else str(named).removeprefix("torch.")
    if scale_dtype is not None and scale_dtype not in SCALE_DTYPES:
        raise refuse(f"scale_dtype '{named}' in group '{group}'")
    return int(size), scale_dtype


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
