"""CUDA graphs for the target's uniform-width forwards: plain decode (width 1) and tree verification
(width = num_draft_tokens per request); and, through tandem.engine.prefill_graphs, for batches of short
prompt chunks (each padded to a prefill family's width).

One graph per (width, padded batch size), captured by tandem.graph_capture. Each graph reads static
input buffers (token ids, positions, KV slots, block tables, KV lengths, tree masks) and writes static
outputs (logits, and for verification the EAGLE-3 features). Padding rows write their KV into the
reserved dummy page 0 and are never read back. Everything else — long prompts, mixed widths, batches
beyond the largest bucket — runs eagerly, which is also what ``--disable-cuda-graph`` and CPU runs do.
"""

from __future__ import annotations

import torch

from tandem.distributed import broadcast_tensor
from tandem.forward_batch import ForwardBatch
from tandem.staging import PinnedStaging, send_page_rows
from tandem.graph_capture import GraphRunner, batch_buckets
from tandem.engine.graph_buffers import GraphFamily, own_float
from tandem.engine.prefill_graphs import PrefillFamily, is_prompt_chunk
from tandem.engine.run_graphs import RUN_GRAPH_MAX_STEP_S, RunGraphs
from tandem.kv_cache import page_slots
from tandem.layers.fast_path import use_triton
from tandem.prefill_shapes import prefill_buckets
from tandem.watchdog import Watchdog

PLAIN_DECODE = ("decode", "plain")  # the member of the decode family's twin without features


def _name(fam: GraphFamily) -> str:
    if isinstance(fam, PrefillFamily):
        return f"prefill(width={fam.width})"
    return "decode" if fam.width == 1 else f"verify(width={fam.width})"


class TargetGraphRunner(GraphRunner):
    def __init__(self, runner, widths: tuple[int, ...], max_bs: int, watchdog: Watchdog | None = None,
                 capture_deadline_s: float = 120.0, replay_deadline_s: float = 60.0, use_graphs: bool | None = None,
                 prefill_widths: tuple[int, ...] = (), prefill_max_bs: int = 8, run_steps: int = 1):
        """``runner`` is the rank's ModelRunner (model, KV pool, graph attention backend). Graphs are keyed
        (member, bucket): a member is a width, PLAIN_DECODE, a run of ``run_steps`` decode
        steps (tandem.engine.run_graphs) or a prefill family's ("prefill", width, captures)
        (tandem.engine.prefill_graphs)."""
        super().__init__(runner.device, batch_buckets(max_bs), log_name="tandem.cuda_graph", watchdog=watchdog,
                         use_graphs=runner.device.type == "cuda" if use_graphs is None else use_graphs,
                         capture_deadline_s=capture_deadline_s, replay_deadline_s=replay_deadline_s)
        self.runner = runner
        self.page_size = runner.cfg.page_size
        self.max_pages = -(-runner.model_cfg.max_position_embeddings // self.page_size)
        # A speculative engine also needs features from plain decode steps (the drafter stays in step
        # while the policy has speculation off for a request).
        self.decode_features = any(w > 1 for w in widths) or runner.cfg.graph_decode_features
        # ... and, for the steps whose features no drafter keeps (it is detached), twins of the decode and prefill
        # families without them: such steps replay what target-only's graphs compute, not the capture layers' adds,
        # concatenation and copies on top (a small target's step is mostly kernel launches).
        twins = self.decode_features and not runner.cfg.graph_decode_features
        family = lambda w, captures, key=None: GraphFamily(  # noqa: E731
            w, self.max_bs, self.max_pages, self.page_size, self.device, captures=captures, key=key)
        self.families = {w: family(w, w > 1 or self.decode_features) for w in widths}
        self.plain_decode = family(1, False, PLAIN_DECODE) if twins and 1 in widths else None
        buckets = prefill_buckets(prefill_max_bs)
        prefill = lambda captures: {  # noqa: E731
            w: PrefillFamily(w, buckets, self.max_pages, self.page_size, self.device, captures) for w in prefill_widths}
        self.prefill = prefill(self.decode_features)
        self.plain_prefill = prefill(False) if twins else {}
        twin_families = [f for f in (self.plain_decode, *self.plain_prefill.values()) if f is not None]
        self._members = {f.key: f for f in (*self.families.values(), *self.prefill.values(), *twin_families)}
        self._names = {key: _name(f) + (" without features" if f in twin_families else "")
                       for key, f in self._members.items()}
        # runs of decode steps in one graph, on the decode families plain steps replay, without features and with them
        decode = self.families.get(1)
        self.run_graphs = RunGraphs(self, self.plain_decode or (decode if decode is not None and not decode.captures
                                                                  else None),
                                    decode if decode is not None and decode.captures else None, run_steps)
        self._members.update(self.run_graphs.families)
        self._names.update(self.run_graphs.names())
        # ids, positions, slots, kv_lens, block tables, masks of the widest family's largest batch
        self.staging = PinnedStaging(max([self.max_bs * (3 * w + 1 + self.max_pages + w * w) for w in widths]
                                         + [f.staging_size for f in self.prefill.values()]), self.device)

    # -- capture ---------------------------------------------------------------------------------
    def capture_plan(self):
        """The widths' families first; then, the twins kept only where they pay (``_twins_pay``, timed on the decode
        graphs just captured), the decode twin, the runs and the prefill families (yielded as the capture goes)."""
        for w in sorted(self.families, reverse=True):
            yield self._family_name(w), [w]
        if self.plain_decode is not None and not self._twins_pay():
            self._drop_twins()
        members = [PLAIN_DECODE] if self.plain_decode is not None else []
        members += list(self.run_graphs.families)
        for families in (self.prefill, self.plain_prefill):
            members += [f.key for _, f in sorted(families.items(), reverse=True)]
        for m in members:
            yield self._family_name(m), [m]

    def _twins_pay(self) -> bool:
        """Whether twins without features are worth their capture: where the decode graph with features takes the
        device RUN_GRAPH_MAX_STEP_S or less at one row, a step is mostly launches and the capture layers' adds,
        concatenation and copies a share of it; a longer step hides them (DeepSeek-V2-Lite's twins were 2.2 of its
        5.8 s of capture)."""
        # timed on a GPU's graphs, one rank only: ranks timing their own steps could keep different families, whose
        # captures' collectives would then not pair (as runs in one graph, which are one rank's only)
        if not self.use_graphs or self.device.type != "cuda" or self.runner.cfg.tp_size > 1:
            return True
        return self.run_graphs.step_seconds(self.families[1], 1) <= RUN_GRAPH_MAX_STEP_S

    def _drop_twins(self) -> None:
        """Plain steps and prompts replay the families with features (their features unused); runs too."""
        twins = [self.plain_decode, *self.plain_prefill.values()]
        self.plain_decode, self.plain_prefill = None, {}
        for key in [f.key for f in twins] + list(self.run_graphs.families):
            del self._members[key], self._names[key]
        self.run_graphs = RunGraphs(self, None, self.families[1], self.run_graphs.steps, self.run_graphs.step_s)
        self._members.update(self.run_graphs.families)
        self._names.update(self.run_graphs.names())
        self.log.info("no twins without features: a decode step with them takes over %.2f ms at one row (timed below)",
                      1e3 * RUN_GRAPH_MAX_STEP_S)

    def _family_name(self, member) -> str:
        return self._names[member]

    def _family_of(self, member) -> GraphFamily:
        """A member's static buffers: a width's decode or verify family, a prefill family, or a twin."""
        return self._members[member]

    def member_buckets(self, member) -> list[int]:
        if member in self.run_graphs.families:
            return self.run_graphs.buckets(member)
        fam = self._family_of(member)
        return fam.buckets if isinstance(fam, PrefillFamily) else self.buckets

    def static_warmup_bucket(self, member) -> int:
        # a prefill family sizes its outputs for its largest bucket at any: the smallest is the cheapest (the CPU
        # tests' interpreted kernels)
        fam = self._family_of(member)
        return fam.buckets[0] if isinstance(fam, PrefillFamily) else super().static_warmup_bucket(member)

    def _pad_all(self, member, bs: int) -> None:
        # staged as a batch's are, so that a capture also compiles each family's scatter kernel
        self._family_of(member).stage_uniform([], bs, self.staging)

    def _body(self, member, bs: int) -> None:
        fam = self._family_of(member)
        layers = self.runner.capture_layers if fam.captures else ()
        if isinstance(fam, PrefillFamily):
            fam.run_model(self.runner, bs, layers)
        elif member in self.run_graphs.families:
            self.run_graphs.body(member, bs)
        else:
            self._run_model(fam, bs, layers)

    def _run_model(self, fam: GraphFamily, bs: int, layers: tuple[int, ...]) -> None:
        n = bs * fam.width
        r = self.runner
        hidden, features = r.model(fam.input_ids[:n], fam.positions[:n], fam.meta(bs), r.kv, r.graph_backend, layers)
        fam.store(r.model.logits(hidden), features, self.max_bs * fam.width, self.max_bs * fam.width)

    # -- replay ----------------------------------------------------------------------------------
    def can_run(self, batch: ForwardBatch) -> bool:
        return bool(batch.seqs) and (self._uniform_fits(batch) or self._prefill_family(batch) is not None)

    def _prefill_family(self, batch: ForwardBatch) -> PrefillFamily | None:
        """The narrowest prefill family for a batch of prompt chunks alone, if one takes it."""
        if not self.prefill or not all(is_prompt_chunk(s) for s in batch.seqs):
            return None
        if batch.capture_features and not self.decode_features:
            return None  # (as a decode graph's rule)
        longest = max(len(s.token_ids) for s in batch.seqs)
        if longest == 1:
            return None  # single tokens are a decode step (its family, or eager: a run's graphs are the decode family's)
        families = self.plain_prefill if self.plain_prefill and not batch.capture_features else self.prefill
        fam = next((f for w, f in sorted(families.items()) if w >= longest), None)
        return fam if fam is not None and fam.takes(batch) else None

    def _uniform_fits(self, batch: ForwardBatch) -> bool:
        """A decode or verify family takes the batch: every sequence as wide as the family."""
        seqs = batch.seqs
        if len(seqs) > self.max_bs:
            return False
        width = len(seqs[0].token_ids)
        fam = self.families.get(width)
        if fam is None or any(len(s.token_ids) != width for s in seqs):
            return False
        if batch.capture_features and width == 1 and not self.decode_features:
            return False  # features asked of a decode graph captured without them: eager (correct, slower)
        if width > 1 and any(s.logits != "all" or s.logits_from for s in seqs):
            # the graph returns every row's logits: a prompt (one row wanted, or those from a position) is eager or a
            # prefill family's
            return False
        # a tree mask must cover exactly the new tokens (verification); the last W keys of drafting are eager
        return all(s.tree_mask is None or len(s.tree_mask[0]) == width for s in seqs)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, sync: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the bucket that fits ``batch``. ``sync=False`` returns as soon as the replay is queued
        (the caller queues more work behind it and waits later, under ``guard``)."""
        member, bs, outputs = self._stage(batch)
        # A hang shows at the first wait on the replay's work; the caller reads the logits right after
        # anyway, so waiting here costs nothing and puts the hang inside the guard.
        with self.guard(self._replay_name(member, bs)):
            self._launch(member, bs)
            if sync and self.device.type == "cuda":  # (CPU tests stand replays in with eager code)
                torch.cuda.current_stream(self.device).synchronize()
        return outputs()

    def _stage(self, batch: ForwardBatch) -> tuple[object, int, object]:
        """Fill the static inputs of the family that takes ``batch`` → (its member, bucket, a function that
        reads the replay's (float32 logits, features) into tensors of the caller's own)."""
        fam = None if self._uniform_fits(batch) else self._prefill_family(batch)
        if fam is not None:
            bs, n, real = fam.stage(batch, self.staging)
            return fam.key, bs, lambda: fam.outputs(n, real, batch.capture_features)
        fam, bs, m = self.prepare(batch)
        return fam.key, bs, lambda: (own_float(fam.logits[:m]), fam.features[:m] if fam.features is not None else None)

    @torch.inference_mode()
    def run_decode_steps(self, batch: ForwardBatch | None, steps: int, pick, after: tuple | None = None,
                         features: bool = False, whole_run: tuple | None = None) -> tuple:
        """``steps`` replays of the decode graph for a width-1 ``batch`` whose pages cover all of them
        (tandem.engine.decode_ahead). Step k+1's input token is ``pick(logits of step k, its features or
        None, k)`` (a device tensor [n], model-dtype logits; features only when the decode graphs output
        them and ``features``); between replays the inputs advance on the device (``advance``)
        and nothing waits for it. ``after``: what a run queued before returned — go on from its inputs
        (``batch`` unused; the block tables restaged for the pages reserved since). → (family, bucket,
        the last step's tokens), for a run after this one. ``whole_run``: (the run's tokens [steps, n], the list
        its features go into or None, its StepSampler) where ``pick`` is that sampler alone (no penalties, no
        logprobs); where a run's graph takes it (tandem.engine.run_graphs), one replay fills them, ``pick`` unused."""
        if after is None:
            fam, bs, _ = self.prepare(batch)
            token = None
        else:
            fam, bs, token = after
        n = len(batch.seqs) if after is None else token.shape[0]
        if whole_run is not None and self.run_graphs.run(fam, bs, n, steps, token, *whole_run):
            return fam, bs, whole_run[0][steps - 1]
        for k in range(steps):
            if token is not None:
                self.advance(fam, n, token[:, None], 1)
            logits, feats = self.replay_prepared(fam, bs, n)
            token = pick(logits, feats if features else None, k)
        return fam, bs, token

    def replay_prepared(self, fam: GraphFamily, bs: int, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay bucket ``bs`` of ``fam`` on the static inputs as they stand (``prepare``d, then
        ``advance``d), without waiting: → views of the first ``n`` sequences' logits (model dtype) and
        features, valid until the family's next replay."""
        with self.guard(self._replay_name(fam.key, bs)):
            self._launch(fam.key, bs)
        m = n * fam.width
        return fam.logits[:m], (fam.features[:m] if fam.features is not None else None)

    def advance(self, fam: GraphFamily, n: int, ids: torch.Tensor, by: torch.Tensor | int) -> None:
        """Stage, on the device, the next forward of the ``n`` sequences the static inputs hold: ``ids``
        ([n, width] device tokens) in, each sequence moved ``by`` tokens further (an int, or a device
        int64 [n]) — positions, KV lengths and slots follow through the block tables, which must
        already hold the pages. For forwards whose KV index is the token's position: decode steps
        and chains (a tree's nodes share positions). On a GPU in one kernel (tandem.kernels.round_glue):
        these ten small torch ops ran between every two replays of a queued decode run."""
        w, ps = fam.width, self.page_size
        if use_triton(fam.input_ids):
            from tandem.kernels import round_glue

            round_glue.advance(None, None, by, fam.input_ids, fam.positions, fam.kv_lens, fam.slots, fam.block_tables,
                               ps, w, chains=ids.reshape(n, w).contiguous())
            return
        fam.input_ids[: n * w].copy_(ids.reshape(-1))
        positions = fam.positions[: n * w].view(n, w)
        positions += by if isinstance(by, int) else by[:, None]
        fam.kv_lens[:n] += by
        fam.slots[: n * w].view(n, w).copy_(page_slots(fam.block_tables[:n], positions, ps))

    def share_inputs(self, fam: GraphFamily, n: int) -> None:
        """Several ranks: the first ``n`` sequences' inputs as rank 0 advanced them on the device (tokens,
        positions, slots, lengths) become every rank's, by device broadcasts queued before the replay."""
        w = fam.width
        for t in (fam.input_ids[: n * w], fam.positions[: n * w], fam.slots[: n * w], fam.kv_lens[:n]):
            broadcast_tensor(t)

    def restage_pages(self, fam: GraphFamily, tables: list | None) -> None:
        """Copy the block tables of the sequences the static inputs hold again (more pages were reserved
        for forwards queued further), leaving positions, lengths and slots as the device advanced them (None:
        nothing new to stage)."""
        if tables is None:
            return
        rows = send_page_rows(self.staging, tables)
        fam.block_tables[: rows.shape[0], : rows.shape[1]].copy_(rows)

    def _replay_name(self, member, bs: int) -> str:
        return f"replay {self._family_name(member)} cuda graph bs={bs}"

    @torch.inference_mode()
    def run_static_eagerly(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the graph computes, without the graph: the static buffers, kernels and padding, run
        eagerly. Lets the CPU tests (Triton's interpreter) check everything but capture itself."""
        member, bs, outputs = self._stage(batch)
        self._body(member, bs)
        return outputs()

    def prepare(self, batch: ForwardBatch) -> tuple[GraphFamily, int, int]:
        """Fill the static inputs of the bucket that fits ``batch`` (one host→device copy); → (family,
        bucket, real rows)."""
        seqs = batch.seqs
        width = len(seqs[0].token_ids)
        fam = (self.plain_decode if width == 1 and self.plain_decode is not None and not batch.capture_features
               else self.families[width])
        bs = self.bucket(len(seqs))
        return fam, bs, fam.stage_uniform(seqs, bs, self.staging)
