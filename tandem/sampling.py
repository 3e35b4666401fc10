"""Sampling parameters and batched token sampling (greedy, temperature, min-p, top-k, top-p, per-request seeds).

``adjusted_probs`` turns logits into the distribution a request actually samples from; speculative
acceptance uses the same function, so what is accepted and what plain decoding would sample are the
same distribution by construction. Randomness is one uniform number per token, a hash of the request's
seed and the token's place in its sequence (``token_uniform``), drawn by inverse CDF (``sample_from_probs``):
every path that samples a token — a plain step, a queued run of steps, the acceptance of a speculative round
(tandem.speculative.accept) — draws the same number for it, so a seeded request gives the same tokens whatever
else is in the batch, whether or not its steps speculate, and on whatever device the logits live (up to the
logits' own rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.errors import ConfigError
from tandem.sampling_limits import MAX_ABS_PENALTY, MAX_LOGPROBS, MAX_REPETITION_PENALTY, MAX_STOP_TOKEN_IDS
from tandem.staging import upload


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 (or -1) = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0  # drop tokens below min_p × the most likely token's probability (after temperature)
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens are generated
    # vLLM's penalties (tandem.penalties): repetition over prompt and output, presence/frequency over output
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # log-probabilities of each generated token and its top-N alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first ...
    # ... from this one on (SGLang's logprob_start_len + 1): the prefix cache may hold the prompt before it
    prompt_logprobs_from: int = 1

    @property
    def penalized(self) -> bool:
        """Whether the request's logits depend on the tokens before them (each draft node's on its own path)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

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
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ConfigError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(self.stop_token_ids)}")
        if self.top_k < -1:
            raise ConfigError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ConfigError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                              f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise ConfigError(f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], "
                                  f"got {getattr(self, name)}")
        if self.prompt_logprobs_from < 1:
            raise ConfigError(f"prompt_logprobs_from must be >= 1 (the first prompt token has none), "
                              f"got {self.prompt_logprobs_from}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ConfigError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")


_MASK64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output for each uint64 state of ``x`` (its first output from that state; array arithmetic wraps
    modulo 2^64 as the generator's does)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def token_uniforms(starts: list[tuple[int, int]], steps: int) -> np.ndarray:
    """float32 ``[steps, rows]``: the uniform in [0, 1) that samples token ``first + k`` (its place in the sequence,
    the prompt's tokens included) of each row's request ``(seed, first)`` — a hash of the two, 24 bits: exact in
    float32, so never rounded up to 1."""
    seeds = splitmix64(np.array([seed & _MASK64 for seed, _ in starts], dtype=np.uint64))
    index = np.array([first for _, first in starts], dtype=np.uint64)[None, :] + np.arange(steps, dtype=np.uint64)[:, None]
    return (splitmix64(seeds[None, :] ^ index) >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)


def token_uniform(seed: int, index: int) -> float:
    """``token_uniforms`` of one token: request ``seed``'s token ``index``."""
    return float(token_uniforms([(seed, index)], 1)[0, 0])


@dataclass(frozen=True)
class RowSampling:
    """A batch's per-row sampling settings as device tensors, decided once (see StepSampler)."""

    greedy: torch.Tensor  # bool [B]
    temps: torch.Tensor  # float32 [B] (1 for greedy rows)
    top_k: torch.Tensor  # int64 [B] (vocab = no cut)
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B] (0 = no cut)
    any_greedy: bool
    any_cut: bool  # some row has a top-k or top-p cut
    any_min_p: bool


def row_sampling(params: list[SamplingParams], device: torch.device, vocab: int) -> RowSampling:
    greedy = [p.greedy for p in params]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    f32 = lambda values: upload(np.asarray(values, dtype=np.float32), device)  # noqa: E731 (pinned: no sync)
    return RowSampling(
        greedy=upload(np.asarray(greedy, dtype=np.bool_), device),
        temps=f32([p.temperature if not p.greedy else 1.0 for p in params]),
        top_k=upload(np.asarray(top_k, dtype=np.int64), device),
        top_p=f32([p.top_p for p in params]),
        min_p=f32([p.min_p for p in params]),
        any_greedy=any(greedy),
        any_cut=any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in params),
        any_min_p=any(p.min_p > 0.0 and not p.greedy for p in params),
    )


def adjusted_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p (vLLM's order), per row ([B, V] float32).

    Greedy rows get a one-hot distribution on their argmax, which is what greedy decoding samples.
    """
    return adjusted_probs_rows(logits, row_sampling(params, logits.device, logits.shape[1]))


def adjusted_probs_rows(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    logits = logits.float()
    vocab = logits.shape[1]
    dev = logits.device
    scaled = logits / rows.temps.unsqueeze(1)
    if rows.any_min_p:
        probs = scaled.softmax(dim=-1)
        below = probs < rows.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(below, float("-inf"))  # the most likely token never falls below
    if rows.any_cut:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = rank >= rows.top_k.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = drop | (mass_before >= rows.top_p.unsqueeze(1))
        drop[:, 0] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    if rows.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(rows.greedy.unsqueeze(1), one_hot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first token whose cumulative probability exceeds u·total — never past the
    last token of positive probability (u·total rounded up to the total would land on the flat tail)."""
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).byte().argmax(dim=-1)  # (from the end: the first)
    return torch.minimum(torch.searchsorted(cdf, targets, right=True).squeeze(1), last_positive)


def sample(logits: torch.Tensor, params: list[SamplingParams], starts: list[tuple[int, int]]) -> torch.Tensor:
    """One token per row of ``logits`` ([B, V]); ``starts``: each row's (seed, index of the token) → int64 [B]."""
    return StepSampler(params, starts, logits.device, logits.shape[1], steps=1)(logits, 0)


ARGMAX_CHUNKS = 64  # the vocabulary's split for argmax_rows


def argmax_rows(logits: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [..., V] — the first maximum wins — in two passes when the
    vocabulary is large: the maximum of each of ``chunks`` slices, then the best slice. torch's one-pass
    reduction keeps a few rows on a few thread blocks, which leaves most of the GPU idle over a
    128K-token vocabulary. ``chunks``: by default ARGMAX_CHUNKS on the GPU when it divides V (and
    V >= 8192), else one pass; tests force it on the CPU."""
    vocab = logits.shape[-1]
    if chunks is None:
        chunks = ARGMAX_CHUNKS if logits.is_cuda and vocab >= 8192 and vocab % ARGMAX_CHUNKS == 0 else 1
    if chunks <= 1:
        return logits.argmax(dim=-1)
    width = vocab // chunks
    values, within = logits.reshape(*logits.shape[:-1], chunks, width).max(dim=-1)  # first max in each slice
    best = values.argmax(dim=-1, keepdim=True)  # the first slice holding the maximum
    return (best * width + within.gather(-1, best)).squeeze(-1)


class StepSampler:
    """Samples the same rows for ``steps`` consecutive steps with only device work per step: the
    settings and every step's uniforms are on the device before the first step (each small host copy
    waits for the device), so steps can be queued behind forwards (tandem.engine.decode_ahead).
    ``starts``: each row's (seed, index of its first step's token); step k samples token ``index + k``,
    with the uniform one call of ``sample`` per step would use. An all-greedy batch needs neither."""

    def __init__(self, params: list[SamplingParams], starts: list[tuple[int, int]], device: torch.device,
                 vocab: int, steps: int):
        greedy = all(p.greedy for p in params)
        self.rows = None if greedy else row_sampling(params, device, vocab)
        self.uniforms = None if greedy else upload(token_uniforms(starts, steps), device)

    @classmethod
    def over(cls, rows: RowSampling | None, uniforms: torch.Tensor | None) -> "StepSampler":
        """A sampler of settings and uniforms ([steps, B]) already on the device (a CUDA graph's static buffers);
        None and None: greedy."""
        sampler = cls.__new__(cls)
        sampler.rows, sampler.uniforms = rows, uniforms
        return sampler

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """Step ``step``'s token per row of ``logits`` ([B, V]) → int64 [B]."""
        if self.rows is None:
            return argmax_rows(logits)
        tokens = sample_from_probs(adjusted_probs_rows(logits, self.rows), self.uniforms[step])
        return torch.where(self.rows.greedy, argmax_rows(logits), tokens)
