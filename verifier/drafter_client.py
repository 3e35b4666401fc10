"""DrafterClient: the engine's Proposer, backed by the drafter service over one bidirectional stream.

``extend`` writes features into the shared-memory ring and queues the offsets; ``release`` queues a
request id; ``draft`` sends everything queued plus the draft requests as one Round and waits for that
round's Drafts — one message each way per round, on the round lane (a local socket agreed on at
handshake, tandem/round_lane.py) when the drafter could attach to it, else on the stream. The reply
frees the round's ring rows.

``prefetch`` sends that Round early — at the end of a step, for the requests that will most likely
draft next — and returns at once, so the drafter works while the engine finishes its step (streams
the tokens, schedules the next). The next ``draft`` then only collects the reply. Its trees are used
for the requests it covers that were neither extended nor released since (a request's tree depends
only on its draft state, which nothing else changes); the others of that ``draft`` go in a Round of
their own. At most one Round is ever in flight, so the ring's round bookkeeping is unchanged.

The drafter is optional at every moment. While it is absent ``available`` is False and the engine
decodes plainly; a reply later than the deadline, a broken stream or a dead process raises
ProposerUnavailable (the engine then drops all draft state) and a background thread reconnects
(verifier/drafter_reconnect.py). The drafter starts every connection empty, so nothing from before a
loss is ever referenced again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from tandem import internal_secret
from tandem.errors import TandemError
from tandem.ring import HiddenRing
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.speculative.remote_rounds import RemoteDraftSide
from tandem.speculative.round_mailbox import DRAFTED, RoundMailbox
from tandem.speculative.tree import DraftTree
from tandem.speculative.proposer import Proposer, ProposerUnavailable
from tandem.speculative.tree_wire import unpack_trees
from verifier.config import ROUND_FEATURE_ROWS
from verifier.drafter_connection import DrafterConnection
from verifier.drafter_reconnect import DrafterReconnector

log = logging.getLogger("verifier.drafter_client")
REFUSED_RUN_BACKOFF_S = 0.5  # after the drafter refused a run, rounds go one at a time this long
MAX_TRACES = 65536  # trace contexts kept at most (each request's is forgotten when it finishes, whatever the path)


class DrafterClient(Proposer):
    prefetches = True  # a Round sent at the end of a step is answered while the engine finishes it
    caches_prefixes = True  # the drafter service keeps its own prefix cache (attach_prefix travels in Extend.prefix)
    ships_features = True  # attached, every plain step's features travel to the service

    FLUSH_ROWS = ROUND_FEATURE_ROWS  # pending extend rows that trigger an extend-only round
    # ... and pending prefix tokens (attach_prefix: a request starting on a long cached prefix, or joining with all
    # it committed): 64 requests of 32k tokens in one Round were ~6 MB, past gRPC's default 4 MB message
    FLUSH_PREFIX_TOKENS = 262_144

    def __init__(self, address: str, ring: HiddenRing, target: pb.TargetInfo, deadline_s: float,
                 reconnect_interval_s: float = 1.0, on_state: Callable[[bool], None] = lambda up: None,
                 on_round: Callable[[float, float, pb.Drafts, str], None] = lambda round_trip_s, wait_s, drafts, kind: None,
                 round_lane: bool = True, prefetch: bool = True, mailbox: RoundMailbox | None = None,
                 secret: str | None = None):
        """``on_round(round trip, wait, drafts, kind)`` after every reply: seconds from the Round's send to
        its reply's receipt, the part of it the caller spent blocked (less when the Round was prefetched),
        the reply (the drafter's own timings), and how the Round was sent (see ``_collect``)."""
        self.address, self.ring, self.target = address, ring, target
        self.round_lane = round_lane  # offer the drafter a local socket for the rounds (tandem/round_lane.py)
        self.prefetch_rounds = prefetch  # False: prefetch() sends nothing (--disable-round-prefetch)
        # Runs of chain rounds queued on the device with the drafter (tandem.speculative.remote_rounds);
        # owned here, offered at every handshake. Round numbers never go back, across connections too.
        self.mailbox = mailbox
        self._next_round = 0
        self._runs: list[RemoteDraftSide] = []  # queued runs whose chains may not all have come yet
        self._refused_until = 0.0
        self.deadline_s, self.reconnect_interval_s = deadline_s, reconnect_interval_s
        self.on_state, self.on_round = on_state, on_round
        self._lock = threading.Lock()
        self._conn: DrafterConnection | None = None
        self._seq = 0  # the latest Round's number (never back, across connections too)
        self._connections = 0  # connections adopted so far
        self._pending_extend: list[pb.Extend] = []
        self._pending_release: list[str] = []
        self._pending_start: dict[str, pb.PrefixStart] = {}  # rides on the request's next extend
        self._prefetched: _Prefetch | None = None  # the Round in flight, sent by prefetch
        self._sent_at = 0.0  # when the last Round went out (one is in flight at most)
        self._traces: dict[str, dict[str, str]] = {}
        # Opens a connection whenever _conn is None (so _drop alone makes it reconnect); _adopt takes it.
        self._reconnector = DrafterReconnector(
            address, ring, target, mailbox, deadline_s=lambda: self.deadline_s, interval_s=reconnect_interval_s,
            offer_lane=round_lane, metadata=internal_secret.metadata(secret),  # the stream's credentials
            connected=lambda: self._conn is not None, adopt=self._adopt, on_up=lambda: self.on_state(True),
            check=self._check_alive)

    # -- connection ------------------------------------------------------------------------------
    def start(self) -> None:
        self._reconnector.start()

    def close(self) -> None:
        self._reconnector.stop()
        with self._lock:
            self._drop(None)
        if self.mailbox is not None:
            self.mailbox.close()

    @property
    def available(self) -> bool:
        return self._conn is not None

    @property
    def connection(self) -> int:
        return self._connections

    @property
    def chain_runs_available(self) -> bool:
        """Whether the drafter takes its half of runs of chain rounds queued on the device."""
        conn = self._conn
        return (conn is not None and conn.welcome.chain_runs and self.mailbox is not None
                and time.monotonic() >= self._refused_until)

    @property
    def rounds_on_lane(self) -> bool:
        """Whether the current connection's rounds go on the round lane (False: stream, or none)."""
        conn = self._conn
        return conn is not None and conn.lane is not None

    def wait_connected(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.available:
                return True
            time.sleep(0.05)
        return self.available

    def _adopt(self, conn: DrafterConnection) -> bool:
        """A new connection from the reconnector (its thread): start it with nothing queued; False when
        closed while the handshake ran."""
        with self._lock:
            if self._reconnector.stopped:
                return False
            self._conn, self._seq, self._connections = conn, self._seq + 1, self._connections + 1
            self._pending_extend.clear()
            self._pending_release.clear()
            self._pending_start.clear()
            self.ring.begin_round(self._seq)
        return True

    def _check_alive(self) -> None:
        """Drop the connection if its drafter has gone (the reconnector's thread, now and then). Skipped while the
        engine holds the lock: a round under way finds a dead drafter itself."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._conn is not None and self._prefetched is None and self._conn.gone():
                self._drop("the drafter's connection closed")
        finally:
            self._lock.release()

    def _drop(self, reason: str | None) -> None:
        """Forget the connection and everything in flight (called with the lock held); ``reason`` None: this verifier
        closes it (shutting down), not a loss."""
        if self._conn is None:
            return
        if reason is None:
            log.info("closed the connection to the drafter (shutting down)")
        else:
            log.warning("lost the drafter: %s; decoding without speculation until it is back", reason)
        conn, self._conn = self._conn, None
        self._prefetched = None
        for side in self._runs:  # no verify may wait on chains that will not come
            side.release()
        self._runs.clear()
        conn.close()
        self.ring.release_all()
        self._pending_extend.clear()
        self._pending_release.clear()
        self._pending_start.clear()
        self.on_state(False)

    # -- Proposer --------------------------------------------------------------------------------
    def note_trace(self, rid: str, carrier: dict[str, str]) -> None:
        """The request's W3C trace context, so the drafter's spans join the request's trace. Bounded: past
        MAX_TRACES the oldest goes (its drafter spans then start traces of their own)."""
        if carrier:
            self._traces[rid] = carrier
            while len(self._traces) > MAX_TRACES:
                self._traces.pop(next(iter(self._traces)), None)

    def forget_trace(self, rid: str) -> None:
        """The request finished (any way: at prefill, aborted while waiting, after a lost drafter)."""
        self._traces.pop(rid, None)

    def extend(self, items: list[tuple[str, list[int], torch.Tensor]]) -> None:
        # One request's rows go in pieces of at most FLUSH_ROWS (consecutive extends, applied in order),
        # so that no single item — a long prompt — needs more of the ring than a round may hold.
        pieces = [(rid, tokens[i : i + self.FLUSH_ROWS], features[i : i + self.FLUSH_ROWS])
                  for rid, tokens, features in items for i in range(0, len(tokens), self.FLUSH_ROWS)]
        queued = sum(e.ring_rows for e in self._pending_extend)
        prefixes = None  # prefix tokens queued, counted only once a piece carries a prefix (rare: a request's start)
        for rid, tokens, features in pieces:
            # Queued extends go out with the next draft; past FLUSH_ROWS (or FLUSH_PREFIX_TOKENS) they go first in
            # an extend-only round, so that many at once (prefills, catch-ups of held plain steps) cannot fill the
            # ring, nor the prefixes starting requests make a message too large.
            starting = len(self._pending_start[rid].token_ids) if rid in self._pending_start else 0
            if starting and prefixes is None:
                prefixes = sum(len(e.prefix.token_ids) for e in self._pending_extend)
            if queued and (queued + features.shape[0] > self.FLUSH_ROWS
                           or starting and prefixes + starting > self.FLUSH_PREFIX_TOKENS):
                self.draft([], None)
                queued, prefixes = 0, 0
            with self._lock:
                if self._conn is None:
                    raise ProposerUnavailable("the drafter is not connected")
                try:
                    offset = self.ring.allocate(features.shape[0])
                    self.ring.write(offset, features)
                except TandemError as e:  # the ring is full: the drafter is far behind
                    self._drop(str(e))
                    raise ProposerUnavailable(str(e)) from e
                self._pending_extend.append(pb.Extend(request_id=rid, token_ids=tokens, ring_offset=offset,
                                                      ring_rows=features.shape[0],
                                                      prefix=self._pending_start.pop(rid, None)))
                if self._prefetched is not None:
                    self._prefetched.changed.add(rid)
            queued += features.shape[0]
            if starting:
                prefixes += starting

    def discard(self, reason: str) -> None:
        """The engine found a tree unusable: drop this connection (the drafter starts the next one empty)."""
        with self._lock:
            self._drop(reason)

    def attach_prefix(self, rid: str, tokens: list[int]) -> None:
        """The request starts on a cached prefix (Eagle3Drafter.attach_prefix): sent with its next extend."""
        with self._lock:
            if self._conn is None:
                raise ProposerUnavailable("the drafter is not connected")
            self._pending_start[rid] = pb.PrefixStart(token_ids=tokens)

    def flush(self) -> None:
        """Send the queued releases and extends now, in a Round that drafts nothing (none when nothing is queued)."""
        if self._conn is not None and (self._pending_release or self._pending_extend):
            self.draft([], None)

    def release(self, rid: str) -> None:
        self._traces.pop(rid, None)
        with self._lock:
            self._pending_start.pop(rid, None)  # it never reached the drafter
            if self._conn is not None:
                queued = self._last_extend(rid)
                if queued is not None:  # after that extend (a Round's releases go before its extends), so that
                    # the pages the drafter caches on release include it
                    queued.release_after = True
                else:
                    self._pending_release.append(rid)
                if self._prefetched is not None:
                    self._prefetched.changed.add(rid)

    def _last_extend(self, rid: str) -> pb.Extend | None:
        """The request's last extend not sent yet (lock held)."""
        return next((e for e in reversed(self._pending_extend) if e.request_id == rid), None)

    def prefetch(self, rids: list[str], spec) -> None:
        """Send the Round for ``rids`` now (with everything queued) and return without its reply; the next
        ``draft`` collects it. Does nothing while the drafter is away or a Round is already in flight."""
        with self._lock:
            if not self.prefetch_rounds or self._conn is None or self._prefetched is not None or not rids:
                return
            self._prefetched = _Prefetch(self._send_round(rids, spec), tuple(rids), spec)

    def draft(self, rids: list[str], spec) -> list[DraftTree]:
        observed = []  # (round trip, wait, drafts, kind) per collected reply, reported outside the lock
        try:
            with self._lock:
                if self._conn is None:
                    raise ProposerUnavailable("the drafter is not connected")
                early, self._prefetched = self._prefetched, None
                covered = early.covered(rids, spec) if early is not None else set()
                rest = [r for r in rids if r not in covered]
                replies = []  # (the requests a reply drafted, in order; the reply) — the ones whose trees are used
                if early is not None:  # collected even when nothing is used: one Round in flight at most
                    reply = self._collect(early.seq, "prefetched" if covered else "prefetch_dropped", observed)
                    if covered:
                        replies.append((early.rids, reply))
                if rest or spec is None:  # what the prefetch did not cover (or an extend-only flush)
                    seq = self._send_round(rest, spec)
                    replies.append((tuple(rest), self._collect(seq, "direct" if spec is not None else "flush", observed)))
        finally:
            for round_trip, wait, drafts, kind in observed:
                self.on_round(round_trip, wait, drafts, kind)
        trees = {}
        for asked, drafts in replies:
            trees.update(zip(asked, self._unpack(drafts, len(asked))))
        return [trees[r] for r in rids]

    def queue_run(self, rids: list[str], spec, rounds: int, continues: bool, roots: list[int]) -> RemoteDraftSide | None:
        """Announce a run of ``rounds`` chain rounds of ``rids`` (``continues``: after the last one, not
        read back yet) and wait for the drafter's answer → the run's drafter half for the verifier's
        queue (of fewer rounds, ``side.rounds``, where the drafter's pages held only those), or None when the drafter
        refused it (rounds then go one at a time for a while)."""
        observed = []
        try:
            with self._lock:
                if self._conn is None:
                    raise ProposerUnavailable("the drafter is not connected")
                early, self._prefetched = self._prefetched, None
                if early is not None:  # one Round in flight at most: its trees are not used
                    self._collect(early.seq, "prefetch_dropped", observed)
                first = self._next_round
                run = pb.ChainRun(first_round=first, rounds=rounds, request_ids=rids, continues=continues,
                                  spec=_spec_params(spec))
                # The numbers are taken before the answer: a reply lost on the way (the drafter queued the run, this
                # side dropped the connection) must not have a later run reuse them, whose waits the drafter's
                # release of this one (ChainRuns.abandon) would pass at once.
                self._next_round = first + rounds
                reply = self._collect(self._send_round([], None, chain_run=run), "chain_run", observed)
                if reply.chain_run_refused and 0 < reply.chain_run_fits < rounds:  # its pages hold a shorter one
                    rounds = run.rounds = reply.chain_run_fits
                    self._next_round = first + rounds
                    reply = self._collect(self._send_round([], None, chain_run=run), "chain_run", observed)
                if reply.chain_run_refused:
                    log.debug("the drafter refused a run of %d rounds: %s", rounds, reply.chain_run_refused)
                    self._refused_until = time.monotonic() + REFUSED_RUN_BACKOFF_S
                    self._next_round = first  # (answered: nothing was queued)
                    return None
                side = RemoteDraftSide(self.mailbox, first, rounds, self.target.vocab_size, roots)
                flags_drafted = self.mailbox.flags[DRAFTED]
                self._runs = [s for s in self._runs if s.last_needed > flags_drafted] + [side]
                return side
        finally:
            for round_trip, wait, drafts, kind in observed:
                self.on_round(round_trip, wait, drafts, kind)

    def _send_round(self, rids: list[str], spec, chain_run: pb.ChainRun | None = None) -> int:
        """Send everything queued and the draft requests (or a chain run) as the next Round (lock held)
        → its seq."""
        conn = self._conn
        params = _spec_params(spec) if spec is not None else None
        seq = self._seq
        round_msg = pb.Round(seq=seq, release=self._pending_release, extend=self._pending_extend,
                             draft=[pb.DraftRequest(request_id=r, spec=params, trace_context=self._traces.get(r, {}))
                                    for r in rids], chain_run=chain_run)
        self._pending_extend, self._pending_release = [], []
        self._seq += 1
        self.ring.begin_round(self._seq)
        self.ring.publish()
        self._sent_at = time.perf_counter()
        try:
            conn.send_round(pb.VerifierMessage(round=round_msg), self.deadline_s)
        except ProposerUnavailable as e:
            self._drop(str(e))
            raise
        return seq

    def _collect(self, seq: int, kind: str, observed: list) -> pb.Drafts:
        """Wait for round ``seq``'s reply (lock held) and free its rows; appends what the round cost to
        ``observed``. ``kind``: "direct" (sent by this draft), "prefetched" (sent early, some of its
        trees used), "prefetch_dropped" (sent early, then all its requests changed) or "flush" (drafting nothing:
        queued extends and releases sent on their own). The deadline
        counts the time the engine waits, from here: a prefetched reply may have waited for the engine
        far longer (a pause in speculation), which says nothing about the drafter."""
        sent, waiting = self._sent_at, time.perf_counter()
        try:
            reply = self._conn.receive_round(self.deadline_s)
            if not reply.HasField("drafts") or reply.drafts.seq != seq:
                raise ProposerUnavailable(f"the drafter answered round {seq} out of order")
        except ProposerUnavailable as e:
            self._drop(str(e))
            raise
        self.ring.release(seq)
        now = time.perf_counter()
        observed.append((now - sent, now - waiting, reply.drafts, kind))
        return reply.drafts

    def _unpack(self, drafts: pb.Drafts, count: int) -> list[DraftTree]:
        try:
            return unpack_trees(drafts, count)
        except ValueError as e:  # a broken reply: start over on a fresh stream (the drafter then forgets every request)
            with self._lock:
                self._drop(str(e))
            raise ProposerUnavailable(str(e)) from None


def _spec_params(spec) -> pb.SpecParams:
    return pb.SpecParams(num_steps=spec.num_steps, topk=spec.topk, num_draft_tokens=spec.num_draft_tokens)


class _Prefetch:
    """A Round sent ahead of its ``draft``, and the requests whose draft state changed since."""

    def __init__(self, seq: int, rids: tuple[str, ...], spec):
        self.seq, self.rids, self.spec = seq, rids, spec
        self.changed: set[str] = set()

    def covered(self, rids: list[str], spec) -> set[str]:
        """Those of ``rids`` whose prefetched trees are the ones a Round would draft now: asked for with
        the same spec, neither extended nor released since."""
        if spec != self.spec:
            return set()
        return (set(rids) & set(self.rids)) - self.changed

