"""The embedded demo model: what ``tandem generate``/``tandem up`` serve when no model is given.

Nothing can be downloaded, so the demo is built locally on first use and cached: a byte-level BPE
tokenizer trained on the Python standard library's own source (present on every machine), and a
small Llama-architecture target. NOTE: until the drafter-training issue lands the demo pair, the
target's weights are random — the plumbing is real, the text is not meaningful.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from pathlib import Path

log = logging.getLogger("tandem.demo")

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
DEMO_VERSION = "v1-random"


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def stdlib_sources(limit_bytes: int = 4_000_000) -> list[Path]:
    """Python files of the standard library, in a stable order, up to ``limit_bytes`` in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        size = path.stat().st_size
        if total + size > limit_bytes:
            break
        files.append(path)
        total += size
    return files


def train_tokenizer(out_dir: Path, vocab_size: int = 2048) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in stdlib_sources(1_500_000)], trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
        "chat_template": "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}",
    }, indent=2))


def ensure_demo_target() -> Path:
    """Build (once) and return the demo target's folder."""
    out = cache_root() / "demo" / DEMO_VERSION / "target"
    if (out / "config.json").is_file():
        return out
    from tandem.models.random_checkpoint import LlamaShape, write_random_llama

    log.info("building the demo target in %s (first use only)", out)
    tmp = out.with_name("target.partial")
    tmp.mkdir(parents=True, exist_ok=True)
    train_tokenizer(tmp)
    write_random_llama(tmp, LlamaShape(), dtype="float32", seed=0, std=0.05,
                       bos=0, eos=1)
    tmp.rename(out)
    return out


def ensure_demo_draft() -> Path:
    """Build (once) and return the demo target's EAGLE-3 head (random weights until it is trained)."""
    out = cache_root() / "demo" / DEMO_VERSION / "draft"
    if (out / "config.json").is_file():
        return out
    from tandem.models.config import ModelConfig
    from tandem.models.eagle3_checkpoint import write_random_eagle3

    target = ensure_demo_target()
    log.info("building the demo draft in %s (first use only)", out)
    tmp = out.with_name("draft.partial")
    write_random_eagle3(tmp, ModelConfig.from_dir(target), draft_vocab_size=1024, seed=0)
    tmp.rename(out)
    return out
