"""Tool calls in a chat model's answer (``--tool-call-parser``): the markup each model family writes them in, read
into OpenAI's ``tool_calls`` whole (``split``) or as the text streams (``ToolCallStream``), as vLLM's and SGLang's
parsers of the same names read it.

  kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
                <|tool_call_end|>...<|tool_calls_section_end|>   (the call's id is the model's "functions.NAME:0",
                which Kimi's chat template puts back in the conversation's tool messages)
  deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
                <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
  deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
  hermes        <tool_call>{"name": NAME, "arguments": {...}}</tool_call> ...   (Qwen2.5 / Qwen3; also "qwen25")
  llama3_json   {"name": NAME, "parameters": {...}}; {...}   an answer that opens with them (after white space, or
                after <|python_tag|>) is calls; one that opens otherwise is content (Llama 3.1-3.3; also "llama3",
                "llama4_json")

Streamed, the markup is read again only when a call's end marker arrives, from the end of the last call read (a
coding agent's call carries whole files in its arguments: reading all of it at each delta cost seconds, 42 KB in
4-character deltas, on the event loop every stream shares). What comes before the first call's markup is the answer's
content; the arguments are the model's JSON text as written
(stripped). A call whose markup is unfinished when the answer ends is not a call; an answer with no finished call is
all content, its markup included.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self, index: int | None = None) -> dict:
        """The call as OpenAI shows it (``index``: in a stream's ``delta.tool_calls``)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallFormat:
    """A model family's markup: ``start`` opens the tool calls (what comes before is content); ``calls`` reads the
    finished calls in the text from ``start`` on."""

    start: str
    end: str  # closes one call: the stream reads its text again only once this has come
    keeps_special_tokens = False  # its markers are special tokens: the answer is decoded with them
    anywhere = True  # the calls may follow some content (False: only an answer that opens with them has calls)

    def find(self, text: str) -> int:
        """Where the calls' markup starts in ``text`` (the answer so far), or -1."""
        return text.find(self.start)

    def waiting(self, text: str) -> int:
        """How many characters at the end of ``text`` (the answer so far) could begin the markup."""
        return held_back(text, self.start)

    def calls(self, section: str) -> tuple[list[ToolCall], int]:
        """The finished calls in ``section``, and where the last one ends (0: none)."""
        raise NotImplementedError


def _ended(calls: list[ToolCall], match) -> tuple[list[ToolCall], int]:
    return calls, match.end() if match is not None else 0


class KimiK2(ToolCallFormat):
    start = "<|tool_calls_section_begin|>"
    keeps_special_tokens = True
    _call = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)"
                       r"<\|tool_call_end\|>", re.DOTALL)

    end = "<|tool_call_end|>"

    def calls(self, section: str) -> tuple[list[ToolCall], int]:
        out, m = [], None
        for m in self._call.finditer(section):
            call_id = m["id"]
            name = call_id.rsplit(":", 1)[0]  # "functions.get_weather:0" → get_weather
            out.append(ToolCall(call_id, name.split(".", 1)[1] if "." in name else name, m["args"].strip()))
        return _ended(out, m)


class DeepSeekV3(ToolCallFormat):
    start = "<｜tool▁calls▁begin｜>"
    _call = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```(?:json)?\n(?P<args>.*?)\n```"
                       r"\s*<｜tool▁call▁end｜>", re.DOTALL)

    end = "<｜tool▁call▁end｜>"

    def calls(self, section: str) -> tuple[list[ToolCall], int]:
        matches = list(self._call.finditer(section))
        return _ended([ToolCall(_call_id(), m["name"].strip(), m["args"].strip()) for m in matches],
                      matches[-1] if matches else None)


class DeepSeekV31(DeepSeekV3):
    _call = re.compile(r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<args>.*?)<｜tool▁call▁end｜>", re.DOTALL)


class Hermes(ToolCallFormat):
    start = "<tool_call>"
    _call = re.compile(r"<tool_call>(?P<json>.*?)</tool_call>", re.DOTALL)

    end = "</tool_call>"

    def calls(self, section: str) -> tuple[list[ToolCall], int]:
        out, m = [], None
        for m in self._call.finditer(section):
            try:
                call = json.loads(m["json"])
            except ValueError:
                continue  # (not a call the client could run)
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                out.append(_json_call(call))
        return _ended(out, m)


def _json_call(call: dict) -> ToolCall:
    """A call written as JSON: its name, and its arguments (or parameters) as JSON text."""
    arguments = call.get("arguments", call.get("parameters", {}))
    return ToolCall(_call_id(), call["name"],
                    arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


class Llama3Json(ToolCallFormat):
    start = "<|python_tag|>"
    anywhere = False

    def find(self, text: str) -> int:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(("{", self.start)) else -1

    def waiting(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if self.start.startswith(body) else 0  # (white space, or the tag's beginning)

    end = "}"

    def calls(self, section: str) -> tuple[list[ToolCall], int]:
        at = len(section) - len(section.lstrip())
        if section.startswith(self.start, at):
            at += len(self.start)
        decoder, out, ended = json.JSONDecoder(), [], 0
        while True:
            while at < len(section) and (section[at].isspace() or section[at] == ";"):
                at += 1
            if at == len(section):
                return out, ended
            try:
                call, at = decoder.raw_decode(section, at)
            except ValueError:  # (unfinished, or not a call)
                return out, ended
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return out, ended
            out.append(_json_call(call))
            ended = at


FORMATS: dict[str, ToolCallFormat] = {"kimi_k2": KimiK2(), "deepseek_v3": DeepSeekV3(), "deepseekv3": DeepSeekV3(),
                                      "deepseek_v31": DeepSeekV31(), "deepseekv31": DeepSeekV31(), "hermes": Hermes(),
                                      "qwen25": Hermes(), "qwen": Hermes(), "llama3_json": Llama3Json(),
                                      "llama3": Llama3Json(), "llama4_json": Llama3Json()}


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (so must wait for the next delta)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split(fmt: ToolCallFormat, text: str) -> tuple[str, list[ToolCall]]:
    """→ the content (the text before the calls; all of it where no call was made) and the calls."""
    at = fmt.find(text)
    if at < 0:
        return text, []
    calls, _ = fmt.calls(text[at:])
    return (text[:at], calls) if calls else (text, [])


class ToolCallStream:
    """A streamed answer's text in, its content and each finished tool call out (a call is sent whole, once its
    markup ends: OpenAI clients gather a call's pieces by index, and one piece is a whole call)."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self._pending = ""  # content held back: it may begin the calls' markup
        self._section: str | None = None  # the text from the markup's start on, once seen
        self._read = 0  # of the section: read up to the last finished call (only the rest is read again)
        self._said = False  # content was sent (a format whose calls open the answer has none then)
        self.sent = 0  # calls sent so far

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """→ the content to send now, and the calls finished since the last feed."""
        if self._section is not None:
            seen = len(self._section)
            self._section += text
            # read again only where a call may have ended (a long call's arguments arrive in thousands of deltas)
            ends = self._section.find(self.fmt.end, max(self._read, seen - len(self.fmt.end) + 1)) >= 0
            return "", self._new_calls() if ends else []
        if self._said and not self.fmt.anywhere:
            return text, []
        text = self._pending + text
        at = self.fmt.find(text)
        if at >= 0:
            self._pending, self._section = "", text[at:]
            return text[:at], self._new_calls()
        keep = self.fmt.waiting(text)
        self._pending = text[len(text) - keep:]
        self._said = self._said or keep < len(text)
        return text[:len(text) - keep], []

    def finish(self) -> str:
        """The content still held back when the answer ends: text that only looked like the markup's start, or the
        markup itself where it held no finished call (as ``split`` answers it)."""
        rest = self._pending + (self._section if self._section is not None and not self.sent else "")
        self._pending, self._section = "", None
        return rest

    def _new_calls(self) -> list[ToolCall]:
        calls, ended = self.fmt.calls(self._section[self._read:])
        self._read += ended
        self.sent += len(calls)
        return calls
