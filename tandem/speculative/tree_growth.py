"""The eager draft of an EAGLE-3 head (tandem.speculative.drafter): a top-k tree grown from each request's root in
``num_steps - 1`` forwards, for a batch its draft graphs do not cover (docs/architecture.md, "One speculative round").
Each forward runs every request's ``topk`` frontier nodes — input = the node's token and its parent's pre-norm state —
in scratch KV slots after the committed ones, with a tree mask so a node sees its own ancestors but not its cousins;
the scratch is dropped afterwards."""

from __future__ import annotations

import torch

from tandem.errors import OutOfPagesError
from tandem.forward_batch import ForwardBatch, SequenceChunk, to_device
from tandem.speculative.spec_config import SpecConfig
from tandem.speculative.tree import DraftTree


@torch.inference_mode()
def grow_trees(drafter, reqs: list, spec: SpecConfig) -> list[DraftTree]:
    """Trees for ``reqs`` (HeadRequest, each extended at least once) drafted eagerly by ``drafter``."""
    k, steps = spec.topk, spec.num_steps
    B, H, dev = len(reqs), drafter.head.config.hidden_size, drafter.device
    rows = torch.arange(B, device=dev).unsqueeze(1)  # [B, 1] for per-request gathers
    eye = torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)

    # Depth 1: the root's top-k children, scored by their log-prob (the root scores 0).
    f_scores = torch.stack([r.top_logp[:k] for r in reqs])  # [B, k]
    f_tokens = torch.stack([r.top_ids[:k] for r in reqs])  # [B, k] target ids
    f_cand = torch.arange(k, device=dev).expand(B, k)  # candidate index of each frontier node
    f_parent_state = torch.stack([r.state for r in reqs]).unsqueeze(1).expand(B, k, H)  # [B, k, H]
    anc = eye  # [B, k, W]: frontier node j's ancestors-or-self among the W scratch entries
    scores, tokens, parents = [f_scores], [f_tokens], [torch.full((B, k), -1, device=dev)]

    committed = [r.kv.num_tokens for r in reqs]
    try:
        if steps > 1:
            scratch = (steps - 1) * k
            need = sum(r.kv.pages_needed(n + scratch) for r, n in zip(reqs, committed))
            if need > drafter.allocator.num_free:
                raise OutOfPagesError(f"draft KV cache has no room for the draft scratch: need {need} pages, {drafter.allocator.num_free} free")
            for r, n in zip(reqs, committed):
                r.kv.reserve(n + scratch)
        for step in range(2, steps + 1):
            # Forward the frontier (depth step-1): token + parent's state, at position L + depth - 1.
            chunks, tok_lists, masks = [], f_tokens.tolist(), anc.tolist()
            for b, r in enumerate(reqs):
                pos = min(committed[b] + step - 2, drafter.head.max_positions - 1)  # past the context nothing is verified anyway
                chunks.append(SequenceChunk(tok_lists[b], committed[b] + (step - 2) * k, r.kv.page_table(),
                                            positions=[pos] * k, tree_mask=masks[b], logits="all"))
            batch = to_device(ForwardBatch(chunks), drafter.cfg.page_size, dev)
            drafter.backend.plan(batch.meta)
            states, logits = drafter.head(batch.input_ids, f_parent_state.reshape(B * k, H), batch.positions,
                                       batch.meta, drafter.kv, drafter.backend, batch.logits_indices)
            # Each frontier node's top-k children: k² candidates per request at this depth.
            logp = torch.log_softmax(logits, dim=-1).clamp(max=0.0)  # [B*k, Vd]; clamp keeps child <= parent
            if k == 1:  # a chain: the first maximum, as the static chain and its kernel pick it
                c_logp, c_draft = logp.max(dim=-1, keepdim=True)
            else:
                c_logp, c_draft = logp.topk(k, dim=-1)  # [B*k, k]
            c_scores = (f_scores.reshape(B * k, 1) + c_logp).view(B, k * k)
            c_tokens = drafter.head.to_target_ids(c_draft).view(B, k * k)
            scores.append(c_scores)
            tokens.append(c_tokens)
            parents.append(f_cand.repeat_interleave(k, dim=1))  # candidate j*k+c descends from frontier j
            if step == steps:
                break
            # Next frontier: the best k of the k² by cumulative score (ties: lower index), SGLang's rule.
            best = torch.sort(c_scores, dim=1, descending=True, stable=True).indices[:, :k]  # [B, k]
            slot = best // k  # parent's frontier slot
            f_scores, f_tokens = c_scores.gather(1, best), c_tokens.gather(1, best)
            f_cand = k + (step - 2) * k * k + best
            f_parent_state = states.view(B, k, H)[rows, slot]
            anc = torch.cat([anc[rows, slot], eye], dim=2)  # parent's ancestors + own new column
    finally:
        for r, n in zip(reqs, committed):
            r.kv.truncate(n)  # scratch slots are discarded; committed KV is untouched
    return build_trees(reqs, spec, torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1))


def build_trees(reqs, spec: SpecConfig, scores, tokens, parents) -> list[DraftTree]:
    """Keep the best num_draft_tokens-1 candidates; ascending candidate order puts parents first.

    A child's score never exceeds its parent's and a parent has the lower index, so with ties
    broken by index the kept set is closed under parents.
    """
    if torch.isnan(scores).any():
        raise FloatingPointError("draft log-probs contain NaN; the draft head or its features are broken")
    keep = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : spec.num_draft_tokens - 1]
    keep = keep.sort(dim=1).values  # [B, n] candidate indices in generation order
    kept_scores = scores.gather(1, keep).tolist()
    kept_tokens = tokens.gather(1, keep).tolist()
    kept_parents = parents.gather(1, keep).tolist()
    trees = []
    for b, req in enumerate(reqs):
        node = {cand: i + 1 for i, cand in enumerate(keep[b].tolist())}
        tree_parents = [-1] + [0 if p < 0 else node[p] for p in kept_parents[b]]
        trees.append(DraftTree([req.root, *kept_tokens[b]], tree_parents, [0.0, *kept_scores[b]]))
    return trees

