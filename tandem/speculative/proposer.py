"""What the engine needs from a drafter (the head in process, or the client of the drafter service), in one
place: three calls every proposer makes, and the optional capabilities, declared here with what a proposer
without them means. The engine and the verifier call these directly; a proposer overrides what it has."""

from __future__ import annotations

from typing import Any, Callable


class ProposerUnavailable(RuntimeError):
    """The drafter cannot answer (absent, past its deadline, dead). Its state for every request is
    considered lost; the engine carries on without speculation."""


class Proposer:
    # While False, the engine neither captures features for this proposer nor asks it to draft (a drafter
    # service that is down).
    available: bool = True
    # The in-process Eagle3Drafter whose greedy chain rounds can be queued on the device
    # (tandem.engine.rounds_ahead); None: rounds go one per step on the host.
    rounds_drafter: Any = None
    # A drafter service's client that takes its half of runs of chain rounds on the device.
    chain_runs_available: bool = False
    # The controlled-acceptance instrument's steering of chain rounds on the device (benchmarks only).
    steer_on_device: Callable | None = None
    # Whether ``prefetch`` does anything (a proposer that answers later: the drafter service's client).
    prefetches: bool = False
    # Whether plain steps with it attached send it every token's features (a drafter service): they then pay for input
    # no draft may use, and plain steps with it detached may be much faster (the policy probes them sooner).
    ships_features: bool = False
    # Whether it keeps a prefix cache of its own KV (``attach_prefix``): requests on cached target pages
    # start on it; without one, such requests do not speculate.
    caches_prefixes: bool = False
    # The number of the connection behind it (a drafter service's client: each new one starts empty); the engine
    # forgets every request's draft state when it changes
    connection: int = 0

    def extend(self, items: list) -> None:
        """Per request (rid, new tokens, the target features of the tokens before them, same count)."""
        raise NotImplementedError

    def draft(self, rids: list[str], spec) -> list:
        """One DraftTree per request, rooted at the last token given to ``extend``."""
        raise NotImplementedError

    def flush(self) -> None:
        """Deliver what is queued for the proposer now (a drafter service gets releases with its next Round;
        the engine detaching it sends no Round for a while)."""

    def release_device(self) -> None:
        """The engine shuts down: drop what holds device memory in the target's graph pool (in-process drafters)."""

    def release(self, rid: str) -> None:
        """Forget a request (finished, aborted or preempted)."""
        raise NotImplementedError

    def attach_prefix(self, rid: str, tokens: list[int]) -> None:
        """Start ``rid`` on the cached KV of ``tokens`` (x_0..x_c, the target's cached prefix and the token
        after it), before its first extend (``caches_prefixes`` proposers only)."""
        raise NotImplementedError

    def discard(self, reason: str) -> None:
        """A tree this proposer returned was unusable: its state for every request is dropped, as after a loss."""

    def prefetch(self, rids: list[str], spec) -> None:
        """The requests likely to draft next step: a proposer that answers later may start on them now."""

    def guarded(self, call: Callable, *args):
        """``call(*args)``, with the proposer's recoverable failures turned into ProposerUnavailable."""
        return call(*args)

    def note_trace(self, rid: str, carrier: dict[str, str]) -> None:
        """The request's trace context, for spans on the drafter's side."""

    def forget_trace(self, rid: str) -> None:
        pass
