"""TargetExecutor: rank 0's handle on the tensor-parallel group that runs the target model.

The engine process is rank 0. With ``tp_size > 1`` it spawns ranks 1..N-1 itself (one process per
rank, ``torch.distributed`` with gloo on CPU and NCCL on GPU); each worker builds its shard of the
model and then follows rank 0's broadcasts: ``forward`` with a ForwardBatch, ``move_kv`` (compacting
accepted tree nodes), ``decode_steps`` (a run of graphed decode steps queued on the device: each step's
token, sampled on rank 0, reaches the other ranks by a device broadcast, so no rank waits for the host),
``chain_rounds`` (a run of speculative chain rounds: each round's verify inputs, as rank 0's draft and
accept left them on the device, broadcast before its replay), or ``stop``. Sampling and every other
decision happen on rank 0 only, so ranks cannot diverge.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.connection import wait

import torch

from tandem.distributed import broadcast_object, broadcast_tensor, destroy_tp, free_tcp_init_method, init_tp
from tandem.forward_batch import ForwardBatch
from tandem.engine.config import EngineConfig
from tandem.engine.model_runner import ModelRunner, rank_device
from tandem.configs.model import ModelConfig
from tandem.parent_death import exit_with_parent_process, process_alive
from tandem.watchdog import ENGINE_FAILED_EXIT_CODE, fail_process

log = logging.getLogger("tandem.executor")


def _worker_main(cfg: EngineConfig, rank: int, init_method: str, log_level: int, rank0_pid: int) -> None:
    """``log_level``: rank 0's (a quiet `tandem generate` keeps every rank quiet)."""
    logging.basicConfig(level=log_level, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    # A rank ends by rank 0's "stop", its parent's end, or a kill — not by a terminal's Ctrl-C or a service manager's
    # SIGTERM to the whole process group, which rank 0 answers with a drain of its own (the rank gone meanwhile would
    # read as a lost rank, and a trainer's last step could not be saved).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent_process(f"tensor-parallel rank {rank}", rank0_pid)  # (rank 0 killed outright: no "stop" comes)
    torch.set_num_threads(1)
    init_tp(rank, cfg.tp_size, init_method, rank_device(cfg.device, rank))
    runner = ModelRunner(cfg, ModelConfig.from_dir(cfg.model))
    run_state = None  # the last run of decode steps: where a run after it goes on from
    while True:
        command, payload = broadcast_object()
        if command == "stop":
            break
        if command == "move_kv":
            runner.move_kv(*payload)
        elif command == "decode_steps":
            run_state = _follow_decode_steps(runner, *payload, run_state)
        elif command == "chain_rounds":
            run_state = _follow_chain_rounds(runner, *payload, run_state)
        else:
            runner.forward(payload)
    destroy_tp()


def _follow_decode_steps(runner: ModelRunner, first: ForwardBatch | None, steps: int, tables: list | None,
                         rows: int, after: tuple | None) -> tuple:
    """A worker's share of rank 0's ``decode_steps``: the same replays, each step's input token received;
    ``after``: this worker's state after the run before (used when ``first`` is None)."""
    def receive(logits, features, k):
        return broadcast_tensor(torch.empty(rows, dtype=torch.int64, device=runner.device))

    if first is None:
        runner.graphs.restage_pages(after[0], tables)
    return runner.graphs.run_decode_steps(first, steps, receive, after=after if first is None else None)


@torch.inference_mode()
def _follow_chain_rounds(runner: ModelRunner, first: ForwardBatch | None, tables: list | None, rows: int,
                         rounds: int, after: tuple | None) -> tuple:
    """A worker's share of a run of chain rounds (tandem.speculative.chain_rounds): each round's verify, its
    inputs received from rank 0; ``after``: (family, bucket) of the run before (used when ``first`` is None)."""
    graphs = runner.graphs
    if first is not None:
        fam, bs, _ = graphs.prepare(first)
    else:
        fam, bs = after
        graphs.restage_pages(fam, tables)
    for _ in range(rounds):
        graphs.share_inputs(fam, rows)
        graphs.replay_prepared(fam, bs, rows)
    return fam, bs


def _end_ranks(workers: list, stopping: threading.Event) -> None:
    """Kill the ranks, quietly (``stopping`` set first), and reap them (a killed process not yet waited for is still a
    child). Killed: a rank ignores SIGTERM (``_worker_main``) and holds nothing to save — at interpreter exit too, where
    multiprocessing's own exit hook would send SIGTERM and then wait on them forever."""
    stopping.set()
    for p in workers:
        if p.is_alive():
            p.kill()
    for p in workers:
        p.join(timeout=10)


class _RoundFollowers:
    """Rank 0's handle on the other ranks for a run of chain rounds (``queue_chain_rounds(followers=...)``)."""

    def start(self, first: ForwardBatch | None, tables: list | None, rows: int, rounds: int) -> None:
        broadcast_object(("chain_rounds", (first.with_host_tokens() if first is not None else None, tables, rows,
                                           rounds)))


class TargetExecutor:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(cfg.model)  # fail fast, before any process starts
        self.model_config.check_tensor_parallel(cfg.tp_size)
        self._workers: list[mp.Process] = []
        self._stopping = threading.Event()  # set before ranks end on purpose (their watch then stays quiet)
        if cfg.tp_size > 1:
            if cfg.device == "cpu":
                # Split the machine's cores between ranks instead of oversubscribing them.
                torch.set_num_threads(max(1, torch.get_num_threads() // cfg.tp_size))
            init_method = free_tcp_init_method()
            ctx = mp.get_context("spawn")
            if cfg.device == "cpu":
                # Ranks forked from a server that imported this module once (torch and all) start in a fraction
                # of a second; spawned, each imports them again (~2.5 s of CPU a rank: the CPU tests start ~30).
                # Not on GPUs: there a rank starts from a fresh interpreter, as before.
                ctx = mp.get_context("forkserver")
                ctx.set_forkserver_preload([__name__])
            for rank in range(1, cfg.tp_size):
                level = logging.getLogger().getEffectiveLevel()
                p = ctx.Process(target=_worker_main, args=(cfg, rank, init_method, level, os.getpid()), daemon=True,
                                name=f"tandem-tp{rank}")
                p.start()
                self._workers.append(p)
            self._watch_ranks()
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

    def _watch_ranks(self) -> None:
        """Exit this process (ENGINE_FAILED_EXIT_CODE, health NOT_SERVING first) as soon as another rank ends unasked —
        killed, OOM-killed, failed to load its shard: every collective after that waits for it forever under NCCL (at
        start-up, init's rendezvous for init_tp's 10 minutes), the service SERVING and its requests hung. A supervisor starts
        the whole group again. Ranks ended on purpose (``_end_ranks``: shutdown, interpreter exit) are not a loss."""
        workers, stopping = list(self._workers), self._stopping
        atexit.register(_end_ranks, workers, stopping)  # (before multiprocessing's own exit hook, registered earlier)

        def watch() -> None:
            wait([p.sentinel for p in workers])
            # (ranks started through a fork server, the CPU's: their sentinels follow that server, which a signal to
            # the process group may end while they live on; their pids decide)
            def lost() -> list[int]:
                return [r for r, p in enumerate(workers, start=1) if not process_alive(p.pid)]

            while not stopping.is_set() and not lost():
                time.sleep(0.5)
            if stopping.is_set():
                return
            rank = lost()[0]
            workers[rank - 1].join(timeout=1)
            fail_process(f"tensor-parallel rank {rank}", f"tensor-parallel rank {rank} of {len(workers) + 1} ended "
                         f"(exit code {workers[rank - 1].exitcode}; see its log above); the target cannot run without "
                         "it: exiting so that a supervisor starts the group again", ENGINE_FAILED_EXIT_CODE)

        threading.Thread(target=watch, name="tandem-rank-watch", daemon=True).start()

    @property
    def prefill_graph_width(self) -> int:
        """The widest prompt chunk a prefill graph takes (0: none)."""
        graphs = self.runner.graphs
        return max(graphs.prefill, default=0) if graphs is not None else 0

    @property
    def num_pages(self) -> int:
        return self.runner.num_pages

    def forward(self, batch: ForwardBatch, sync: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._workers:
            batch = batch.with_host_tokens()  # the other ranks cannot read rank 0's device
        broadcast_object(("forward", batch))
        return self.runner.forward(batch, sync=sync)

    def decode_steps(self, first: ForwardBatch | None, steps: int, pick, after: tuple | None = None,
                     tables: list | None = None, features: bool = False, whole_run: tuple | None = None) -> tuple:
        """Queue ``steps`` graphed decode steps on every rank (TargetGraphRunner.run_decode_steps): of ``first``,
        or going on ``after`` the run before (its pages restaged from ``tables``, None: unchanged). Rank 0 samples each step's
        token with ``pick``; it reaches the other ranks by a device broadcast. ``whole_run``: a run's tokens
        [steps, n], features' list and sampler, for a graph of the whole run (one rank only: other ranks follow rank
        0's picks)."""
        graphs = self.runner.graphs
        if self._workers:
            rows = len(first.seqs) if first is not None else after[2].shape[0]
            broadcast_object(("decode_steps", (first.with_host_tokens() if first is not None else None, steps,
                                               tables, rows)))
            sample = pick
            pick = lambda logits, feats, k: broadcast_tensor(sample(logits, feats, k))  # noqa: E731
        if first is None:
            graphs.restage_pages(after[0], tables)
        return graphs.run_decode_steps(first, steps, pick, after=after if first is None else None, features=features,
                                       whole_run=None if self._workers else whole_run)

    def round_followers(self) -> _RoundFollowers | None:
        """The other ranks, for runs of chain rounds queued on the device (None: one rank)."""
        return _RoundFollowers() if self._workers else None

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy KV slots on every rank (rank 0 decides which, from the accepted tree nodes)."""
        if src:
            broadcast_object(("move_kv", (src, dst)))
            self.runner.move_kv(src, dst)

    def synchronize(self) -> None:
        """Wait for the device work queued so far (rank 0's; the ranks run in step)."""
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def shutdown(self, release: bool = True) -> None:
        """Stop the ranks; ``release``: give this rank's device memory back (not while a step may still run)."""
        self._stopping.set()
        if self._workers:
            broadcast_object(("stop", None))
            for p in self._workers:
                p.join(timeout=30)
            self._kill_workers()
        destroy_tp()
        if release:
            self.runner.release()

    def _kill_workers(self) -> None:
        _end_ranks(self._workers, self._stopping)
        self._workers = []
