"""The draft vocabulary: the ``draft_vocab_size`` most frequent target tokens of the training
responses, as EAGLE-3 and SpecForge build it.

``d2t[i] = used[i] - i`` (int64, so ``target_id = draft_id + d2t[draft_id]``) and ``t2d`` marks the
used target ids (bool over the target vocabulary). ``used`` is sorted ascending, so draft ids keep
the target's order. When the data has fewer distinct tokens than the draft vocabulary, the rest is
filled with the lowest unused ids (SpecForge pads the same way), so every draft id maps somewhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    used: torch.Tensor  # int64 [draft_vocab] target ids, ascending
    d2t: torch.Tensor  # int64 [draft_vocab]
    t2d: torch.Tensor  # bool [target_vocab]
    coverage: float  # fraction of counted tokens the draft vocabulary covers

    @property
    def size(self) -> int:
        return len(self.used)

    def target_to_draft(self) -> torch.Tensor:
        """int64 [target_vocab]: the draft id of each target id, -1 where it has none."""
        index = torch.full((len(self.t2d),), -1, dtype=torch.int64)
        index[self.used] = torch.arange(len(self.used))
        return index


def build_draft_vocab(token_lists: Iterable[list[int]], target_vocab: int, draft_vocab: int) -> DraftVocab:
    if not 0 < draft_vocab <= target_vocab:
        raise ValueError(f"draft vocab size {draft_vocab} must be in [1, {target_vocab}] (the target vocabulary)")
    counts: Counter[int] = Counter()
    for tokens in token_lists:
        counts.update(tokens)
    total = sum(counts.values())
    # Ties broken by the lower id, so the vocabulary does not depend on the order of the data.
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:draft_vocab]
    chosen = {t for t, _ in ranked}
    covered = sum(c for _, c in ranked)
    filler = (t for t in range(target_vocab) if t not in chosen)
    while len(chosen) < draft_vocab:
        chosen.add(next(filler))
    used = torch.tensor(sorted(chosen), dtype=torch.int64)
    d2t = used - torch.arange(draft_vocab)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[used] = True
    return DraftVocab(used, d2t, t2d, covered / total if total else 0.0)


def vocab_from_tensors(d2t: torch.Tensor, t2d: torch.Tensor) -> DraftVocab:
    used = torch.arange(len(d2t)) + d2t
    return DraftVocab(used, d2t.clone(), t2d.clone(), float("nan"))
