"""A Kimi-K2-style tokenizer folder (``tiktoken.model``, ``tokenization_kimi.py``, ``tokenizer_config.json``; no
tokenizer.json), read by tandem.tiktoken_tokenizer: its encodings equal those of the tiktoken package's Encoding
built here from the same raw facts (BPE ranks, Kimi's split pattern, the special ids after the ranks, named by
added_tokens_decoder); the folder's code is read, never run; long runs are cut where tiktoken would fail; broken
folders are one line; and the gateway serves a chat completion through it."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

tiktoken = pytest.importorskip("tiktoken")

from tandem.errors import CheckpointError  # noqa: E402
from tandem.tiktoken_tokenizer import TiktokenTokenizer  # noqa: E402
from tandem.tokenizer import load_tokenizer  # noqa: E402

# Kimi's pre-tokenizer pattern (its tokenization_kimi.py's pat_str), as the remote code writes it.
KIMI_PATTERN_PARTS = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", "你".encode(), "你好".encode()]
RESERVED = 4  # the class's num_reserved_special_tokens: 4 + 2 special ids after the ranks
NAMED = {0: "[BOS]", 1: "[EOS]", 3: "<|im_end|>", 4: "<|im_user|>", 5: "<|im_assistant|>"}  # offsets after the ranks
TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}<|im_user|>{% else %}<|im_assistant|>{% endif %}"
            "{{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>{% endif %}")


def _ranks() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for token in MERGES:
        if token not in ranks:
            ranks[token] = len(ranks)
    return ranks


def kimi_folder(root: Path, code: str | None = None) -> Path:
    ranks = _ranks()
    root.mkdir(parents=True, exist_ok=True)
    (root / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    parts = ",\n".join(f"            r\"\"\"{p}\"\"\"" for p in KIMI_PATTERN_PARTS)
    (root / "tokenization_kimi.py").write_text(code if code is not None else (
        "import tiktoken\n"
        "raise SystemExit('the tokenizer code ran')  # never: it is read, not run\n\n\n"
        "class TikTokenTokenizer:\n"
        f"    num_reserved_special_tokens = {RESERVED}\n"
        f"    pat_str = \"|\".join(\n        [\n{parts},\n        ]\n    )\n"))
    first = len(ranks)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": TEMPLATE,
        "added_tokens_decoder": {str(first + k): {"content": v, "special": True} for k, v in NAMED.items()}}))
    return root


def reference() -> tiktoken.Encoding:
    ranks = _ranks()
    first = len(ranks)
    specials = {NAMED.get(k, f"<|reserved_token_{first + k}|>"): first + k for k in range(RESERVED + 2)}
    return tiktoken.Encoding(name="reference", pat_str="|".join(KIMI_PATTERN_PARTS), mergeable_ranks=ranks,
                             special_tokens=specials)


TEXTS = ["hello world", "Hello World, it's 2026!", "你好世界 hello", "<|im_user|>hello<|im_end|>", "tabs\t\tand\n\nlines",
         "ünïcödé 42 3.14159 <|reserved_token_262|>", ""]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return kimi_folder(tmp_path_factory.mktemp("kimi") / "kimi-tok")


def test_encodings_and_decodings_equal_the_tiktoken_encoding_of_the_same_facts(folder):
    tok, ref = load_tokenizer(folder), reference()
    assert isinstance(tok, TiktokenTokenizer)
    first = len(_ranks())
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=True)  # (no BOS: the remote code adds none)
        assert ids == ref.encode(text, allowed_special="all"), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == ref.decode([i for i in ids if i < first])
    assert tok.encode("hello")[0] == _ranks()[b"hello"]
    assert tok.token_id("<|im_end|>") == first + 3 and tok.token_id("[EOS]") == first + 1
    assert tok.token_id("<|reserved_token_%d|>" % (first + 2)) == first + 2
    assert tok.token_id("hello") == _ranks()[b"hello"] and tok.token_id("no such token") is None
    assert tok.decode([first + 10_000, *tok.encode("hello")]) == "hello"  # a model's padded rows: nothing
    assert [tok.token_str(i) for i in tok.encode("hello<|im_end|>")] == \
        [ref.decode_single_token_bytes(_ranks()[b"hello"]).decode(), "<|im_end|>"]
    assert tok.token_str(first + 10_000) is None


def test_a_run_longer_than_tiktoken_takes_is_cut_and_round_trips(folder):
    tok = load_tokenizer(folder)
    text = "hello" + " " * 30_000 + "x" * 26_000 + "world"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("broken, message", [
    ("no code", "without its tokenizer's code"),
    ("computed pattern", "no literal pat_str"),
    ("bad rank line", "line 3 is not a base64 token and its rank"),
])
def test_broken_folders_are_one_line(tmp_path, broken, message):
    folder = kimi_folder(tmp_path / "k")
    if broken == "no code":
        (folder / "tokenization_kimi.py").unlink()
    elif broken == "computed pattern":
        kimi_folder(folder, code="class TikTokenTokenizer:\n    num_reserved_special_tokens = 4\n"
                                  "    pat_str = make_pattern()\n")
    else:
        lines = (folder / "tiktoken.model").read_text().splitlines()
        lines[2] = "not-base64!"
        (folder / "tiktoken.model").write_text("\n".join(lines))
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(folder)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_gateway_serves_a_chat_through_it(folder, monkeypatch):
    import httpx

    import gateway_harness
    from gateway_harness import MODEL_NAME, Stack
    from tandem.chat_template import ChatTemplate

    plain = len(_ranks())
    monkeypatch.setattr(gateway_harness, "vocab_size", lambda: plain + RESERVED + 2)  # the model's: specials included
    monkeypatch.setattr(gateway_harness, "TextTokenizer", load_tokenizer)
    stack = Stack(model_dir=folder, served_model_name=MODEL_NAME)
    try:
        messages = [{"role": "user", "content": "hello 你好"}]
        r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10,
                       json={"model": MODEL_NAME, "messages": messages, "max_tokens": 6})
        assert r.status_code == 200, r.text
        ref = reference()
        rendered = ChatTemplate.from_model_dir(folder).render(messages, add_generation_prompt=True)
        prompt = ref.encode(rendered, allowed_special="all")
        assert list(stack.fake.requests[-1].prompt_token_ids) == prompt
        made = stack.expected(prompt, 6)
        assert r.json()["choices"][0]["message"]["content"] == ref.decode([i for i in made if i < plain])  # (specials skipped)
        # streamed: the deltas (bytes of a character split across tokens held back) add up to the same text
        body = {"model": MODEL_NAME, "prompt": "你好 hello", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as s:
            deltas = [json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                      if line.startswith("data: {")]
        made = stack.expected(ref.encode("你好 hello"), 40)
        assert "".join(deltas) == ref.decode([i for i in made if i < plain])
    finally:
        stack.close()
