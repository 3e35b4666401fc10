"""StepChain: the chain the engine's speculating requests draft now, where the policy shortens it at batch.

Requests on the engine's default speculation setting draft what the policy picks for the running batch
(``SpeculationPolicy.chain_spec``: the configured chain or a shorter one, tandem.speculative.chain_depth). The
pick is written into each such request's ``spec``, so that drafting, verify widths, runs of rounds and acceptance
read one setting; it changes only between runs of rounds: while one is in flight the pick waits (``wanted``), and
no further run of the old chain is queued behind it (``settled``). A request with a setting of its own keeps it.
"""

from __future__ import annotations

from tandem.speculative.chain_depth import chain_ladder


class StepChain:
    def __init__(self):
        self._default = None  # the engine's default SpecConfig this was synced to
        self._ladder: frozenset = frozenset()  # the chains a default request may be switched between
        self.current = None  # what default requests draft now
        self.wanted = None  # what the policy picked last (differs from current while a run of rounds is in flight)
        self.switches = 0  # changes of the chain default requests draft (each ends a queued run of rounds)

    def for_new_request(self, default_spec):
        """The setting a request on the engine's default starts with: the chain in use."""
        self._sync(default_spec)
        return self.current

    def use(self, spec, default_spec, requests, now: bool = True) -> None:
        """From now on default requests (among ``requests()``: the running and waiting ones; asked only on a change)
        draft ``spec``; not ``now`` (a run of rounds in flight): once the run is read back."""
        self._sync(default_spec)
        self.wanted = spec
        if spec == self.current or not now:
            return
        self.current = spec
        self.switches += 1
        for req in requests():
            if req.spec in self._ladder:
                req.spec = spec

    def settled(self, spec) -> bool:
        """Whether a run of rounds drafting ``spec`` may be followed by another: the policy still picks it (or it is
        not a default request's chain)."""
        return self.wanted is None or spec == self.wanted or spec not in self._ladder

    def _sync(self, default_spec) -> None:
        if default_spec is not self._default:  # (set after the engine is built, by whoever gives it a proposer)
            self._default, self.current, self.wanted = default_spec, default_spec, None
            self._ladder = frozenset(chain_ladder(default_spec)) if default_spec is not None else frozenset()
