"""The target as teacher: EAGLE-3 features and logits for whole sequences, captured online.

Every training batch runs the target forward over prompt+response through our engine's executor
with ``capture_features=True`` — the same code that serves, so the head trains on exactly the
features the verifier will hand it, and tensor parallelism (``--tp-size``) comes for free: rank 0
broadcasts the batch and gets the full logits and the replicated residual stream back. Nothing is
stored on disk (SpecForge's offline mode needs terabytes for real models).
"""

from __future__ import annotations

import torch

from tandem.forward_batch import ForwardBatch, SequenceChunk
from tandem.kv_cache import SequenceKV


class TargetTeacher:
    """Online for samples given as text; served-traffic samples bring their features from disk (the
    target already computed them while serving) and their next tokens as targets."""

    def __init__(self, engine):
        """``engine``: an LLMEngine over the target (its KV pool is borrowed for each forward)."""
        self.engine = engine
        self.capture_layers = engine.executor.runner.capture_layers

    def teach(self, samples) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """→ per sample (features, logits [n, V]) online, or (stored features [n-1, W], next ids [n-1])."""
        online = iter(self.forward([s.tokens for s in samples if s.traffic is None]))
        return [next(online) if s.traffic is None else self._stored(s) for s in samples]

    @staticmethod
    def _stored(sample) -> tuple[torch.Tensor, torch.Tensor]:
        from tandem.errors import ConfigError
        from tandem.traffic.dataset import read_features

        feats = read_features(sample.traffic)
        if feats.shape[0] != len(sample.tokens) - 1:  # the shard was replaced under a saved run
            raise ConfigError(f"{sample.traffic.shard} sample {sample.traffic.index}: {feats.shape[0]} feature rows "
                              f"for {len(sample.tokens)} tokens; the traffic folder changed since the run began")
        return feats, torch.tensor(sample.tokens[1:], dtype=torch.int64)

    def forward(self, sequences: list[list[int]], max_tokens: int = 4096) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """→ per sequence (features [n, 3·H], float32 logits [n, V]), as normal (autograd-usable)
        tensors. Sequences are packed into forwards of at most ``max_tokens`` tokens."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        group: list[list[int]] = []
        for seq in sequences:
            if group and sum(map(len, group)) + len(seq) > max_tokens:
                out += self._forward_group(group)
                group = []
            group.append(seq)
        if group:
            out += self._forward_group(group)
        return out

    def _forward_group(self, group: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        kvs, chunks = [], []
        try:
            for tokens in group:
                kv = SequenceKV(self.engine.allocator)
                kvs.append(kv)
                kv.reserve(len(tokens))
                chunks.append(SequenceChunk(list(tokens), 0, kv.page_table(), logits="all"))
            logits, features = self.engine.executor.forward(ForwardBatch(chunks, capture_features=True))
        finally:
            for kv in kvs:
                kv.release()
        # The executor runs under inference_mode; clone() outside it gives tensors autograd may save.
        logits, features = logits.clone(), features.clone()
        result, row = [], 0
        for tokens in group:
            n = len(tokens)
            result.append((features[row : row + n], logits[row : row + n]))
            row += n
        return result
