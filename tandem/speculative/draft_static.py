"""Static-shape, pure-tensor versions of ``Eagle3Drafter.draft`` and ``.extend``: what the drafter's
CUDA graphs capture (docs/architecture.md, "CUDA graphs"), and what the CPU tests run eagerly to prove they
compute what the eager drafter computes.

Nothing here looks at host data: no ``.item()``/``.tolist()``, no loop over requests, no shape that
depends on a value. Every request of a padded batch has the same width (``topk`` frontier nodes per
draft step, ``width`` tokens per extend); KV slots, positions and KV lengths are computed from the
committed lengths and block tables with tensor ops. Padding rows have length 0 and a block table of
zeros, so they write into the dummy page 0 and only ever read it; every op is row-independent, so
whatever they compute never reaches a real row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.attention.backend import AttentionBackend
from tandem.kv_cache import page_slots
from tandem.layers.fast_path import use_triton

MAX_MASK_W = 64  # the Triton kernel keeps a row's mask over the last W keys in one 64-bit word


@dataclass
class StaticMeta:
    """Attention metadata of a fixed-width forward: each of ``bs`` sequences has ``q_len`` new tokens."""

    block_tables: torch.Tensor  # int32 [bs, max_pages]
    kv_lens: torch.Tensor  # int32 [bs]: keys including the new ones
    slot_mapping: torch.Tensor  # int64 [bs * q_len]: flat pool slot of each new token
    mask: torch.Tensor | None  # bool [bs, q_len, W] over the last W keys; None = causal new tokens


class StaticAttention(AttentionBackend):
    """Store K/V at the static slots, then paged attention: the Triton kernel (GPU, or CPU under
    TRITON_INTERPRET=1) or a static-shape torch version of it (CPU tests; gathers every page of the
    table, so it is for small tables only). With the Triton kernels the head's rotary and K/V store
    are one kernel too (``forward_with_rotary``, reached through ``attend``)."""

    name = "static"

    def __init__(self, kernel: str = "triton"):
        if kernel not in ("triton", "torch"):
            raise ValueError(f"unknown static attention kernel '{kernel}'; available: triton, torch")
        self.kernel = kernel
        # With the Triton kernels, rotary and the K/V store are one kernel too (as in the target's graphs).
        self.fuses_rotary = kernel == "triton"

    def forward_with_rotary(self, q, k, v, positions, rotary, k_pool, v_pool, meta: StaticMeta, scale: float):
        from tandem.attention.graph_backend import rotate_store_attend

        return rotate_store_attend(q, k, v, positions, rotary, k_pool, v_pool, meta.slot_mapping, meta.block_tables,
                                   meta.kv_lens, meta.mask, scale)

    def plan(self, meta) -> None:  # everything is in the static tensors
        pass

    def forward(self, q, k, v, k_pool, v_pool, meta: StaticMeta, scale: float) -> torch.Tensor:
        hkv, d = k_pool.shape[2:]
        k_pool.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k.to(k_pool.dtype))
        v_pool.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v.to(v_pool.dtype))
        if self.kernel == "triton":
            from tandem.kernels.paged_attention import paged_attention

            return paged_attention(q.contiguous(), k_pool, v_pool, meta.block_tables, meta.kv_lens, scale, mask=meta.mask)
        return torch_paged_attention(q, k_pool, v_pool, meta.block_tables, meta.kv_lens, scale, meta.mask)


def torch_paged_attention(q, k_pool, v_pool, block_tables, kv_lens, scale, mask=None) -> torch.Tensor:
    """The Triton kernel's contract in static-shape torch: q [B*q_len, Hq, D] → [B*q_len, Hq, D]."""
    T, Hq, D = q.shape
    B = kv_lens.shape[0]
    q_len, (_, _, hkv, _) = T // B, k_pool.shape
    keys = k_pool[block_tables.long()].flatten(1, 2).float()  # [B, N, Hkv, D], N = max_pages * page_size
    values = v_pool[block_tables.long()].flatten(1, 2).float()
    n = torch.arange(keys.shape[1], device=q.device)  # [N] key index
    kv = kv_lens.long()[:, None, None]  # [B, 1, 1]
    if mask is None:  # new token i sees keys up to its own
        visible = n <= kv - q_len + torch.arange(q_len, device=q.device)[None, :, None]  # [B, q_len, N]
    else:  # keys before the last W always; among them, the mask
        W = mask.shape[2]
        j = (n - (kv - W)).expand(B, q_len, -1)  # [B, q_len, N] position within the last W
        visible = (j < 0) | mask.gather(2, j.clamp(0, W - 1))
    visible = visible & (n < kv)
    qh = q.float().view(B, q_len, hkv, Hq // hkv, D)  # GQA: query head h*group+g reads kv head h
    s = torch.einsum("bqhgd,bnhd->bhgqn", qh, keys) * scale
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees no key attends to nothing (kernel: zeros)
    out = torch.einsum("bhgqn,bnhd->bqhgd", p, values)
    return out.reshape(T, Hq, D).to(q.dtype)


def static_draft(head, kv, attn: StaticAttention, spec, page_size: int,
                 lens: torch.Tensor,  # int64 [B] committed draft KV per request
                 block_tables: torch.Tensor,  # int32 [B, max_pages], covering lens + (S-1)k scratch
                 root: torch.Tensor,  # int64 [B] the tree root (last extended token)
                 state: torch.Tensor,  # [B, H] pre-norm state of the root's row
                 top_logp: torch.Tensor,  # float32 [B, k] the root's children: log-probs
                 top_ids: torch.Tensor,  # int64 [B, k] and target ids
                 out: torch.Tensor,  # float64 [B, 3n + 1]: tokens | parents | scores | NaN flag, n = num_draft_tokens
                 ) -> None:
    """``Eagle3Drafter.draft`` step for step (same ops, same order), writing the final trees to ``out``."""
    B, H = state.shape
    k, S, n = spec.topk, spec.num_steps, spec.num_draft_tokens
    dev = state.device
    if k == 1:
        return _static_chain(head, kv, attn, S, n, page_size, lens, block_tables, root, state, top_logp, top_ids, out)
    rows = torch.arange(B, device=dev).unsqueeze(1)  # [B, 1]
    offs = torch.arange(k, device=dev)  # [k]
    eye = torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)

    f_scores, f_tokens = top_logp, top_ids  # [B, k]: depth 1, scored by log-prob (root scores 0)
    f_cand = offs.expand(B, k)  # candidate index of each frontier node
    f_parent_state = state.unsqueeze(1).expand(B, k, H)  # [B, k, H]
    anc = eye  # [B, k, W]: ancestors-or-self among the W scratch entries
    scores, tokens, parents = [f_scores], [f_tokens], [torch.full((B, k), -1, device=dev)]
    for step in range(2, S + 1):
        # Frontier of depth step-1 at KV indices L + (step-2)k + j, position L + step - 2 (clamped).
        idx = lens.unsqueeze(1) + (step - 2) * k + offs  # [B, k]
        pos = (lens + step - 2).clamp(max=head.max_positions - 1).unsqueeze(1).expand(B, k)
        slots = page_slots(block_tables, idx, page_size).flatten()
        meta = StaticMeta(block_tables, (lens + (step - 1) * k).int(), slots, anc)
        states, _ = head(f_tokens.reshape(B * k), f_parent_state.reshape(B * k, H), pos.reshape(B * k), meta, kv, attn)
        logits = head.logits(states)  # [B*k, Vd] float32
        logp = torch.log_softmax(logits, dim=-1).clamp(max=0.0)
        c_logp, c_draft = logp.topk(k, dim=-1)  # [B*k, k]
        c_scores = (f_scores.reshape(B * k, 1) + c_logp).view(B, k * k)
        c_tokens = head.to_target_ids(c_draft).view(B, k * k)
        scores.append(c_scores)
        tokens.append(c_tokens)
        parents.append(f_cand.unsqueeze(2).expand(B, k, k).reshape(B, k * k))  # candidate j*k+c descends from frontier j
        if step == S:
            break
        best = torch.sort(c_scores, dim=1, descending=True, stable=True).indices[:, :k]  # [B, k]; ties: lower index
        slot = best // k
        f_scores, f_tokens = c_scores.gather(1, best), c_tokens.gather(1, best)
        f_cand = k + (step - 2) * k * k + best
        f_parent_state = states.view(B, k, H)[rows, slot]
        anc = torch.cat([anc[rows, slot], eye], dim=2)
    scores, tokens, parents = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)  # [B, C]

    # Final cut: best n-1 by score (stable: ties to the lower index), back in generation order.
    keep = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : n - 1]
    keep = keep.sort(dim=1).values  # [B, n-1]
    # Renumber: candidate keep[b, i] becomes node i+1; kept parents are kept (closed set), depth 1 → root 0.
    node_of = torch.zeros_like(scores, dtype=torch.int64).scatter_(1, keep, torch.arange(1, n, device=dev).expand(B, n - 1))
    cand_parent = parents.gather(1, keep)
    tree_parent = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0)))
    out[:, 0] = root
    out[:, 1:n] = tokens.gather(1, keep)
    out[:, n] = -1
    out[:, n + 1 : 2 * n] = tree_parent
    out[:, 2 * n] = 0.0
    out[:, 2 * n + 1 : 3 * n] = scores.gather(1, keep)
    out[:, 3 * n] = torch.isnan(scores).any(dim=1)


def _static_chain(head, kv, attn, S: int, n: int, page_size: int, lens, block_tables, root, state, top_logp, top_ids,
                  out) -> None:
    """``static_draft`` for topk 1: the same forwards and top-1 choices, without the tree's frontier
    selection and final cut (a chain keeps its first n-1 nodes: scores never rise along it), so the
    graph holds far fewer kernels — sorts, gathers and concatenations are most of a small head's draft."""
    B = state.shape[0]
    fused = use_triton(state)
    if fused:
        from tandem.kernels.chain_pick import chain_pick
    visible = torch.ones(B, 1, max(S - 1, 1), dtype=torch.bool, device=state.device)  # a chain sees all its scratch
    token, parent_state, score = top_ids[:, 0], state, top_logp[:, 0]  # depth 1: the root's best child
    tokens, scores = [token], [score]
    for step in range(2, S + 1):
        idx = (lens + step - 2).unsqueeze(1)  # [B, 1] KV index of the depth step-1 node
        pos = (lens + step - 2).clamp(max=head.max_positions - 1)
        meta = StaticMeta(block_tables, (lens + step - 1).int(), page_slots(block_tables, idx, page_size).flatten(),
                          visible[:, :, : step - 1])
        parent_state, _ = head(token, parent_state, pos, meta, kv, attn)
        if fused:  # the same choice in one kernel (tandem/kernels/chain_pick.py)
            token, score = chain_pick(head.logits_in_model_dtype(parent_state), head.d2t, score)
        else:
            logp = torch.log_softmax(head.logits(parent_state), dim=-1).clamp(max=0.0)
            c_logp, c_draft = logp.max(dim=-1)  # the first maximum, as the fused kernel picks it
            score = score + c_logp
            token = head.to_target_ids(c_draft)
        tokens.append(token)
        scores.append(score)
    chain_tokens, chain_scores = torch.stack(tokens, 1), torch.stack(scores, 1)  # [B, S]
    out[:, 0] = root
    out[:, 1:n] = chain_tokens[:, : n - 1]
    out[:, n : 2 * n] = torch.arange(-1, n - 1, device=out.device, dtype=out.dtype)
    out[:, 2 * n] = 0.0
    out[:, 2 * n + 1 : 3 * n] = chain_scores[:, : n - 1]
    out[:, 3 * n] = torch.isnan(chain_scores).any(dim=1)


def static_extend(head, kv, attn: StaticAttention, page_size: int, width: int,
                  lens: torch.Tensor,  # int64 [B] committed draft KV before this extend
                  counts: torch.Tensor,  # int64 [B] real new tokens, 1..width (padding rows: 1)
                  block_tables: torch.Tensor,  # int32 [B, max_pages], covering lens + width
                  token_ids: torch.Tensor,  # int64 [B*width], each request's tokens padded at the end
                  features: torch.Tensor,  # [B*width, 3·H_target], padded alike
                  out_state: torch.Tensor,  # [B, H] ← pre-norm state of each request's last real row
                  out_logp: torch.Tensor,  # float32 [B, top_width] ← its children's log-probs (≤ 0)
                  out_ids: torch.Tensor,  # int64 [B, top_width] ← and target ids
                  ) -> None:
    """``Eagle3Drafter.extend`` at a fixed width. Padded tokens sit after the real ones, so under
    causal attention no real token sees them; their KV lands past the committed length (scratch that
    the next extend or draft overwrites)."""
    B = lens.shape[0]
    idx = lens.unsqueeze(1) + torch.arange(width, device=lens.device)  # [B, width] KV index = position
    pos = idx.clamp(max=head.max_positions - 1)  # only padded tokens can pass the end (the caller checks)
    meta = StaticMeta(block_tables, (lens + width).int(), page_slots(block_tables, idx, page_size).flatten(), None)
    states, _ = head(token_ids, features, pos.flatten(), meta, kv, attn)  # [B*width, H]
    last = torch.arange(B, device=lens.device) * width + counts - 1  # [B] last real row
    st = states[last]
    logp = torch.log_softmax(head.logits(st), dim=-1)
    top_logp, top_draft = logp.topk(out_logp.shape[1], dim=-1)
    out_state.copy_(st)
    out_logp.copy_(top_logp.clamp(max=0.0))
    out_ids.copy_(head.to_target_ids(top_draft))
