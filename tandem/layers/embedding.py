"""Vocabulary-parallel token embedding and LM head.

The vocabulary is split into equal contiguous ranges (the last one padded) so each rank holds
``ceil(V / tp)`` rows. The embedding zeroes lookups outside its range and all-reduces; the LM head
computes its range's logits and all-gathers them, dropping the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import all_gather_last_dim, all_reduce, tp_group
from tandem.layers.linear import check_shape, matmul


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        tp = tp_group()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.local_vocab = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden_size), requires_grad=False)

    def load_weight(self, param: str, tensor: torch.Tensor, shard_id: object = None) -> None:
        check_shape(tensor, (self.vocab_size, self.hidden_size))
        rows = max(0, min(self.local_vocab, self.vocab_size - self.vocab_start))
        self.weight.data.zero_()
        self.weight.data[:rows].copy_(tensor.narrow(0, self.vocab_start, rows))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if tp_group().size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary; may share its weight with the embedding (tied checkpoints)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, V]
        logits = all_gather_last_dim(matmul(hidden, self.weight))
        return logits[..., : self.vocab_size]
