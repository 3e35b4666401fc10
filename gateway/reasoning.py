"""The model's reasoning apart from its answer (``--reasoning-parser``): text in ``<think>`` ... ``</think>`` becomes
the message's ``reasoning_content``, the rest its ``content`` — whole (``split``) or as the text streams
(``ReasoningStream``), as vLLM's and SGLang's parsers of the same names read it.

  deepseek_r1   reasoning from the answer's start up to ``</think>`` (the chat template opened it; a leading
                ``<think>`` is dropped); an answer that never closes it is all reasoning
  kimi_k2       as deepseek_r1 (thinking is Kimi's default), and the tool-call section ends the reasoning too;
                ``chat_template_kwargs`` ``thinking: false`` switches it off (all content)
  deepseek_v3   reasoning only where the answer opens with ``<think>``; ``thinking: true`` (DeepSeek-V3.1's template
                then writes the ``<think>``) reads it as deepseek_r1
  qwen3         reasoning only where the answer opens with ``<think>`` (after white space); otherwise, and with
                thinking switched off (``enable_thinking``), all content

SGLang's spellings ``deepseek-r1`` and ``deepseek-v3`` are taken too. A continued assistant message
(``continue_final_message``) that closed its reasoning continues as content; one that opened it, as reasoning.
Streamed or whole, an answer splits the same way (tests/test_answer_parsing.py cuts it at every character).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway.tool_calls import KimiK2, held_back

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    opened: bool  # the answer starts inside the reasoning (the template wrote <think>)
    keeps_special_tokens: bool = False  # its tags are special tokens: the answer is decoded with them
    ended_by: str | None = None  # markup that ends the reasoning as well, and begins the content (Kimi's tool calls)
    thinking_switch: bool = False  # chat_template_kwargs' "thinking" opens (true) or switches off (false) the reasoning

    def for_request(self, template_kwargs: dict, continued: str | None) -> "ReasoningFormat | None":
        """This request's reading (None: all content): by its ``thinking`` switch, and by the assistant message it
        continues, if any."""
        fmt = self
        thinking = template_kwargs.get("thinking") if self.thinking_switch else None
        if thinking is not None:
            if not thinking:
                return None
            fmt = dataclasses.replace(fmt, opened=True)
        if continued is not None:
            if CLOSE in continued:
                return None
            if OPEN in continued:
                fmt = dataclasses.replace(fmt, opened=True)
        return fmt


FORMATS = {"deepseek_r1": ReasoningFormat(True), "deepseek-r1": ReasoningFormat(True),
           "qwen3": ReasoningFormat(False),
           "kimi_k2": ReasoningFormat(True, keeps_special_tokens=True, ended_by=KimiK2.start, thinking_switch=True),
           "deepseek_v3": ReasoningFormat(False, thinking_switch=True),
           "deepseek-v3": ReasoningFormat(False, thinking_switch=True)}


def _end(fmt: ReasoningFormat, text: str) -> tuple[int, int]:
    """Where the reasoning in ``text`` ends and where the content begins (-1, -1: not in it)."""
    close = text.find(CLOSE)
    marker = text.find(fmt.ended_by) if fmt.ended_by is not None else -1
    if marker >= 0 and (close < 0 or marker < close):
        return marker, marker  # (the marker is the content's)
    return (close, close + len(CLOSE)) if close >= 0 else (-1, -1)


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
    end, content = _end(fmt, body)
    if end < 0:
        return body, ""
    return body[:end], body[content:]


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
            end, content = _end(self.fmt, text)
            if end < 0:
                keep = max(held_back(text, CLOSE), held_back(text, self.fmt.ended_by) if self.fmt.ended_by else 0)
                self._pending = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text, self._state = text[:end], text[content:], "content"
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What was held back when the answer ends."""
        rest, self._pending = self._pending, ""
        reasoning = self._state == "reasoning" or (self._state == "start" and self.fmt.opened)
        return (rest, "") if reasoning else ("", rest)
