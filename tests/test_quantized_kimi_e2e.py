"""A Kimi-K2.5-style INT4 folder (the wrapper, text_config with its quantization_config, language_model.*
tensors, a vision tower; only the routed experts INT4, packed by compressed-tensors) served end to end:
gateway over REST → verifier with a random EAGLE-3 head drafting in process, speculating on every round;
greedy output identical to target-only decoding by the in-process engine on the same folder."""

from __future__ import annotations

import pytest

from helpers import target_only_greedy
from services import Service, free_port, gateway_service, generate
from deepseek_checkpoints import write_deepseek, write_kimi_k25
from quantized_deepseek_checkpoints import write_quantized_deepseek

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from draft_checkpoints import make_draft
    from tandem.training.stdlib_text import train_tokenizer
    from tandem.configs.model import ModelConfig

    root = tmp_path_factory.mktemp("kimi-int4")
    write_deepseek(root / "src", seed=41, num_hidden_layers=4)
    write_quantized_deepseek(root / "src", root / "int4", root / "twin", "int4")
    write_kimi_k25(root / "int4", root / "kimi")
    train_tokenizer(root / "kimi", vocab_size=512)
    make_draft(root / "draft", ModelConfig.from_dir(root / "kimi"), draft_vocab=128, seed=5, aux_layer_ids=(0, 1, 2),
               num_heads=4, num_kv_heads=4, head_dim=16)
    return root


@pytest.fixture(scope="module")
def stack(dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("kimi-logs")
    target, draft = str(dirs / "kimi"), str(dirs / "draft")
    verifier = Service("verifier", ["--model", target, "--drafter", "in-process", "--draft-model", draft,
                                    "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                                    "--speculative-num-draft-tokens", "5", "--speculation-policy", "always"],
                       free_port(), logs / "verifier.log")
    gateway = gateway_service(verifier.address, target, "kimi", logs / "gateway.log")
    try:
        verifier.start()
        gateway.start()
        yield {"verifier": verifier, "url": gateway.url}
    finally:
        for s in (gateway, verifier):
            s.stop()


def test_int4_kimi_k25_over_rest_with_speculation_equals_target_only_greedy(dirs, stack):
    openai = pytest.importorskip("openai")
    from tandem.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(dirs / "kimi")
    texts = ["def fibonacci(n):\n    ", "import os\nfor path in"]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = target_only_greedy(dirs / "kimi", prompts, 20)
    assert expected == target_only_greedy(dirs / "twin", prompts, 20)  # the wrapper serves the dequantized model
    client = openai.OpenAI(base_url=stack["url"], api_key="unused", max_retries=0, timeout=120)
    for text, want in zip(texts, expected):
        out = client.completions.create(model="kimi", prompt=text, max_tokens=20, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == tokenizer.decode(want) and out.usage.completion_tokens == len(want)
    tokens, last = generate(stack["verifier"].address, prompts[0], max_new_tokens=20)  # the verifier's own stream
    assert tokens == expected[0] and last.spec.rounds > 0
