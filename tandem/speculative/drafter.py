"""The drafting runtime: an EAGLE-3 head with its own paged KV cache, batched over requests.

Two calls per speculative round (docs/architecture.md, "One speculative round"), the API both the in-process
engine and the drafter service use:

- ``extend`` appends committed draft KV from target features: the draft sees pairs
  ``(token_{t+1}, feature_t)``, so after a prefill over ``x_0..x_{n-1}`` that sampled ``x_n`` the
  caller passes tokens ``x_1..x_n`` with features ``f_0..f_{n-1}``; after a round that accepted
  ``a_1..a_m`` plus bonus ``b`` it passes ``[a_1..a_m, b]`` with the features of nodes
  ``[root, a_1..a_m]``. Entry ``t`` of a request's draft KV sits at rotary position ``t``.
- ``draft`` grows a top-k tree from the last extended token (the root) in ``num_steps - 1``
  forwards (step 1's children come from the last extend's logits, SGLang's scheme): each forward
  runs every request's ``topk`` frontier nodes — input = the node's token and its parent's pre-norm
  state — in scratch KV slots after the committed ones, with a tree mask so a node sees its own
  ancestors but not its cousins (eagerly: tree_growth.py; replayed: draft_graph.py). The scratch is dropped
  afterwards: drafting never changes committed state, so drafting twice gives the same tree.

A request may start on a cached prefix: tandem.speculative.head_prefix.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from tandem.attention.choice import make_backend
from tandem.forward_batch import ForwardBatch, SequenceChunk, to_device
from tandem.errors import ConfigError, OutOfPagesError
from tandem.kv_cache import KVPool, PageAllocator, SequenceKV
from tandem.configs.model import ModelConfig
from tandem.models.eagle3 import Eagle3Head
from tandem.models.eagle3_checkpoint import load_eagle3, load_target_embedding
from tandem.configs.eagle3 import DraftConfig, draft_tensor_files, validate_draft
from tandem.models.loader import resolve_dtype
from tandem.prefill_shapes import PREFILL_GRAPH_MAX_BS, PREFILL_GRAPH_TOKENS, prefill_widths
from tandem.speculative.head_kv import DEFAULT_KV_TOKENS
from tandem.speculative.head_prefix import HeadPrefixes, HeadRequest
from tandem.speculative.head_room import ShedRequests, make_room, pages_needed, past_shed, scratch_room
from tandem.speculative.proposer import Proposer
from tandem.speculative.spec_config import SpecConfig
from tandem.speculative.tree import DraftTree
from tandem.speculative.tree_growth import grow_trees

log = logging.getLogger("tandem.drafter")


# Entries a forward rebuilds from zero features at most (attach_prefix's pages found in no cache: Eagle3Drafter._rebuild)
REBUILD_TOKENS = 8192


@dataclass(frozen=True)
class DrafterConfig:
    device: str = "cpu"
    dtype: str = "auto"  # auto = the draft checkpoint's dtype on GPU, float32 on CPU
    page_size: int = 16
    kv_pages: int | None = None  # explicit pool size; None = max_kv_tokens worth (+ the reserved page)
    max_kv_tokens: int = DEFAULT_KV_TOKENS  # (a drafter service sizes it from the GPU's memory: drafter/config.py)
    max_topk: int = 8  # top-k kept per request after extend; a SpecConfig may not ask for more
    attention_backend: str = "auto"
    page_shuffle_seed: int | None = None  # scatter page order (tests of the paged layout)
    disable_cuda_graph: bool = False  # --disable-cuda-graph: draft and draft-extend always eager
    cuda_graph_max_bs: int = 64  # --cuda-graph-max-bs: largest captured draft batch (requests)
    # --prefill-graph-tokens / --prefill-graph-max-bs (the target's flags, and their defaults): prompt extends of up to
    # this many tokens a request, this many requests, replay graphs (draft_prompt_graphs); 0 tokens = always eager
    prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS
    prefill_graph_max_bs: int = PREFILL_GRAPH_MAX_BS
    # In process with the target: a graphed chain draft returns without waiting, its tokens left on the
    # device for the verify (tree.PendingTokens). Off where trees leave the process (the drafter service).
    defer_chain_tokens: bool = False

    def __post_init__(self) -> None:
        if self.prefill_graph_tokens < 0 or self.prefill_graph_max_bs < 1:
            raise ConfigError(f"--prefill-graph-tokens must be >= 0 (0: off) and --prefill-graph-max-bs >= 1, got "
                              f"{self.prefill_graph_tokens} and {self.prefill_graph_max_bs}")


class Eagle3Drafter(Proposer):
    caches_prefixes = True  # attach_prefix (tandem.prefix_cache)

    def __init__(self, head: Eagle3Head, cfg: DrafterConfig = DrafterConfig()):
        self.head, self.cfg = head, cfg
        dc = head.config
        self.device, self.dtype = head.fc.weight.device, head.fc.weight.dtype
        self.backend = make_backend(cfg.attention_backend, self.device)
        num_pages = cfg.kv_pages if cfg.kv_pages is not None else math.ceil(cfg.max_kv_tokens / cfg.page_size) + 1
        self.kv = KVPool(1, num_pages, cfg.page_size, dc.num_kv_heads, dc.head_dim, self.dtype, self.device)
        log.info("EAGLE-3 head: KV cache %d pages x %d tokens = %d tokens, %.2f GiB", num_pages, cfg.page_size,
                 num_pages * cfg.page_size, num_pages * cfg.page_size * 2 * dc.num_kv_heads * dc.head_dim
                 * head.fc.weight.element_size() / 2**30)
        self.prefixes = HeadPrefixes(cfg.page_size)
        self.allocator = PageAllocator(num_pages, cfg.page_size, cfg.page_shuffle_seed, cache=self.prefixes.cache)
        self.top_width = min(cfg.max_topk, dc.draft_vocab_size)
        self.capture_layers: tuple[int, ...] | None = None  # set by from_dirs: the target layers to capture
        self._reqs: dict[str, HeadRequest] = {}
        self.shed = ShedRequests()  # requests its pool could not hold: bare roots until released (head_room)
        self.graphs = None  # DraftGraphRunner (draft_graph.py) once capture_cuda_graphs ran; None = eager

    def capture_cuda_graphs(self, specs: list[SpecConfig], static: bool = False, **runner_kw) -> dict | None:
        """Capture the draft, draft-extend and prompt-extend graphs for ``specs`` (docs/architecture.md, "CUDA
        graphs"; the prompt widths and batches from ``prefill_graph_tokens`` / ``prefill_graph_max_bs``). A no-op
        on CPU and with ``disable_cuda_graph``; batches the graphs cannot take still run eagerly. ``static``: the
        graphs' static path without capture, on any device (EngineConfig.static_graph_path)."""
        if not static and (self.device.type != "cuda" or self.cfg.disable_cuda_graph):
            return None
        from tandem.speculative.draft_graph import DraftGraphRunner

        cfg = self.cfg
        prompts = dict(prompt_widths=prefill_widths(cfg.prefill_graph_tokens), prompt_max_bs=cfg.prefill_graph_max_bs)
        self.graphs = DraftGraphRunner(self, specs, self.cfg.cuda_graph_max_bs, use_graphs=not static,
                                       **{**prompts, **runner_kw})
        if static:
            self.graphs.run_statically()
            return None
        return self.graphs.capture()

    @classmethod
    def from_dirs(
        cls,
        draft_dir: str,
        target_dir: str,
        cfg: DrafterConfig = DrafterConfig(),
        capture_layers: tuple[int, ...] | None = None,
        embed_weight: torch.Tensor | None = None,
    ) -> "Eagle3Drafter":
        """Validate the draft against the target (configs and tensor headers only), then load it.

        ``embed_weight``: the target's full embedding when it lives in this process on the same device
        (shared, not copied); otherwise it is read from the target checkpoint. ``capture_layers`` are
        what the target was configured to capture; the result's ``capture_layers`` is what it must.
        """
        target = ModelConfig.from_dir(target_dir)
        draft = DraftConfig.from_dir(draft_dir)
        capture = validate_draft(draft, target, capture_layers)
        device = torch.device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, draft.dtype, device)
        if "embed_tokens.weight" in draft_tensor_files(draft_dir):
            embed_weight = None  # a draft that carries its own embedding uses it
        elif embed_weight is None:
            embed_weight = load_target_embedding(target_dir, device, dtype)
        # Rotary table covers the target's context; draft steps past it are clamped (never verifiable).
        head = load_eagle3(draft_dir, embed_weight, device=device, dtype=dtype, max_positions=target.max_position_embeddings)
        drafter = cls(head, cfg)
        drafter.capture_layers = capture
        return drafter

    # -- bookkeeping -----------------------------------------------------------------------------
    def has(self, rid: str) -> bool:
        return rid in self._reqs

    @property
    def requests(self) -> dict[str, HeadRequest]:
        """rid → the drafter's state of each request it holds, in the order they started (read, do not change)."""
        return self._reqs

    @property
    def rounds_drafter(self) -> "Eagle3Drafter":
        """What runs greedy chain rounds on the device for this proposer (tandem.engine.rounds_ahead):
        the drafter itself (wrappers name the drafter they wrap)."""
        return self

    @property
    def prefix_cache(self):
        """The head's prefix cache (tandem.speculative.head_prefix): its stats, what it holds."""
        return self.prefixes.cache

    def request_states(self, rids: list[str]) -> list[HeadRequest]:
        """The drafter's state of each request (for runs that advance it on the device: chain_rounds)."""
        return [self._reqs[rid] for rid in rids]

    def num_tokens(self, rid: str) -> int:
        """Committed draft KV entries of ``rid`` (= tokens passed to ``extend`` so far)."""
        return self._reqs[rid].kv.num_tokens

    def release(self, rid: str) -> None:
        """Free the request's pages, its full ones kept in the prefix cache if it was started by
        ``attach_prefix``; unknown ids are ignored (a restarted drafter never saw them)."""
        self.shed.forget(rid)
        req = self._reqs.pop(rid, None)
        if req is not None:
            self.prefixes.offer_filled([req])
            req.kv.release()

    def release_device(self) -> None:
        self.graphs = None  # captured in the target's graph pool, which its runner gives back next

    def release_all(self) -> None:
        """Forget every request and every cached page (a new verifier stream starts from nothing)."""
        for rid in list(self._reqs):
            self.release(rid)
        self.shed.clear()
        self.allocator.free(self.prefix_cache.evict(self.prefix_cache.num_evictable))

    # -- prefix cache (tandem.speculative.head_prefix) ---------------------------------------------
    @torch.inference_mode()
    def attach_prefix(self, rid: str, tokens: list[int]) -> int:
        """Start a new request whose prompt may start on cached target KV, and keep its pages in the prefix
        cache as they fill: ``tokens`` are ``x_0..x_c`` (c: the tokens found cached, maybe 0), so that its
        entries ``0..c-1`` (entry t pairs x_{t+1} with the target's feature at t) come from the cache. Pages
        not found are built from zero features right before the request's next ``extend``, which goes on from
        entry c with x_{c+1}, …. → the entries found cached."""
        if rid in self._reqs:
            raise ValueError(f"attach_prefix of '{rid}': the request already has draft state")
        if not tokens:
            raise ValueError(f"attach_prefix of '{rid}': no tokens (the first token at least)")
        self.shed.forget(rid)  # (a shed request that joins again starts over)
        req = self.prefixes.start(SequenceKV(self.allocator), tokens)
        self._reqs[rid] = req
        return req.kv.num_tokens

    def _rebuild(self, rids: list[str]) -> None:
        """The entries attach_prefix left to rebuild of these requests, from zero features, before their extend: requests
        joining together share forwards, each of at most REBUILD_TOKENS entries (64 joins of 32k tokens are not one
        forward of 2M rows)."""
        pieces = []
        for rid in rids:
            req = self._reqs.get(rid)
            if req is not None and req.rebuild:
                tokens, req.rebuild = req.rebuild, []
                pieces += [(rid, tokens[i : i + REBUILD_TOKENS]) for i in range(0, len(tokens), REBUILD_TOKENS)]
        batch: list = []
        for rid, tokens in pieces:
            if batch and (sum(len(t) for _, t, _ in batch) + len(tokens) > REBUILD_TOKENS or batch[-1][0] == rid):
                self.extend(batch)
                batch = []
            zeros = torch.zeros(len(tokens), self.head.config.feature_width, dtype=self.dtype, device=self.device)
            batch.append((rid, tokens, zeros))
        if batch:
            self.extend(batch)

    # -- extend ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def extend(
        self, items: list[tuple[str, list[int], torch.Tensor]], return_logits: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Append draft KV for ``(rid, token_ids [n], features [n, 3·H_target])`` items, in one forward.

        With ``return_logits`` → per item (pre-norm states [n, H], float32 draft logits [n, draft_vocab]); without,
        a batch the pool cannot hold sheds its newest requests instead of failing (head_room).
        """
        if not items:
            return [] if return_logits else None
        width, ps, vocab = self.head.config.feature_width, self.cfg.page_size, self.head.config.vocab_size
        rids = [rid for rid, _, _ in items]
        if len(set(rids)) != len(rids):
            raise ValueError("extend got the same request twice in one call")
        for rid, tokens, feats in items:
            if not tokens or tuple(feats.shape) != (len(tokens), width):
                raise ValueError(
                    f"extend of '{rid}': {len(tokens)} tokens need features of shape ({len(tokens)}, {width}), "
                    f"got {tuple(feats.shape)}"
                )
            if not 0 <= min(tokens) <= max(tokens) < vocab:  # caught here, not as a device-side assert
                raise ValueError(f"extend of '{rid}': token ids must be in [0, {vocab})")
        if not return_logits:
            items = past_shed(self, items)
            self._rebuild([rid for rid, _, _ in items])
            items = make_room(self, past_shed(self, items))
            if not items:
                return None
            rids = [rid for rid, _, _ in items]
        else:
            self._rebuild(rids)
            need = pages_needed(self, items)
            if need > self.allocator.num_free:
                raise OutOfPagesError(f"draft KV cache out of pages: need {need}, {self.allocator.num_free} free; "
                                      "raise max_kv_tokens")
        reqs = [self._reqs.get(rid) or HeadRequest(SequenceKV(self.allocator)) for rid in rids]
        prefixes = [r.kv.num_tokens for r in reqs]
        if self.graphs is not None and not return_logits and self.graphs.extend(reqs, prefixes, items):
            for rid, req, (_, tokens, _) in zip(rids, reqs, items):
                if req.tokens is not None:
                    req.tokens.extend(tokens)
                self._reqs[rid] = req  # a new request (a prompt-extend graph takes prefills) starts here
            self.prefixes.offer_filled(reqs)
            return None  # replayed a draft-extend or prompt-extend graph
        chunks = []
        for req, prefix, (_, tokens, _) in zip(reqs, prefixes, items):
            req.kv.reserve(prefix + len(tokens))
            chunks.append(SequenceChunk(list(tokens), prefix, req.kv.page_table(), logits="all" if return_logits else "last"))
        try:
            dev = to_device(ForwardBatch(chunks), ps, self.device)
            self.backend.plan(dev.meta)
            feats = torch.cat([f.to(self.device, self.dtype) for _, _, f in items])  # [T, 3·H_target]
            states, _ = self.head(dev.input_ids, feats, dev.positions, dev.meta, self.kv, self.backend)  # [T, H]
        except BaseException:
            for req, prefix in zip(reqs, prefixes):
                req.kv.truncate(prefix)
            raise
        last = dev.meta.cu_q_lens[1:].long() - 1  # [B] last row of each item
        last_states = states[last]  # [B, H]
        logp = torch.log_softmax(self.head.logits(last_states), dim=-1)  # [B, draft_vocab]
        top_logp, top_draft = logp.topk(self.top_width, dim=-1)  # [B, top_width]
        top_logp, top_ids = top_logp.clamp(max=0.0), self.head.to_target_ids(top_draft)
        for b, (rid, tokens, _) in enumerate(items):  # (rows of the batch's tensors: no launch a request)
            req = reqs[b]
            req.kv.num_tokens = prefixes[b] + len(tokens)
            if req.tokens is not None:
                req.tokens.extend(tokens)
            req.root, req.state = tokens[-1], last_states[b]
            req.top_logp, req.top_ids = top_logp[b], top_ids[b]
            self._reqs[rid] = req
        self.prefixes.offer_filled(reqs)
        if not return_logits:
            return None
        cu = dev.meta.cu_q_lens.tolist()
        return [(states[cu[b]:cu[b + 1]], self.head.logits(states[cu[b]:cu[b + 1]])) for b in range(len(items))]

    # -- draft -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, rids: list[str], spec: SpecConfig) -> list[DraftTree]:
        k = spec.topk
        if k > self.top_width:
            raise ConfigError(
                f"--speculative-eagle-topk {k} exceeds the drafter's max_topk {self.top_width}; raise max_topk or lower the flag"
            )
        missing = [r for r in rids if r not in self._reqs and r not in self.shed]
        if missing:
            raise KeyError(f"draft for unknown request '{missing[0]}' (extend it first)")
        live = scratch_room(self, [r for r in rids if r in self._reqs], (spec.num_steps - 1) * k)
        drafted = dict(zip(live, self._draft_live([self._reqs[r] for r in live], spec))) if live else {}
        # (a request not drafted gets its bare root, which verifies as a plain step)
        return [drafted[r] if r in drafted else DraftTree([self.shed.roots[r] if r in self.shed else self._reqs[r].root],
                                                          [-1]) for r in rids]

    def _draft_live(self, reqs: list[HeadRequest], spec: SpecConfig) -> list[DraftTree]:
        trees = self.graphs.draft(reqs, spec, self.cfg.defer_chain_tokens) if self.graphs is not None else None
        return trees if trees is not None else grow_trees(self, reqs, spec)  # (None: no graph for this batch)
