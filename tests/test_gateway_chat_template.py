"""Chat templates render as transformers' apply_chat_template renders them — with tools, a request's
chat_template_kwargs (Qwen3's enable_thinking), continue_final_message, strftime_now and the
{% generation %} block — in the gateway's chat completions and /tokenize; what this server cannot honour
(tool_choice "auto" with no --tool-call-parser, "required", a named function) is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gateway_harness import stack_fixture, tiny_model_copy

from tandem.chat_template import ChatTemplate, ChatTemplateError

# A Qwen3-like template: tools as JSON in the system turn, thinking switched by a template variable, the
# assistant's turns inside {% generation %}, today's date, and raise_exception for an unknown role.
TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "Today is {{ strftime_now('%Y-%m-%d') }}.<|end|>\n{% endif %}"
    "{% if documents %}<|system|>Sources:{% for d in documents %}\n{{ d.title }}: {{ d.text }}{% endfor %}<|end|>\n"
    "{% endif %}{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
    "{% if m.role == 'assistant' %}<|assistant|>{% generation %}{{ m.content }}{% endgeneration %}<|end|>\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
DOCUMENTS = [{"title": "Climate", "text": "Paris is mild."}, {"title": "News", "text": "Rain today."}]
CONTINUED = MESSAGES + [{"role": "assistant", "content": "Let me think: Paris is"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_copy(tmp_path_factory.mktemp("chat") / "chat-model", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import PreTrainedTokenizerFast

    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    return PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), eos_token=config["eos_token"],
                                   chat_template=TEMPLATE)


stack = stack_fixture(model_dir_from="model_dir", served_model_name="chat-model")


@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS}, {"enable_thinking": False}, {"enable_thinking": True},
                                    {"tools": TOOLS, "enable_thinking": False}])
def test_rendering_equals_transformers(model_dir, hf, kwargs):
    ours = ChatTemplate.from_model_dir(model_dir).render(MESSAGES, add_generation_prompt=True, **kwargs)
    assert ours == hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs)


def test_continue_final_message_equals_transformers(model_dir, hf):
    ours = ChatTemplate.from_model_dir(model_dir).render(CONTINUED, add_generation_prompt=False,
                                                         continue_final_message=True)
    theirs = hf.apply_chat_template(CONTINUED, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    assert ours == theirs and ours.endswith("Paris is")


def test_tojson_takes_transformers_arguments(hf):
    """Kimi-K2's template writes ``tools | tojson(separators=(',', ':'))``; positional arguments in transformers'
    order (ensure_ascii, indent)."""
    source = ("{{ tools | tojson(separators=(',', ':')) }}|{{ tools | tojson(true, 1) }}|"
              "{{ tools | tojson(sort_keys=true, indent=2) }}{% for m in messages %}{{ m.content }}{% endfor %}")
    ours = ChatTemplate(source).render(MESSAGES, add_generation_prompt=False, tools=TOOLS)
    theirs = hf.apply_chat_template(MESSAGES, tools=TOOLS, chat_template=source, tokenize=False)
    assert ours == theirs and '"type":"function"' in ours


def test_a_template_error_is_a_chat_template_error(model_dir):
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        ChatTemplate.from_model_dir(model_dir).render([{"role": "robot", "content": "x"}])


def _post(stack, path: str, body: dict):
    import httpx

    return httpx.post(stack.url + path, json=body, timeout=30.0)


def test_chat_request_options_reach_the_prompt_as_transformers_renders_them(stack, hf):
    cases = [({"chat_template_kwargs": {"enable_thinking": False}}, dict(enable_thinking=False)),
             ({"tools": TOOLS, "tool_choice": "none"}, dict(tools=TOOLS)),
             ({"documents": DOCUMENTS}, dict(documents=DOCUMENTS)),
             ({"messages": CONTINUED, "continue_final_message": True},
              dict(continue_final_message=True, add_generation_prompt=False))]
    for extra, theirs in cases:
        body = {"model": "chat-model", "messages": MESSAGES, "max_tokens": 2, **extra}
        r = _post(stack, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        expected = hf.apply_chat_template(body["messages"], tokenize=True, return_dict=False,
                                          **{"add_generation_prompt": True, **theirs})
        assert list(stack.fake.requests[-1].prompt_token_ids) == list(expected), extra
        r = _post(stack, "/tokenize", {k: v for k, v in body.items() if k != "max_tokens"})
        assert r.status_code == 200 and r.json()["tokens"] == list(expected)


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS}, "tool_choice"),  # "auto" by default: this stack has no --tool-call-parser
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
    ({"tools": "get_weather", "tool_choice": "none"}, "tools"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"documents": DOCUMENTS}}, "chat_template_kwargs"),
    ({"documents": "Paris is in France."}, "documents"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": "yes"}, "continue_final_message"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
])
def test_what_cannot_be_honoured_is_refused_by_name(stack, extra, param):
    r = _post(stack, "/v1/chat/completions", {"model": "chat-model", "messages": MESSAGES, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_given_template_replaces_the_folders_file_or_text(model_dir, tmp_path):
    """--chat-template (vLLM's): a Jinja file, or the template's text, instead of the model folder's; anything else is
    refused at start-up naming it."""
    from tandem.errors import CheckpointError

    plain = tiny_model_copy(tmp_path / "no-template", chat_template="")  # a folder without a template
    assert ChatTemplate.from_model_dir(plain) is None
    other = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(other)
    want = "[system] Be brief.\n[user] Weather in Paris?\n"
    for given in (str(tmp_path / "t.jinja"), other):
        assert ChatTemplate.from_model_dir(plain, given).render(MESSAGES) == want
        assert ChatTemplate.from_model_dir(model_dir, given).render(MESSAGES) == want  # the folder's is replaced
    with pytest.raises(CheckpointError, match="--chat-template no/such.jinja: no such file"):
        ChatTemplate.from_model_dir(plain, "no/such.jinja")


def test_a_gateway_given_a_template_serves_chat_for_a_folder_without_one(tmp_path):
    from gateway_harness import Stack

    (tmp_path / "t.jinja").write_text(TEMPLATE)
    stack = Stack(model_dir=tiny_model_copy(tmp_path / "bare", chat_template=""), chat_template=str(tmp_path / "t.jinja"))
    try:
        r = _post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        stack.close()


def test_a_value_nested_too_deeply_for_the_template_is_a_request_error():
    """JSON nested below the parser's limit still overflowed Python's stack in a template's ``tojson`` (Llama-3.1's and
    Qwen's render ``tools`` so): a 500 with two tracebacks."""
    deep: object = "x"
    for _ in range(5000):
        deep = {"a": deep}
    with pytest.raises(ChatTemplateError, match="nested too deeply"):
        ChatTemplate("{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}").render(
            MESSAGES, tools=[deep])
