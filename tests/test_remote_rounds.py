"""Runs of chain rounds whose drafter half is queued by another party through the round mailbox
(tandem.speculative.remote_rounds on the verifier's side, drafter/chain_runs.py on the drafter's), as
the service pair queues them: here the drafter's half runs on a thread of this process over a CPU
mailbox, whose flags the hosts poll (on the GPU the streams wait on them). The tokens must be target-only
greedy decoding's, each round must verify the same chain and accept the same drafts as the in-process
runs, the drafter must end where they leave it, and a drafter that stops answering must cost
speculation only."""

from __future__ import annotations

import concurrent.futures
import os

import pytest
import torch

from drafter.chain_runs import ChainRuns
from tandem.sampling import SamplingParams
from tandem.speculative.chain_rounds import LocalDraftSide
from tandem.speculative.controlled import ControlledAcceptanceProposer
from tandem.speculative.proposer import Proposer
from tandem.speculative.remote_rounds import RemoteDraftSide
from tandem.speculative.round_mailbox import MailboxLayout, RoundMailbox
from test_chain_rounds import NEW_TOKENS, SPEC, _speculative_engine, pair  # noqa: F401 - pair is a fixture

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="runs the Triton kernels: set TRITON_INTERPRET=1 on a CPU machine")


class LoopbackDrafter(Proposer):
    """The drafter service's part, in this process: round-by-round steps go straight to ``proposer``
    (the steered drafter) once the last run is committed, and a run's Round goes through the service's
    own handling (``DrafterService._round``: its check and reply now, then — here on a thread — its
    queuing and the read-back of the run it follows)."""

    chain_runs_available = True
    deadline_s = 30.0

    def __init__(self, proposer: ControlledAcceptanceProposer, box: RoundMailbox, vocab_size: int):
        from drafter.service import DrafterService

        self.proposer, self.box, self.vocab_size = proposer, box, vocab_size
        drafter = proposer.rounds_drafter
        self.service = DrafterService(drafter, "draft", "target", drafter.head.config.hidden_size)
        self.runs = ChainRuns(box, deadline_s=self.deadline_s)
        self.next_round, self.seq = 0, 0
        self.job: concurrent.futures.Future | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.queued: list[tuple[int, bool]] = []  # (rounds, continues) per run
        self.refusals: list[str] = []
        self.discarded: list[str] = []
        self.half = "real"  # "dead": takes runs, queues nothing; "garbage": hands over garbage chains

    @property
    def steer_on_device(self):
        return self.proposer.steer_on_device

    def _caught_up(self) -> None:
        """What a Round without a run does first in the service: the last run read back and committed."""
        if self.job is not None:
            self.job.result()
            self.job = None
        if self.half == "real":
            self.runs.settle()

    def extend(self, items):
        self._caught_up()
        return self.proposer.extend(items)

    def draft(self, rids, spec):
        self._caught_up()
        return self.proposer.draft(rids, spec)

    def release(self, rid):
        self._caught_up()
        self.proposer.release(rid)

    def discard(self, reason):
        self.discarded.append(reason)

    def queue_run(self, rids, spec, rounds, continues, roots):
        from tandem.rpc.drafter.v1 import drafter_pb2 as pb

        if self.job is not None:
            self.job.result()
        run = pb.ChainRun(first_round=self.next_round, rounds=rounds, request_ids=rids, continues=continues,
                          spec=pb.SpecParams(num_steps=spec.num_steps, topk=spec.topk,
                                             num_draft_tokens=spec.num_draft_tokens))
        self.seq += 1
        reply, after_reply = self.service._round(pb.Round(seq=self.seq, chain_run=run), None, self.runs)
        assert reply.seq == self.seq and not reply.tree_sizes
        if reply.chain_run_refused and 0 < reply.chain_run_fits < rounds:  # as DrafterClient: the part that fits
            self.refusals.append(reply.chain_run_refused)
            rounds = run.rounds = reply.chain_run_fits
            self.seq += 1
            reply, after_reply = self.service._round(pb.Round(seq=self.seq, chain_run=run), None, self.runs)
        if reply.chain_run_refused:
            self.refusals.append(reply.chain_run_refused)
            return None
        first, self.next_round = self.next_round, self.next_round + rounds
        self.queued.append((rounds, continues))
        if self.half == "real":
            self.job = self.pool.submit(after_reply)
        elif self.half == "garbage":
            self.job = self.pool.submit(self._garbage, first, rounds, len(rids))
        return RemoteDraftSide(self.box, first, rounds, self.vocab_size, roots)

    def _garbage(self, first: int, rounds: int, n: int) -> None:
        """A broken drafter half: each round's rows hold NaN, huge, negative and wrong-root tokens."""
        from tandem.speculative.round_mailbox import ACCEPTED, DRAFTED

        junk = torch.tensor([float("nan"), 1e12, -5.0, float("inf"), 3.0, -1e9], dtype=torch.float64)
        for r in range(rounds):
            self.box.rows[:n].copy_(junk[torch.randint(0, len(junk), self.box.rows[:n].shape)])
            self.box.flags.write(None, DRAFTED, first + r + 1)
            self.box.flags.wait(None, ACCEPTED, first + r + 1)


def _mailbox(engine, wait_s: float) -> RoundMailbox:
    width = 3 * engine.model_config.hidden_size
    return RoundMailbox.create(MailboxLayout(4, SPEC.num_draft_tokens, width, torch.float32), "cpu", wait_s)


@pytest.fixture
def chains(monkeypatch):
    """Every chain a run's verify takes, before any steering, as the drafter half hands it over."""

    seen = {LocalDraftSide: [], RemoteDraftSide: []}  # (the remote run's drafter half is a LocalDraftSide too)
    for side in seen:
        def draft(self, real=side.draft, into=seen[side]):
            rows = real(self)
            into.append(rows[:, : SPEC.num_draft_tokens].tolist())
            return rows
        monkeypatch.setattr(side, "draft", draft)
    return seen


def _generate(eng, prompts, ref, remote: bool, half="real", first_round: int = 0):
    """Greedy generation, 4 rounds per step, steered at corruption 0.3 → (outputs, accepted drafts per
    round, the loopback or None); the loopback's round numbers from ``first_round``."""
    drafter = eng.proposer
    steered = ControlledAcceptanceProposer(drafter, 0.3, seed=7)
    box = _mailbox(eng, wait_s=1.0 if half == "dead" else 60.0) if remote else None
    eng.proposer = LoopbackDrafter(steered, box, eng.model_config.vocab_size) if remote else steered
    if remote:
        eng.proposer.half, eng.proposer.next_round = half, first_round
    eng.spec_rounds = 4
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        rids = [eng.add_request(p, params, rid=f"p{i}") for i, p in enumerate(prompts)]
        for rid, prompt, r in zip(rids, prompts, ref):
            steered.set_reference(rid, len(prompt), r + [0] * 8)
        while eng.has_unfinished():
            eng.step()
        results = [eng.requests.pop(rid) for rid in rids]
        loopback = eng.proposer if remote else None
        if remote:
            loopback._caught_up()
    finally:
        eng.proposer = drafter
        if box is not None:
            box.close()
    return [r.output for r in results], [r.spec_stats.accepted_per_round for r in results], loopback


@pytest.mark.parametrize("glue, first_round", [("torch", 0), ("fused", 2**32 - 5)])
def test_runs_with_the_drafter_half_in_another_party_emit_target_greedy_and_accept_as_in_process(pair, chains, glue,
                                                                                                 first_round,
                                                                                                 monkeypatch):
    """Steered (corruption 0.3), so that rounds accept 0..3 drafts: the mailbox then carries counts
    above one and the features of several nodes; the head's own chains, before the steering, show
    that its state follows the in-process one round after round. Both glues between the graphs: torch
    ops (the CPU's), and the GPU's fused kernels writing into the mailbox (forced under the interpreter).
    Round numbers crossing 2**32 (weeks of a verifier's uptime) go on as before it: the flags must not wrap."""
    import tandem.speculative.chain_rounds as chain_rounds

    monkeypatch.setattr(chain_rounds, "use_triton", lambda x: glue == "fused")
    root, prompts, ref = pair
    # the drafter's extend buffers sized by a prompt family whose rows (21) are no multiple of a round's width (4),
    # as served (1024 rows for 6-wide rounds)
    with _speculative_engine(root, draft_prompts=(7, 3)) as eng:
        local, accepted_local, _ = _generate(eng, prompts, ref, remote=False)
    local_chains = [list(c) for c in chains.values()]
    for c in chains.values():
        c.clear()
    with _speculative_engine(root, draft_prompts=(7, 3)) as eng:
        remote, accepted_remote, loopback = _generate(eng, prompts, ref, remote=True, first_round=first_round)
        drafter = eng.proposer
        assert drafter.allocator.num_free == drafter.allocator.capacity_pages  # every draft page back
        assert eng.allocator.num_free == eng.allocator.capacity_pages
    assert local == ref and remote == ref
    assert accepted_remote == accepted_local  # the same drafts accepted
    verified_in_process, nothing_remote = local_chains
    assert not nothing_remote and len(verified_in_process) > 4
    # the remote head drafted the chains the in-process head drafted, round after round, and the
    # verifier verified them
    assert chains[RemoteDraftSide] == verified_in_process
    assert {a for per_request in accepted_remote for a in per_request} >= {0, 1, 2}
    assert any(rounds > 1 for rounds, _ in loopback.queued)
    assert any(continues for _, continues in loopback.queued)  # runs queued after runs not read back
    assert not loopback.discarded and not loopback.refusals


@pytest.mark.parametrize("half", ["garbage", "dead"])
def test_a_drafter_half_that_is_broken_or_gone_costs_speculation_only(pair, half):
    """Garbage chains (NaN, out of the vocabulary, a wrong root) are verified as guesses; a drafter
    half that never comes is given up on (here a CPU host's wait of 1 s; on the GPU the verifier's host
    writes the flag itself). Either way the output is target-only greedy decoding's."""
    root, prompts, ref = pair
    with _speculative_engine(root) as eng:
        outputs, _, loopback = _generate(eng, prompts, ref, remote=True, half=half)
    assert outputs == ref
    assert loopback.queued  # a run was taken, and went wrong


def test_the_drafter_refuses_runs_it_cannot_take(pair):
    from tandem.rpc.drafter.v1 import drafter_pb2 as pb

    root, _, _ = pair
    with _speculative_engine(root) as eng:
        box = _mailbox(eng, wait_s=1.0)
        loopback = LoopbackDrafter(ControlledAcceptanceProposer(eng.proposer, 0.3), box, eng.model_config.vocab_size)
        try:
            assert loopback.queue_run(["unknown"], SPEC, 4, False, [1]) is None  # no draft state for it
            assert loopback.queue_run(["unknown"], SPEC, 4, True, [1]) is None  # nothing to go on after
            spec = pb.SpecParams(num_steps=3, topk=1, num_draft_tokens=4)
            run = pb.ChainRun(rounds=4, request_ids=["x"], spec=spec)
            reply, _ = loopback.service._round(pb.Round(seq=9, chain_run=run), None, None)
            assert loopback.refusals == ["the run does not fit the drafter's graphs or pages",
                                         "a run that continues must follow the last run of the same requests"]
            assert reply.chain_run_refused == "this connection has no round mailbox"
            assert loopback.next_round == 0 and not loopback.queued
        finally:
            box.close()


@pytest.mark.parametrize("failure", ["fault", "verifier gone"])
def test_a_run_that_fails_to_queue_turns_runs_off_on_the_drafter(pair, monkeypatch, failure):
    """A run the drafter accepted and then could not queue (a fault of its own: the 6-wide rounds on GPU extend
    buffers of 1024 rows) ends that connection; the next connection would meet it again, so later runs are
    refused, naming the failure, and the verifier drafts one round at a time. A verifier gone (the mailbox's wait
    timing out) is the connection's end, not the drafter's fault: runs go on being taken."""
    from drafter.chain_runs import ChainRuns
    from drafter.run_desk import RUNS_OFF_S
    from tandem.ring import HiddenRing
    from tandem.rpc.drafter.v1 import drafter_pb2 as pb
    from tandem.speculative.round_mailbox import MailboxTimeout

    def failing_queue(self, *args, **kwargs):
        raise (RuntimeError("shape '[-1, 6]' is invalid for input of size 1024") if failure == "fault"
               else MailboxTimeout("flag 1 did not reach 1 within 1 s"))

    root, _, _ = pair
    with _speculative_engine(root) as eng:
        box = _mailbox(eng, wait_s=1.0)
        loopback = LoopbackDrafter(ControlledAcceptanceProposer(eng.proposer, 0.3), box, eng.model_config.vocab_size)
        monkeypatch.setattr(ChainRuns, "check", lambda self, *args: ("", 0))
        monkeypatch.setattr(ChainRuns, "queue", failing_queue)
        try:
            assert loopback.queue_run(["x"], SPEC, 4, False, [1]) is not None  # taken ...
            with pytest.raises(RuntimeError if failure == "fault" else MailboxTimeout):
                loopback.job.result()  # ... and failed after the reply (the service closes the connection)
            loopback.job = None
            loopback.runs = ChainRuns(box)  # the verifier's next connection
            taken = loopback.queue_run(["x"], SPEC, 4, False, [1])
            if failure == "fault":
                assert taken is None and loopback.refusals == [
                    "runs of chain rounds are off on this drafter since one failed to queue (RuntimeError: shape "
                    "'[-1, 6]' is invalid for input of size 1024)"]
                desk = loopback.service.run_desk  # a connection made meanwhile still gets runs (to come back on) ...
                with HiddenRing.create(16, box.layout.feature_width, "float32") as ring:
                    layout = box.layout
                    hello = pb.Hello(ring=pb.RingSpec(**ring.spec.to_fields()), mailbox=pb.RoundMailbox(
                        storage=pb.RingSpec(**box.storage_spec.to_fields()), flags=box.flags_name,
                        max_batch=layout.max_bs, max_draft_tokens=layout.max_nd))
                    attached = desk.attach(hello, loopback.service.drafter)
                    assert attached is not None
                    attached.box.close()
                # ... refused for a while (a failure may have been transient) ...
                now = desk.clock()
                desk.clock = lambda: now + RUNS_OFF_S - 1
                assert loopback.queue_run(["x"], SPEC, 4, False, [1]) is None
                desk.clock = lambda: now + RUNS_OFF_S  # ... then taken again on the same connection
                assert loopback.queue_run(["x"], SPEC, 4, False, [1]) is not None
            else:
                assert taken is not None and not loopback.refusals
        finally:
            if loopback.job is not None:
                with pytest.raises(Exception):
                    loopback.job.result()
            box.close()


def _starved_run(pair, short_of: int, holds: int) -> tuple[list, list]:
    """One request generating through the loopback drafter service, 4 rounds a run, its head's pages taken by someone
    else after the prefill until ``short_of`` rounds no longer fit (``holds`` still do), for one step → (the runs
    queued then as (rounds, continues), the refusals). The output must be target greedy's and every page come back."""
    from tandem.sampling import SamplingParams
    from tandem.speculative.chain_rounds import drafter_rounds_fit

    root, prompts, ref = pair
    with _speculative_engine(root) as eng:
        drafter = eng.proposer
        box = _mailbox(eng, wait_s=60.0)
        loop = LoopbackDrafter(drafter, box, eng.model_config.vocab_size)
        eng.proposer, eng.spec_rounds = loop, 4
        free = eng.allocator.num_free
        try:
            rid = eng.add_request(prompts[2], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), rid="full")
            eng.step()  # the prefill (and the head's first extend)
            held = []
            while drafter_rounds_fit(drafter, [rid], SPEC, short_of):
                held += drafter.allocator.allocate(1)  # someone else's pages
            assert drafter_rounds_fit(drafter, [rid], SPEC, holds)
            eng.step()
            queued, refusals = list(loop.queued), list(loop.refusals)
            loop._caught_up()
            drafter.allocator.free(held)
            while eng.has_unfinished():
                eng.step()
            assert eng.requests.pop(rid).output == ref[2]
        finally:
            loop._caught_up()
            eng.proposer = drafter
            box.close()
        assert eng.allocator.num_free == free
    return queued, refusals


def test_a_run_the_drafter_services_pages_cannot_hold_is_shortened_too(pair):
    """In process, a run the head's pages cannot hold is shortened (rounds_ahead._run_length asks chain_rounds_fit
    for each length); with the drafter service (GPU only: the round mailbox needs a CUDA IPC ring) the verifier asked
    for the full run, the drafter refused it, the step emitted nothing and runs stayed off for REFUSED_RUN_BACKOFF_S,
    after which the same full run was asked and refused again: under a nearly full draft KV cache runs never came
    back. The drafter now says how many rounds fit, and the run is queued that long."""
    queued, refusals = _starved_run(pair, short_of=4, holds=2)
    assert queued and 1 < queued[0][0] < 4, (queued, refusals)  # a shorter run, not a step without one


def test_a_run_that_fails_part_way_has_its_queued_waits_released_when_the_connection_ends(monkeypatch):
    """A run whose queuing failed after some of its rounds were queued leaves waits on the verifier's ACCEPTED flag
    on the drafter's stream; the connection's end (ChainRuns.abandon) must release them as it does a pending run's,
    or the stream (and every later round on it) waits for ever."""
    import types

    from drafter.chain_runs import ChainRuns
    from tandem.speculative.round_mailbox import ACCEPTED

    box = RoundMailbox.create(MailboxLayout(2, 4, 8, torch.float32), "cpu", 1.0)
    try:
        runs = ChainRuns(box)
        monkeypatch.setattr(LocalDraftSide, "begin", lambda self, *args: (_ for _ in ()).throw(RuntimeError("boom")))
        drafter = types.SimpleNamespace(graphs=types.SimpleNamespace(width=4))
        with pytest.raises(RuntimeError):
            runs.queue(drafter, ["a"], SPEC, 10, 4, False)
        assert runs.pending is None and box.flags[ACCEPTED] == 0
        runs.abandon()
        assert box.flags[ACCEPTED] == 14  # every wait the run may have queued passes
    finally:
        box.close()


def test_a_continuing_run_the_drafters_pages_hold_only_in_part_is_shortened(pair):
    """A run queued behind another (continues) that the drafter's pages hold only in part: the drafter counts the
    rounds still pending in what fits, and the shorter continuing run is queued."""
    queued, _ = _starved_run(pair, short_of=6, holds=4)  # a fresh run of 4, then (overlapped) 4 more do not fit
    assert (4, False) in queued and any(continues and rounds < 4 for rounds, continues in queued), queued


def test_a_head_whose_kv_cache_holds_less_than_the_verifiers_says_so_at_the_handshake(pair, caplog):
    """The verifier's Hello says how many tokens its KV cache holds; a drafter service whose head holds fewer (its
    --max-kv-tokens: 65536 on CPU, on a GPU a share of its memory; against a GPU target's hundreds of thousands)
    warns, naming the setting."""
    import asyncio

    from drafter.service import DrafterService
    from tandem.ring import HiddenRing
    from tandem.rpc.drafter.v1 import PROTOCOL_VERSION
    from tandem.rpc.drafter.v1 import drafter_pb2 as pb

    root, _, _ = pair
    with _speculative_engine(root) as eng:
        drafter = eng.proposer
        service = DrafterService(drafter, "draft", "target", drafter.head.config.hidden_size)
        held = drafter.allocator.capacity_pages * drafter.cfg.page_size
        with HiddenRing.create(16, drafter.head.config.feature_width, "float32") as ring:
            for kv_tokens, warned in ((held, False), (held + 1, True)):
                hello = pb.Hello(protocol_version=PROTOCOL_VERSION, ring=pb.RingSpec(**ring.spec.to_fields()),
                                 target=pb.TargetInfo(model="t", kv_tokens=kv_tokens,
                                                      capture_layers=list(drafter.capture_layers)))
                caplog.clear()
                asyncio.run(service._hello(hello, None, None)).close()
                assert (f"--max-kv-tokens {held + 1}" in caplog.text) == warned, caplog.text
