"""Sampling parameters and batched token sampling (greedy, temperature, top-k, top-p, per-request seeds).

``adjusted_probs`` turns logits into the distribution a request actually samples from; speculative
acceptance uses the same function, so what is accepted and what plain decoding would sample are the
same distribution by construction. Randomness comes from one uniform number per row, drawn from the
request's own CPU generator: a seeded request gives the same tokens whatever else is in the batch and
on whatever device the logits live.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 (or -1) = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (vLLM's threshold) dividing by the temperature overflows float32 logits; such a
        # temperature is greedy in all but name.
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise ConfigError naming the offending field."""
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ConfigError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def adjusted_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, per row ([B, V] float32).

    Greedy rows get a one-hot distribution on their argmax, which is what greedy decoding samples.
    """
    logits = logits.float()
    rows, vocab = logits.shape
    dev = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    scaled = logits / temps.unsqueeze(1)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = rank >= top_k.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = drop | (mass_before >= top_p.unsqueeze(1))
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def draw_uniforms(generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.rand(1, generator=g) for g in generators]).to(device)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first token whose cumulative probability exceeds u·total."""
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logits`` ([B, V]) → int64 [B]."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    probs = adjusted_probs(logits, params)
    tokens = sample_from_probs(probs, draw_uniforms(generators, logits.device))
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    return torch.where(greedy, logits.argmax(dim=-1), tokens)
