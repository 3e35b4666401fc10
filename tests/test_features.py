"""EAGLE-3 feature capture: the residual-stream inputs of the capture layers, which are Hugging Face's
``hidden_states[i]``, concatenated in ascending layer order (docs/architecture.md, "Contracts"). The default layers are
[2, N//2, N-3]: always three blocks (the draft head's fc takes 3·H), repeated where they coincide."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel, forward_fresh, hf_hidden_states, hf_logits, random_prompt
from tandem.forward_batch import ForwardBatch, SequenceChunk
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import ConfigError
from tandem.kv_cache import SequenceKV

HIDDEN = 64


@pytest.fixture(scope="module")
def deep8(checkpoint):
    return checkpoint("llama", seed=3, num_hidden_layers=8)


@pytest.fixture(scope="module")
def deep6(checkpoint):
    return checkpoint("qwen3", seed=4, num_hidden_layers=6)


def expected_features(hf, prompt, layers):
    """HF hidden_states of ``layers`` concatenated in ascending layer order (repeats kept)."""
    hs = hf_hidden_states(hf, prompt)
    return torch.cat([hs[i] for i in sorted(layers)], dim=-1)


def test_default_layers_of_8_layer_model(deep8):
    prompt = random_prompt(10, 30)
    with LLMEngine(EngineConfig(model=deep8.path)) as eng:
        assert eng.executor.runner.capture_layers == (2, 4, 5)  # [2, N//2, N-3]
        logits, features = forward_fresh(eng, [prompt], capture_features=True)
    assert features.shape == (len(prompt), 3 * HIDDEN)
    hs = hf_hidden_states(deep8.hf, prompt)
    for block, layer in enumerate((2, 4, 5)):
        got = features[:, block * HIDDEN : (block + 1) * HIDDEN]
        assert_rel(got, hs[layer], 1e-4, f"feature block {block} is not HF hidden_states[{layer}]")
    assert_rel(logits, hf_logits(deep8.hf, prompt), 1e-4)


def test_default_layers_of_6_layer_model_repeat_to_three_blocks(deep6):
    # [2, 6//2, 6-3] = [2, 3, 3]: still three blocks, layer 3 twice.
    prompt = random_prompt(11, 20)
    with LLMEngine(EngineConfig(model=deep6.path)) as eng:
        _, features = forward_fresh(eng, [prompt], capture_features=True)
    assert features.shape == (len(prompt), 3 * HIDDEN)
    assert_rel(features, expected_features(deep6.hf, prompt, (2, 3, 3)), 1e-4)


@pytest.mark.parametrize("layers", [(1, 3), (0, 7), (6,), (1, 4, 6)])
def test_custom_capture_layers(deep8, layers):
    prompt = random_prompt(12, 25)
    with LLMEngine(EngineConfig(model=deep8.path, capture_layers=layers)) as eng:
        _, features = forward_fresh(eng, [prompt], capture_features=True)
    assert features.shape == (len(prompt), len(layers) * HIDDEN)
    assert_rel(features, expected_features(deep8.hf, prompt, layers), 1e-4)


@pytest.mark.parametrize("layers", [(3, 1), (5, 4, 2)])
def test_custom_capture_layers_are_concatenated_in_ascending_order(deep8, layers):
    """docs/architecture.md, "Contracts": ascending layer order, whatever order the setting lists them in. The draft
    validation (validate_draft) accepts an override in any order, since it compares sorted sets, so
    the features must not depend on it: (5, 4, 2) must give the same features as the default (2, 4, 5)."""
    prompt = random_prompt(17, 25)
    with LLMEngine(EngineConfig(model=deep8.path, capture_layers=layers)) as eng:
        _, features = forward_fresh(eng, [prompt], capture_features=True)
    assert_rel(features, expected_features(deep8.hf, prompt, layers), 1e-4,
               f"capture_layers={layers}: features are not in ascending layer order")


def test_no_features_unless_asked(deep8):
    with LLMEngine(EngineConfig(model=deep8.path)) as eng:
        _, features = forward_fresh(eng, [random_prompt(13, 5)], capture_features=False)
    assert features is None


def test_features_of_a_packed_batch_with_cached_prefix(deep8):
    """Rows of a packed forward: an extension of a cached sequence, then a fresh prompt, then a
    single decode token; each row must equal HF's hidden states at that token's position."""
    a, b, c = random_prompt(14, 21), random_prompt(15, 9), random_prompt(16, 12)
    with LLMEngine(EngineConfig(model=deep8.path, page_size=4)) as eng:
        kvs = [SequenceKV(eng.allocator) for _ in range(3)]
        for kv, p in zip(kvs, (a, b, c)):
            kv.reserve(len(p))
        prefix = ForwardBatch([SequenceChunk(a[:15], 0, list(kvs[0].pages), logits="none"),
                               SequenceChunk(c[:11], 0, list(kvs[2].pages), logits="none")])
        eng.executor.forward(prefix)
        batch = ForwardBatch([SequenceChunk(a[15:], 15, list(kvs[0].pages), logits="all"),
                              SequenceChunk(b, 0, list(kvs[1].pages), logits="all"),
                              SequenceChunk(c[11:], 11, list(kvs[2].pages), logits="all")],
                             capture_features=True)
        logits, features = eng.executor.forward(batch)
        for kv in kvs:
            kv.release()
    layers = (2, 4, 5)
    want = torch.cat([expected_features(deep8.hf, a, layers)[15:], expected_features(deep8.hf, b, layers),
                      expected_features(deep8.hf, c, layers)[11:]])
    assert features.shape == (6 + 9 + 1, 3 * HIDDEN)
    assert_rel(features, want, 1e-4)
    want_logits = torch.cat([hf_logits(deep8.hf, a)[15:], hf_logits(deep8.hf, b), hf_logits(deep8.hf, c)[11:]])
    assert_rel(logits, want_logits, 1e-4)


@pytest.mark.parametrize("layers", [(1, 8), (-1, 2), (9,)])
def test_out_of_range_capture_layer_is_a_config_error(deep8, layers):
    with pytest.raises(ConfigError) as info:
        LLMEngine(EngineConfig(model=deep8.path, capture_layers=layers))
    msg = str(info.value)
    bad = next(i for i in layers if not 0 <= i < 8)
    assert "\n" not in msg
    assert "capture" in msg and str(bad) in msg and "8" in msg, msg
