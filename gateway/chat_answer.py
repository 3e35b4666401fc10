"""A chat answer's text read into OpenAI's message fields — ``reasoning_content`` (also as ``reasoning``), ``content``
and ``tool_calls`` — by the server's ``--reasoning-parser`` and ``--tool-call-parser`` (gateway/reasoning.py,
gateway/tool_calls.py): whole (``message``) or delta by delta (``AnswerStream``). Reasoning is split off first; tool calls are read in what
remains. An answer that made calls and stopped finishes with ``tool_calls``, as OpenAI's and vLLM's do."""

from __future__ import annotations

from dataclasses import dataclass

from gateway import reasoning, tool_calls
from gateway.reasoning import ReasoningFormat
from gateway.tool_calls import ToolCallFormat


@dataclass(frozen=True)
class AnswerFormats:
    tools: ToolCallFormat | None = None  # None: no tool calls read (no parser, no tools, or tool_choice "none")
    reasoning: ReasoningFormat | None = None
    shows_reasoning: bool = True  # False: the reasoning split off is not sent (vLLM's include_reasoning: false)

    @property
    def reads(self) -> bool:
        return self.tools is not None or self.reasoning is not None

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the markup read is made of special tokens, which the answer's text must then keep."""
        return any(f is not None and f.keeps_special_tokens for f in (self.tools, self.reasoning))

    def for_request(self, read_tools: bool, separate_reasoning: bool = True, include_reasoning: bool = True,
                    template_kwargs: dict | None = None, continued: str | None = None) -> "AnswerFormats":
        """This request's: tool calls read only where it may call (``read_tools``); reasoning split off unless it asks
        not to (SGLang's ``separate_reasoning``) or its ``thinking`` switch or the message it ``continued`` says there
        is none (ReasoningFormat.for_request), and sent unless it asks not to (vLLM's ``include_reasoning``)."""
        thought = self.reasoning if separate_reasoning else None
        if thought is not None:
            thought = thought.for_request(template_kwargs or {}, continued)
        return AnswerFormats(self.tools if read_tools else None, thought, include_reasoning)


# the reasoning's field: reasoning_content (DeepSeek's API, SGLang, vLLM until lately) and reasoning (vLLM's newer name)
REASONING_FIELDS = ("reasoning_content", "reasoning")


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def message(formats: AnswerFormats, text: str, prefix: str = "") -> tuple[dict, bool]:
    """The assistant message of a whole answer (``prefix``: text before it, a continued message's), and whether it
    called tools."""
    thought = None
    if formats.reasoning is not None:
        thought, text = reasoning.split(formats.reasoning, text)
    calls = []
    if formats.tools is not None:
        text, calls = tool_calls.split(formats.tools, text)
    content = prefix + text
    out = {"role": "assistant", "content": content or None}  # (vLLM's: no text, null)
    if formats.reasoning is not None:
        for name in REASONING_FIELDS:
            out[name] = thought if formats.shows_reasoning else None
    if calls:
        out["tool_calls"] = [call.openai() for call in calls]
    return out, bool(calls)


class AnswerStream:
    """One choice's streamed text in, its delta's fields out."""

    def __init__(self, formats: AnswerFormats):
        self.reasoning = reasoning.ReasoningStream(formats.reasoning) if formats.reasoning is not None else None
        self.tools = tool_calls.ToolCallStream(formats.tools) if formats.tools is not None else None
        self.shows_reasoning = formats.shows_reasoning

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.sent > 0

    def feed(self, text: str, last: bool = False) -> dict:
        """The delta's fields for ``text`` (``last``: the answer ends with it: everything held back goes too)."""
        thought, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if last and self.reasoning is not None:
            held_thought, held_content = self.reasoning.finish()
            thought, content = thought + held_thought, content + held_content
        first_call = self.tools.sent if self.tools is not None else 0
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if last:
                content += self.tools.finish()
        fields = {}
        if thought and self.shows_reasoning:
            fields.update(dict.fromkeys(REASONING_FIELDS, thought))
        if content:
            fields["content"] = content
        if calls:
            fields["tool_calls"] = [call.openai(first_call + i) for i, call in enumerate(calls)]
        return fields
