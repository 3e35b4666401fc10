"""Requests admitted while the drafter was detached join it when it attaches again (DraftLink.join_running):
from their committed tokens, whose draft entries the drafter rebuilds from zero features, then each step's
features. They speculate for the rest of their generation instead of decoding plainly to their end, every token
is still the target's, the drafter's entries keep pace with the target's KV, and — on the shipped demo pair,
whose head really accepts — a joined request accepts about as much as one drafted from its prompt on."""

from __future__ import annotations

import pytest

import torch

from draft_checkpoints import draft_inputs, pair_drafter, pair_engine
from helpers import random_prompt
from test_drafter_attachment import Clock
from tandem.sampling import SamplingParams
from tandem.speculative.attachment import AttachmentConfig, DrafterAttachment
from tandem.speculative.spec_config import SpecConfig

LONG = SamplingParams(max_new_tokens=72, ignore_eos=True)  # past the 32 tokens a join needs to go
SHORT = SamplingParams(max_new_tokens=20, ignore_eos=True)


def _target_only(pair, prompts) -> list[list[int]]:
    """The target's own greedy tokens for ``prompts`` (the reference every joined request must reproduce)."""
    with pair_engine(pair, page_size=4) as eng:
        return [r.output_token_ids for r in eng.generate(prompts, LONG)]


def _started(eng, prompts, steps: int = 4) -> list[str]:
    """``prompts`` added and ``steps`` steps run: requests speculating mid-generation."""
    rids = [eng.add_request(p, LONG) for p in prompts]
    for _ in range(steps):
        eng.step()
    return rids


def _record_attaches(eng) -> dict:
    """rid -> the tokens the engine attached it on (``attach_prefix``), recorded as they pass to the drafter."""
    attached, attach_prefix = {}, eng.proposer.attach_prefix
    eng.proposer.attach_prefix = lambda rid, tokens: attached.setdefault(rid, list(tokens)) and attach_prefix(rid, tokens)
    return attached


@pytest.mark.parametrize("cache", [True, False])
def test_requests_prefilled_while_detached_join_the_drafter_once_it_attaches_again(pair, cache):
    prompts = [random_prompt(740 + i, 9 + 3 * i) for i in range(4)]
    params = [SHORT, LONG, LONG, SHORT]
    with pair_engine(pair, page_size=4, enable_prefix_caching=cache) as eng:
        reference = [eng.generate([p], sp)[0].output_token_ids for p, sp in zip(prompts, params)]
    clock = Clock()
    with pair_engine(pair, SpecConfig(3, 1, 4), page_size=4, enable_prefix_caching=cache) as eng:
        eng.attachment = DrafterAttachment(AttachmentConfig(detach_after_s=0.0, detach_after_steps=2,
                                                            detached_first_s=5.0, ready_timeout_s=1e9), clock)
        speculate = [False]
        eng.policy.decide = lambda batch, drafting, runs=None: bool(drafting) and speculate[0]
        first = eng.add_request(prompts[0], params[0])
        while not eng.attachment.detached:
            eng.step()
        late = [eng.add_request(p, sp) for p, sp in zip(prompts[1:], params[1:])]  # prefilled while detached
        for _ in range(6):
            eng.step()
        assert all(eng.requests[r].output and not eng.requests[r].follows_drafter for r in late)
        speculate[0] = True
        attached = _record_attaches(eng)
        clock.now += 5.0
        eng.step()  # the detached period is over: attached again; the join is made at the next step
        assert not eng.attachment.detached
        committed = {r: eng.requests[r].tokens for r in late}
        eng.step()  # the first step with features: held for the joined requests' first drafts
        joined = [r for r in late if eng.requests[r].params is LONG]
        assert [r for r in late if eng.requests[r].follows_drafter] == joined  # short ones have < 32 tokens to go
        assert not attached  # made with the first extend, right before the first draft
        checked = set()
        while eng.has_unfinished():
            eng.step()
            for r in joined:
                req = eng.requests[r]
                if req.spec_stats.rounds and not req.finished and not req.pending_extend and r not in checked:
                    # the drafter's entries pair token t+1 with the target's feature at t: one fewer than tokens
                    assert eng.proposer.num_tokens(r) == req.num_tokens - 1
                    checked.add(r)
        got = [eng.requests[r].output for r in [first, *late]]
        rounds = {r: eng.requests[r].spec_stats.rounds for r in late}
    assert got == reference
    assert checked == set(joined)
    assert attached == {r: committed[r] for r in joined}  # on every token committed when it joined
    assert all(rounds[r] > 0 for r in joined) and all(rounds[r] == 0 for r in late if r not in joined)


def test_after_the_drafter_is_lost_and_back_running_requests_join_it_without_a_recompute(pair):
    """A lost drafter (every draft state dropped) that comes back: the long running requests join it from their
    committed tokens; the target computes no token twice (no prefill after the prompts), and output is the target's."""
    prompts = [random_prompt(780 + i, 10 + 2 * i) for i in range(3)]
    reference = _target_only(pair, prompts)
    with pair_engine(pair, SpecConfig(3, 1, 4), page_size=4) as eng:
        rids = _started(eng, prompts)
        starts = []  # the KV each forward's sequences start on: a recompute starts on none
        forward = eng.executor.forward
        eng.executor.forward = lambda batch, *a, **k: starts.extend(c.prefix_len for c in batch.seqs) or forward(batch, *a, **k)
        eng.proposer.available = False
        eng.drafts.lost(RuntimeError("the drafter went away"))
        eng.step()
        eng.step()
        assert not any(eng.requests[r].follows_drafter for r in rids)
        committed = {r: eng.requests[r].tokens for r in rids}
        rounds = {r: eng.requests[r].spec_stats.rounds for r in rids}
        attached = _record_attaches(eng)
        eng.proposer.release_all()  # a restarted drafter knows nothing
        eng.proposer.available = True  # back: the next step's start joins them
        while eng.has_unfinished():
            eng.step()
        got = [eng.requests[r].output for r in rids]
        again = {r: eng.requests[r].spec_stats.rounds - rounds[r] for r in rids}
    assert got == reference
    assert attached == committed and all(again[r] > 0 for r in rids)
    assert starts and min(starts) >= min(len(p) for p in prompts)  # nothing recomputed


@pytest.mark.parametrize("down_steps", [0, 2])
def test_a_drafter_connection_made_again_is_joined_not_drafted_from_state_it_lacks(pair, down_steps):
    """The drafter client can drop a connection whose drafter went and make the next one while no round ran (between
    two steps, or with steps seeing it down meanwhile): no lost() told the engine, which drafted its running requests
    on a drafter that had never seen them. A new connection number makes it forget their draft state; they join it,
    and output is the target's."""
    prompts = [random_prompt(790 + i, 12 + 2 * i) for i in range(2)]
    reference = _target_only(pair, prompts)
    with pair_engine(pair, SpecConfig(3, 1, 4), page_size=4) as eng:
        rids = _started(eng, prompts)
        attached = _record_attaches(eng)
        eng.proposer.available = False  # (the client dropped it: the reconnector waits a second before the next)
        for _ in range(down_steps):
            eng.step()
        committed = {r: eng.requests[r].tokens for r in rids}
        eng.proposer.release_all()  # the new drafter knows nothing ...
        eng.proposer.connection = 7  # ... behind a new connection
        eng.proposer.available = True
        while eng.has_unfinished():
            eng.step()
        got = [eng.requests[r].output for r in rids]
    assert got == reference
    assert attached == committed


def test_a_joined_request_drafts_about_as_well_as_one_drafted_from_its_prompt():
    """The shipped demo pair, greedy, float32: requests that join after 48 plain tokens accept, over their later
    rounds, at least 0.9 of what the same requests accept over the same positions drafted from the start."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.speculative_setup import speculative_engine
    from tandem.training import demo
    from tandem.training.demo_pair import demo_eval_prompts
    from proposers import always_speculate

    target, draft = str(demo.SHIPPED / "target"), str(demo.SHIPPED / "draft")
    prompts, join_at = demo_eval_prompts(target)[:6], 48
    params = SamplingParams(max_new_tokens=144, ignore_eos=True)

    def tau_from(req, start: int, plain: int) -> float:
        """Tokens per round over the rounds that began at output ``start`` or later, the first ``plain`` tokens
        made without rounds."""
        made, kept = plain, []
        for accepted in req.spec_stats.accepted_per_round:
            if made >= start:
                kept.append(accepted + 1)
            made += accepted + 1
        return sum(kept) / len(kept)

    taus, outputs = {}, {}
    for joins in (False, True):
        with speculative_engine(EngineConfig(model=target), draft, SpecConfig(3, 1, 4),
                                policy=always_speculate()) as eng:
            if joins:
                eng.attachment.hold_detached()
            reqs = [eng.requests[eng.add_request(p, params)] for p in prompts]
            plain = {r.rid: 1 for r in reqs}  # (a prompt's step makes the first token)
            if joins:
                while any(len(r.output) < join_at for r in reqs):
                    eng.step()
                assert not any(r.spec_stats.rounds for r in reqs)
                plain = {r.rid: len(r.output) for r in reqs}
                eng.attachment.reset()  # attached again, as after a detached period
                eng.drafts.joins_due = True
            while eng.has_unfinished():
                eng.step()
            taus[joins] = sum(tau_from(r, join_at, plain[r.rid]) for r in reqs) / len(reqs)
            outputs[joins] = [r.output for r in reqs]
    assert outputs[True] == outputs[False]
    assert taus[False] > 2.5 and taus[True] >= 0.9 * taus[False], taus


def test_entries_found_in_no_cached_page_are_rebuilt_in_the_next_extend_as_an_extend_of_zero_features(pair, monkeypatch):
    import tandem.speculative.drafter as drafter_module

    """attach_prefix of two requests, then one extend of both: their entries equal those of a drafter extended with
    zero features for the prefix, then the same features (its own API, one request at a time), their next drafts
    too; the two rebuilds share one forward of the head, the extend another — and with a smaller cap on a rebuild's
    forward, the rebuilds go in pieces within it, to the same entries."""
    spec = SpecConfig(3, 2, 6)
    inputs = [draft_inputs(760 + i, n) for i, n in enumerate((23, 30))]  # (tokens, features) of each request
    joined_at = (15, 9)  # tokens committed when each joined: entries 0..n-2 are rebuilt
    reference = pair_drafter(pair)
    for i, ((tokens, feats), n) in enumerate(zip(inputs, joined_at)):
        reference.extend([(f"r{i}", tokens[1:n], torch.zeros(n - 1, feats.shape[1]))])
        reference.extend([(f"r{i}", tokens[n:], feats[n - 1 : -1])])
    for cap in (8192, 6):
        monkeypatch.setattr(drafter_module, "REBUILD_TOKENS", cap)
        drafter = pair_drafter(pair)
        rows = []
        drafter.head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
        for i, ((tokens, _), n) in enumerate(zip(inputs, joined_at)):
            assert drafter.attach_prefix(f"r{i}", tokens[:n]) == 0  # nothing cached: all rebuilt
        drafter.extend([(f"r{i}", tokens[n:], feats[n - 1 : -1])
                        for i, ((tokens, feats), n) in enumerate(zip(inputs, joined_at))])
        rebuilt = sum(n - 1 for n in joined_at)
        extended = sum(len(tokens) - n for (tokens, _), n in zip(inputs, joined_at))
        assert rows[-1] == extended and sum(rows[:-1]) == rebuilt
        assert len(rows) == 2 if cap == 8192 else max(rows[:-1]) <= cap
        for i, (tokens, _) in enumerate(inputs):
            assert drafter.num_tokens(f"r{i}") == reference.num_tokens(f"r{i}") == len(tokens) - 1
            torch.testing.assert_close(_entries(drafter, f"r{i}"), _entries(reference, f"r{i}"), rtol=1e-5, atol=1e-6)
        got, want = drafter.draft(["r0", "r1"], spec), reference.draft(["r0", "r1"], spec)
        assert [(t.tokens, t.parents) for t in got] == [(t.tokens, t.parents) for t in want]


def _entries(drafter, rid: str) -> torch.Tensor:
    """The head's committed KV of ``rid`` in entry order: [k/v, entries, heads, dim]."""
    state = drafter.request_states([rid])[0]
    slots = torch.tensor([state.kv.slot(t) for t in range(state.kv.num_tokens)])
    return drafter.kv.data.flatten(2, 3)[:, 0].index_select(1, slots)


def test_overlapped_decode_runs_stop_for_a_join(pair, monkeypatch):
    """Decode runs queued one after another (the static graph path: what CUDA graphs run) go on from the device while
    the batch stays the same, without features once detached: a lone request that started detached would never join.
    Due to join, the run after the one read back is not queued; it joins, speculates, and its output is the target's."""
    import tandem.attention.graph_backend as graph_backend
    from helpers import TorchGraphBackend
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.speculative_setup import speculative_engine
    from proposers import always_speculate

    prompt = random_prompt(800, 11)
    with LLMEngine(EngineConfig(model=str(pair.target_dir), page_size=4)) as plain:
        reference = plain.generate([prompt], LONG)[0].output_token_ids
    monkeypatch.setattr(graph_backend, "make_graph_backend", lambda latent: TorchGraphBackend())
    cfg = EngineConfig(model=str(pair.target_dir), page_size=4, static_graph_path=True, decode_steps=4,
                       cuda_graph_max_bs=2, prefill_graph_tokens=16, prefill_graph_max_bs=2)
    with speculative_engine(cfg, str(pair.draft_dir), SpecConfig(3, 1, 4), policy=always_speculate()) as engine:
        engine.attachment.hold_detached()
        rid = engine.add_request(prompt, LONG)
        while len(engine.requests[rid].output) < 12:
            engine.step()
        assert engine.run_in_flight is not None  # runs overlap
        engine.attachment.reset()  # attached again (the engine's "attach" change)
        engine.drafts.joins_due = True
        while engine.has_unfinished():
            engine.step()
        req = engine.requests[rid]
        assert req.output == reference
        assert req.spec_stats.rounds > 0
