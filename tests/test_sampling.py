"""Sampling: the adjusted distribution equals HF's logits warpers; inverse-CDF draws follow it
(chi-square); per-request seeds make sampling independent of batch composition; greedy is argmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from helpers import hf_logits, random_prompt
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams, adjusted_probs, sample, sample_from_probs, token_uniform, token_uniforms

VOCAB = 40


def spaced_logits(seed: int, rows: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    """Random logits without near-ties: a random permutation of well-separated values."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        values = torch.arange(vocab, dtype=torch.float32) * 0.17 + torch.rand(vocab, generator=g) * 0.05
        out.append(values[torch.randperm(vocab, generator=g)] - 3.0)
    return torch.stack(out)


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's warpers in generate's order (temperature, top-k, top-p), then softmax."""
    scores = logits.clone()
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    if p.temperature not in (0.0, 1.0):
        scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return scores.softmax(-1)


def near_top_p_boundary(logits: torch.Tensor, p: SamplingParams, tol: float = 1e-4) -> bool:
    """True when the mass before some token is within tol of top_p (a cut float rounding could flip)."""
    scaled = logits.double() / (p.temperature or 1.0)
    sorted_vals = scaled.sort(dim=-1, descending=True).values
    if p.top_k > 0:
        sorted_vals = sorted_vals[..., : p.top_k]
    probs = sorted_vals.softmax(-1)
    before = probs.cumsum(-1) - probs
    return bool(((before - p.top_p).abs() < tol).any())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([0.3, 0.7, 1.0, 1.6]),
       top_k=st.sampled_from([0, 1, 2, 5, 17, VOCAB, 100]), top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1]))
def test_adjusted_probs_equal_hf_warpers(seed, temperature, top_k, top_p):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = spaced_logits(seed)
    assume(not near_top_p_boundary(logits, p))
    ours = adjusted_probs(logits, [p])
    ref = hf_probs(logits, p)
    assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-5)
    assert ((ours > 0) == (ref > 0)).all(), "different set of surviving tokens"


def test_adjusted_probs_per_row_params_in_one_batch():
    params = [SamplingParams(temperature=0.5, top_k=5), SamplingParams(),  # greedy
              SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=1.0, top_k=8, top_p=0.7),
              SamplingParams(temperature=0.9, top_k=-1)]
    logits = spaced_logits(7, rows=len(params))
    ours = adjusted_probs(logits, params)
    for i, p in enumerate(params):
        if p.greedy:
            want = torch.zeros(VOCAB)
            want[logits[i].argmax()] = 1.0
        else:
            assert not near_top_p_boundary(logits[i : i + 1], p)
            want = hf_probs(logits[i : i + 1], p)[0]
        assert torch.allclose(ours[i], want, atol=1e-6, rtol=1e-5), f"row {i} ({p})"


def test_greedy_rows_in_a_mixed_batch_return_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams() if i % 2 == 0 else SamplingParams(temperature=5.0) for i in range(6)]
    for k in range(20):
        tokens = sample(logits, params, [(i, k) for i in range(6)])
        assert tokens.dtype == torch.int64 and tokens.shape == (6,)
        for i in range(0, 6, 2):
            assert tokens[i].item() == logits[i].argmax().item()
    assert sample(logits, [SamplingParams()] * 6, [(i, 0) for i in range(6)]).tolist() == logits.argmax(-1).tolist()


DRAWS = 20_000


@pytest.mark.parametrize("chunks", [2, 8, 64])
def test_two_pass_argmax_equals_argmax_first_maximum_included(chunks):
    """argmax_rows (the greedy pick on the GPU) in two passes gives torch.argmax: random rows, rows whose
    maximum repeats inside one slice and across slices (the first wins), and several leading dims."""
    from tandem.sampling import argmax_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, 1024, generator=g).to(torch.bfloat16)
    logits[0, 0, [5, 7]] = 9.0  # a tie inside the first slice
    logits[1, 2, [1000, 3]] = 9.0  # a tie across slices: the lower index wins
    logits[2, 1, :] = 0.0  # all equal: index 0
    logits[3, 3, -1] = 9.0  # the last token
    assert torch.equal(argmax_rows(logits, chunks), logits.argmax(dim=-1))
    assert torch.equal(argmax_rows(logits[0], chunks), logits[0].argmax(dim=-1))
    assert argmax_rows(logits, chunks)[1, 2] == 3 and argmax_rows(logits, chunks)[2, 1] == 0


def test_inverse_cdf_sampling_chi_square():
    probs = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.22, 0.28])
    for scale in (1.0, 3.0):  # unnormalised rows are sampled in proportion
        u = torch.rand(DRAWS, generator=torch.Generator().manual_seed(123))
        tokens = sample_from_probs((probs * scale).expand(DRAWS, -1).contiguous(), u)
        counts = torch.bincount(tokens, minlength=6).double()
        assert chisquare(counts.numpy(), (probs.double() * DRAWS).numpy()).pvalue > 1e-3


def test_inverse_cdf_never_draws_zero_probability_tokens():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])
    # (1.0: u·total rounded up to the total, which lands past the last positive token)
    u = torch.cat([torch.tensor([0.0, 0.5, 1.0 - 1e-7, 1.0]), torch.rand(5000, generator=torch.Generator().manual_seed(5))])
    tokens = sample_from_probs(probs.expand(len(u), -1).contiguous(), u)
    assert set(tokens.tolist()) <= {1, 4}


def test_token_uniforms_are_uniform_and_independent_across_tokens_and_seeds():
    """A request's token i samples with token_uniform(seed, i): uniform on [0, 1) (Kolmogorov-Smirnov), exact in
    float32, uncorrelated between neighbouring tokens and between seeds; equal for equal arguments."""
    from scipy.stats import kstest, pearsonr

    u = np.array([token_uniform(seed, i) for seed in (0, 1, 2**40 + 3) for i in range(6000)])
    assert u.min() >= 0.0 and u.max() < 1.0 and np.array_equal(u.astype(np.float32).astype(np.float64), u)
    assert kstest(u, "uniform").pvalue > 1e-3
    by_seed = u.reshape(3, 6000)
    assert abs(pearsonr(by_seed[0, :-1], by_seed[0, 1:])[0]) < 0.05  # token i and i + 1
    assert abs(pearsonr(by_seed[0], by_seed[1])[0]) < 0.05  # seeds 0 and 1 at the same token
    assert token_uniform(7, 100) == token_uniform(7, 100) != token_uniform(7, 101)
    many = token_uniforms([(0, 0), (2**64 - 1, 5)], 4)  # a queued run's rows and steps at once: token by token
    assert many.dtype == np.float32 and many.shape == (4, 2)
    assert [float(v) for v in many[:, 1]] == [token_uniform(2**64 - 1, 5 + k) for k in range(4)]


def test_the_hash_is_splitmix64():
    """SplitMix64 against the published outputs of the reference generator seeded 1234567 (the xoshiro authors' page):
    its k-th output is the mix of the state seed + k x the golden gamma."""
    from tandem.sampling import splitmix64

    gamma, seed = 0x9E3779B97F4A7C15, 1234567
    states = np.array([(seed + k * gamma) % 2**64 for k in range(5)], dtype=np.uint64)
    assert [int(v) for v in splitmix64(states)] == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                                                    4593380528125082431, 16408922859458223821]


def exact_adjusted(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution after temperature, top-k and top-p, computed by hand in float64."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k]
    renorm = probs[kept] / probs[kept].sum()
    mass, survivors = 0.0, []
    for tok, q in zip(kept, renorm.tolist()):
        if mass >= top_p:
            break
        survivors.append(tok)
        mass += q
    out = torch.zeros_like(probs)
    out[survivors] = probs[survivors] / probs[survivors].sum()
    return out


def test_sampled_top_k_top_p_distribution_chi_square():
    logits = torch.tensor([1.2, -0.3, 2.5, 0.4, 1.9, -1.0, 0.9, 2.2])
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=1)
    want = exact_adjusted(logits, 0.7, 5, 0.8)
    assert 2 <= int((want > 0).sum()) < 5  # both cuts bite
    tokens = sample(logits.expand(DRAWS, -1).contiguous(), [p] * DRAWS, [(2024, i) for i in range(DRAWS)])
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    support = want > 0
    assert counts[~support].sum() == 0, "drew a token the cuts remove"
    assert chisquare(counts[support].numpy(), (want[support] * DRAWS).numpy()).pvalue > 1e-3


# ---------------------------------------------------------------------------------- through the engine


def test_seeded_requests_independent_of_batch_composition(llama):
    prompt = random_prompt(70, 9)
    mine = SamplingParams(temperature=1.0, seed=42, max_new_tokens=24, ignore_eos=True)
    others = [random_prompt(71, 20), random_prompt(72, 3), random_prompt(73, 14)]
    other_params = [SamplingParams(temperature=0.8, seed=7, max_new_tokens=30, ignore_eos=True),
                    SamplingParams(max_new_tokens=5, ignore_eos=True),  # greedy
                    SamplingParams(temperature=1.2, top_p=0.9, max_new_tokens=12, ignore_eos=True)]  # engine seed
    with LLMEngine(EngineConfig(model=llama.path)) as eng:
        alone = eng.generate([prompt], mine)[0].output_token_ids
        again = eng.generate([prompt], mine)[0].output_token_ids
        batched = eng.generate([others[0], prompt, *others[1:]], [other_params[0], mine, *other_params[1:]])
        other_seed = eng.generate([prompt], SamplingParams(temperature=1.0, seed=43, max_new_tokens=24,
                                                           ignore_eos=True))[0].output_token_ids
    with LLMEngine(EngineConfig(model=llama.path, page_size=4, page_shuffle_seed=3, seed=99)) as other_engine:
        elsewhere = other_engine.generate([prompt], mine)[0].output_token_ids
    assert alone == again == batched[1].output_token_ids == elsewhere
    assert other_seed != alone, "the seed does not influence sampling"
    assert len(alone) == 24


def test_engine_first_token_distribution_matches_hf(llama):
    """Many seeded requests' first sampled tokens follow HF's warped distribution (chi-square)."""
    prompt = random_prompt(80, 6)
    p_kw = dict(temperature=0.8, top_k=6, max_new_tokens=1, ignore_eos=True)
    probs = hf_probs(hf_logits(llama.hf, prompt)[-1:], SamplingParams(**p_kw))[0].double()
    n = 600
    with LLMEngine(EngineConfig(model=llama.path, max_running_requests=512)) as eng:
        results = eng.generate([prompt] * n, [SamplingParams(seed=s, **p_kw) for s in range(n)])
    counts = torch.bincount(torch.tensor([r.output_token_ids[0] for r in results]), minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] / probs[support].sum() * n  # float32 probabilities: sum exactly to n for scipy
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3
