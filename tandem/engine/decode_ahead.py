"""Several plain decode steps per engine step, queued back to back on the device.

A batch-1 decode step of an 8B model is ~4 ms of GPU work and ~0.5 ms of host work (scheduling,
staging, sampling, reading the token back). Done one step at a time the two run in series: the GPU
waits while the host handles the token it has just read. Here the host queues step k+1 right after
step k — its input token is step k's sampled token, left on the device: with CUDA graphs the static
inputs advance on the device (``TargetGraphRunner.advance``: token, position, KV length, slot),
eagerly it is fed through ``SequenceChunk.device_ids`` — and reads all the tokens back once, after
the last step. The host's work now overlaps the GPU's. (Speculative rounds are queued the same way:
tandem.speculative.chain_rounds.)

What this changes for a request: pages for all the steps are reserved up front, and a request that
stops early (EOS, a stop token) has its later tokens computed and dropped (its KV beyond the stop is
released at commit, as after a speculative round). Streaming delivers the steps' tokens together.
Greedy tokens are those of one-step decoding; a sampled request draws its uniforms from its own
generator in step order, the numbers one-step decoding would draw, so seeded output is the same too.

The engine uses it only when nothing else needs the host between steps (tandem.engine.llm_engine:
no prompt waiting, no request speculating, no drafter or traffic capture to feed, one rank).
"""

from __future__ import annotations

import contextlib

import torch

from tandem.engine.batch import ForwardBatch, SequenceChunk
from tandem.engine.request import Request
from tandem.sampling import StepSampler


@torch.inference_mode()
def decode_ahead(runner, reqs: list[Request], steps: int) -> list[list[int]]:
    """Run ``steps`` decode steps of ``reqs`` (pages reserved for all of them) → each request's tokens.

    ``runner``: the engine's ModelRunner (tensor-parallel size 1)."""
    device = runner.device
    # Settings and uniforms reach the device before the first forward is queued.
    sampler = StepSampler([req.params for req in reqs], [req.generator for req in reqs], device,
                          runner.model_cfg.vocab_size, steps)
    tokens = torch.empty(steps, len(reqs), dtype=torch.int64, device=device)

    def pick(logits: torch.Tensor, k: int) -> torch.Tensor:
        tokens[k] = sampler(logits, k)
        return tokens[k]

    graphs = runner.graphs
    first = ForwardBatch([SequenceChunk([req.tokens[-1]], req.num_tokens - 1, req.kv.page_table()) for req in reqs])
    if graphs is not None and graphs.can_run(first):
        graphs.run_decode_steps(first, steps, pick)  # the inputs advance on the device
    else:
        _forward_steps(runner, reqs, steps, pick)
    waiting = graphs.guard_wait(f"decode ahead: {steps} steps, batch {len(reqs)}") if graphs else contextlib.nullcontext()
    with waiting:
        per_step = tokens.tolist()
    return [[per_step[k][i] for k in range(steps)] for i in range(len(reqs))]


def _forward_steps(runner, reqs: list[Request], steps: int, pick) -> None:
    """The same steps through ``runner.forward`` (eager, or a batch no graph fits), each fed the
    previous step's token through ``SequenceChunk.device_ids``."""
    token = None
    for k in range(steps):
        chunks = []
        for i, req in enumerate(reqs):
            committed = req.num_tokens - 1 + k  # KV entries before this step's input token
            if k == 0:
                chunks.append(SequenceChunk([req.tokens[-1]], committed, req.kv.page_table()))
            else:
                chunks.append(SequenceChunk([-1], committed, req.kv.page_table(), device_ids=token[i : i + 1]))
        logits, _ = runner.forward(ForwardBatch(chunks), sync=False)
        token = pick(logits, k)
