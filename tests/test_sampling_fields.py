"""The engine's OpenAI sampling fields — logprobs, min_p, min_tokens and vLLM's penalties — checked against
references that do not use the code under test: transformers on the same weights (log-softmax, greedy
``generate`` with its own logits processors), exact distributions computed here from transformers' logits
with the fields' documented formulas, and target-only decoding. Speculation must change none of it."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from checkpoints import write_checkpoint
from helpers import hf_logits, random_prompt
from proposers import RandomTreeProposer, Spec, always_speculate
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.errors import ConfigError
from tandem.sampling import SamplingParams
from tandem.speculative.tree import DraftTree

EOS = 2  # the test checkpoints' eos_token_id


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("fields") / "llama"
    return path, write_checkpoint(path, "llama", seed=11, num_hidden_layers=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A six-token vocabulary: every two-token sequence's probability can be enumerated."""
    path = tmp_path_factory.mktemp("fields") / "tiny"
    return path, write_checkpoint(path, "llama", seed=5, num_hidden_layers=2, vocab_size=6)


class ChainOracle(RandomTreeProposer):
    """Drafts the given continuation as a chain (every draft accepted while the output follows it)."""

    def _tree(self, rid, size):
        full, pos = self.oracle[rid], len(self.tokens[rid])
        return DraftTree.chain(full[pos], (full + [3] * size)[pos + 1 : pos + size])


def _run(eng, prompts, params):
    """→ per prompt: output tokens, their logprobs (StepOutput.logprobs, concatenated), spec rounds."""
    rids = [eng.add_request(p, params) for p in prompts]
    tokens = {r: [] for r in rids}
    logprobs = {r: [] for r in rids}
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.rid] += out.new_token_ids
            if params.logprobs is not None:
                assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
                logprobs[out.rid] += out.logprobs
            else:
                assert out.logprobs is None
    rounds = [eng.requests[r].spec_stats.rounds for r in rids]
    return [tokens[r] for r in rids], [logprobs[r] for r in rids], rounds


# ---- logprobs ----------------------------------------------------------------------------------------


def _check_logprobs(hf, prompt, output, entries, k):
    ref = hf_logits(hf, prompt + output).log_softmax(dim=-1)
    assert len(entries) == len(output)
    for j, (token, entry) in enumerate(zip(output, entries)):
        row = ref[len(prompt) - 1 + j]
        assert abs(entry.logprob - row[token].item()) <= 1e-3
        values, ids = row.topk(k)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert max(abs(v - r) for (_, v), r in zip(entry.top, values.tolist())) <= 1e-3 if k else entry.top == ()


@pytest.mark.parametrize("mode", ["target-only", "greedy-spec", "sampled-spec", "decode-ahead"])
def test_logprobs_equal_transformers_log_softmax(target, mode):
    """The raw log-softmax at each generated position (before temperature and top-k), for the token and the
    top 5 — from the verify's logits at the accepted nodes when speculating."""
    path, hf = target
    prompts = [random_prompt(i, n) for i, n in enumerate((7, 12, 3))]
    temperature = 1.0 if mode == "sampled-spec" else 0.0
    params = SamplingParams(temperature=temperature, top_k=20 if temperature else 0, max_new_tokens=20,
                            ignore_eos=True, logprobs=5, seed=3 if temperature else None)
    cfg = EngineConfig(model=str(path), page_size=4, decode_steps=4 if mode == "decode-ahead" else None)
    if mode == "greedy-spec":
        with LLMEngine(cfg) as plain:
            expected, _, _ = _run(plain, prompts, params)
        oracle = {f"req-{i}": p + e for i, (p, e) in enumerate(zip(prompts, expected))}
        # random trees holding the true path somewhere: accepted nodes are not the first rows of the tree
        engine = LLMEngine(cfg, proposer=RandomTreeProposer(256, seed=4, oracle=oracle, hit_rate=0.9), spec=Spec(8),
                           policy=always_speculate())
    elif mode == "sampled-spec":
        engine = LLMEngine(cfg, proposer=RandomTreeProposer(256, seed=2), spec=Spec(6), policy=always_speculate())
    else:
        engine = LLMEngine(cfg)
    with engine as eng:
        outputs, logprobs, rounds = _run(eng, prompts, params)
    if mode == "greedy-spec":
        assert outputs == expected and all(r >= 3 for r in rounds)
        assert all(eng.requests[f"req-{i}"].spec_stats.accept_length_mean > 1.5 for i in range(3))
    if mode == "sampled-spec":
        assert all(r > 0 for r in rounds)
    for prompt, output, entries in zip(prompts, outputs, logprobs):
        _check_logprobs(hf, prompt, output, entries, 5)


def test_logprobs_zero_gives_the_token_only_and_others_get_none(target):
    path, hf = target
    prompt = random_prompt(4, 9)
    with LLMEngine(EngineConfig(model=str(path))) as eng:
        (out,), (entries,), _ = _run(eng, [prompt], SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=0))
        _run(eng, [prompt], SamplingParams(max_new_tokens=3, ignore_eos=True))  # asserts logprobs is None
    _check_logprobs(hf, prompt, out, entries, 0)


# ---- exact distributions ---------------------------------------------------------------------------


def _reference_probs(logits: torch.Tensor, temperature: float, min_p: float = 0.0, masked=()) -> torch.Tensor:
    """vLLM's documented rules, written out: masked tokens removed, softmax at the temperature, tokens
    below min_p × the top probability removed, renormalised."""
    logits = logits.double().clone()
    logits[list(masked)] = float("-inf")
    p = (logits / temperature).softmax(-1)
    p = torch.where(p >= min_p * p.max(), p, torch.zeros_like(p))
    return p / p.sum()


def _chi_square(counts: dict, exact: dict, n: int) -> float:
    assert all(exact.get(k, 0.0) > 0 for k in counts), f"an impossible sequence was emitted: {counts} {exact}"
    cells = [k for k in exact if exact[k] * n >= 5]
    observed, expected = [counts.get(k, 0) for k in cells], [exact[k] * n for k in cells]
    if n - sum(expected) >= 1:
        observed.append(n - sum(observed))
        expected.append(n - sum(expected))
    return chisquare(observed, expected).pvalue


def _sample_pairs(path, prompt, params, n, speculate: bool) -> dict:
    kw = dict(proposer=RandomTreeProposer(6, seed=1), spec=Spec(4), policy=always_speculate()) if speculate else {}
    with LLMEngine(EngineConfig(model=str(path), seed=7), **kw) as eng:
        results = eng.generate([prompt] * n, params)
    if speculate:
        assert sum(r.spec_stats.rounds for r in results) > n // 2
    counts: dict = {}
    for r in results:
        key = tuple(r.output_token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "spec"])
def test_min_p_keeps_the_exact_distribution(tiny, speculate):
    path, hf = tiny
    prompt, n = [1, 4, 2, 5, 3], 2000
    params = SamplingParams(temperature=0.7, min_p=0.2, max_new_tokens=2, ignore_eos=True)
    exact = {}
    with torch.no_grad():
        p1 = _reference_probs(hf_logits(hf, prompt)[-1], 0.7, 0.2)
        for a in range(6):
            p2 = _reference_probs(hf_logits(hf, prompt + [a])[-1], 0.7, 0.2)
            for b in range(6):
                exact[(a, b)] = float(p1[a] * p2[b])
    assert sum(v == 0 for v in exact.values()) > 6, "min_p must cut something for the test to mean anything"
    assert _chi_square(_sample_pairs(path, prompt, params, n, speculate), exact, n) > 1e-3


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "spec"])
def test_min_tokens_masks_eos_by_depth(tiny, speculate):
    """min_tokens=1: the first token is never EOS, the second may be (then the output ends there). In a tree
    a node at depth 1 decides the second token, so it must not be masked."""
    path, hf = tiny
    prompt, n = [1, 4, 2, 5, 3], 2000
    params = SamplingParams(temperature=1.0, min_tokens=1, max_new_tokens=2)
    exact = {}
    with torch.no_grad():
        p1 = _reference_probs(hf_logits(hf, prompt)[-1], 1.0, masked=[EOS])
        for a in range(6):
            p2 = _reference_probs(hf_logits(hf, prompt + [a])[-1], 1.0)
            for b in range(6):
                exact[(a, b)] = float(p1[a] * p2[b])
    assert sum(v for (a, b), v in exact.items() if b == EOS) > 0.05, "EOS must be likely second"
    assert _chi_square(_sample_pairs(path, prompt, params, n, speculate), exact, n) > 1e-3


def _penalized_reference(logits, prompt, output, rep, presence, frequency):
    """vLLM's penalties from its documentation: repetition divides positive / multiplies negative logits
    of tokens in prompt or output; presence subtracts once, frequency per occurrence, over output tokens."""
    logits = logits.double().clone()
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
    for t in set(output):
        logits[t] -= presence + frequency * output.count(t)
    return logits


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "spec"])
def test_penalties_keep_the_exact_distribution(tiny, speculate):
    path, hf = tiny
    prompt, n = [1, 4, 4, 5, 3], 2000
    rep, presence, frequency = 1.8, 0.7, 0.9
    params = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True, repetition_penalty=rep,
                            presence_penalty=presence, frequency_penalty=frequency)
    exact = {}
    with torch.no_grad():
        p1 = _penalized_reference(hf_logits(hf, prompt)[-1], prompt, [], rep, presence, frequency).softmax(-1)
        for a in range(6):
            l2 = _penalized_reference(hf_logits(hf, prompt + [a])[-1], prompt, [a], rep, presence, frequency)
            for b, q in enumerate(l2.softmax(-1).tolist()):
                exact[(a, b)] = float(p1[a]) * q
    kw = dict(proposer=RandomTreeProposer(6, seed=1), spec=Spec(4), policy=always_speculate()) if speculate else {}
    with LLMEngine(EngineConfig(model=str(path), seed=7), **kw) as eng:
        results = eng.generate([prompt] * n, params)
    # speculating: each tree node's row penalized over its own path's history (tandem.request_logits)
    assert all(r.spec_stats.rounds > 0 for r in results) == speculate
    counts: dict = {}
    for r in results:
        counts[tuple(r.output_token_ids)] = counts.get(tuple(r.output_token_ids), 0) + 1
    assert _chi_square(counts, exact, n) > 1e-3


def test_penalties_along_a_draft_path_count_the_path_tokens(tiny):
    """A six-token vocabulary and strong penalties: the greedy continuation keeps avoiding tokens it has
    just produced, so a draft node's row is right only if the draft tokens above it are penalized too. The
    chain holds the reference's own continuation (the test's penalty loop over transformers' logits): it is
    accepted deep, and the output is the reference."""
    path, hf = tiny
    prompt, rep, presence, frequency = [1, 4, 0, 5], 3.0, 0.5, 0.7
    output: list[int] = []
    with torch.no_grad():
        for _ in range(16):
            logits = _penalized_reference(hf_logits(hf, prompt + output)[-1], prompt, output, rep, presence, frequency)
            output.append(int(logits.argmax()))
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=rep, presence_penalty=presence,
                            frequency_penalty=frequency)
    with LLMEngine(EngineConfig(model=str(path)), proposer=ChainOracle(6, oracle={"req-0": prompt + output}),
                   spec=Spec(5), policy=always_speculate()) as eng:
        (got,), _, (rounds,) = _run(eng, [prompt], params)
    assert got == output and rounds <= 8  # about three tokens a round: drafts accepted deep along the path


# ---- greedy against transformers -------------------------------------------------------------------


def test_min_tokens_greedy_equals_transformers_speculating_or_not(target):
    """A stop token that greedy decoding wants early, masked until min_tokens: transformers'
    min_new_tokens masks the same ids (its eos_token_id list)."""
    path, hf = target
    prompts = [random_prompt(20 + i, 10) for i in range(2)]
    with LLMEngine(EngineConfig(model=str(path))) as eng:
        free, _, _ = _run(eng, prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for prompt, free_out in zip(prompts, free):
        stop = free_out[2]  # wanted at the third position: min_tokens must push it later
        params = SamplingParams(max_new_tokens=24, min_tokens=8, stop_token_ids=(stop,))
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=8,
                          eos_token_id=[EOS, stop], pad_token_id=0)[0, len(prompt):].tolist()
        ref = ref[: next((i + 1 for i, t in enumerate(ref) if t in (EOS, stop)), len(ref))]
        assert ref[:3] != free_out[:3]
        with LLMEngine(EngineConfig(model=str(path))) as eng:
            (plain,), _, _ = _run(eng, [prompt], params)
        oracle = {"req-0": prompt + ref}
        with LLMEngine(EngineConfig(model=str(path)), proposer=ChainOracle(256, oracle=oracle, seed=1),
                       spec=Spec(5), policy=always_speculate()) as eng:
            (spec,), _, (rounds,) = _run(eng, [prompt], params)
        assert plain == ref and spec == ref and rounds >= 2


def test_repetition_penalty_greedy_equals_transformers_generate(target):
    """transformers' generate(repetition_penalty=...) is its RepetitionPenaltyLogitsProcessor; a penalized
    request speculates beside an unpenalized one, each verified against its own logits."""
    path, hf = target
    prompt = random_prompt(30, 8)
    ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, repetition_penalty=1.5,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    plain_ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ref != plain_ref
    oracle = {"req-0": prompt + ref, "req-1": prompt + plain_ref}
    with LLMEngine(EngineConfig(model=str(path)), proposer=ChainOracle(256, oracle=oracle), spec=Spec(4),
                   policy=always_speculate()) as eng:
        penalized = eng.add_request(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True, repetition_penalty=1.5))
        other = eng.add_request(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        assert eng.requests[penalized].output == ref and eng.requests[penalized].spec_stats.rounds > 0
        assert eng.requests[penalized].spec_stats.accept_length_mean > 1.5  # its chain (the penalized path) accepted
        assert eng.requests[other].output == plain_ref and eng.requests[other].spec_stats.rounds > 0


def test_presence_and_frequency_greedy_equal_a_reference_loop(target):
    path, hf = target
    prompt = random_prompt(31, 6)
    output: list[int] = []
    with torch.no_grad():
        for _ in range(25):
            logits = _penalized_reference(hf_logits(hf, prompt + output)[-1], prompt, output, 1.0, 0.5, 0.8)
            output.append(int(logits.argmax()))
    params = SamplingParams(max_new_tokens=25, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.8)
    with LLMEngine(EngineConfig(model=str(path), decode_steps=4)) as eng:
        (got,), _, _ = _run(eng, [prompt], params)
    with LLMEngine(EngineConfig(model=str(path))) as eng:
        (unpenalized,), _, _ = _run(eng, [prompt], SamplingParams(max_new_tokens=25, ignore_eos=True))
    assert got == output and got != unpenalized


@pytest.mark.parametrize("field, value", [("min_p", 1.5), ("min_p", -0.1), ("min_tokens", 40),
                                          ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
                                          ("frequency_penalty", -3.0), ("logprobs", 21), ("logprobs", -1)])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(max_new_tokens=16, **{field: value}).validate()


# ---- prompt logprobs -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers_log_softmax(target, chunked):
    """Every prompt token after the first gets the raw log-softmax of the position before it, on the request's
    first output — whole or prefilled in chunks, beside a request that asks for none and a speculating one."""
    path, hf = target
    prompts = [random_prompt(40 + i, n) for i, n in enumerate((23, 9, 14))]
    cfg = EngineConfig(model=str(path), page_size=4, chunked_prefill_size=8 if chunked else -1)
    params = [SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=1),
              SamplingParams(max_new_tokens=4, ignore_eos=True),
              SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=0)]
    with LLMEngine(cfg, proposer=RandomTreeProposer(256, seed=1), spec=Spec(4), policy=always_speculate()) as eng:
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        got, tokens = {}, {r: [] for r in rids}
        while eng.has_unfinished():
            for out in eng.step():
                tokens[out.rid] += out.new_token_ids
                if out.prompt_logprobs is not None:
                    assert out.rid not in got and out.new_token_ids  # once, with the first token
                    got[out.rid] = out.prompt_logprobs
    assert set(got) == {rids[0], rids[2]}
    spread = 0  # (near-ties the tolerance leaves open: few, or the rank check says little)
    for rid, prompt, k in ((rids[0], prompts[0], 3), (rids[2], prompts[2], 0)):
        ref = hf_logits(hf, prompt).log_softmax(dim=-1)
        assert len(got[rid]) == len(prompt) - 1
        for t, entry in enumerate(got[rid], start=1):
            assert abs(entry.logprob - ref[t - 1, prompt[t]].item()) <= 1e-3
            assert [i for i, _ in entry.top] == ref[t - 1].topk(k).indices.tolist()
            # vLLM's rank: tokens at least as likely, itself included — by the reference's values, those within the
            # logprobs' tolerance of the token's own either way
            row, own = ref[t - 1].tolist(), ref[t - 1, prompt[t]].item()
            surely_above, maybe_level = sum(v > own + 1e-3 for v in row), sum(v >= own - 1e-3 for v in row)
            assert 1 + surely_above <= entry.rank <= maybe_level, (t, entry.rank, surely_above, maybe_level)
            spread += maybe_level - surely_above - 1
    assert spread <= len(prompts[0]) + len(prompts[2]), spread
    with LLMEngine(EngineConfig(model=str(path))) as eng:
        assert [r.output_token_ids for r in eng.generate(prompts, params)] == [tokens[r] for r in rids]
