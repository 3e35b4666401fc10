"""ModelRunner: one rank's target model, KV pool and attention backend, executing ForwardBatches.

Every rank runs the same ``forward`` on the same ForwardBatch; the collectives inside the layers keep
them in step. Rank 0 gets the full logits (the LM head all-gathers) and the EAGLE-3 features (the
residual stream is replicated after every row-parallel all-reduce) and decides what happens next.
"""

from __future__ import annotations

import gc
import logging
import time

import torch
import torch.distributed as dist

from tandem.attention.choice import make_backend, resolve_backend
from tandem.forward_batch import ForwardBatch, to_device
from tandem.engine.config import EngineConfig
from tandem.errors import ConfigError
from tandem.kv_cache import KVPool, KVSpec
from tandem.matmul_warm import MatmulWarm, shapes_file
from tandem.configs.model import ModelConfig
from tandem.models.loader import default_dtype, resolve_dtype
from tandem.models.random_weights import randomize_weights
from tandem.models.registry import build_model
from tandem.distributed import tp_group

log = logging.getLogger("tandem.runner")


def rank_device(device: str, rank: int) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    base = torch.device(device)
    return torch.device("cuda", (base.index or 0) + rank)


def graph_widths(widths: tuple[int, ...], latent: bool) -> tuple[int, ...]:
    """The verify widths to capture: the graphs' attention kernels (tandem/kernels/paged_attention.py, and MLA's) hold a
    row's tree mask in one 64-bit word, so they take trees of at most 64 nodes (wider ones verify eagerly)."""
    from tandem.attention.mla_triton_backend import MAX_MASK_WIDTH

    kept = tuple(w for w in widths if w <= MAX_MASK_WIDTH)
    if kept != tuple(widths):
        log.warning("verify widths %s exceed the %s kernel's %d nodes: those verifies run eagerly",
                    sorted(set(widths) - set(kept)), "MLA" if latent else "paged attention", MAX_MASK_WIDTH)
    return kept


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig):
        self.cfg, self.model_cfg = cfg, model_cfg
        self.rank = tp_group().rank
        self.device = rank_device(cfg.device, self.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(cfg.dtype, model_cfg.dtype, self.device)
        # Ascending, always (docs/architecture.md, "Contracts": features concatenate in ascending layer order).
        self.capture_layers = tuple(sorted(cfg.capture_layers if cfg.capture_layers is not None
                                           else model_cfg.default_capture_layers()))
        bad = [i for i in self.capture_layers if not 0 <= i < model_cfg.num_layers]
        if bad:
            raise ConfigError(f"capture layer {bad[0]} is out of range for a {model_cfg.num_layers}-layer model")

        attention = resolve_backend(cfg.attention_backend, self.device, latent=model_cfg.mla is not None)
        self.matmul_warm = None
        if self.device.type == "cuda":
            from tandem.kernels.triton_start import hash_triton_early

            hash_triton_early()  # (while the weights load)
            if not cfg.disable_cuda_graph and not cfg.static_graph_path:
                self.matmul_warm = MatmulWarm(shapes_file(cfg, model_cfg, torch.cuda.get_device_name(self.device)),
                                              self.device).start()
        started = time.perf_counter()
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = build_model(model_cfg).eval()
        if cfg.load_format == "random":
            randomize_weights(self.model, seed=1234 + self.rank)
        else:
            self.model.load(cfg.model)
        for module in self.model.modules():  # what a layer derives from its weights (tandem.layers.moe)
            if hasattr(module, "weights_loaded"):
                module.weights_loaded()
        quant = model_cfg.quantization
        log.info("rank %d: loaded %s (%s, %s%s) in %.1f s", self.rank, cfg.model, model_cfg.architecture,
                 str(self.dtype).replace("torch.", ""), f", {quant.describe()}" if quant is not None else "",
                 time.perf_counter() - started)
        if self.matmul_warm is not None:
            self.matmul_warm.join()  # (before the KV cache is sized: its spare memory is handed back)

        spec = self.model.kv_spec()
        self.backend = make_backend(attention, self.device, latent=spec.entries == 1)
        self.num_pages = self._size_kv_pool(spec)
        self.kv = KVPool.from_spec(spec, model_cfg.num_layers, self.num_pages, cfg.page_size, self.dtype, self.device)
        page_bytes = KVPool.bytes_per_page(model_cfg.num_layers, cfg.page_size, spec.heads, spec.dim, self.dtype,
                                           spec.entries)
        log.info("rank %d: KV cache %d pages x %d tokens = %d tokens (%d for requests: page 0 is reserved), %.2f GiB "
                 "(%d bytes a token)", self.rank, self.num_pages, cfg.page_size, self.num_pages * cfg.page_size,
                 (self.num_pages - 1) * cfg.page_size, self.num_pages * page_bytes / 2**30, page_bytes // cfg.page_size)
        self.graphs = None
        graphable = self.model.supports_cuda_graphs
        wanted = (self.device.type == "cuda" and not cfg.disable_cuda_graph) or cfg.static_graph_path
        if wanted and not graphable:
            log.warning("rank %d: %s has no CUDA-graph path yet; every forward runs eagerly", self.rank,
                        model_cfg.architecture)
        if wanted and graphable:
            from tandem.attention.graph_backend import make_graph_backend
            from tandem.engine.cuda_graph import TargetGraphRunner
            from tandem.prefill_shapes import prefill_widths

            latent = spec.entries == 1
            self.graph_backend = make_graph_backend(latent)
            widths = graph_widths(cfg.cuda_graph_widths, latent)
            prefills = prefill_widths(cfg.prefill_graph_tokens)
            # runs in one graph on one rank only (several follow rank 0's picks a step at a time, and each rank timing
            # its own steps could capture different graphs, whose collectives would then not pair)
            run_steps = cfg.decode_steps_with(graphed=True) if cfg.tp_size == 1 else 1
            self.graphs = TargetGraphRunner(self, widths, cfg.cuda_graph_max_bs, use_graphs=not cfg.static_graph_path,
                                            prefill_widths=prefills, prefill_max_bs=cfg.prefill_graph_max_bs,
                                            run_steps=run_steps)
            if cfg.static_graph_path:
                self.graphs.run_statically()
            else:
                try:
                    self.graph_report = self.graphs.capture(self.matmul_warm)
                except Exception as e:
                    raise ConfigError(f"capturing the CUDA graphs of {model_cfg.architecture} failed "
                                      f"({type(e).__name__}: {e}); --disable-cuda-graph serves it eagerly") from e

    def _size_kv_pool(self, spec: KVSpec) -> int:
        cfg, m = self.cfg, self.model_cfg
        if cfg.kv_pages is not None:
            pages = cfg.kv_pages
        elif self.device.type == "cpu":
            pages = -(-cfg.cpu_kv_tokens // cfg.page_size) + 1
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            # Blocks this process's allocator caches are ours to reuse.
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            used = total - free
            budget = total * cfg.mem_fraction_static - used
            per_page = KVPool.bytes_per_page(m.num_layers, cfg.page_size, spec.heads, spec.dim, self.dtype, spec.entries)
            pages = int(budget // per_page)
            if pages < 2:
                raise ConfigError(
                    f"no GPU memory left for the KV cache after the weights ({used / 2**30:.1f} GiB used of "
                    f"{total / 2**30:.1f}); raise --mem-fraction-static or --tp-size"
                )
        if tp_group().size > 1:  # every rank must hold the same page ids
            t = torch.tensor([pages], device=self.device if self.device.type == "cuda" else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            pages = int(t.item())
        return pages

    def release(self) -> None:
        """Give the device memory back (weights, KV pool, graphs) even where something still holds this
        runner: the next engine in the process sizes its KV pool from what is free."""
        self.graphs = self.kv = self.model = None
        if self.device.type == "cuda":  # (a collection costs ~0.1 s; host memory needs none of this)
            gc.unfreeze()  # a service froze its start-up heap (tandem.service_runtime): this runner is in it
            gc.collect()
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def move_kv(self, src: list[int], dst: list[int]) -> None:
        self.kv.move_slots(src, dst)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, sync: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """→ (float32 logits of the requested rows [N, V], features [T, k·H] or None). ``sync=False``: a
        graph replay returns once queued (eager forwards are queued anyway)."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch, sync=sync)
        batch = batch.with_host_tokens()
        dev = to_device(batch, self.cfg.page_size, self.device)
        self.backend.plan(dev.meta)
        layers = self.capture_layers if batch.capture_features else ()
        hidden, features = self.model(dev.input_ids, dev.positions, dev.meta, self.kv, self.backend, layers)
        logits = self.model.logits(hidden[dev.logits_indices]).float()
        return logits, features
