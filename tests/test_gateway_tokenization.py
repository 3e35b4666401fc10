"""Prompts are tokenized as transformers tokenizes them: prompt text with the tokenizer's special tokens
(the BOS its post-processor adds), a chat template's text without (the template renders its own BOS, so
it is not doubled); token-id prompts as given. generation_config.json's sampling defaults apply where a
request leaves them unset (vLLM's --generation-config auto)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from gateway_harness import BOS, stack_fixture, tiny_model_copy

from gateway.generation_defaults import SamplingDefaults
from tandem.rpc.generation.v1 import generation_pb2, generation_pb2_grpc
from tandem.tokenizer import TextTokenizer

GENERATION_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7,
                     "repetition_penalty": 1.25, "min_p": 0.125, "bos_token_id": 0, "eos_token_id": 1}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory) -> Path:
    """The gateway tests' tokenizer with a Llama-3-like post-processor: ``<|bos|> $A``."""
    return tiny_model_copy(tmp_path_factory.mktemp("bos") / "bos-model", bos_post_processor=True,
                           generation_config=GENERATION_CONFIG)


@pytest.fixture(scope="module")
def hf(bos_model_dir):
    from transformers import PreTrainedTokenizerFast

    config = json.loads((bos_model_dir / "tokenizer_config.json").read_text())
    return PreTrainedTokenizerFast(tokenizer_file=str(bos_model_dir / "tokenizer.json"), bos_token=BOS,
                                   eos_token=config["eos_token"], chat_template=config["chat_template"])


stack = stack_fixture(model_dir_from="bos_model_dir", served_model_name="bos-model")


def _sent(stack) -> list[int]:
    return list(stack.fake.requests[-1].prompt_token_ids)


def test_text_tokenizer_matches_transformers(bos_model_dir, hf):
    tok = TextTokenizer(bos_model_dir)
    bos = hf.convert_tokens_to_ids(BOS)
    for text in ("def fibonacci(n):", "  x = 1\n", "é ü 😀"):
        with_bos = tok.encode(text, add_special_tokens=True)
        assert with_bos == hf(text)["input_ids"] == hf.encode(text)
        assert with_bos[0] == bos and with_bos[1:] == tok.encode(text, add_special_tokens=False) == tok.encode(text)
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]


def test_tokenize_returns_the_token_strings_transformers_names(stack, hf):
    import httpx

    text = "def fibonacci(n):\n    return n"
    r = httpx.post(f"{stack.url}/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=10).json()
    assert r["tokens"] == hf(text)["input_ids"]
    assert r["token_strs"] == hf.convert_ids_to_tokens(r["tokens"])
    assert httpx.post(f"{stack.url}/tokenize", json={"prompt": text}, timeout=10).json()["token_strs"] is None


def test_completion_prompt_gets_the_bos_transformers_adds(stack, client, hf):
    prompt = "def fibonacci(n):"
    client.completions.create(model="bos-model", prompt=prompt, max_tokens=2)
    assert _sent(stack) == hf(prompt)["input_ids"] and _sent(stack).count(hf.bos_token_id) == 1
    client.completions.create(model="bos-model", prompt=prompt, max_tokens=2, extra_body={"add_special_tokens": False})
    assert _sent(stack) == hf(prompt, add_special_tokens=False)["input_ids"]
    client.completions.create(model="bos-model", prompt=[5, 6, 7], max_tokens=2)  # token ids: as given
    assert _sent(stack) == [5, 6, 7]


def test_chat_bos_comes_from_the_template_once(stack, client, hf):
    client.chat.completions.create(model="bos-model", messages=MESSAGES, max_tokens=2)
    expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert _sent(stack) == list(expected)
    assert _sent(stack)[:2] != [hf.bos_token_id] * 2


def test_grpc_text_prompt_gets_the_bos(stack, hf):
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        list(stub.Generate(generation_pb2.GenerateRequest(text="def f(x):", max_tokens=2)))
    assert _sent(stack) == hf("def f(x):")["input_ids"]
    sampling = stack.fake.requests[-1].sampling
    assert (round(sampling.temperature, 4), round(sampling.top_p, 4), sampling.top_k) == (0.6, 0.9, 20)


def test_generation_config_defaults_apply_where_the_request_is_silent(stack, client):
    client.chat.completions.create(model="bos-model", messages=MESSAGES)
    s = stack.fake.requests[-1].sampling
    assert (round(s.temperature, 4), round(s.top_p, 4), s.top_k, s.max_new_tokens) == (0.6, 0.9, 20, 7)
    assert (s.repetition_penalty, s.min_p) == (1.25, 0.125)
    client.completions.create(model="bos-model", prompt="x", extra_body={"repetition_penalty": 1, "min_p": 0})
    assert (stack.fake.requests[-1].sampling.repetition_penalty, stack.fake.requests[-1].sampling.min_p) == (1, 0)
    client.completions.create(model="bos-model", prompt="x")
    assert stack.fake.requests[-1].sampling.max_new_tokens == 16  # completions keep OpenAI's default, as vLLM's
    client.chat.completions.create(model="bos-model", messages=MESSAGES, temperature=0, top_p=1, max_tokens=3,
                                   extra_body={"top_k": -1})
    s = stack.fake.requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.0, 1.0, 0, 3)


def test_generation_config_is_read_as_transformers_diffs_it(bos_model_dir, tmp_path):
    from transformers import GenerationConfig

    diff = GenerationConfig.from_pretrained(bos_model_dir).to_diff_dict()
    d = SamplingDefaults.load(bos_model_dir)
    assert (d.temperature, d.top_p, d.top_k, d.max_tokens) == \
        (diff["temperature"], diff["top_p"], diff["top_k"], diff["max_new_tokens"])
    assert SamplingDefaults.load(bos_model_dir, "vllm") == SamplingDefaults()
    assert SamplingDefaults.load(tmp_path) == SamplingDefaults()  # no file: the OpenAI defaults
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 50, "repetition_penalty": 1.1,
                                                                   "min_p": 0.05}))
    diff = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
    stated = SamplingDefaults(top_k=diff["top_k"], repetition_penalty=diff["repetition_penalty"], min_p=diff["min_p"])
    assert SamplingDefaults.load(tmp_path) == stated == SamplingDefaults(top_k=50, repetition_penalty=1.1, min_p=0.05)
    assert SamplingDefaults.load(bos_model_dir, str(tmp_path)) == stated  # --generation-config DIR
    for bad in ({"min_p": 1.5}, {"repetition_penalty": 0}):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingDefaults.load(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature"):
        SamplingDefaults.load(tmp_path)
