"""Chat messages → prompt text through the model folder's own chat template (torch-free).

The template is the Jinja source that ``transformers`` would use: ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of named templates of which "default" is taken), or a
``chat_template.jinja`` file beside it (the newer layout, which wins). It is rendered the way
``transformers.apply_chat_template`` renders it — an immutable sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and ``tojson`` — so prompts are
token-identical to what the model was tuned on, and a template cannot reach Python objects.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.errors import CheckpointError


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or the model has no template)."""


def _special(value: Any) -> str:
    # tokenizer_config.json stores special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
            return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The folder's template, or None when it has none (chat requests are then refused)."""
        folder = Path(model_dir)
        config_path = folder / "tokenizer_config.json"
        config: dict = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{config_path}: not valid JSON ({e})") from e
        source = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        return cls(source, _special(config.get("bos_token")), _special(config.get("eos_token")))

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {e}") from e
