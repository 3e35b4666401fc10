"""Keeping a drafter connection: DrafterReconnector's background thread opens one (handshake included,
verifier/drafter_connection.py) whenever its owner has none, and hands it over.

The owner (DrafterClient, verifier/drafter_client.py) is the one place that says whether there is a
connection: ``connected()`` asks it, ``adopt(conn)`` gives it a new one (the owner resets its
per-connection state under its own lock, and answers False when it was closed while the handshake ran),
and dropping a connection is the owner's alone — the thread notices at its next look and opens another.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

import grpc

from tandem.ring import HiddenRing
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.rpc.drafter.v1 import PROTOCOL_VERSION
from tandem.speculative.proposer import ProposerUnavailable
from tandem.speculative.round_mailbox import RoundMailbox
from verifier.drafter_connection import DrafterConnection, LaneNotJoined

log = logging.getLogger("verifier.drafter_client")  # one logger for the verifier's whole drafter side
# Handshake refusals that retrying alone will not fix (or not soon): logged once each, as errors.
REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ALREADY_EXISTS)


class DrafterReconnector:
    def __init__(self, address: str, ring: HiddenRing, target: pb.TargetInfo, mailbox: RoundMailbox | None,
                 deadline_s: Callable[[], float], interval_s: float, offer_lane: bool, metadata: tuple,
                 connected: Callable[[], bool], adopt: Callable[[DrafterConnection], bool],
                 on_up: Callable[[], None], check: Callable[[], None] = lambda: None):
        """``deadline_s()``: the owner's round deadline, read at each attempt (a handshake gets at least
        5 s). ``adopt(conn)``: False when the owner was closed meanwhile (the connection is then closed
        here and the thread ends). ``on_up()`` after the connection was adopted and logged. ``check()`` at every look
        while connected: the owner drops a connection whose drafter has gone (one that no round uses for a while, a
        detached drafter's, would otherwise be found dead only when the next round is sent)."""
        self.address, self.ring, self.target, self.mailbox = address, ring, target, mailbox
        self.deadline_s, self.interval_s = deadline_s, interval_s
        self.offer_lane, self.metadata = offer_lane, metadata
        self.connected, self.adopt, self.on_up, self.check = connected, adopt, on_up, check
        self.last_refusal = ""  # the last refusal logged: the same one again is not
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_connected, name="drafter-connect", daemon=True)
        self._loop, self._loop_lock = asyncio.new_event_loop(), threading.Lock()  # shared by every connection

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No further connection (one whose handshake is running is closed when it ends)."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def hello(self) -> pb.VerifierMessage:
        hello = pb.VerifierMessage(hello=pb.Hello(protocol_version=PROTOCOL_VERSION,
                                                   ring=pb.RingSpec(**self.ring.spec.to_fields()), target=self.target))
        if self.mailbox is not None:  # offered at every handshake: the drafter takes its half of chain runs
            layout = self.mailbox.layout
            hello.hello.mailbox.CopyFrom(pb.RoundMailbox(storage=pb.RingSpec(**self.mailbox.storage_spec.to_fields()),
                                                         flags=self.mailbox.flags_name, max_batch=layout.max_bs,
                                                         max_draft_tokens=layout.max_nd))
        return hello

    def _keep_connected(self) -> None:
        hello = self.hello()
        while not self._stop.is_set():
            if not self.connected():
                try:
                    conn = DrafterConnection(self.address, hello, max(self.deadline_s(), 5.0), self._loop,
                                             self._loop_lock, self.offer_lane, self.metadata)
                except LaneNotJoined as e:  # the next connection offers none: rounds on the stream, not none at all
                    log.warning("the drafter at %s said it joined the round lane and did not (%s): its rounds go on "
                                "the gRPC stream from now on", self.address, e)
                    self.offer_lane = False
                    continue  # (at once: nothing is wrong with the drafter itself)
                except Exception as e:  # noqa: BLE001 - this thread must outlive any failed attempt
                    self._failed(e)
                else:
                    if not self.adopt(conn):  # closed while the handshake ran
                        conn.close()
                        return
                    log.info("connected to the drafter at %s (%s); rounds on %s", self.address, conn.welcome.draft_model,
                             "the round lane" if conn.lane is not None else "the gRPC stream")
                    self.on_up()
            else:
                try:
                    self.check()
                except Exception:  # noqa: BLE001 - this thread must outlive a failed look too
                    log.exception("checking the drafter connection")
            self._stop.wait(self.interval_s)

    def _failed(self, e: Exception) -> None:
        if not isinstance(e, ProposerUnavailable):
            log.warning("connecting to the drafter at %s failed: %s: %s", self.address, type(e).__name__, e)
        details = getattr(e, "details", "")
        if getattr(e, "status", None) in REFUSALS:  # misconfigured or taken: say it once
            if details != self.last_refusal:
                log.error("the drafter at %s refused this verifier: %s", self.address, details)
            self.last_refusal = details
        else:
            log.debug("drafter at %s not reachable: %s", self.address, e)
