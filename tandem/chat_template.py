"""Chat messages → prompt text through the model folder's own chat template (torch-free).

The template is the Jinja source that ``transformers`` would use: ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of named templates of which "default" is taken), or a
``chat_template.jinja`` file beside it (the newer layout, which wins). It is rendered the way
``transformers.apply_chat_template`` renders it — an immutable sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now`` and the
``{% generation %}`` block — so prompts are token-identical to what the model was tuned on, and a
template cannot reach Python objects. Extra variables (``tools``, a request's ``chat_template_kwargs``
such as Qwen3's ``enable_thinking``) reach the template as transformers passes them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
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


def _generation_block():
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens with it (for
    training masks); rendering keeps its body as it is."""
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            from jinja2 import nodes

            return nodes.Scope(body, lineno=lineno)

    return GenerationBlock


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # (transformers')
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(format: str) -> str:
            return datetime.now().strftime(format)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_block(), "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self._template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, given: str | None = None) -> ChatTemplate | None:
        """The folder's template, or None when it has none (chat requests are then refused). ``given``: a
        template file or the template's text (``--chat-template``, as vLLM's), used instead (the folder's
        tokenizer_config.json still gives the BOS and EOS tokens)."""
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
        if given is not None:
            source = _given_template(given)
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        from jinja2.exceptions import TemplateSyntaxError

        try:
            return cls(source, _special(config.get("bos_token")), _special(config.get("eos_token")))
        except TemplateSyntaxError as e:
            where = f"--chat-template {given[:80]}" if given is not None else f"{folder}'s chat template"
            raise CheckpointError(f"{where}: not a valid Jinja template (line {e.lineno}: {e.message})") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **extra: Any) -> str:
        """The prompt text. ``continue_final_message``: the last message (the assistant's start) is left
        open for the model to continue — the text ends where that message's content ends, as transformers
        cuts it. ``extra``: more template variables (``tools``, chat_template_kwargs)."""
        from jinja2.exceptions import TemplateError

        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other")
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
        try:
            text = self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **variables)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:  # a variable of the wrong shape
            raise ChatTemplateError(f"the model's chat template failed on these messages: {e}") from e
        except RecursionError:  # (a value nested deeper than the JSON parser refuses, e.g. tools read by tojson)
            raise ChatTemplateError("the model's chat template failed on these messages: a value is nested too "
                                    "deeply") from None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final.strip() or final.strip() not in text:
                raise ChatTemplateError("continue_final_message needs a final message whose text the template shows")
            text = text[: text.rindex(final.strip()) + len(final.strip())]
        return text


def _given_template(given: str) -> str:
    """``--chat-template``'s value: a file's text, or the template itself when it reads as Jinja."""
    path = Path(given)
    if path.is_file():
        return path.read_text()
    if "{{" in given or "{%" in given:
        return given
    raise CheckpointError(f"--chat-template {given[:80]}: no such file, and not a Jinja template either")
