"""Incremental detokenization: the deltas of random token streams, cut into random messages, join to
exactly ``tokenizer.decode`` of the whole stream (byte-level BPE with characters split across tokens,
invalid bytes, special tokens; a Metaspace tokenizer), and the work is linear in the stream's length."""

from __future__ import annotations

import random

import pytest
from gateway_harness import tiny_model_dir

from gateway.detokenize import IncrementalDetokenizer
from tandem.tokenizer import TextTokenizer

MULTIBYTE = "aé日本語✓🙂 \n\tx\ufffdß€"


@pytest.fixture(scope="module")
def byte_level():
    return TextTokenizer(tiny_model_dir())


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory):
    from tokenizers import SentencePieceBPETokenizer

    texts = ["def fibonacci(n): return n if n < 2 else fibonacci(n - 1)", "naïve café — 日本語 ✓ done",
             "hello world"]
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(texts * 20, vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    folder = tmp_path_factory.mktemp("metaspace")
    trained.save(str(folder / "tokenizer.json"))
    return TextTokenizer(folder)


def _stream(decode, ids: list[int], rng: random.Random) -> list[str]:
    detok = IncrementalDetokenizer(decode)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)  # the verifier sends 1 token per message, several when speculating
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    deltas.append(detok.add([], final=True))
    return deltas


def _random_streams(tok: TextTokenizer, vocab: int, rng: random.Random, count: int):
    byte_tokens = [i for i in range(vocab) if tok.decode([i]) == "\ufffd"]  # halves of characters
    for k in range(count):
        n = rng.randint(0, 80)
        kind = k % 4
        if kind == 0:  # anything, special tokens included
            yield [rng.randrange(vocab) for _ in range(n)]
        elif kind == 1:  # real text full of multi-byte characters
            yield tok.encode("".join(rng.choice(MULTIBYTE) for _ in range(n))) if n else []
        elif kind == 2:  # mostly split characters and invalid bytes
            yield [rng.choice(byte_tokens) if rng.random() < 0.8 else rng.randrange(vocab) for _ in range(n)]
        else:  # text with stray bytes inside
            ids = tok.encode("".join(rng.choice(MULTIBYTE) for _ in range(n))) if n else []
            for _ in range(rng.randint(0, 3)):
                ids.insert(rng.randint(0, len(ids)), rng.choice(byte_tokens))
            yield ids


def test_byte_level_streams_join_to_the_full_decode(byte_level):
    rng = random.Random(22)
    vocab = 512
    for ids in _random_streams(byte_level, vocab, rng, 1200):
        deltas = _stream(byte_level.decode, ids, rng)
        assert "".join(deltas) == byte_level.decode(ids), ids


def test_metaspace_streams_join_to_the_full_decode(metaspace):
    rng = random.Random(7)
    vocab = len(metaspace._tok.get_vocab())
    for _ in range(600):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        assert "".join(_stream(metaspace.decode, ids, rng)) == metaspace.decode(ids), ids


def test_split_characters_are_held_back_not_sent_as_replacement_characters(byte_level):
    text = "日本語 ✓ 🙂" * 20
    ids = byte_level.encode(text)
    deltas = _stream(byte_level.decode, ids, random.Random(3))
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("kind", ["text", "garbage"])
def test_the_work_is_linear_in_the_output(byte_level, kind):
    """Count the tokens handed to decode: bounded per token, where a full decode per message costs
    n²/2 (~50 s of event loop for one 32k-token stream)."""
    n = 20_000
    rng = random.Random(5)
    if kind == "text":
        ids = [rng.randrange(3, 512) for _ in range(n)]
    else:  # the first byte of "é" again and again: every decode ends in U+FFFD
        ids = byte_level.encode("é")[:1] * n
    decoded = [0]

    def decode(window):
        decoded[0] += len(window)
        return byte_level.decode(window)

    detok = IncrementalDetokenizer(decode)
    text = "".join(detok.add([t]) for t in ids) + detok.add([], final=True)
    assert text == byte_level.decode(ids)
    assert decoded[0] <= 40 * n, decoded[0]
