"""A request stops at the EOS ids of generation_config.json (config.json's where it names none) and at the tokenizer's
``eos_token``, as vLLM stops (a chat model's end of turn is often only the tokenizer's, which was never read)."""

from __future__ import annotations

import json

from tandem.configs.model import ModelConfig, tokenizer_eos_id

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128}


def _folder(tmp_path, config_eos, generation_eos=None, tokenizer_config=None, tokenizer_json=None):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "eos_token_id": config_eos}))
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    if tokenizer_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if tokenizer_json is not None:
        (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    return tmp_path


def test_every_named_eos_id_stops(tmp_path):
    folder = _folder(tmp_path, 52, [2, 7], {"eos_token": "<|im_end|>",
                                            "added_tokens_decoder": {"163586": {"content": "<|im_end|>"},
                                                                     "163585": {"content": "[EOS]"}}})
    assert ModelConfig.from_dir(folder).eos_token_ids == (2, 7, 163586)  # (generation_config's win over config's 52)


def test_one_id_named_twice_counts_once_and_none_named_is_none(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert ModelConfig.from_dir(_folder(tmp_path / "a", 2, 2)).eos_token_ids == (2,)
    assert ModelConfig.from_dir(_folder(tmp_path / "b", None)).eos_token_ids == ()


def test_the_tokenizers_eos_from_tokenizer_json_or_as_a_dict(tmp_path):
    folder = _folder(tmp_path, 2, None, {"eos_token": {"content": "<|eos|>", "special": True}},
                     {"added_tokens": [{"id": 0, "content": "<unk>"}, {"id": 1, "content": "<|eos|>"}]})
    assert tokenizer_eos_id(folder) == 1
    assert ModelConfig.from_dir(folder).eos_token_ids == (2, 1)


def test_a_tokenizer_eos_the_folder_does_not_place_adds_nothing(tmp_path):
    folder = _folder(tmp_path, 2, None, {"eos_token": "</s>"})  # (a SentencePiece model's own piece: not read here)
    assert tokenizer_eos_id(folder) is None and ModelConfig.from_dir(folder).eos_token_ids == (2,)


def test_the_tokenizers_eos_from_the_models_vocabulary(tmp_path):
    (tmp_path / "bpe").mkdir()
    (tmp_path / "unigram").mkdir()
    bpe = _folder(tmp_path / "bpe", 2, None, {"eos_token": "</s>"}, {"added_tokens": [], "model": {"vocab": {"</s>": 9}}})
    unigram = _folder(tmp_path / "unigram", None, None, {"eos_token": "</s>"},
                      {"model": {"vocab": [["<unk>", 0.0], ["</s>", 0.0]]}})
    assert ModelConfig.from_dir(bpe).eos_token_ids == (2, 9) and ModelConfig.from_dir(unigram).eos_token_ids == (1,)
