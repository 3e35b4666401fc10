"""DraftConfig: the frozen view of an EAGLE-3 draft head's ``config.json``, and its validation
against the target it will serve.

Torch-free (like ``tandem.configs.model``): the verifier checks a draft at start-up, before any
weight is loaded, by reading ``config.json`` and the safetensors *headers* (plus the small ``d2t``
tensor through numpy). Every mismatch is one line that names both numbers and the fix — the silent
failure this project exists to prevent is an EAGLE-1/2 head fed one layer's hidden state
(7168 wide) where an EAGLE-3 head needs three (21504).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import CheckpointError, ConfigError
from tandem.configs.fields import decoder_dims
from tandem.configs.model import AttentionWidths, ModelConfig, RopeConfig, _rope_from_hf, read_config_json
from tandem.configs.stored_dtypes import tensor_files

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
NUM_AUX_LAYERS = 3  # EAGLE-3 fuses the residual streams of three target layers (low, middle, high)


@dataclass(frozen=True)
class DraftConfig(AttentionWidths):
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary (embedding rows, t2d length)
    draft_vocab_size: int  # lm_head rows; draft id -> target id through d2t
    target_hidden_size: int
    # eagle_config.eagle_aux_hidden_state_layer_ids as written: OUTPUTS of layers k (inputs of k+1); None = default
    aux_layer_ids: tuple[int, ...] | None
    fc_bias: bool
    dtype: str  # checkpoint dtype name
    model_dir: str | None = None  # folder it was read from; validation reads tensor headers there

    @property
    def feature_width(self) -> int:
        """fc input: three captured target layers, concatenated."""
        return NUM_AUX_LAYERS * self.target_hidden_size

    def capture_layers(self, target: ModelConfig) -> tuple[int, ...]:
        """Target layers whose residual-stream input feeds the head, ascending (our capture indices)."""
        if self.aux_layer_ids is None:
            return target.default_capture_layers()
        # Ascending, as the target concatenates them; a repeated layer (toy targets) stays repeated.
        return tuple(sorted(k + 1 for k in self.aux_layer_ids))

    @classmethod
    def from_dir(cls, draft_dir: str | Path) -> "DraftConfig":
        path, raw = read_config_json(draft_dir, "an EAGLE-3 draft folder")
        return cls.from_hf_dict(raw, source=str(path), model_dir=str(draft_dir))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json", model_dir: str | None = None) -> "DraftConfig":
        archs = raw.get("architectures") or []
        layers = int(raw.get("num_hidden_layers", 1))
        # EAGLE's own training repo writes a plain LlamaForCausalLM config for its 1-layer head.
        eagle_repo_style = "LlamaForCausalLM" in archs and layers == 1 and raw.get("draft_vocab_size") is not None
        if EAGLE3_ARCHITECTURE not in archs and not eagle_repo_style:
            named = ", ".join(archs) if archs else "none given"
            hint = " (a 1-layer head without draft_vocab_size looks like EAGLE-1/2)" if layers == 1 else ""
            raise CheckpointError(
                f"{source}: not an EAGLE-3 draft (architectures: {named}){hint}; expected {EAGLE3_ARCHITECTURE}"
            )
        if layers != 1:
            raise CheckpointError(f"{source}: num_hidden_layers is {layers}; only 1-layer EAGLE-3 heads are supported")

        dims = decoder_dims(raw, source)
        hidden, heads, vocab = dims["hidden_size"], dims["num_heads"], dims["vocab_size"]
        eagle = raw.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
        return cls(
            **dims,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope=_rope_from_hf(raw, source),
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(int(k) for k in aux) if aux is not None else None,
            fc_bias=bool(raw.get("bias", False)),
            dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32").replace("torch.", ""),
            model_dir=model_dir,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json SGLang's LlamaForCausalLMEagle3 loader (and SpecForge) read."""
        rope = self.rope
        raw: dict[str, Any] = {
            "architectures": [EAGLE3_ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": rope.theta,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "bias": self.fc_bias,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
        }
        if rope.rope_type != "default":
            raw["rope_scaling"] = {
                "rope_type": rope.rope_type,
                "factor": rope.factor,
                "low_freq_factor": rope.low_freq_factor,
                "high_freq_factor": rope.high_freq_factor,
                "original_max_position_embeddings": rope.original_max_position_embeddings,
            }
        if self.aux_layer_ids is not None:
            raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids), "use_aux_hidden_state": True}
        return raw


def draft_tensor_files(draft_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, read from headers only (torch-free twin of loader.checkpoint_files)."""
    files = tensor_files(draft_dir)
    if not files:
        raise CheckpointError(f"{draft_dir}: no *.safetensors files in the draft folder")
    return files


def validate_draft(
    draft: DraftConfig, target: ModelConfig, capture_layers: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Check ``draft`` against ``target`` before any weight is loaded; return the capture layers to use.

    ``capture_layers`` is what the target engine was told to capture (None: whatever the draft asks
    for). Raises CheckpointError / ConfigError with one line naming both numbers and the fix.
    """
    n, h_t = target.num_layers, target.hidden_size
    fix = "use a draft trained for this target"
    if draft.vocab_size != target.vocab_size:
        raise CheckpointError(
            f"draft vocab_size {draft.vocab_size} does not match the target's {target.vocab_size}: "
            f"the draft was made for another model; {fix}"
        )
    if not 0 < draft.draft_vocab_size <= draft.vocab_size:
        raise CheckpointError(
            f"draft_vocab_size {draft.draft_vocab_size} must be in [1, {draft.vocab_size}] (the target vocab); fix the draft config"
        )
    wanted = draft.capture_layers(target)
    bad = [k for k in wanted if not 0 <= k < n]
    if bad:
        ids = list(draft.aux_layer_ids) if draft.aux_layer_ids is not None else list(wanted)
        raise CheckpointError(
            f"draft eagle_aux_hidden_state_layer_ids {ids} name the output of layer {bad[0] - 1}, which feeds layer "
            f"{bad[0]}, but the target has {n} layers (valid ids -1..{n - 2}); {fix}"
        )
    if len(wanted) != NUM_AUX_LAYERS:
        raise CheckpointError(
            f"an EAGLE-3 head reads {NUM_AUX_LAYERS} target layers but the draft's eagle_aux_hidden_state_layer_ids "
            f"name {len(wanted)} ({list(draft.aux_layer_ids or ())}); list three layer ids in the draft config"
        )
    if capture_layers is not None and tuple(sorted(capture_layers)) != wanted:
        raise ConfigError(
            f"the target captures layers {list(capture_layers)} but the draft was trained on layers {list(wanted)}; "
            "drop the capture-layer override or use a matching draft"
        )
    if draft.target_hidden_size != h_t:
        raise CheckpointError(
            f"draft target_hidden_size {draft.target_hidden_size} does not match the target's hidden size {h_t}; {fix}"
        )
    if draft.model_dir is not None:
        _validate_tensors(draft, target, wanted)
    elif draft.hidden_size != h_t:
        raise CheckpointError(_hidden_message(draft.hidden_size, h_t))
    return wanted


def _hidden_message(h_d: int, h_t: int) -> str:
    return (
        f"draft hidden_size {h_d} differs from the target's {h_t} and the draft has no embed_tokens.weight "
        "of its own (the head reuses the target's token embedding); use a draft trained for this target"
    )


def _validate_tensors(draft: DraftConfig, target: ModelConfig, capture: tuple[int, ...]) -> None:
    from safetensors import safe_open

    files = draft_tensor_files(draft.model_dir)
    h_t = target.hidden_size

    def shape(name: str) -> tuple[int, ...] | None:
        if name not in files:
            return None
        with safe_open(str(files[name]), framework="numpy") as f:
            return tuple(f.get_slice(name).get_shape())

    fc = shape("fc.weight")
    if fc is None:
        raise CheckpointError(f"{draft.model_dir}: no fc.weight tensor; this is not an EAGLE-3 draft checkpoint")
    width, need = fc[1], NUM_AUX_LAYERS * h_t
    if width != need:
        if width in (h_t, 2 * h_t):  # EAGLE-1/2 heads see one layer's hidden (fc over [embed; hidden] is 2H)
            raise CheckpointError(
                f"draft fc takes {width}-wide features but an EAGLE-3 head for this target needs {need} "
                f"({NUM_AUX_LAYERS} x {h_t}): this looks like an EAGLE-1/2 head; use an EAGLE-3 checkpoint"
            )
        raise CheckpointError(
            f"draft fc takes {width}-wide features but this target gives {need} ({NUM_AUX_LAYERS} captured layers "
            f"{list(capture)} x {h_t}); use a draft trained for this target"
        )
    if fc[0] != draft.hidden_size:
        raise CheckpointError(f"draft fc.weight has {fc[0]} rows but hidden_size is {draft.hidden_size}; the config does not match the weights")
    embed = shape("embed_tokens.weight")
    if embed is None and draft.hidden_size != h_t:
        raise CheckpointError(_hidden_message(draft.hidden_size, h_t))
    if embed is not None and embed != (draft.vocab_size, draft.hidden_size):
        raise CheckpointError(
            f"draft embed_tokens.weight has shape {embed}, expected {(draft.vocab_size, draft.hidden_size)}; the checkpoint is inconsistent"
        )
    _validate_token_map(draft, files)


def _validate_token_map(draft: DraftConfig, files: dict[str, Path]) -> None:
    import numpy as np
    from safetensors import safe_open

    if "d2t" not in files:
        if draft.draft_vocab_size != draft.vocab_size:
            raise CheckpointError(
                f"draft has draft_vocab_size {draft.draft_vocab_size} < vocab_size {draft.vocab_size} but no d2t "
                "token map; use a complete EAGLE-3 checkpoint"
            )
        return
    with safe_open(str(files["d2t"]), framework="numpy") as f:
        d2t = f.get_tensor("d2t")  # small: [draft_vocab] int64
    if tuple(d2t.shape) != (draft.draft_vocab_size,):
        raise CheckpointError(f"draft d2t has shape {tuple(d2t.shape)}, expected ({draft.draft_vocab_size},) (draft_vocab_size)")
    target_ids = np.arange(len(d2t), dtype=np.int64) + d2t.astype(np.int64)
    bad = np.flatnonzero((target_ids < 0) | (target_ids >= draft.vocab_size))
    if len(bad):
        i = int(bad[0])
        raise CheckpointError(
            f"draft d2t maps draft id {i} to target id {int(target_ids[i])}, outside the target vocabulary "
            f"[0, {draft.vocab_size}) ({len(bad)} of {len(d2t)} draft ids out of range); the token map belongs to another model, "
            "use a draft trained for this target"
        )
