"""A second CUDA stream per device for work a layer can run beside its main chain of kernels.

At batch-1 decode a mixture-of-experts layer is a chain of small dependent kernels (router logits, routing,
the routed experts' two GEMVs, their sum); the shared experts depend on none of them, so they run on this stream
(tandem/layers/moe.py), forked from the main stream before the router and joined before the sum that adds them.
Inside a CUDA graph capture the fork and join become the graph's edges (torch captures side streams that join
back); eagerly they are two streams' order: ``x`` is read there after the fork, the shared output on the main stream
after the join, and each stream's later allocations come after the next fork or join, so neither reuses memory the
other still reads. That holds as long as only this fork-and-join uses the stream: work queued on it must start after
a fork from the stream that reads its results, and be joined before they are read. ``SIDE_STREAMS``: off for an A/B
(bench/profile_deepseek.py ``--no-side-stream``).
"""

from __future__ import annotations

import functools

import torch

SIDE_STREAMS = True
# Up to this many rows (decode and verify batches, short prompts): beyond, the work is compute-bound with nothing to
# hide, and the caching allocator would keep a prompt's activations in each stream's pool apart (the KV cache is sized
# before any serving step, from what is left).
MAX_ROWS = 512


@functools.cache
def _stream(device_index: int) -> torch.cuda.Stream:
    """A stream of torch's per-device pool (handed out in turn, 32 of them) that is neither the one this call runs on
    nor the graphs' capture stream: on either, the fork and join would order nothing apart and the overlap be lost."""
    from tandem.graph_capture import capture_stream

    taken = {torch.cuda.current_stream(device_index), capture_stream(torch.device("cuda", device_index))}
    for _ in range(64):
        stream = torch.cuda.Stream(device=device_index)
        if stream not in taken:
            return stream
    return stream


def side_stream(x: torch.Tensor) -> torch.cuda.Stream | None:
    """The side stream of ``x``'s device; None on the CPU, past ``MAX_ROWS`` rows or with side streams off."""
    if not SIDE_STREAMS or not x.is_cuda or x.shape[0] > MAX_ROWS:
        return None
    return _stream(x.device.index if x.device.index is not None else torch.cuda.current_device())
