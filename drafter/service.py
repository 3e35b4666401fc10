"""The drafter's gRPC surface: one bidirectional Rounds stream from the verifier.

Hello → check the target the verifier runs against the one this head was validated for, attach the
ring, start empty → Welcome. Then each Round: forget released requests, extend with the ring rows
named in the message, draft the requested trees → exactly one Drafts. The model work runs on a
worker thread so health checks keep answering during a long round. A new stream (the verifier
reconnecting) replaces the old one and starts empty again: the verifier never refers to state from
before a reconnect.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from tandem import tracing
from tandem.errors import TandemError
from tandem.ring import HiddenRingView, RingSpec
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.speculative.drafter import Eagle3Drafter, SpecConfig

log = logging.getLogger("drafter.service")
PROTOCOL_VERSION = 1
SERVICE = "tandem.rpc.drafter.v1.Drafter"


class DrafterService:
    def __init__(self, drafter: Eagle3Drafter, draft_model: str, target_hidden: int):
        self.drafter, self.draft_model, self.target_hidden = drafter, draft_model, target_hidden
        self._lock = asyncio.Lock()  # one stream drives the model at a time
        self._generation = 0

    async def Rounds(self, requests, context: grpc.aio.ServicerContext):
        self._generation += 1
        generation = self._generation
        ring: HiddenRingView | None = None
        try:
            async for message in requests:
                if generation != self._generation:
                    await context.abort(grpc.StatusCode.ABORTED, "a newer verifier stream replaced this one")
                if message.HasField("hello"):
                    async with self._lock:
                        ring = await self._hello(message.hello, context, ring)
                    yield pb.DrafterMessage(welcome=pb.Welcome(protocol_version=PROTOCOL_VERSION,
                                                               draft_model=self.draft_model,
                                                               draft_vocab_size=self.drafter.head.config.draft_vocab_size))
                elif ring is None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "send Hello before the first Round")
                else:
                    async with self._lock:
                        drafts = await asyncio.to_thread(self._round, message.round, ring)
                    yield pb.DrafterMessage(drafts=drafts)
        finally:
            if ring is not None:
                ring.close()

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
        try:
            ring = HiddenRingView.attach(RingSpec.from_fields(hello.ring))
        except TandemError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        if old_ring is not None:
            old_ring.close()
        self.drafter.release_all()
        log.info("verifier connected (target %s, ring %s, %d rows)", hello.target.model, hello.ring.name, hello.ring.num_rows)
        return ring

    def _round(self, round_msg: pb.Round, ring: HiddenRingView) -> pb.Drafts:
        started = time.perf_counter()
        for rid in round_msg.release:
            self.drafter.release(rid)
        if round_msg.extend:
            ring.wait_ready()
            # Plain steps between drafts queue several extends of one request: apply them in order, in
            # waves where each request appears once (one packed forward per wave).
            waves: list[list] = []
            seen: dict[str, int] = {}
            for e in round_msg.extend:  # a request's k-th extend goes to wave k: per-request order is kept
                k = seen.get(e.request_id, 0)
                seen[e.request_id] = k + 1
                if k == len(waves):
                    waves.append([])
                waves[k].append((e.request_id, list(e.token_ids), ring.read(e.ring_offset, e.ring_rows, copy=False)))
            for wave in waves:
                self.drafter.extend(wave)
        drafts = pb.Drafts(seq=round_msg.seq)
        by_spec: dict[SpecConfig, list[pb.DraftRequest]] = {}
        for d in round_msg.draft:
            spec = SpecConfig(d.spec.num_steps, d.spec.topk, d.spec.num_draft_tokens)
            by_spec.setdefault(spec, []).append(d)
        for spec, group in by_spec.items():
            spans = [tracing.start_span("drafter.draft", parent=tracing.extract(dict(d.trace_context)),
                                        attributes={"tandem.request_id": d.request_id,
                                                    "tandem.num_draft_tokens": spec.num_draft_tokens},
                                        tracer="tandem.drafter") for d in group]
            try:
                trees = self.drafter.draft([d.request_id for d in group], spec)
            finally:
                for span in spans:
                    span.end()
            for d, tree in zip(group, trees):
                drafts.trees.append(pb.Tree(request_id=d.request_id, token_ids=tree.tokens, parents=tree.parents,
                                            scores=tree.scores))
        drafts.draft_seconds = time.perf_counter() - started
        return drafts
