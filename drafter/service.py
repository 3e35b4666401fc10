"""The drafter's gRPC surface: one bidirectional Rounds stream from the verifier.

Hello → check the target the verifier runs against the one this head was validated for, attach the
ring, start empty → Welcome. Then each Round: forget released requests, extend with the ring rows
named in the message, draft the requested trees → exactly one Drafts. When the verifier offers a
round lane (tandem/round_lane.py) and it is reachable, the Rounds arrive there instead of on the
stream, which then only keeps the connection alive. The round runs inline on the
event loop (a thread hand-off per round cost more than the round's own host work); health checks and
Reload wait for the round boundary, a few milliseconds. Each stream starts empty: the verifier never
refers to state from before a reconnect.

The internal plane is closed (docs/architecture.md, "Contracts"): with a secret configured
(tandem.internal_secret), Rounds and Reload without it are UNAUTHENTICATED. One verifier stream at a time:
a second one is refused with ALREADY_EXISTS instead of taking the drafter away from the serving verifier. A
verifier whose stream died (its process killed, its connection cut) is not locked out: its end of the stream
ends the handler (TCP closes, or the server's keepalive finds the peer gone), and a new stream waits briefly
for that.

Reload loads another checkpoint for the same target beside the serving head (DraftHeads): new
requests draft with it, running ones finish on theirs. Nothing is dropped, and a checkpoint that does
not fit the verifier's stream is refused with FAILED_PRECONDITION while serving goes on. Only folders
below the reload root load (PERMISSION_DENIED otherwise), and filesystem errors go to the log, never
back to the caller.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import grpc
from google.protobuf.message import DecodeError

from tandem import tracing
from tandem.errors import TandemError
from tandem.ring import HiddenRingView, RingSpec
from tandem.round_lane import AsyncLane, LaneError
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.rpc.drafter.v1 import PROTOCOL_VERSION
from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
from tandem.speculative.spec_config import SpecConfig
from tandem.speculative.tree import DraftTree, resolve_pending
from tandem.speculative.tree_wire import pack_trees
from drafter.chain_runs import ChainRuns
from drafter.run_desk import RunDesk, nothing
from drafter.guard import InternalPlaneGuard
from drafter.heads import DraftHeads
from drafter.metrics import DrafterMetrics
from drafter.profiling import RoundProfiler
from drafter.verifier_watch import VerifierWatch

log = logging.getLogger("drafter.service")
SERVICE = "tandem.rpc.drafter.v1.Drafter"
LANE_CONNECT_S = 2.0


class DrafterService:
    def __init__(self, drafter: Eagle3Drafter, draft_model: str, target_model: str, target_hidden: int,
                 runtime: DrafterConfig = DrafterConfig(), graph_specs: tuple = (), lane_busy_poll_s: float = 0.0,
                 profiler: RoundProfiler | None = None, secret: str | None = None, reload_root: str | None = None,
                 metrics: DrafterMetrics | None = None, watch: VerifierWatch | None = None):
        """``secret``: what Rounds and Reload must present (None: nothing, a loopback-only drafter);
        ``reload_root``: Reload loads folders below it only (default: the starting head's parent); ``watch``: told
        when a verifier's stream says Hello and when it ends (--exit-without-verifier-s)."""
        self.watch = watch
        self.heads = DraftHeads(drafter, draft_model)
        self.guard = InternalPlaneGuard(secret, reload_root or os.path.dirname(os.path.abspath(draft_model)))
        self.lane_busy_poll_s = lane_busy_poll_s  # spin this long for the next Round (DrafterServiceConfig)
        self.profiler = profiler or RoundProfiler(0, None)  # --profile-rounds
        self.target_model, self.target_hidden = target_model, target_hidden
        self.runtime, self.graph_specs = runtime, graph_specs
        self._lock = asyncio.Lock()  # one stream drives the model at a time
        self._reload_lock = asyncio.Lock()  # one reload at a time
        self._generation = 0  # of verifier streams (not of heads)
        self.run_desk = RunDesk()  # runs of chain rounds, over every connection
        self.metrics = metrics or DrafterMetrics()  # recorded always; served with --metrics-port
        self.metrics.watch_prefix_cache(lambda: self.heads.current.prefix_cache.stats)
        self.metrics.watch_shed(lambda: self.heads.current.shed.total)

    @property
    def drafter(self) -> Eagle3Drafter:
        """The head new requests draft with."""
        return self.heads.current

    async def Rounds(self, requests, context: grpc.aio.ServicerContext):
        await self.guard.authenticate(context)
        ended = await self.guard.claim_stream()
        if ended is None:
            log.warning("refused a second Rounds stream from %s while a verifier is connected", context.peer())
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                "another verifier is connected to this drafter (one stream at a time)")
        try:
            async for message in self._rounds(requests, context):
                yield message
        finally:
            ended.set()

    async def _rounds(self, requests, context: grpc.aio.ServicerContext):
        self._generation += 1
        generation = self._generation
        ring: HiddenRingView | None = None
        runs: ChainRuns | None = None  # the connection's runs of chain rounds, when it offered a mailbox
        lane_task: asyncio.Task | None = None
        said_hello = False
        watched = False  # this stream counted as a connected verifier (VerifierWatch)
        try:
            async for message in requests:
                if generation != self._generation:
                    await context.abort(grpc.StatusCode.ABORTED, "a newer verifier stream replaced this one")
                if message.HasField("hello"):
                    if said_hello:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "one Hello per stream")
                    said_hello = True
                    async with self._lock:
                        ring = await self._hello(message.hello, context, ring)
                        runs = self.run_desk.attach(message.hello, self.drafter)
                    self.metrics.verifier_connected.set(1)
                    if self.watch is not None:
                        self.watch.connected()
                        watched = True
                    lane = await _attach_lane(message.hello)
                    if lane is not None:
                        lane_task = asyncio.create_task(self._serve_lane(lane, ring, runs, generation))
                    yield pb.DrafterMessage(welcome=pb.Welcome(protocol_version=PROTOCOL_VERSION,
                                                               draft_model=self.heads.current_model,
                                                               draft_vocab_size=self.drafter.head.config.draft_vocab_size,
                                                               round_lane=lane is not None, chain_runs=runs is not None))
                elif ring is None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "send Hello before the first Round")
                else:
                    async with self._lock:
                        drafts, after_reply = self._round(message.round, ring, runs)
                    yield pb.DrafterMessage(drafts=drafts)
                    async with self._lock:
                        after_reply()
                    self.profiler.round_done()
        finally:
            if said_hello and generation == self._generation:  # (a newer stream keeps it connected)
                self.metrics.verifier_connected.set(0)
            if watched:  # (a Hello refused never counted as a verifier)
                self.watch.disconnected()
            if lane_task is not None:  # the stream is the connection's lifeline: its end ends the lane
                lane_task.cancel()
                await asyncio.gather(lane_task, return_exceptions=True)
            if runs is not None:  # nothing of this connection may wait on its verifier any more
                runs.abandon()
                runs.box.close()
            if ring is not None:
                ring.close()

    async def _serve_lane(self, lane: AsyncLane, ring: HiddenRingView, runs: ChainRuns | None, generation: int) -> None:
        """The rounds of one connection, on its round lane: the same Round in, the same Drafts out.
        Whatever ends it closes the lane, which the verifier sees at once (and reconnects)."""
        try:
            while True:
                if self.lane_busy_poll_s > 0:
                    await asyncio.sleep(0)  # the loop's other work (the stream, health) runs between rounds
                    lane.spin_until_readable(self.lane_busy_poll_s)
                frame = await lane.receive()
                if frame is None:
                    break
                if generation != self._generation:
                    log.warning("round lane: a newer verifier stream replaced this one")
                    return
                message = pb.VerifierMessage.FromString(frame)
                if not message.HasField("round"):
                    raise LaneError(f"expected a Round on the round lane, got {message.WhichOneof('body')}")
                async with self._lock:
                    drafts, after_reply = self._round(message.round, ring, runs)
                await lane.send(pb.DrafterMessage(drafts=drafts).SerializeToString())
                async with self._lock:
                    after_reply()  # a run's queuing, once the verifier has its answer
                self.profiler.round_done()  # after the reply: starting or ending a trace takes seconds
        except asyncio.CancelledError:
            raise
        except (LaneError, DecodeError, ConnectionError) as e:
            log.warning("round lane closed: %s", e)
        except Exception:  # noqa: BLE001 - a failed round ends this connection, as on the stream
            log.exception("a round on the round lane failed; closing the lane (the verifier reconnects)")
        finally:
            lane.close()

    async def _hello(self, hello: pb.Hello, context, old_ring: HiddenRingView | None) -> HiddenRingView:
        if hello.protocol_version != PROTOCOL_VERSION:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"protocol version {hello.protocol_version}; this drafter speaks {PROTOCOL_VERSION}")
        expected = tuple(self.drafter.capture_layers or ())
        got = tuple(hello.target.capture_layers)
        if expected and got != expected:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the verifier captures target layers {list(got)} but this EAGLE-3 head needs {list(expected)}")
        width = self.drafter.head.config.feature_width
        if hello.ring.row_width != width:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the verifier sends {hello.ring.row_width}-wide features but this EAGLE-3 head takes "
                                f"{width} (3 x {self.target_hidden}); is it the draft for this target?")
        try:  # read-only: the drafter never writes the verifier's ring
            ring = HiddenRingView.attach(RingSpec.from_fields(hello.ring), writable=False)
        except TandemError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if old_ring is not None:
            old_ring.close()
        self.heads.release_all()
        log.info("verifier connected (target %s, ring %s, %d rows)", hello.target.model, hello.ring.name, hello.ring.num_rows)
        held = self.drafter.allocator.capacity_pages * self.drafter.cfg.page_size
        if hello.target.kv_tokens > held:
            log.warning("the verifier's KV cache holds %d tokens, this head's %d: under load its oldest entries go "
                        "first, requests draft from rebuilt ones and runs of rounds are shortened (--max-kv-tokens %d "
                        "matches the verifier)", hello.target.kv_tokens, held, hello.target.kv_tokens)
        return ring

    def _round(self, round_msg: pb.Round, ring: HiddenRingView, runs: ChainRuns | None = None):
        """→ (the reply, what to do once it is sent)."""
        started = time.perf_counter()
        if runs is not None and not (round_msg.HasField("chain_run") and round_msg.chain_run.continues):
            runs.settle()  # the last run read back and committed before anything reads the state
        kind = "chain_run" if round_msg.HasField("chain_run") else "drafts"
        reply = self._chain_run(round_msg, ring, runs) if kind == "chain_run" else (self._drafts(round_msg, ring), nothing)
        self.metrics.rounds.labels(kind).inc()
        self.metrics.round_seconds.labels(kind).observe(time.perf_counter() - started)
        return reply

    def _chain_run(self, round_msg: pb.Round, ring: HiddenRingView, runs: ChainRuns | None):
        """A Round's releases and extends (it drafts no trees), then its run checked, answered and queued (RunDesk)."""
        self._release_and_extend(round_msg, ring)
        return self.run_desk.take(round_msg.seq, round_msg.chain_run, runs, self.heads)

    def _release_and_extend(self, round_msg: pb.Round, ring: HiddenRingView) -> None:
        """A Round's releases, then its extends (before any draft or run reads the state). An extend may
        start its request on a cached prefix first, and release it after."""
        for rid in round_msg.release:
            self.heads.release(rid)
        if round_msg.extend:
            self.metrics.extend_tokens.inc(sum(len(e.token_ids) for e in round_msg.extend))
            ring.wait_ready()
            # Plain steps between drafts queue several extends of one request: apply them in order, in
            # waves where each request appears once (one packed forward per wave and head).
            waves: list[dict[int, list]] = []
            starts: dict[int, list] = {}  # wave -> extends that start their request on a cached prefix
            after: dict[int, list] = {}  # wave -> extends that release their request after
            seen: dict[str, int] = {}
            for e in round_msg.extend:  # a request's k-th extend goes to wave k: per-request order is kept
                k = seen.get(e.request_id, 0)
                seen[e.request_id] = k + 1
                if k == len(waves):
                    waves.append({})
                gen, _ = self.heads.for_request(e.request_id)
                if e.HasField("prefix"):
                    starts.setdefault(k, []).append((gen, e))
                if e.release_after:
                    after.setdefault(k, []).append(e)
                waves[k].setdefault(gen, []).append(
                    (e.request_id, list(e.token_ids), ring.read(e.ring_offset, e.ring_rows, copy=False)))
            for k, wave in enumerate(waves):
                for gen, items in wave.items():
                    drafter = self.heads.drafter(gen)
                    for start_gen, e in starts.get(k, ()):
                        if start_gen == gen:
                            drafter.attach_prefix(e.request_id, list(e.prefix.token_ids))
                    drafter.extend(items)
                for e in after.get(k, ()):
                    self.heads.release(e.request_id)

    def _drafts(self, round_msg: pb.Round, ring: HiddenRingView) -> pb.Drafts:
        started = time.perf_counter()
        self._release_and_extend(round_msg, ring)
        drafts = pb.Drafts(seq=round_msg.seq, extend_seconds=time.perf_counter() - started)
        by_spec: dict[tuple[int, SpecConfig], list[tuple[int, pb.DraftRequest]]] = {}
        drafted: list[DraftTree | None] = [None] * len(round_msg.draft)  # by position in the Round
        for i, d in enumerate(round_msg.draft):
            spec = SpecConfig(d.spec.num_steps, d.spec.topk, d.spec.num_draft_tokens)
            by_spec.setdefault((self.heads.for_request(d.request_id)[0], spec), []).append((i, d))
        for (gen, spec), group in by_spec.items():
            # (a request whose verifier traces no rounds sends no context: no span, rather than a root of its own)
            spans = [tracing.start_span("drafter.draft", parent=tracing.extract(dict(d.trace_context)),
                                        attributes={"tandem.request_id": d.request_id,
                                                    "tandem.num_draft_tokens": spec.num_draft_tokens},
                                        tracer="tandem.drafter") for _, d in group if d.trace_context]
            try:
                trees = self.heads.drafter(gen).draft([d.request_id for _, d in group], spec)
                resolve_pending(trees)  # trees leave the process: no token may stay on the device
            finally:
                for span in spans:
                    span.end()
            for (i, _), tree in zip(group, trees):
                drafted[i] = tree
        self.metrics.trees.inc(len(drafted))
        pack_trees(drafts, drafted)  # in the Round's order
        drafts.draft_seconds = time.perf_counter() - started
        return drafts

    async def Reload(self, request: pb.ReloadRequest, context: grpc.aio.ServicerContext) -> pb.ReloadReply:
        await self.guard.authenticate(context)
        if not request.draft_model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "draft_model: name the EAGLE-3 folder to load")
        folder = self.guard.below_root(request.draft_model)
        if folder is None:  # the same answer whether it exists or not: the caller learns nothing of the disk
            log.warning("reload of %r refused: not a folder below the reload root %s", request.draft_model,
                        self.guard.reload_root)
            self.metrics.reloads.labels("refused").inc()
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,  # (the root is the operator's setting, named)
                                f"draft_model: not an EAGLE-3 folder below this drafter's reload root "
                                f"{self.guard.reload_root} (--reload-root)")
        async with self._reload_lock:
            started = time.perf_counter()
            log.info("reload: loading %s beside generation %d", folder, self.heads.generation)
            try:  # validation and loading run beside serving
                drafter = await asyncio.to_thread(self._load, folder)
            except (TandemError, OSError, ValueError, RuntimeError) as e:  # RuntimeError: out of memory
                self.metrics.reloads.labels("refused").inc()
                await _refuse_reload(context, request.draft_model, e, folder)
            async with self._lock:
                # Graph capture must not overlap other work on the GPU, so drafting pauses for it (GPU only;
                # ~1.5 s at the 8B shape: a verifier whose deadline is shorter decodes plainly meanwhile,
                # reconnects, and recomputes its long running requests, which then draft with the new head).
                if self.graph_specs:
                    try:
                        await asyncio.to_thread(drafter.capture_cuda_graphs, list(self.graph_specs))
                    except RuntimeError as e:
                        self.metrics.reloads.labels("refused").inc()
                        await _refuse_reload(context, request.draft_model, e, folder)
                left = self.heads.install(drafter, request.draft_model)
                self.run_desk.failed = None  # (a new head, new graphs: runs are tried again)
            seconds = time.perf_counter() - started
            self.metrics.reloads.labels("loaded").inc()
            log.info("reload: generation %d (%s) drafts new requests; %d running requests finish on the previous "
                     "head (%.2f s)", self.heads.generation, request.draft_model, left, seconds)
            return pb.ReloadReply(draft_model=request.draft_model, generation=self.heads.generation,
                                  requests_on_previous=left, load_seconds=seconds)

    def _load(self, draft_model: str) -> Eagle3Drafter:
        """Validate and load, sharing the serving head's copy of the target embedding. Validation against
        the serving head's capture layers is what the verifier's stream needs: the same target (hence
        feature width) and the same layers, or a one-line refusal naming both."""
        serving = self.heads.current
        return Eagle3Drafter.from_dirs(draft_model, self.target_model, self.runtime, serving.capture_layers,
                                       embed_weight=serving.head.shared_embedding)


async def _attach_lane(hello: pb.Hello) -> AsyncLane | None:
    """Connect to the round lane the verifier offered, if any and if reachable from here."""
    if not hello.round_lane:
        return None
    try:
        lane = await asyncio.wait_for(AsyncLane.connect(hello.round_lane, hello.round_lane_token), LANE_CONNECT_S)
    except (OSError, LaneError, asyncio.TimeoutError) as e:  # another network namespace, say: stay on the stream
        log.info("round lane %s not reachable (%s); rounds stay on the gRPC stream", hello.round_lane, e)
        return None
    log.info("rounds on the round lane %s", hello.round_lane)
    return lane


async def _refuse_reload(context: grpc.aio.ServicerContext, draft_model: str, error: Exception, folder: str) -> None:
    """The checkpoint's own validation (a TandemError: other layers, other width) is the caller's to read,
    naming the folder as the caller did (not where it resolved to); anything else (a filesystem error,
    out of memory) stays in the log."""
    log.error("reload of %s (%s) refused: %s: %s", draft_model, folder, type(error).__name__, error)
    if isinstance(error, TandemError) and not isinstance(error, OSError):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"the checkpoint does not fit: {str(error).replace(folder, draft_model)}")
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the checkpoint could not be loaded (see the drafter's log)")
