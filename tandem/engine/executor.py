"""TargetExecutor: rank 0's handle on the tensor-parallel group that runs the target model.

The engine process is rank 0. With ``tp_size > 1`` it spawns ranks 1..N-1 itself (one process per
rank, ``torch.distributed`` with gloo on CPU and NCCL on GPU); each worker builds its shard of the
model and then follows rank 0's broadcasts: ``forward`` with a ForwardBatch, ``move_kv`` (compacting
accepted tree nodes), or ``stop``. Sampling
and every other decision happen on rank 0 only, so ranks cannot diverge.
"""

from __future__ import annotations

import logging
import multiprocessing as mp

import torch

from tandem.distributed import broadcast_object, destroy_tp, free_tcp_init_method, init_tp
from tandem.engine.batch import ForwardBatch
from tandem.engine.config import EngineConfig
from tandem.engine.model_runner import ModelRunner, rank_device
from tandem.models.config import ModelConfig

log = logging.getLogger("tandem.executor")


def _worker_main(cfg: EngineConfig, rank: int, init_method: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    init_tp(rank, cfg.tp_size, init_method, rank_device(cfg.device, rank))
    runner = ModelRunner(cfg, ModelConfig.from_dir(cfg.model))
    while True:
        command, payload = broadcast_object()
        if command == "stop":
            break
        if command == "move_kv":
            runner.move_kv(*payload)
        else:
            runner.forward(payload)
    destroy_tp()


class TargetExecutor:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(cfg.model)  # fail fast, before any process starts
        self._workers: list[mp.Process] = []
        if cfg.tp_size > 1:
            if cfg.device == "cpu":
                # Split the machine's cores between ranks instead of oversubscribing them.
                torch.set_num_threads(max(1, torch.get_num_threads() // cfg.tp_size))
            init_method = free_tcp_init_method()
            ctx = mp.get_context("spawn")
            for rank in range(1, cfg.tp_size):
                p = ctx.Process(target=_worker_main, args=(cfg, rank, init_method), daemon=True, name=f"tandem-tp{rank}")
                p.start()
                self._workers.append(p)
            try:
                init_tp(0, cfg.tp_size, init_method, rank_device(cfg.device, 0))
            except Exception:
                self._kill_workers()
                raise
        try:
            self.runner = ModelRunner(cfg, self.model_config)
        except Exception:
            self._kill_workers()
            destroy_tp()
            raise

    @property
    def num_pages(self) -> int:
        return self.runner.num_pages

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._workers:
            batch = batch.with_host_tokens()  # the other ranks cannot read rank 0's device
        broadcast_object(("forward", batch))
        return self.runner.forward(batch)

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy KV slots on every rank (rank 0 decides which, from the accepted tree nodes)."""
        if src:
            broadcast_object(("move_kv", (src, dst)))
            self.runner.move_kv(src, dst)

    def shutdown(self) -> None:
        if self._workers:
            broadcast_object(("stop", None))
            for p in self._workers:
                p.join(timeout=30)
            self._kill_workers()
        destroy_tp()

    def _kill_workers(self) -> None:
        """Stop every rank process and reap it (a terminated process not yet waited for is still a child)."""
        for p in self._workers:
            if p.is_alive():
                p.terminate()
        for p in self._workers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._workers = []
