"""The model's reasoning apart from its answer (``--reasoning-parser``): text in ``<think>`` ... ``</think>`` becomes
the message's ``reasoning_content``, the rest its ``content`` — whole (``split``) or as the text streams
(``ReasoningStream``), as vLLM's and SGLang's parsers of the same names read it.

  deepseek_r1         reasoning from the answer's start up to ``</think>`` (the chat template opened it; a leading
                      ``<think>`` is dropped); an answer that never closes it is all reasoning
  qwen3, kimi_k2,     reasoning only where the answer opens with ``<think>`` (after white space); otherwise, and with
  deepseek_v3         thinking switched off (``chat_template_kwargs``), all content (a template that writes the
                      ``<think>`` itself wants deepseek_r1)

Streamed or whole, an answer splits the same way (tests/test_answer_parsing.py cuts it at every character).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tool_calls import held_back

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    opened: bool  # the answer starts inside the reasoning (the template wrote <think>)
    keeps_special_tokens: bool = False  # its tags are special tokens: the answer is decoded with them


FORMATS = {"deepseek_r1": ReasoningFormat(True), "qwen3": ReasoningFormat(False),
           "kimi_k2": ReasoningFormat(False, keeps_special_tokens=True), "deepseek_v3": ReasoningFormat(False)}


def split(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """→ (the reasoning, or None where there is none; the content)."""
    body = text.lstrip()
    opened = body.startswith(OPEN)
    if opened:
        body = body[len(OPEN):]
    elif fmt.opened:
        body = text
    else:
        return None, text
    end = body.find(CLOSE)
    if end < 0:
        return body, ""
    return body[:end], body[end + len(CLOSE):]


class ReasoningStream:
    """A streamed answer's text in, its reasoning and content pieces out; a tag split across deltas is held back."""

    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self._state = "start"  # start → reasoning → content, or start → content
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """→ (reasoning, content) to send now."""
        text = self._pending + text
        self._pending = ""
        reasoning = ""
        if self._state == "start":
            body = text.lstrip()
            if body.startswith(OPEN):
                self._state, text = "reasoning", body[len(OPEN):]
            elif not body or OPEN.startswith(body):  # (white space, or the tag's beginning: wait)
                self._pending = text
                return "", ""
            else:
                self._state = "reasoning" if self.fmt.opened else "content"
        if self._state == "reasoning":
            end = text.find(CLOSE)
            if end < 0:
                keep = held_back(text, CLOSE)
                self._pending = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text, self._state = text[:end], text[end + len(CLOSE):], "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What was held back when the answer ends."""
        rest, self._pending = self._pending, ""
        reasoning = self._state == "reasoning" or (self._state == "start" and self.fmt.opened)
        return (rest, "") if reasoning else ("", rest)
