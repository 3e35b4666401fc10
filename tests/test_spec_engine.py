"""The engine's speculative round, checked independently of any draft model.

Verification must be lossless whatever the proposer drafts: greedy output equals target-only greedy
decoding (itself checked against transformers in test_hf_parity), and sampled output keeps the
target's exact distribution (computed here from transformers' own logits).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from scipy.stats import chisquare

from checkpoints import write_checkpoint
from helpers import target_only_greedy, torch_prompts
from proposers import RandomTreeProposer, Spec, always_speculate
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling import SamplingParams, adjusted_probs
from tandem.speculative.tree import DraftTree, PendingTokens


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "llama"
    hf = write_checkpoint(path, "llama", seed=3, num_hidden_layers=3)
    return path, hf


@pytest.fixture(scope="module")
def reference_outputs(target):
    """Target-only greedy continuations (the oracle) for a fixed set of prompts."""
    path, _ = target
    prompts = torch_prompts(0, (5, 13, 21, 34, 40, 3))
    return prompts, target_only_greedy(path, prompts, 48, page_size=4)


def test_target_only_reference_matches_transformers(target, reference_outputs):
    _, hf = target
    prompts, outputs = reference_outputs
    for prompt, out in list(zip(prompts, outputs))[:2]:
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=48, min_new_tokens=48, do_sample=False)
        assert out == ref[0, len(prompt):].tolist()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree_size=st.integers(2, 16), seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 3, 4, 16]),
       hit_rate=st.floats(0.0, 1.0), shuffle=st.booleans())
def test_greedy_speculation_is_token_identical(target, reference_outputs, tree_size, seed, page_size, hit_rate, shuffle):
    path, _ = target
    prompts, expected = reference_outputs
    oracle = {f"r{i}": p + e for i, (p, e) in enumerate(zip(prompts, expected))}
    proposer = RandomTreeProposer(vocab=256, seed=seed, oracle=oracle, hit_rate=hit_rate)
    cfg = EngineConfig(model=str(path), page_size=page_size, page_shuffle_seed=seed if shuffle else None)
    with LLMEngine(cfg, proposer=proposer, spec=Spec(tree_size)) as eng:
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=48, ignore_eos=True), rid=f"r{i}")
                for i, p in enumerate(prompts)]
        while eng.has_unfinished():
            eng.step()
        got = [eng.requests[r].output for r in rids]
        stats = [eng.requests[r].spec_stats for r in rids]
        assert eng.allocator.num_free == eng.allocator.capacity_pages, "every page comes back"
    assert got == expected
    assert all(s.rounds > 0 for s in stats)
    if hit_rate > 0.5 and tree_size > 2:
        assert max(s.accept_length_mean for s in stats) > 1.0  # the oracle's tokens were accepted
    assert sorted(proposer.released) == sorted(rids)


def test_perfect_oracle_chain_accepts_everything(target, reference_outputs):
    """A chain that always holds the true continuation is accepted whole: tree size tokens per round."""
    path, _ = target
    prompts, expected = reference_outputs

    class ChainOracle(RandomTreeProposer):
        def _tree(self, rid, size):
            from tandem.speculative.tree import DraftTree

            full, pos = self.oracle[rid], len(self.tokens[rid])
            return DraftTree.chain(full[pos], full[pos + 1 : pos + size])

    oracle = {f"r{i}": p + e + [0] * 16 for i, (p, e) in enumerate(zip(prompts, expected))}
    with LLMEngine(EngineConfig(model=str(path)), proposer=ChainOracle(256, oracle=oracle), spec=Spec(5),
                   policy=always_speculate()) as eng:
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=41, ignore_eos=True), rid=f"r{i}")
                for i, p in enumerate(prompts)]
        while eng.has_unfinished():
            eng.step()
        for rid, exp in zip(rids, expected):
            req = eng.requests[rid]
            assert req.output == exp[:41]
            # 1 token from prefill, then 8 rounds of 5 tokens = 41
            assert req.spec_stats.accepted_per_round == [4] * 8
            assert req.spec_stats.acceptance_by_position == [1.0] * 4


def _exact_joint(hf, prompt, params, steps):
    """P(first `steps` tokens) under the target with the request's sampling adjustments."""
    joint = {}
    vocab = hf.config.vocab_size
    for seq in itertools.product(range(vocab), repeat=steps):
        joint[seq] = 1.0
    with torch.no_grad():
        for seq in list(joint):
            p = 1.0
            for k in range(steps):
                logits = hf(torch.tensor([prompt + list(seq[:k])])).logits[0, -1:]
                p *= adjusted_probs(logits, [params])[0, seq[k]].item()
                if p == 0.0:
                    break
            joint[seq] = p
    return joint


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=4, max_new_tokens=2, ignore_eos=True),
    SamplingParams(temperature=1.2, top_p=0.7, max_new_tokens=2, ignore_eos=True),
], ids=["t1", "topk", "topp"])
def test_sampling_speculation_keeps_target_distribution(tmp_path, params):
    path = tmp_path / "tiny_vocab"
    hf = write_checkpoint(path, "llama", seed=5, num_hidden_layers=2, vocab_size=6)
    prompt = [1, 4, 2, 5, 3]
    n = 3000
    proposer = RandomTreeProposer(vocab=6, seed=1)
    with LLMEngine(EngineConfig(model=str(path), seed=7), proposer=proposer, spec=Spec(4)) as eng:
        results = eng.generate([prompt] * n, SamplingParams(**{**params.__dict__, "seed": None}))
    counts: dict[tuple, int] = {}
    for r in results:
        key = tuple(r.output_token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    exact = _exact_joint(hf, prompt, params, 2)
    assert all(exact[k] > 0 for k in counts), "a token with zero target probability was emitted"
    cells = [k for k in exact if exact[k] * n >= 5]
    observed = [counts.get(k, 0) for k in cells]
    expected = [exact[k] * n for k in cells]
    rest_obs, rest_exp = n - sum(observed), n - sum(expected)
    if rest_exp >= 1:
        observed.append(rest_obs)
        expected.append(rest_exp)
    scale = sum(observed) / sum(expected)
    p_value = chisquare(observed, [e * scale for e in expected]).pvalue
    assert p_value > 1e-3, f"speculative samples do not follow the target distribution (p={p_value:.2e})"
    assert any(r.spec_stats.rounds for r in results)


@pytest.mark.parametrize("tree_size", [2, 4, 8])
def test_seeded_sampled_requests_give_target_onlys_tokens_whether_or_not_they_speculate(target, tree_size):
    """A seeded sampled request's tokens are those target-only sampling gives it — one step at a time or in
    queued runs of steps — when its steps speculate (chains and trees, drafts accepted or not, beside other
    requests): each token draws the uniform of its place in the sequence on every path."""
    path, _ = target
    prompts = torch_prompts(5, (7, 19, 30))
    params = [SamplingParams(temperature=t, top_p=top_p, seed=seed, max_new_tokens=40, ignore_eos=True)
              for t, top_p, seed in ((1.0, 1.0, 3), (0.7, 0.9, 11), (1.3, 1.0, 12))]
    with LLMEngine(EngineConfig(model=str(path), page_size=4)) as eng:
        plain = [r.output_token_ids for r in eng.generate(prompts, params)]
    with LLMEngine(EngineConfig(model=str(path), page_size=4, decode_steps=4)) as eng:
        runs = [r.output_token_ids for r in eng.generate(prompts, params)]
    oracle = {f"r{i}": p + e for i, (p, e) in enumerate(zip(prompts, plain))}
    proposer = RandomTreeProposer(vocab=256, seed=tree_size, oracle=oracle, hit_rate=0.7)
    with LLMEngine(EngineConfig(model=str(path), page_size=4), proposer=proposer, spec=Spec(tree_size),
                   policy=always_speculate()) as eng:
        rids = [eng.add_request(p, params[i], rid=f"r{i}") for i, p in enumerate(prompts)]
        while eng.has_unfinished():
            eng.step()
        speculated = [eng.requests[r].output for r in rids]
        stats = [eng.requests[r].spec_stats for r in rids]
    assert runs == plain
    assert speculated == plain
    assert all(s.rounds > 0 for s in stats) and max(s.accept_length_mean for s in stats) > 1.5


class BrokenTrees(RandomTreeProposer):
    """Drafts like RandomTreeProposer, except that one round returns an unusable tree of ``kind``."""

    def __init__(self, kind: str, **kwargs):
        super().__init__(**kwargs)
        self.kind, self.calls, self.discarded = kind, 0, []

    def draft(self, rids, spec):
        trees = super().draft(rids, spec)
        self.calls += 1
        self.trees_drafted = getattr(self, "trees_drafted", 0) + len(trees)
        if self.calls == 3:
            t = trees[0]
            if self.kind == "root":  # e.g. trees returned in another request's order
                t.tokens[0] = (t.tokens[0] + 1) % 256
            elif self.kind == "size":  # more nodes than the step reserved KV for
                trees[0] = type(t)(t.tokens + [5] * spec.num_draft_tokens, t.parents + list(range(t.size - 1, t.size - 1 + spec.num_draft_tokens)))
            elif self.kind == "vocabulary":  # a token id the target's embedding does not have
                t.tokens[-1] = 10**6
            else:  # "nan": a chain left on the device (as the graphed head leaves it) whose log-probs are NaN
                n = spec.num_draft_tokens
                ids = torch.tensor([t.tokens[0]] + [7] * (n - 1))  # what the verify reads: garbage tokens
                flags = torch.zeros(3 * n + 1, dtype=torch.float64)
                flags[3 * n] = 1.0  # the NaN flag the draft graph sets
                trees[0] = DraftTree([t.tokens[0]] + [-1] * (n - 1), list(range(-1, n - 1)), [],
                                     PendingTokens(ids, flags))
        return trees

    def discard(self, reason):
        self.discarded.append(reason)


@pytest.mark.parametrize("kind", ["root", "size", "vocabulary"])
def test_an_unusable_tree_costs_speculation_not_the_step(target, reference_outputs, kind):
    """A drafter bug (or a broken reply) must not fail requests: the engine drops the drafter's state,
    tells the proposer (the service client then reconnects), and decodes on; outputs stay target-only
    greedy."""
    path, _ = target
    prompts, expected = reference_outputs
    proposer = BrokenTrees(kind, vocab=256, seed=1)
    with LLMEngine(EngineConfig(model=str(path), page_size=4), proposer=proposer, spec=Spec(4)) as eng:
        out = eng.generate(prompts[:3], SamplingParams(max_new_tokens=48, ignore_eos=True))
    assert [o.output_token_ids for o in out] == expected[:3]
    assert len(proposer.discarded) == 1 and proposer.calls == 3  # dropped once; these requests then decode plainly


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_chain_found_nan_after_its_verify_costs_that_request_its_speculation(target, reference_outputs,
                                                                                temperature):
    """An in-process head leaves a chain's tokens on the device for the verify; a NaN shows only when
    the verify has read them. That request takes the root's token (a plain step: no round counted, no
    draft token emitted, whatever garbage the nodes held) and decodes on without speculation, its draft
    state released; the other requests keep drafting. Greedy: outputs stay target-only; sampled: every
    token is a real one."""
    path, _ = target
    prompts, expected = reference_outputs
    proposer = BrokenTrees("nan", vocab=256, seed=1)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True, temperature=temperature, seed=5)
    always = always_speculate()  # random drafts would soon turn the batch plain
    with LLMEngine(EngineConfig(model=str(path), page_size=4), proposer=proposer, spec=Spec(4), policy=always) as eng:
        out = eng.generate(prompts[:3], params)
    if temperature == 0.0:
        assert [o.output_token_ids for o in out] == expected[:3]
    assert all(0 <= t < 256 for o in out for t in o.output_token_ids)
    assert sum(o.spec_stats.rounds for o in out) == proposer.trees_drafted - 1  # the broken one is no round
    # the third draft call broke the first request's chain: two rounds, then plain; the others went on
    assert sorted(o.spec_stats.rounds for o in out)[0] == 2 and sorted(o.spec_stats.rounds for o in out)[1] >= 4
    assert proposer.calls > 3 and not proposer.discarded, "the others kept drafting; nothing was dropped wholesale"
