"""The Python standard library as text (the same on every machine, nothing to download) and the demo's
byte-level BPE tokenizer trained on it. Torch-free."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]


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
