"""DraftLink: the engine's side of the drafter's per-request state.

The proposer (an in-process Eagle3Drafter, or the client of the drafter service) holds draft KV for
each request; this keeps it in step with the target: extends after every step (plain steps' tokens
wait on the request and go in one extend before its next draft), drafts, releases, and recovers from
a drafter that is lost (every request continues plainly) and comes back (long requests join it again:
``join_running``). It never changes the target's output.

With the prefix cache, every request starts on the drafter with ``attach_prefix`` and the tokens its prompt
found cached (``attach``; while the batch decodes plainly, deferred to its first extend): the drafter takes
its own cached pages for them and keeps the request's pages as they fill. A proposer without that
capability gets no draft state for a request on a cached prefix: it decodes plainly.
"""

from __future__ import annotations

import logging

import torch

from tandem.speculative.tree import DraftTree
from tandem.speculative.proposer import ProposerUnavailable

log = logging.getLogger("tandem.engine")
# a drafter that comes back, or attaches again, takes the running requests with at least this many tokens to go
JOIN_MIN_TOKENS_LEFT = 32
# Features a request may hold for the drafter (plain steps, a plain-starting prompt) before they are
# sent anyway: ~340 rows of an 8B target's (3 x 4096 bf16), whole prompts of a small one; and all
# requests together (device memory outside the KV budget).
PENDING_LIMIT_BYTES = 8 << 20
PENDING_TOTAL_LIMIT_BYTES = 512 << 20
# A plain step that had to send more held tokens than this is left out of the step times: the price of
# having held them, not of the step.
UNTIMED_CATCH_UP_TOKENS = 16


class DraftLink:
    def __init__(self, engine):
        """``engine``: the LLMEngine (its ``proposer`` may be replaced at any time; read it here)."""
        self.engine = engine
        self._was_up = True
        self._connection: int | None = None  # the proposer's connection number seen at the last step
        self.held_bytes = 0  # features held by all requests (see hold)
        self.joins_due = False  # attached again: running requests join the drafter (join_running)

    @property
    def proposer(self):
        return self.engine.proposer

    def up(self) -> bool:
        return self.proposer is not None and self.proposer.available

    @property
    def detached(self) -> bool:
        """The engine detached the drafter from a batch kept plain (tandem.speculative.attachment): no request
        keeps draft state, none starts on it, nothing is captured for it."""
        return self.engine.attachment.detached

    def keeping(self) -> bool:
        """Whether the target's steps capture EAGLE-3 features for the drafter: it is up and attached."""
        return self.up() and not self.detached

    def detach(self, reqs: list) -> None:
        """On detaching: release the requests' draft state, held input dropped (they decode plainly until they join
        again: join_running);
        a drafter service gets the releases now, not with a Round that may be a detached period away."""
        self.joins_due = False
        self.forget_all(reqs, complete=False)
        self.settle()

    def settle(self) -> None:
        """A drafter service gets what is queued for it now, where no Round may come for a while (detached, or nothing
        running): the last requests' releases would otherwise wait for it, keeping a reloaded drafter's previous head."""
        if self.up():
            try:
                self.proposer.flush()
            except ProposerUnavailable as e:
                self.lost(e)

    def extend(self, items: list) -> None:
        """``items``: (request, next tokens, their features); a request's deferred attach is made first."""
        if not items or not self.up():
            return
        try:
            for req, _, _ in items:
                if req.attach_at is not None:
                    cached, req.attach_at = req.attach_at, None
                    self.proposer.attach_prefix(req.rid, req.tokens[: cached + 1])
            self.proposer.extend([(req.rid, tokens, feats) for req, tokens, feats in items])
        except ProposerUnavailable as e:
            self.lost(e)
            return
        for req, _, _ in items:
            req.draft_ready = True

    def _caching(self) -> bool:
        """Whether requests start on the drafter's prefix cache (the engine caches, the proposer can)."""
        return self.engine.prefix_cache is not None and self.proposer.caches_prefixes

    def completes(self, finishing: bool) -> bool:
        """Whether a request released now first sends the drafter what it holds (forget_all): with the prefix
        cache, a preempted one always, a finishing one only while the batch speculates."""
        return self.up() and self._caching() and (self.engine.speculating or not finishing)

    def attach(self, req, cached: int) -> bool:
        """Before a request's first extend after its prompt started on ``cached`` tokens of cached target KV:
        start the drafter on the same prefix (its own cached pages for those tokens). → whether the
        request's features may go to the drafter. While the batch decodes plainly the start is deferred to
        the request's first extend (``Request.attach_at``): a request that never drafts costs the drafter
        nothing, not even a lookup or the zero-feature rebuild of pages it lacks."""
        if self.detached:
            return False
        if not self._caching() or not self.up():
            return cached == 0  # without the head's KV of the prefix the request does not speculate
        if not self.engine.speculating:
            req.attach_at, req.draft_ready = cached, True  # its features are held until then
            return True
        try:
            self.proposer.attach_prefix(req.rid, req.tokens[: cached + 1])
        except ProposerUnavailable as e:
            self.lost(e)
            return False
        req.draft_ready = True  # it holds draft state now (forget releases it)
        return True

    def join_running(self) -> int:
        """After the drafter attached again or came back (``joins_due``), the running requests without draft state — admitted
        while it was detached or down — start on it too, where they have JOIN_MIN_TOKENS_LEFT to go: on all their
        committed tokens (``Request.attach_at``), whose entries the drafter rebuilds from zero features since it
        never saw theirs (or finds in its prefix cache), then their next steps' features, held for their first
        draft. Drafts over such entries accept less, output is exact either way; without a join they would
        decode plainly to their end. Called between runs only: a run queued while detached goes on without
        features, and the join must start at the first step that has them. → requests joined."""
        if not self.joins_due:
            return 0
        self.joins_due = False
        if not self.keeping() or not self.proposer.caches_prefixes:
            return 0
        joined = 0
        for req in self.engine.scheduler.running:
            left = req.params.max_new_tokens - len(req.output)
            if (req.spec is not None and req.output and not req.finished and not req.follows_drafter
                    and left >= JOIN_MIN_TOKENS_LEFT):
                req.attach_at = req.num_tokens - 1  # its last token's KV and feature come with its next step
                joined += 1
        return joined

    def _may_hold(self, req, features: torch.Tensor) -> bool:
        """Whether the request may hold ``features`` too (PENDING_LIMIT_BYTES, and all requests' total);
        if so they are counted as held."""
        size = features.numel() * features.element_size()
        if (not self.up() or req.pending_bytes + size > PENDING_LIMIT_BYTES
                or self.held_bytes + size > PENDING_TOTAL_LIMIT_BYTES):
            return False
        req.pending_bytes += size
        self.held_bytes += size
        return True

    def keep_in_step(self, items: list, owned: bool = False) -> bool:
        """Plain steps' (request, tokens, features): held for each request's next draft, or, past the
        limits, sent now with what it held; → whether what was sent was a catch-up (UNTIMED_CATCH_UP_TOKENS).
        What is held is copied (graph outputs are overwritten), items of one shape in one copy — unless ``owned``:
        the features are the columns of a tensor no later step writes (a queued run's own), all of them given, held as
        they are where all are held (a view keeps the whole tensor alive): attached plain runs were a fifth slower than
        detached ones at batch 8 on the demo pair (bench/detached_plain.py), the copy's stack and views a share of it."""
        held, now = [], []
        for req, tokens, feats in items:
            if self._may_hold(req, feats):
                held.append((req, tokens, feats))
            else:
                now.append(self.take_pending(req, tokens, feats))
        copies = [feats for _, _, feats in held] if owned and not now else _copied([feats for _, _, feats in held])
        for (req, tokens, _), copy in zip(held, copies):
            req.pending_extend.append((tokens, copy))
            req.draft_ready = True  # the drafter will have its state (the held extend goes first)
        self.extend(now)
        return any(len(tokens) > UNTIMED_CATCH_UP_TOKENS for _, tokens, _ in now)

    def _drop_held(self, req) -> None:
        self.held_bytes -= req.pending_bytes
        req.pending_extend, req.pending_bytes = [], 0

    def take_pending(self, req, tokens: list[int] = (), features: torch.Tensor | None = None):
        """→ (request, all held tokens [+ tokens], their features) as one extend item; clears what is held."""
        held = [*req.pending_extend, *([(list(tokens), features)] if features is not None else [])]
        self._drop_held(req)
        return req, [t for toks, _ in held for t in toks], torch.cat([f for _, f in held])  # (contiguous: a copy)

    def flush_pending(self, reqs: list) -> None:
        """Catch the drafter up on the plain steps of requests about to draft, in one extend; their held features
        joined in one copy (a resume at batch 64 held a dozen pieces a request: one concatenation each was a
        launch each, on the host's clock)."""
        reqs = [req for req in reqs if req.pending_extend]
        if not reqs:
            return
        pieces = [f for req in reqs for _, f in req.pending_extend]
        joined = torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()  # (a held column is a strided view)
        items, start = [], 0
        for req in reqs:
            tokens = [t for toks, _ in req.pending_extend for t in toks]
            items.append((req, tokens, joined[start:start + len(tokens)]))
            start += len(tokens)
            self._drop_held(req)
        self.extend(items)

    def draft(self, decoding: list, tree_width) -> dict[str, DraftTree]:
        """A tree per decoding request: drafted for those that speculate this step, the bare root otherwise."""
        trees = {req.rid: DraftTree([req.last_token], [-1]) for req in decoding}
        by_spec: dict[object, list] = {}
        for req in decoding:
            if req.spec is not None and req.draft_ready and tree_width(req) > 1:
                by_spec.setdefault(req.spec, []).append(req)
        drafted = {}
        try:
            for spec, group in by_spec.items():
                for req, tree in zip(group, self.proposer.draft([r.rid for r in group], spec)):
                    problem = self._unusable(req, tree, tree_width(req))
                    if problem is not None:  # a broken proposer must not break the step: as after a loss
                        self.proposer.discard(problem)
                        raise ProposerUnavailable(problem)
                    drafted[req.rid] = tree
        except ProposerUnavailable as e:
            self.lost(e)
            return trees
        return trees | drafted

    def prefetch(self, tree_width) -> None:
        """At the end of a step, ask a proposer that can answer later (the drafter service's client) for
        the trees of the requests that will most likely draft next step — those running that speculate
        now, with nothing held — so the drafter works while the engine finishes this step. Draft uses
        them if the guess holds (DrafterClient.prefetch); one spec only (the common case)."""
        if not self.up() or not self.proposer.prefetches:
            return
        by_spec: dict[object, list[str]] = {}
        for req in self.engine.scheduler.running:
            if not req.pending_extend and tree_width(req) > 1:
                by_spec.setdefault(req.spec, []).append(req.rid)
        if len(by_spec) != 1:
            return
        ((spec, rids),) = by_spec.items()
        try:
            self.proposer.prefetch(rids, spec)
        except ProposerUnavailable as e:
            self.lost(e)

    def _unusable(self, req, tree: DraftTree, width: int) -> str | None:
        """Why ``tree`` cannot be verified for ``req`` (None: it can): another root, more nodes than the
        step reserved KV for, a token outside the target's vocabulary."""
        if tree.tokens[0] != req.last_token:
            return f"draft tree of {req.rid} is rooted at {tree.tokens[0]}, not at its last token {req.last_token}"
        if tree.size > width:
            return f"draft tree of {req.rid} has {tree.size} nodes; the round has room for {width}"
        lowest = -1 if tree.pending is not None else 0  # -1: a token still on the device (in-process chains)
        if min(tree.tokens) < lowest or max(tree.tokens) >= self.engine.model_config.vocab_size:
            return f"draft tree of {req.rid} holds a token outside the vocabulary [0, {self.engine.model_config.vocab_size})"
        return None

    def forget(self, req, complete: bool = True, finishing: bool = False) -> None:
        """Release the request's draft state; ``complete``: with prefix caching, first send the drafter what
        the request holds, so that the pages it caches on release are whole (see forget_all)."""
        self.forget_all([req], complete, finishing)

    def forget_all(self, reqs: list, complete: bool = True, finishing: bool = False) -> None:
        """``forget`` for several requests, their held features sent in one extend (requests finishing
        together: one drafter forward, not one each): a later request on the same prefix — a next turn, or a
        preempted request recomputed — would otherwise find the target's pages cached and the drafter's not,
        and draft from zero features there (tandem.speculative.drafter.attach_prefix). Requests ``finishing``
        while the batch decodes plainly send nothing: a finish then costs the drafter nothing, and a later
        request on those pages drafts from rebuilt entries there, only if speculation resumes."""
        if complete and self.completes(finishing):
            self.extend([self.take_pending(req) for req in reqs if req.draft_ready and req.pending_extend])
        for req in reqs:
            if self.proposer is not None and req.draft_ready and req.attach_at is None:
                self.proposer.release(req.rid)
            req.draft_ready, req.attach_at = False, None
            self._drop_held(req)

    def broken_drafts(self, reqs: list, problem: str) -> None:
        """These requests' drafts turned out unusable after the verify had read them: they go on without
        speculation (their draft state released); other requests keep theirs. A head broken for every
        request costs each one wasted round."""
        log.warning("%s (requests %s): they continue without speculation", problem, ", ".join(r.rid for r in reqs))
        for req in reqs:
            self.forget(req, complete=False)  # its draft state may be what is broken

    def lost(self, error: Exception) -> None:
        """The drafter's state is gone: every request continues without speculation (nothing fails)."""
        log.warning("drafter unavailable (%s): continuing without speculation", error)
        # A drafter down now and back before the next step is still one that came back (its requests join it again); a
        # head that stays up (in process: a broken draft) leaves them plain to their end, not joined again and again.
        self._was_up = self._was_up and self.up()
        self._forget_drafter_state()

    def _forget_drafter_state(self, release: bool = False) -> None:
        scheduler = self.engine.scheduler
        for req in scheduler.running + list(scheduler.waiting):
            if release and (req.draft_ready or req.attach_at is not None):
                self.proposer.release(req.rid)
            req.draft_ready, req.attach_at = False, None
            self._drop_held(req)

    def after_reconnect(self) -> None:
        """When the drafter comes back after a loss, the running requests join it (join_running): long ones speculate
        again instead of decoding plainly to their end, and no target work is spent on it (a recompute of their
        sequences would stall every stream for a prefill of all of them)."""
        up = self.up()
        if up:
            seen, self._connection = self._connection, self.proposer.connection
            if seen is not None and seen != self._connection:
                # made again since the last step — the drafter client may have dropped the old one itself, while no
                # round ran, so no lost() forgot what the requests held: the new drafter never saw their state (and
                # whatever a catch-up gave it mid-step is released, so that they join it from whole entries)
                self._forget_drafter_state(release=True)
                self._was_up = False
        back, self._was_up = up and not self._was_up, up
        if back and not self.detached:  # (detached: they join when it attaches)
            self.joins_due = True
            log.info("the drafter is back: the running requests join it")


def _copied(pieces: list) -> list:
    """Each piece copied, pieces of one shape in one copy (one launch, not one each), in their order."""
    out: list = [None] * len(pieces)
    by_shape: dict[tuple, list[int]] = {}
    for i, piece in enumerate(pieces):
        by_shape.setdefault(tuple(piece.shape), []).append(i)
    for at in by_shape.values():
        copies = torch.stack([pieces[i] for i in at]) if len(at) > 1 else [pieces[at[0]].clone()]
        for i, copy in zip(at, copies):
            out[i] = copy
    return out
