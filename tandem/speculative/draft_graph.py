"""CUDA graphs for the EAGLE-3 drafter (docs/architecture.md, "CUDA graphs"): the whole multi-step tree draft, the
fixed-width draft-extend and the prompt extends, each captured per padded batch-size bucket.

One graph per (member, bucket) — a SpecConfig for the ``draft`` family, "extend" (one width,
``max num_steps + 1``: accepted path ≤ num_steps plus the bonus) for ``draft_extend``, (PROMPT, width) for
``draft_prompt`` (tandem.speculative.draft_prompt_graphs: prompts and their chunks) — captured by
tandem.graph_capture into the caller's memory pool (the target's) or a new one. The graphs run
``draft_static``'s pure-tensor code over static buffers; the host fills them with one host→device copy of
packed integers (lengths, roots or token ids, block tables) plus on-device stacks of the per-request state,
and reads a draft's trees back in one device→host copy.

The same code runs without graphs (``use_graphs=False``: the static function called directly), which
is how the CPU tests prove it equals the eager drafter. Batches that do not fit — more requests than
the largest bucket, an uncaptured SpecConfig, an extend that neither the draft-extend (a prefill, wider than its
width) nor a prompt family takes, too few free pages for the padding — return None / False and the drafter runs
eagerly.
"""

from __future__ import annotations

import torch

from tandem.staging import PinnedStaging, send_page_rows
from tandem.errors import ConfigError
from tandem.graph_capture import GraphRunner, batch_buckets
from tandem.speculative.draft_prompt_graphs import (PromptFamilies, extend_prompts, is_prompt_member,
                                                    replay_extend_items)
from tandem.speculative.draft_static import MAX_MASK_W, StaticAttention, static_draft, static_extend
from tandem.speculative.tree import DraftTree, PendingTokens
from tandem.watchdog import Watchdog

EXTEND = "extend"  # the draft-extend's member (a draft's is its SpecConfig)


class DraftGraphRunner(GraphRunner):
    def __init__(self, drafter, specs, max_bs: int = 64, *, buckets: list[int] | None = None,
                 watchdog: Watchdog | None = None, pool=None, use_graphs: bool | None = None,
                 attention: str | None = None, capture_deadline_s: float = 120.0, replay_deadline_s: float = 60.0,
                 prompt_widths: tuple[int, ...] = (), prompt_max_bs: int = 1):
        """``drafter``: the Eagle3Drafter whose head, KV pool and requests the graphs serve. ``specs``: the
        SpecConfigs to capture draft graphs for. ``attention``: "triton" (default on GPU) or "torch".
        ``prompt_widths`` / ``prompt_max_bs``: the prompt-extend families (none by default)."""
        device = drafter.device
        super().__init__(device, buckets or batch_buckets(max_bs), log_name="tandem.draft_graph", watchdog=watchdog,
                         pool=pool, use_graphs=device.type == "cuda" if use_graphs is None else use_graphs,
                         capture_deadline_s=capture_deadline_s, replay_deadline_s=replay_deadline_s)
        self.drafter, self.head, self.dtype = drafter, drafter.head, drafter.dtype
        self.attn = StaticAttention(attention or ("triton" if self.device.type == "cuda" else "torch"))
        self.specs = tuple(dict.fromkeys(specs))
        if not self.specs:
            raise ValueError("DraftGraphRunner needs at least one SpecConfig")
        for s in self.specs:
            if s.topk > drafter.top_width:
                raise ConfigError(f"--speculative-eagle-topk {s.topk} exceeds the drafter's max_topk {drafter.top_width}")
            if (s.num_steps - 1) * s.topk > MAX_MASK_W:
                raise ConfigError(f"draft graphs need (--speculative-num-steps - 1) * --speculative-eagle-topk <= "
                                  f"{MAX_MASK_W}, got ({s.num_steps} - 1) * {s.topk}; use --disable-cuda-graph")
        self.width = max(s.num_steps for s in self.specs) + 1  # draft-extend tokens per request
        self.prompts = PromptFamilies(prompt_widths, prompt_max_bs)
        self.page_size = ps = drafter.cfg.page_size
        scratch = max((s.num_steps - 1) * s.topk for s in self.specs)
        reach = max(scratch, self.width, self.prompts.max_width)  # past the context: padded tails and scratch
        self.max_pages = -(-(self.head.max_positions + reach) // ps)  # a request never needs more
        self.replays = {"draft": 0, "draft_extend": 0, "draft_prompt": 0}  # how often each family ran (tests, metrics)

        extends = ((self.max_bs, self.width), (self.prompts.max_bs, self.prompts.max_width))  # (requests, tokens)
        mb, rows = max(b for b, _ in extends), max(b * w for b, w in extends)  # buffers fit the largest family
        dev, H, tw = self.device, self.head.config.hidden_size, drafter.top_width
        # Host → device staging: one copy of packed int64 rows (+ an extend's feature destinations).
        self.staging = PinnedStaging(max(b * (2 + 2 * w + self.max_pages) for b, w in extends), dev)
        # Static inputs shared by both families (filled before every replay).
        self.lens = torch.zeros(mb, dtype=torch.int64, device=dev)  # committed draft KV
        self.aux = torch.ones(mb, dtype=torch.int64, device=dev)  # draft: root token; extend: real count
        self.block_tables = torch.zeros(mb, self.max_pages, dtype=torch.int32, device=dev)
        # Draft inputs / outputs.
        self.state = torch.zeros(mb, H, dtype=self.dtype, device=dev)
        self.top_logp = torch.zeros(mb, tw, dtype=torch.float32, device=dev)
        self.top_ids = torch.zeros(mb, tw, dtype=torch.int64, device=dev)
        self.trees = {s: torch.zeros(mb, 3 * s.num_draft_tokens + 1, dtype=torch.float64, device=dev) for s in self.specs}
        # Extend inputs / outputs.
        self.token_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.features = torch.zeros(rows, self.head.config.feature_width, dtype=self.dtype, device=dev)
        self.out_state = torch.zeros(mb, H, dtype=self.dtype, device=dev)
        self.out_logp = torch.zeros(mb, tw, dtype=torch.float32, device=dev)
        self.out_ids = torch.zeros(mb, tw, dtype=torch.int64, device=dev)

    # -- the captured bodies -----------------------------------------------------------------------
    def capture_plan(self) -> list[tuple[str, list]]:
        prompts = [("draft_prompt", self.prompts.members)] if self.prompts.members else []
        return [("draft", list(self.specs)), ("draft_extend", [EXTEND])] + prompts

    def member_buckets(self, member) -> list[int]:
        return self.prompts.buckets if is_prompt_member(member) else self.buckets

    def _body(self, member, bs: int) -> None:
        if member == EXTEND or is_prompt_member(member):
            w = self.width if member == EXTEND else member[1]
            static_extend(self.head, self.drafter.kv, self.attn, self.page_size, w, self.lens[:bs], self.aux[:bs],
                          self.block_tables[:bs], self.token_ids[: bs * w], self.features[: bs * w],
                          self.out_state[:bs], self.out_logp[:bs], self.out_ids[:bs])
        else:
            k = member.topk
            static_draft(self.head, self.drafter.kv, self.attn, member, self.page_size, self.lens[:bs],
                         self.block_tables[:bs], self.aux[:bs], self.state[:bs], self.top_logp[:bs, :k],
                         self.top_ids[:bs, :k], self.trees[member][:bs])

    def _pad_all(self, member, bs: int) -> None:
        for t in (self.lens, self.block_tables, self.state, self.top_logp, self.top_ids, self.token_ids, self.features):
            t.zero_()
        self.aux.fill_(1)

    # -- host → static buffers ---------------------------------------------------------------------
    def _stage(self, bs: int, heads: list[list[int]], pages: list, pad_aux: int,
               tail: list[int] = (), cols: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Pack one row ``[L, aux, *extra, *pages]`` per request — padding rows: length 0, ``pad_aux``, the
        dummy page 0 — and ``tail`` into the pinned buffer, copy it to the device once, and scatter the
        columns into the static buffers (``cols`` block-table columns at least: the dummy page past a
        request's pages). Returns the device views of the ``extra`` columns and the tail."""
        h, p = len(heads[0]), max(cols, *(len(pg) for pg in pages))
        m, n = bs * (h + p), len(heads)
        host = self.staging.host_array()
        rows = host[:m].reshape(bs, h + p)
        rows[:] = 0
        rows[n:, 1] = pad_aux
        for i, (hd, pg) in enumerate(zip(heads, pages)):
            rows[i, :h] = hd
            rows[i, h : h + len(pg)] = pg
        host[m : m + len(tail)] = tail
        dev = self.staging.send(m + len(tail))
        packed = dev[:m].view(bs, h + p)
        self.lens[:bs].copy_(packed[:, 0])
        self.aux[:bs].copy_(packed[:, 1])
        self.block_tables[:bs, :p].copy_(packed[:, h:])  # columns past p: stale, never read (past kv_len)
        return packed[:, 2:h].reshape(-1), dev[m:]

    # -- draft -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, reqs: list, spec, defer: bool = False) -> list[DraftTree] | None:
        """Trees for ``reqs`` (tandem.speculative.head_prefix.HeadRequest) through the static path, or None when this
        batch does not fit (the caller drafts eagerly, which also raises any error).

        ``defer`` (chains only, whose shape is known in advance): return without waiting for the replay;
        the trees' tokens stay on the device (``PendingTokens``), for a verify that reads them there. A
        hang of this replay then shows at the next wait: the verify graph's, inside its watchdog guard
        (named after the verify), or — when the verify runs eagerly — reading the tokens back, unguarded
        like every eager forward."""
        n, bs = len(reqs), self.bucket(len(reqs))
        if spec not in self.trees or bs is None or not reqs:
            return None
        k, steps, ps = spec.topk, spec.num_steps, self.page_size
        scratch = (steps - 1) * k
        committed = [r.kv.num_tokens for r in reqs]
        if any(L + scratch > self.max_pages * ps for L in committed):
            return None
        need = sum(r.kv.pages_needed(L + scratch) for r, L in zip(reqs, committed))
        if need > self.drafter.allocator.num_free:
            return None  # eager raises the out-of-pages error
        for r, L in zip(reqs, committed):
            r.kv.reserve(L + scratch)  # the scratch pages, as the eager draft reserves them
        try:
            self._stage(bs, [[L, r.root] for L, r in zip(committed, reqs)], [r.kv.page_table(copy=False) for r in reqs], pad_aux=0)
            torch.stack([r.state for r in reqs], out=self.state[:n])
            torch.stack([r.top_logp for r in reqs], out=self.top_logp[:n])
            torch.stack([r.top_ids for r in reqs], out=self.top_ids[:n])
            if bs > n:
                for t in (self.state, self.top_logp, self.top_ids):
                    t[n:bs].zero_()
            with self.guard(f"Replay draft cuda graph bs={bs}"):
                self._launch(spec, bs)
                self.replays["draft"] += 1
                if defer and k == 1:
                    return self._pending_chains(reqs, spec)
                out = self.trees[spec][:n].cpu()  # the one device → host copy (waits for the replay)
        finally:
            for r, L in zip(reqs, committed):
                r.kv.truncate(L)  # the scratch is dropped; committed KV untouched (stream-ordered on the GPU)
        nd = spec.num_draft_tokens
        if bool(out[:, 3 * nd].any()):
            raise FloatingPointError("draft log-probs contain NaN; the draft head or its features are broken")
        rows = out.tolist()
        return [DraftTree([int(t) for t in row[:nd]], [int(p) for p in row[nd : 2 * nd]], row[2 * nd : 3 * nd])
                for row in rows]

    def _pending_chains(self, reqs: list, spec) -> list[DraftTree]:
        """Chains whose tokens are still on the device: copies of the output rows (the next replay
        overwrites the static buffer) and their tokens as int64, ready for the verify's input."""
        n, nd = len(reqs), spec.num_draft_tokens
        rows = self.trees[spec][:n].clone()
        ids = rows[:, :nd].long()
        chain = list(range(-1, nd - 1))
        return [DraftTree([r.root] + [-1] * (nd - 1), chain, [], PendingTokens(ids[b], rows[b]))
                for b, r in enumerate(reqs)]

    # -- extend ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(self, reqs: list, prefixes: list[int], items: list) -> bool:
        """Extend through the static path: the draft-extend for already-extended requests (the round after
        verification), else a prompt-extend family (draft_prompt_graphs); False when neither takes the batch
        (the caller extends eagerly). On True each request's committed length, root, state and top-k are
        updated as the eager extend would."""
        return self._extend_rounds(reqs, prefixes, items) or extend_prompts(self, reqs, prefixes, items)

    def _extend_rounds(self, reqs: list, prefixes: list[int], items: list) -> bool:
        bs, w, ps = self.bucket(len(items)), self.width, self.page_size
        counts = [len(tokens) for _, tokens, _ in items]
        if bs is None or not items or any(p == 0 for p in prefixes) or max(counts) > w:
            return False  # prefills (whole prompts) and wide extends: not this family's
        if any(p + c > self.head.max_positions or p + w > self.max_pages * ps for p, c in zip(prefixes, counts)):
            return False
        need = sum(r.kv.pages_needed(p + w) for r, p in zip(reqs, prefixes))
        if need > self.drafter.allocator.num_free:
            return False
        for r, p in zip(reqs, prefixes):
            r.kv.reserve(p + w)  # room for the padded tail too
        try:
            states, top_logp, top_ids = replay_extend_items(self, EXTEND, w, bs, reqs, prefixes, items)
        except BaseException:
            for r, p in zip(reqs, prefixes):
                r.kv.truncate(p)
            raise
        for b, (r, p, c, (_, tokens, _)) in enumerate(zip(reqs, prefixes, counts, items)):
            r.kv.truncate(p + c)  # pages only the padded tail needed go back; commits the real tokens
            r.root, r.state, r.top_logp, r.top_ids = tokens[-1], states[b], top_logp[b], top_ids[b]
        self.replays["draft_extend"] += 1
        return True

    # -- rounds queued on the device (tandem.speculative.chain_rounds) ------------------------------
    @torch.inference_mode()
    def begin_rounds(self, reqs: list) -> int:
        """Stage already-extended ``reqs`` — whose pages must cover every round to come — for draft and
        extend replays fed from the device (``replay_draft``, ``replay_extend``); → the bucket."""
        n, bs, w = len(reqs), self.bucket(len(reqs)), self.width
        # Padding rows keep count 1 for the extend (as its own staging does); as a draft's root, 1 is as good as 0.
        self._stage(bs, [[r.kv.num_tokens, r.root] for r in reqs], [r.kv.page_table(copy=False) for r in reqs], pad_aux=1)
        for buffer, per_request in ((self.state, "state"), (self.top_logp, "top_logp"), (self.top_ids, "top_ids")):
            torch.stack([getattr(r, per_request) for r in reqs], out=buffer[:n])
            buffer[n:bs].zero_()
        self.token_ids[: bs * w].zero_()  # columns past a round's width stay padding for the whole run
        self.features[: bs * w].zero_()
        return bs

    def replay_draft(self, spec, bs: int) -> torch.Tensor:
        """Replay the draft of the staged requests, without waiting → the trees' rows (float64
        [bs, 3 * num_draft_tokens + 1], as ``static_draft`` writes them), valid until the next draft."""
        with self.guard(f"Replay draft cuda graph bs={bs}"):
            self._launch(spec, bs)
        self.replays["draft"] += 1
        return self.trees[spec][:bs]

    def replay_extend(self, bs: int, tokens: torch.Tensor, features: torch.Tensor, counts: torch.Tensor) -> None:
        """Extend the first n staged requests by ``counts`` ([n] int64, ≥ 1) tokens from the device —
        ``tokens`` [n, c] and ``features`` [n, c, 3·H_target], zero past each count — then leave the
        static inputs ready for their next draft: lengths advanced, the last extended token as the
        root, the extend's state and top-k as the draft's."""
        n, c, w = tokens.shape[0], tokens.shape[1], self.width
        self.token_ids[: bs * w].view(bs, w)[:n, :c].copy_(tokens)
        self.features[: bs * w].view(bs, w, -1)[:n, :c].copy_(features)
        self.aux[:n].copy_(counts)
        with self.guard(f"Replay draft_extend cuda graph bs={bs}"):
            self._launch(EXTEND, bs)
        self.replays["draft_extend"] += 1
        self.aux[:n].copy_(tokens.gather(1, (counts - 1)[:, None])[:, 0])  # the root of the next draft
        self.lens[:n] += counts
        self.state[:bs].copy_(self.out_state[:bs])
        self.top_logp[:bs].copy_(self.out_logp[:bs])
        self.top_ids[:bs].copy_(self.out_ids[:bs])

    def replay_extend_fed(self, bs: int, counts: torch.Tensor) -> None:
        """``replay_extend`` for inputs already fed on the device (tandem.kernels.round_glue.accept wrote
        the tokens, features and counts), with the next draft's inputs left by one kernel (``settle``)."""
        from tandem.kernels import round_glue

        with self.guard(f"Replay draft_extend cuda graph bs={bs}"):
            self._launch(EXTEND, bs)
        self.replays["draft_extend"] += 1
        round_glue.settle(counts, self.token_ids, self.width, self.aux, self.lens, self.state, self.out_state[:bs],
                          self.top_logp, self.out_logp[:bs], self.top_ids, self.out_ids[:bs])

    def restage_pages(self, reqs: list) -> None:
        """Copy the staged requests' block tables again (a run queued after another reserved more pages),
        leaving every other static input — lengths, roots, states, advanced on the device — as it is."""
        rows = send_page_rows(self.staging, [r.kv.page_table(copy=False) for r in reqs])
        self.block_tables[: rows.shape[0], : rows.shape[1]].copy_(rows)

    def snapshot_rounds(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies, queued now, of the first n requests' next-draft inputs (state, top-k log-probs and
        ids): what the run queued so far leaves, whatever a run queued after it does to the buffers."""
        return self.state[:n].clone(), self.top_logp[:n].clone(), self.top_ids[:n].clone()

    def end_rounds(self, reqs: list, extended: list[list[int]], snapshot, rows: list[int],
                   keep_pages: bool = False) -> None:
        """After a run: each request's committed KV grows by its ``extended`` tokens, its root is the last
        of them, and its state and top-k are its row (``rows``) of the run's ``snapshot``. Pages past the
        committed KV go back, unless ``keep_pages`` (a run queued after this one writes into them). Rows
        are taken one by one as views: indexing the snapshot with a list would copy the list to the
        device from pageable memory, which waits for the stream — for the whole run queued after this
        one, leaving the device idle when it ends (docs/benchmarks.md)."""
        state, top_logp, top_ids = snapshot
        for r, tokens, row in zip(reqs, extended, rows):
            if keep_pages:
                r.kv.commit(r.kv.num_tokens + len(tokens))
            else:
                r.kv.truncate(r.kv.num_tokens + len(tokens))
            r.root, r.state, r.top_logp, r.top_ids = tokens[-1], state[row], top_logp[row], top_ids[row]
            if r.tokens is not None:  # a request whose pages go to the prefix cache (Eagle3Drafter.attach_prefix)
                r.tokens.extend(tokens)
