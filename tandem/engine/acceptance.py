"""Acceptance: one verify forward's logits and features, read back into what the step produced.

The engine (tandem.engine.llm_engine) runs the forward over the step's prefill chunks and draft trees,
hands its output here, and commits the new tokens and sends the drafter's extension with what comes back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.engine.request import Request
from tandem.engine.request_sampling import (LogprobJobs, keep_prompt_logprobs, prefill_rows, prompt_logprob_jobs,
                                            sample_rows, tree_logits)
from tandem.logprobs import TokenLogprobs
from tandem.request_logits import history_matters
from tandem.sampling import argmax_rows
from tandem.speculative.accept import accept_greedy
from tandem.speculative.tree import DraftTree, resolve_pending
from tandem.engine.verify import accept_tree, compaction_moves

if TYPE_CHECKING:
    from tandem.engine.draft_link import DraftLink
    from tandem.engine.scheduler import Schedule
    from tandem.speculative.policy import SpeculationPolicy


@dataclass
class Accepted:
    """What one verify forward produced (``accept_verified``)."""
    emitted: dict[str, list[int]]  # rid -> new tokens (the commit stops them at the first stop)
    extend_items: list  # (request, tokens, features) for the drafter's extension
    rounds: dict[str, tuple[int, int]]  # rid -> (drafted tokens, accepted tokens)
    caught_up: bool  # a plain step also sent a request's held features (a catch-up, not a plain step's work)
    logprobs: dict[str, list[TokenLogprobs]]  # the new tokens', for the requests that ask


def accept_verified(sched: Schedule, trees: dict[str, DraftTree], logits: torch.Tensor,
                    features: torch.Tensor | None, *, policy: SpeculationPolicy, drafts: DraftLink,
                    move_kv: Callable[[list[int], list[int]], None], traffic, eos_token_ids: Sequence[int],
                    processed_logprobs: bool, speculating: bool) -> Accepted:
    """→ new tokens per request, the drafter's extension items, per-request round records, whether
    a plain step also sent a request's held features (a catch-up, not a plain step's work), and the
    new tokens' log-probabilities for the requests that ask.

    ``features``: the forward's captured features, None when neither the drafter nor traffic capture takes
    them. The engine's pieces it uses: ``policy`` observes each round, ``drafts`` holds plain steps' features
    and drops broken drafts, ``move_kv`` compacts accepted nodes' KV, ``traffic`` (a TrafficRecorder, or None)
    observes the new tokens' features; ``speculating`` is the policy's decision for the batch."""
    broken = _drop_broken_drafts(sched.decode, trees, drafts)
    prefill_at, simple, plain_rows, tree_jobs = _plan_rows(sched, trees, broken)
    emitted: dict[str, list[int]] = {}
    rounds: dict[str, tuple[int, int]] = {}
    extend_items = []
    observed = []  # (rid, first position, feature rows) for traffic capture (ranges: no cost when off)
    logprob_jobs = LogprobJobs(processed_eos=eos_token_ids if processed_logprobs else None)
    keep_prompt_logprobs(sched.prefill, LogprobJobs(prompt_logprob_jobs(sched.prefill, prefill_at)).compute(logits))
    if simple:
        for (req, row), token in zip(simple, sample_rows(logits, simple, eos_token_ids)):
            emitted[req.rid] = [token]
            logprob_jobs.add(req, [row], [token])
    token_row = 0
    held = []  # kept on the device for the request's next draft (keep_in_step)
    for p in sched.prefill:  # the draft sees (token_{t+1}, feature_t) over the whole prompt, chunk by chunk
        req, n = p.req, p.end - p.start
        observed.append((req.rid, p.start, range(token_row, token_row + n)))
        # A later chunk goes to the drafter only after its earlier ones (a lost drafter lost them); the
        # first one computed starts the drafter on the cached prefix the prompt started on, if any.
        first = p.start == req.prefix_hit
        if (features is not None and req.spec is not None
                and (drafts.attach(req, p.start) if first else req.draft_ready)):
            following = req.tokens[p.start + 1 : p.end + 1] + (emitted[req.rid] if p.last else [])
            item = (req, following, features[token_row : token_row + n])
            # While the batch decodes plainly the prompt waits for the request's first draft too; a
            # chunk after held ones is held too (DraftLink sends them in order).
            (extend_items if speculating and not req.pending_extend else held).append(item)
        token_row += n
    for req, root_row in plain_rows:  # a plain step keeps the drafter in step: (token, root's feature)
        observed.append((req.rid, req.num_tokens - 1, [root_row]))
        if features is not None and req.spec is not None and req.follows_drafter:
            held.append((req, emitted[req.rid], features[root_row : root_row + 1]))
    caught_up = drafts.keep_in_step(held)
    moves_src, moves_dst = [], []
    plain_argmax = _plain_greedy_argmax(tree_jobs, trees, logits)
    for req, first_row, first_token_row in tree_jobs:
        tree = trees[req.rid]
        if req.rid in plain_argmax:
            result = accept_greedy(tree, plain_argmax[req.rid])
        else:
            node_logits = tree_logits(logits[first_row : first_row + tree.size], req, tree, eos_token_ids)
            result = accept_tree(tree, node_logits, req.params, req.seed, req.num_tokens - 1)
        logprob_jobs.add(req, [first_row + n for n in (0, *result.accepted_nodes)], result.tokens)
        src, dst = compaction_moves(req, result.accepted_nodes)
        moves_src += src
        moves_dst += dst
        req.spec_stats.record(max(tree.depths), len(result.accepted_nodes))
        # (a chain's depth is its drafts; a tree's is not)
        policy.observe_round(req.spec_state, len(result.tokens), tree.size - 1 if req.spec.topk == 1 else None)
        rounds[req.rid] = (tree.size - 1, len(result.accepted_nodes))
        emitted[req.rid] = result.tokens
        nodes = [first_token_row + n for n in (0, *result.accepted_nodes)]
        observed.append((req.rid, req.num_tokens - 1, nodes))
        if features is not None:
            # A chain's accepted path is a run of rows: a view, not a gather through a host index.
            path = (features[nodes[0] : nodes[-1] + 1] if nodes[-1] - nodes[0] == len(nodes) - 1
                    else features[nodes])
            extend_items.append((req, result.tokens, path))
    move_kv(moves_src, moves_dst)  # one broadcast for the whole batch
    if traffic is not None and features is not None:
        traffic.observe(features, observed)
    return Accepted(emitted, extend_items, rounds, caught_up, logprob_jobs.compute(logits))


def _plain_greedy_argmax(tree_jobs: list, trees: dict[str, DraftTree], logits: torch.Tensor) -> dict[str, list[int]]:
    """The target's argmax at every node of the greedy trees whose logits acceptance takes as they are (no
    penalty, min_tokens met), rid -> [tree.size] ints: one reduction over the rows from the first such tree
    to the last and one copy to the host for the batch, not one of each a request (each copy waits)."""
    jobs = [(req.rid, row, trees[req.rid].size) for req, row, _ in tree_jobs
            if req.params.greedy and not history_matters(req.params, len(req.output))]
    if not jobs:
        return {}
    start = min(row for _, row, _ in jobs)
    argmax = argmax_rows(logits[start : max(row + size for _, row, size in jobs)]).tolist()
    return {rid: argmax[row - start : row - start + size] for rid, row, size in jobs}


def _drop_broken_drafts(decoding: list[Request], trees: dict[str, DraftTree], drafts: DraftLink) -> set[str]:
    """Draft tokens the verify took on the device (the verify has finished). A chain that came out NaN
    has had its garbage verified: its request takes only the root's token, as a plain step, and
    goes on without speculation (its draft state is released); the other requests are unaffected.
    → the rids of those requests."""
    broken_trees = {id(tree) for tree in resolve_pending(trees.values(), keep_broken=True)}
    broken = {req.rid for req in decoding if id(trees[req.rid]) in broken_trees}
    if broken:
        drafts.broken_drafts([req for req in decoding if req.rid in broken],
                             "draft log-probs contain NaN; the draft head or its features are broken")
    return broken


def _plan_rows(sched: Schedule, trees: dict[str, DraftTree], broken: set[str]):
    """Rows of `logits`: one per prefill (every token's for prompt logprobs), then tree.size per verified
    request. Requests whose tree is just the root are sampled together (plain decoding); trees go
    through acceptance. Features have one row per token (a token row).

    → ``prefill_at`` (each chunk's first logits row, rows), ``simple`` (request, logits row) to sample: prompts'
    last chunks and plain steps; ``plain_rows`` (request, its root's token row); ``tree_jobs`` (request, its
    tree's first logits row, first token row)."""
    prefill_at = prefill_rows(sched.prefill)
    simple = [(p.req, first + n - 1) for p, (first, n) in zip(sched.prefill, prefill_at) if p.last]
    row = sum(n for _, n in prefill_at)
    token_row = sum(p.end - p.start for p in sched.prefill)
    plain_rows, tree_jobs = [], []
    for req in sched.decode:
        size = trees[req.rid].size
        if not trees[req.rid].drafted or req.rid in broken:
            simple.append((req, row))  # the root's row: the plain step's token, whatever the nodes held
            plain_rows.append((req, token_row))
        else:
            tree_jobs.append((req, row, token_row))
        row, token_row = row + size, token_row + size
    return prefill_at, simple, plain_rows, tree_jobs
