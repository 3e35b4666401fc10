"""The model's sampling defaults from ``generation_config.json``, as vLLM's ``--generation-config auto``
applies them: a request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty``
unset gets the file's value, and a chat request without ``max_tokens`` gets its ``max_new_tokens`` (completions
keep OpenAI's 16, the default vLLM's completion requests carry). Every value the file states counts, as in
``GenerationConfig.to_diff_dict`` of transformers 5 (whose own defaults are all unset), which vLLM reads."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from tandem.sampling_limits import MAX_REPETITION_PENALTY

log = logging.getLogger("gateway")

AUTO, NONE = "auto", "vllm"  # --generation-config: the model folder's file / the server's defaults only
FILE = "generation_config.json"
KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0  # the OpenAI API's defaults when the model states none
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int | None = None  # chat requests without max_tokens; None = the room left in the context
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off

    @classmethod
    def load(cls, model_dir: str | Path, setting: str = AUTO) -> "SamplingDefaults":
        """``setting``: auto (the model folder's file), vllm (none), or a folder holding the file."""
        if setting == NONE:
            return cls()
        path = Path(model_dir if setting == AUTO else setting) / FILE
        if not path.is_file():
            if setting != AUTO:
                raise ValueError(f"--generation-config {setting}: no {FILE} there")
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: not a JSON object")
        stated = {k: raw[k] for k in KEYS if raw.get(k) is not None}
        for key, value in stated.items():
            if key in ("top_k", "max_new_tokens"):
                ok = _is_int(value) and value >= (1 if key == "max_new_tokens" else 0)
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if key == "min_p":
                ok = ok and 0 <= value <= 1
            elif key == "repetition_penalty":
                ok = ok and 0 < value <= MAX_REPETITION_PENALTY
            if not ok:
                raise ValueError(f"{path}: {key} = {json.dumps(value)} is not a valid value")
        if stated:
            log.info("sampling defaults from %s: %s", path, stated)
        d = cls()
        return cls(temperature=float(stated.get("temperature", d.temperature)),
                   top_p=float(stated.get("top_p", d.top_p)), top_k=stated.get("top_k", d.top_k),
                   max_tokens=stated.get("max_new_tokens", d.max_tokens),
                   min_p=float(stated.get("min_p", d.min_p)),
                   repetition_penalty=float(stated.get("repetition_penalty", d.repetition_penalty)))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
