"""Chat answers read into reasoning_content, content and tool_calls (--reasoning-parser, --tool-call-parser): each
model family's published markup read as vLLM's and SGLang's parsers of the same names read it, the same whether the
answer comes whole or streamed cut anywhere, and end to end through the gateway (a scripted verifier's answer, the
markup's tokens special as Kimi's are)."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_verifier import EOS_ID
from gateway_harness import stack_fixture, tiny_model_copy

from gateway import reasoning, tool_calls
from gateway.chat_answer import AnswerFormats, AnswerStream, finish_reason, message

WEATHER, TIME = '{"city": "Paris"}', '{"tz": "CET"}'
KIMI = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        f"{WEATHER}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{TIME}"
        "<|tool_call_end|><|tool_calls_section_end|>")
DEEPSEEK_V3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               f"{WEATHER}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DEEPSEEK_V31 = (f"Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{WEATHER}<｜tool▁call▁end｜>"
                f"<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{TIME}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
HERMES = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "CET"}}'
# (parser, answer, content, [(name, arguments)])
CALLS = [("llama3_json", LLAMA3, "", [("get_weather", WEATHER), ("get_time", TIME)]),
         ("llama3_json", '\n<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n",
          [("get_weather", WEATHER)]),("kimi_k2", KIMI, "Let me check.", [("get_weather", WEATHER), ("get_time", TIME)]),
         ("deepseek_v3", DEEPSEEK_V3, "", [("get_weather", WEATHER)]),
         ("deepseek_v31", DEEPSEEK_V31, "Sure.", [("get_weather", WEATHER), ("get_time", TIME)]),
         ("hermes", HERMES, "Checking.\n", [("get_weather", WEATHER), ("get_time", TIME)])]
# answers with no finished call: all content, markup included
NO_CALLS = [("kimi_k2", 'Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a"'),
            ("hermes", "a < b, and <tool"), ("hermes", "<tool_call>not json</tool_call>"),
            ("deepseek_v31", "no calls here"), ("kimi_k2", ""),
            # Llama's calls open the answer, or there are none; JSON that is not a call is content
            ("llama3_json", 'The call would be {"name": "get_weather", "parameters": {}}'),
            ("llama3_json", '{"city": "Paris"}'), ("llama3_json", '{"name": "get_weather", "parameters": {"city"'),
            ("llama3_json", "<|python"), ("llama3_json", "  ")]


def _read(calls) -> list[tuple[str, str]]:
    return [(c.name, json.dumps(json.loads(c.arguments))) for c in calls]


def _streamed_calls(fmt, text: str, cuts) -> tuple[str, list]:
    stream, content, calls, at = tool_calls.ToolCallStream(fmt), "", [], 0
    for cut in [*cuts, len(text)]:
        piece, new = stream.feed(text[at:cut])
        content, calls, at = content + piece, calls + new, cut
    return content + stream.finish(), calls


def _cuts(text: str):
    """Every single cut, and every pair of cuts a few characters apart (markers split in three)."""
    yield from ([i] for i in range(len(text) + 1))
    yield from ([i, j] for i in range(len(text)) for j in range(i + 1, min(len(text), i + 12) + 1))


@pytest.mark.parametrize("parser, text, content, expected", CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CALLS)])
def test_tool_calls_are_read_from_each_familys_markup(parser, text, content, expected):
    fmt = tool_calls.FORMATS[parser]
    got_content, calls = tool_calls.split(fmt, text)
    assert got_content == content
    assert _read(calls) == [(name, json.dumps(json.loads(args))) for name, args in expected]
    if parser == "kimi_k2":  # Kimi's ids are the model's own: its chat template puts them back in tool messages
        assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    else:
        assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    for cuts in _cuts(text):
        streamed_content, streamed = _streamed_calls(fmt, text, cuts)
        assert (streamed_content, _read(streamed)) == (content, _read(calls)), cuts


@pytest.mark.parametrize("parser, text", NO_CALLS)
def test_an_answer_without_a_finished_call_is_all_content_whole_or_streamed(parser, text):
    fmt = tool_calls.FORMATS[parser]
    assert tool_calls.split(fmt, text) == (text, [])
    for cuts in _cuts(text):
        assert _streamed_calls(fmt, text, cuts) == (text, []), cuts


REASONING = [("deepseek_r1", "plan the trip</think>Go by train.", ("plan the trip", "Go by train.")),
             ("deepseek_r1", "<think>\nplan</think>\n\nGo.", ("\nplan", "\n\nGo.")),
             ("deepseek_r1", "still thinking", ("still thinking", "")),
             ("qwen3", "<think>plan</think>Go.", ("plan", "Go.")),
             ("qwen3", "  <think>\nplan\n</think>\n\nGo.", ("\nplan\n", "\n\nGo.")),
             ("qwen3", "Go by train.", (None, "Go by train.")),
             ("qwen3", "plan</think>Go.", (None, "plan</think>Go.")),  # opened by the template: deepseek_r1's case
             ("kimi_k2", "<think>unfinished", ("unfinished", "")),
             ("kimi_k2", "thinking is Kimi's default</think>Go.", ("thinking is Kimi's default", "Go.")),
             # Kimi's tool-call section ends the reasoning too, and is the content's (vLLM's and SGLang's kimi_k2)
             ("kimi_k2", "<think>look it up" + KIMI[len("Let me check."):], ("look it up", KIMI[len("Let me check."):])),
             ("kimi_k2", "<thin", ("<thin", "")), ("qwen3", "", (None, ""))]


@pytest.mark.parametrize("parser, text, expected", REASONING)
def test_reasoning_is_split_from_the_answer_whole_and_streamed(parser, text, expected):
    fmt = reasoning.FORMATS[parser]
    assert reasoning.split(fmt, text) == expected
    for cuts in _cuts(text):
        stream, thought, content, at = reasoning.ReasoningStream(fmt), "", "", 0
        for cut in [*cuts, len(text)]:
            a, b = stream.feed(text[at:cut])
            thought, content, at = thought + a, content + b, cut
        a, b = stream.finish()
        assert (thought + a, content + b) == (expected[0] or "", expected[1]), cuts


def test_a_streamed_answer_gives_the_whole_answers_message_and_finish():
    """Reasoning first, then tool calls in what remains; a call made and the answer stopped: finish "tool_calls"."""
    formats = AnswerFormats(tool_calls.FORMATS["kimi_k2"], reasoning.FORMATS["deepseek_r1"])
    text = "weather first</think>" + KIMI
    whole, called = message(formats, text)
    assert whole["reasoning_content"] == "weather first" and whole["content"] == "Let me check."
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather", "get_time"]
    assert finish_reason("stop", called) == "tool_calls" and finish_reason("length", called) == "length"
    for cuts in ([i] for i in range(len(text) + 1)):
        stream, fields, at = AnswerStream(formats), [], 0
        for k, cut in enumerate([*cuts, len(text)]):
            fields.append(stream.feed(text[at:cut], last=k == len(cuts)))
            at = cut
        thought = "".join(f.get("reasoning_content", "") for f in fields)
        content = "".join(f.get("content", "") for f in fields)
        calls = [c for f in fields for c in f.get("tool_calls", [])]
        assert (thought, content) == ("weather first", "Let me check.")
        assert [(c["index"], c["id"], c["function"]) for c in calls] == [
            (i, c["id"], c["function"]) for i, c in enumerate(whole["tool_calls"])]
        assert stream.called
    plain, called = message(formats, "no tools needed</think>It is sunny.")
    assert plain == {"role": "assistant", "content": "It is sunny.", "reasoning_content": "no tools needed",
                     "reasoning": "no tools needed"}  # (vLLM's newer name for the field, beside the older)
    assert not called
    # Kimi ends its reasoning with the tool-call section, without </think>: the calls are read
    kimi = AnswerFormats(tool_calls.FORMATS["kimi_k2"], reasoning.FORMATS["kimi_k2"])
    text = "<think>look it up" + KIMI[len("Let me check."):]
    whole, called = message(kimi, text)
    assert (whole["reasoning_content"], whole["content"], called) == ("look it up", None, True)
    stream = AnswerStream(kimi)
    fields = [stream.feed(ch, last=k == len(text) - 1) for k, ch in enumerate(text)]
    assert "".join(f.get("reasoning_content", "") for f in fields) == "look it up"
    assert [c["function"]["name"] for f in fields for c in f.get("tool_calls", [])] == ["get_weather", "get_time"]


@pytest.mark.parametrize("parser, kwargs, continued, text, expected", [
    # DeepSeek-V3.1's template writes <think> itself when chat_template_kwargs says thinking: the answer reads as R1's
    ("deepseek_v3", {"thinking": True}, None, "plan</think>Go.", ("plan", "Go.")),
    ("deepseek_v3", {}, None, "plan</think>Go.", (None, "plan</think>Go.")),
    ("kimi_k2", {"thinking": False}, None, "It is sunny.", (None, "It is sunny.")),
    # continue_final_message: a message that closed its reasoning continues as content, one that opened it as reasoning
    ("deepseek_r1", {}, "<think>easy</think>The answer", " is 42.", (None, " is 42.")),
    ("qwen3", {}, "<think>so far", " more</think>Done.", (" more", "Done.")),
])
def test_a_requests_thinking_switch_and_continued_message_decide_where_the_reasoning_is(parser, kwargs, continued, text,
                                                                                        expected):
    formats = AnswerFormats(None, reasoning.FORMATS[parser]).for_request(False, template_kwargs=kwargs,
                                                                          continued=continued)
    whole, _ = message(formats, text)
    assert (whole.get("reasoning_content"), whole["content"]) == expected


def test_sglangs_reasoning_parser_spellings_are_taken():
    from gateway.config import build_parser

    for name in ("deepseek-r1", "deepseek-v3"):
        assert build_parser().parse_args(["--verifier", "x:1", "--model", "m", "--reasoning-parser", name]) \
            .reasoning_parser == name


# ---- end to end: the gateway with --tool-call-parser kimi_k2 --reasoning-parser kimi_k2 ---------------------------

MARKERS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CHAT = {"model": "kimi-like", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 200,
        "tools": TOOLS}


@pytest.fixture(scope="module")
def kimi_like(tmp_path_factory):
    """The tiny model with Kimi's markers and think tags as special tokens (so a default decode drops them)."""
    from tokenizers import AddedToken, Tokenizer

    folder = tiny_model_copy(tmp_path_factory.mktemp("kimi") / "kimi-like", chat_template=TEMPLATE)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True) for m in MARKERS])
    tok.save(str(folder / "tokenizer.json"))
    return folder


stack = stack_fixture(model_dir_from="kimi_like", served_model_name="kimi-like", tool_call_parser="kimi_k2",
                      reasoning_parser="kimi_k2")
ANSWER = "<think>Paris, so weather</think>" + KIMI


def _script(stack, text: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(stack.model_dir) + "/tokenizer.json")
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text and tok.decode(ids) != text  # (the markers: special)
    stack.fake.script = ids + [EOS_ID]


def test_the_gateway_answers_tool_calls_and_reasoning_whole(stack):
    _script(stack, ANSWER)
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Paris, so weather", "Let me check.")
    assert [(c["id"], c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("functions.get_weather:0", "function", "get_weather", {"city": "Paris"}),
                                            ("functions.get_time:1", "function", "get_time", {"tz": "CET"})]


def test_the_gateway_streams_tool_calls_and_reasoning(stack):
    _script(stack, ANSWER)
    fields, reasons = [], []
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                fields.append(choice["delta"])
                reasons.append(choice["finish_reason"])
    assert [r for r in reasons if r] == ["tool_calls"]
    assert "".join(f.get("reasoning_content") or "" for f in fields) == "Paris, so weather"
    assert "".join(f.get("content") or "" for f in fields) == "Let me check."
    calls = [c for f in fields for c in f.get("tool_calls", [])]
    assert [(c["index"], c["id"], c["function"]["name"]) for c in calls] == [
        (0, "functions.get_weather:0", "get_weather"), (1, "functions.get_time:1", "get_time")]


def test_tool_choice_none_and_a_request_without_tools_get_text(stack):
    """tool_choice "none": the tools are shown, the answer is text (no tool_calls, finish "stop"); reasoning is still
    split. Without tools the same."""
    _script(stack, "<think>easy</think>It is sunny.")
    for body in ({**CHAT, "tool_choice": "none"}, {k: v for k, v in CHAT.items() if k != "tools"}):
        choice = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == ("easy", "It is sunny.")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choices_that_need_constrained_decoding_are_refused(stack, choice):
    r = httpx.post(f"{stack.url}/v1/chat/completions", json={**CHAT, "tool_choice": choice}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "constrained" in r.json()["error"]["message"]


def test_an_earlier_answers_tool_calls_reach_the_template_with_their_arguments_as_objects(tmp_path):
    """The next turn sends the assistant's tool_calls back with arguments as OpenAI's JSON text; chat templates index
    into them as objects (transformers' convention, vLLM's too), and the tool's answer keeps its tool_call_id."""
    from gateway.openai_params import _messages
    from tandem.chat_template import ChatTemplate

    template = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.id }} "
                "{{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %}"
                "{% elif m.role == 'tool' %}({{ m.tool_call_id }}: {{ m.content }}){% else %}{{ m.content }}{% endif %}"
                "{% endfor %}")
    folder = tiny_model_copy(tmp_path / "m", chat_template=template)
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "functions.get_weather:0", "type": "function",
                  "function": {"name": "get_weather", "arguments": WEATHER}}]},
             {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    rendered = ChatTemplate.from_model_dir(folder).render(_messages(turns), add_generation_prompt=False)
    assert rendered == "Weather?[functions.get_weather:0 get_weather city=Paris](functions.get_weather:0: sunny)"
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == WEATHER  # (the request's own objects untouched)


def test_a_request_may_keep_its_reasoning_in_the_content_or_leave_it_out(stack):
    """SGLang's separate_reasoning: false leaves the reasoning in the content (its tags too: a server reading Kimi's
    special-token markup decodes every chat answer with its special tokens, tools or not); vLLM's include_reasoning:
    false drops it, streamed or whole."""
    _script(stack, "<think>easy</think>It is sunny.")
    plain = {k: v for k, v in CHAT.items() if k != "tools"}
    for body in (plain, CHAT):
        kept = httpx.post(f"{stack.url}/v1/chat/completions", json={**body, "separate_reasoning": False},
                          timeout=30).json()["choices"][0]["message"]
        assert kept["content"] == "<think>easy</think>It is sunny." and "reasoning_content" not in kept
    dropped = httpx.post(f"{stack.url}/v1/chat/completions", json={**plain, "include_reasoning": False},
                         timeout=30).json()["choices"][0]["message"]
    assert dropped["content"] == "It is sunny." and dropped["reasoning_content"] is None
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions",
                      json={**plain, "include_reasoning": False, "stream": True}, timeout=30) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "It is sunny."


def test_a_long_call_streamed_in_many_deltas_is_read_once_it_ends_not_at_every_delta():
    """A coding agent's call may carry a file in its arguments, thousands of deltas long: the stream reads the markup
    again only where a call's end marker came (reading it all at every delta cost seconds of the event loop)."""
    reads = []

    class Counted(tool_calls.KimiK2):
        def calls(self, section):
            reads.append(len(section))
            return super().calls(section)

    arguments = json.dumps({"path": "a.py", "content": "x = {1}\n" * 2000})
    text = (f"{tool_calls.KimiK2.start}<|tool_call_begin|>functions.write:0<|tool_call_argument_begin|>{arguments}"
            f"<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{TIME}"
            "<|tool_call_end|><|tool_calls_section_end|>")
    content, calls = _streamed_calls(Counted(), text, range(0, len(text), 3))
    assert content == "" and [c.name for c in calls] == ["write", "get_time"]
    assert json.loads(calls[0].arguments) == json.loads(arguments)
    assert len(reads) <= 3 and sum(reads) < 2 * len(text), reads  # (the section's start, then each call's end)
