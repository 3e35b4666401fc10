"""EngineLoop: the thread that owns the LLMEngine and runs rounds back to back.

The gRPC handlers live on the asyncio loop; the engine (and every TP collective) lives on this one
thread. Handlers talk to it through a command queue (add, cancel) and get each request's outputs
through a callback the loop calls from this thread (the handler hops them onto asyncio). Requests
join between rounds and leave as soon as they finish or are cancelled: continuous batching.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from tandem import tracing
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.step import StepOutput
from tandem.errors import TandemError
from verifier.engine_api import EngineStopped, QueueFull, Submission, deliver_outputs
from verifier.metrics import StepTally, VerifierMetrics
from verifier.round_spans import RoundSpans
from verifier.stats_line import StatsLine

log = logging.getLogger("verifier.loop")


def _discard(built) -> None:
    """Shut down what a build made when the service went away during it: the engine (its TP ranks), the
    drafter client and the shared-memory ring."""
    engine, client, ring = built
    if client is not None:
        client.close()
    engine.shutdown()
    if ring is not None:
        ring.close()


class EngineLoop(threading.Thread):
    def __init__(self, build: Callable[[], Any], metrics: VerifierMetrics, max_waiting: int,
                 on_fatal: Callable[[BaseException], None] = lambda error: None, stats: StatsLine | None = None,
                 trace_rounds: bool = False):
        """``build()`` → ``(engine, ...)``: run first on this thread, its result in ``built`` (a Future).
        The model loads on the thread that then steps it: on CPU, torch's intra-op threads of a loading
        thread and of a stepping thread fought over the cores, and decoding slowed down."""
        super().__init__(name="engine-loop", daemon=True)
        self.metrics, self.max_waiting = metrics, max_waiting
        self._build = build
        self.on_fatal = on_fatal  # called on this thread once the loop has died (the service turns NOT_SERVING)
        self._submit_lock = threading.Lock()  # a submission either reaches a live loop or fails at once
        self.built: Future = Future()
        self.engine: LLMEngine | None = None
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[str, Submission] = {}
        self._last_token_at: dict[str, float] = {}
        self._stopping = threading.Event()
        self.spans = RoundSpans() if trace_rounds else None  # (VerifierConfig.trace_rounds)
        self.stats = stats or StatsLine(0.0, speculative=False)  # the periodic stats line (off by default)
        self._preemptions_counted = 0  # of the scheduler's total
        self._chain_switches_counted = 0  # of the engine's chain switches
        self._prefix_counted = (0, 0, 0)  # of the prefix cache's totals: queries, hits, evictions
        self.fatal: BaseException | None = None

    # -- called from other threads ---------------------------------------------------------------
    def submit(self, sub: Submission) -> Future:
        with self._submit_lock:
            if self.fatal is not None:
                sub.added.set_exception(EngineStopped.after(self.fatal))
            else:
                self._commands.put(("add", sub))
        return sub.added

    def cancel(self, rid: str, sub: Submission | None = None) -> None:
        """Abort ``rid``; with ``sub``, only if that submission is the one running under the id (the
        handler of a refused duplicate must not abort the request that holds the id)."""
        self._commands.put(("cancel", (rid, sub)))

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(("wake", None))

    # -- the thread ------------------------------------------------------------------------------
    def run(self) -> None:
        if not self.built.set_running_or_notify_cancel():  # the caller gave up before the load began
            return
        try:
            built = self._build()
        except BaseException as e:  # the caller sees it through ``built`` (a bad checkpoint, no memory)
            self.built.set_exception(e)
            return
        self.built.set_result(built)
        if self._stopping.is_set():  # stopped while loading (the service was cancelled): nobody will use it
            _discard(built)
            return
        self.engine = built[0]
        self._gauges()
        try:
            while not self._stopping.is_set():
                if not self.engine.has_unfinished():
                    self.engine.drafts.settle()  # (the last requests' releases: a reload's old head is freed now)
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # a dead loop must not leave clients waiting forever
            log.exception("engine loop failed")
            with self._submit_lock:
                self.fatal = e
            for rid, sub in list(self._live.items()):
                sub.sink(e)
                self._forget(rid)
            self._live.clear()
            while True:  # submissions queued before the end: refused, not left waiting
                try:
                    command, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command == "add" and arg.added.set_running_or_notify_cancel():
                    arg.added.set_exception(EngineStopped.after(e))
            self.on_fatal(e)

    def _drain_commands(self, block: bool) -> None:
        try:
            command, arg = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if command == "add":
                self._add(arg)
            elif command == "cancel":
                self._cancel(*arg)
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, sub: Submission) -> None:
        # The caller may have given up (its RPC cancelled) before the loop took the submission: nothing to add,
        # and its future must not be settled (a cancelled future refuses a result: that ended the loop).
        if not sub.added.set_running_or_notify_cancel():
            return
        if len(self.engine.scheduler.waiting) >= self.max_waiting:
            sub.added.set_exception(QueueFull(f"the waiting queue is full ({self.max_waiting} requests); retry later"))
            return
        try:
            self.engine.add_request(sub.prompt, sub.params, rid=sub.rid, spec=sub.spec, cache_salt=sub.cache_salt)
        except TandemError as e:
            sub.added.set_exception(e)
            return
        self._live[sub.rid] = sub
        if self.engine.proposer is not None and sub.trace_context is not None and self.spans is not None:
            self.engine.proposer.note_trace(sub.rid, tracing.inject_dict(sub.trace_context))
        self.metrics.prompt_tokens.inc(len(sub.prompt))
        sub.added.set_result(sub.rid)

    def _cancel(self, rid: str, sub: Submission | None = None) -> None:
        live = self._live.get(rid)
        if live is None or (sub is not None and live is not sub):
            return
        del self._live[rid]
        self.engine.abort(rid)
        self._forget(rid)
        self.metrics.finished("abort").inc()
        self._gauges()

    def _forget(self, rid: str) -> None:
        """What this loop and the proposer keep per request, on every way a request ends."""
        self._last_token_at.pop(rid, None)
        if self.engine is not None and self.engine.proposer is not None:
            self.engine.proposer.forget_trace(rid)

    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self.engine.step()
        now = time.perf_counter()
        info = self.engine.last_step
        m = self.metrics
        tokens = rounds = accepted = drafted = 0
        if info is not None:
            m.batch_size.observe(info.num_prefill + info.num_decode)
            for phase, (start_ns, end_ns) in info.spans.items():
                m.phase(phase).observe((end_ns - start_ns) / 1e9)
        delivered = []  # (sink, output) of this step, delivered together at its end
        tally = StepTally()
        try:
            for out in outputs:
                sub = self._live.get(out.rid)
                if sub is None:
                    continue
                self._observe(out, sub, now, tally)
                tokens += len(out.new_token_ids)
                rounds += len(out.round_accepts) if out.drafted else 0
                accepted += out.accepted if out.drafted else 0
                drafted += out.drafted
                if info is not None and self.spans is not None:
                    self.spans.record(sub.trace_context, info, out)
                delivered.append((sub.sink, out))
                if out.finish_reason is not None:
                    self._live.pop(out.rid, None)
                    self._forget(out.rid)
                    self.engine.requests.pop(out.rid, None)
                    m.finished(out.finish_reason.value).inc()
        finally:  # (what the step finished is counted and goes out even where a later output's bookkeeping raised:
            try:  # the loop's end then fails only the requests still live; counted first, so that a scrape after a
                tally.flush(m)  # stream's end counts its tokens)
            finally:
                deliver_outputs(delivered)
        self._count_preemptions()
        self._count_prefix_cache()
        self.stats.step(now, now - started, tokens, rounds, accepted, bool(info is not None and info.speculative),
                        decoded=info is None or bool(info.num_decode), drafted=drafted,
                        run=info.steps if info is not None else 1, plain_reason=self.engine.plain_reason,
                        queued_ahead=bool(info is not None and info.queued_ahead))
        switches = self.engine.chain.switches
        self.stats.chain_switched(switches - self._chain_switches_counted)
        self._chain_switches_counted = switches
        self._gauges()
        if self.stats.due(now):
            engine = self.engine
            self.stats.maybe_log(now, len(engine.scheduler.running), len(engine.scheduler.waiting),
                                 self._kv_usage(), engine.drafts.up(), engine.drafts.detached)

    def _count_preemptions(self) -> None:
        """The step's preemptions: the scheduler's total since the last step's."""
        new = self.engine.scheduler.preemptions - self._preemptions_counted
        if new:
            self._preemptions_counted += new
            self.metrics.preemptions.inc(new)
            self.stats.preempted(new)

    def _count_prefix_cache(self) -> None:
        """The step's prefix-cache lookups and evictions: the cache's totals since the last step's."""
        cache = self.engine.prefix_cache
        if cache is None:
            return
        now = (cache.stats.queries, cache.stats.hits, cache.stats.evictions)
        m = self.metrics
        for counter, new, old in zip((m.prefix_cache_queries, m.prefix_cache_hits, m.prefix_cache_evictions),
                                     now, self._prefix_counted):
            if new > old:
                counter.inc(new - old)
        self._prefix_counted = now

    def _kv_usage(self) -> float:
        allocator = self.engine.allocator
        return 1.0 - allocator.num_free / allocator.capacity_pages if allocator.capacity_pages else 0.0

    def _gauges(self) -> None:
        m, engine = self.metrics, self.engine
        m.running.set(len(engine.scheduler.running))
        m.waiting.set(len(engine.scheduler.waiting))
        m.kv_pages_free.set(engine.allocator.num_free)
        m.kv_pages_capacity.set(engine.allocator.capacity_pages)
        m.kv_usage.set(self._kv_usage())
        m.drafter_detached.set(1 if engine.drafts.detached else 0)

    def _observe(self, out: StepOutput, sub: Submission, now: float, tally: StepTally | None = None) -> None:
        """An output's latencies now, its counts into the step's ``tally`` (the metrics at once without one)."""
        m = self.metrics
        last = self._last_token_at.get(out.rid)
        if last is None:
            m.ttft.observe(now - sub.submitted_at)
        elif out.new_token_ids:
            m.itl.observe((now - last) / len(out.new_token_ids), len(out.new_token_ids))  # (each token's gap)
        self._last_token_at[out.rid] = now
        if tally is None:
            tally = StepTally()
            tally.add(out)
            tally.flush(m)
        else:
            tally.add(out)
