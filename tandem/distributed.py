"""Tensor-parallel process group: which rank this process is, and the collectives the layers call.

One process per rank; rank 0 is the process that owns the scheduler. With ``size == 1`` every
collective is the identity and ``torch.distributed`` is never initialised, so single-process runs
(and the drafter) pay nothing. NCCL carries tensors on GPU, gloo on CPU; control messages (the
batch description rank 0 broadcasts every step) always go over a gloo group, since they are Python
objects that live on the host.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


_GROUP = TPGroup()
_CONTROL_GROUP = None


def tp_group() -> TPGroup:
    return _GROUP


def init_tp(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = 600.0) -> TPGroup:
    """Join the tensor-parallel group. Called once per process before the model is built."""
    global _GROUP, _CONTROL_GROUP
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
        )
        _CONTROL_GROUP = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    _GROUP = TPGroup(rank=rank, size=size)
    return _GROUP


def destroy_tp() -> None:
    global _GROUP, _CONTROL_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP, _CONTROL_GROUP = TPGroup(), None


def free_tcp_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _GROUP.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (rank order)."""
    if _GROUP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_GROUP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` (same shape and dtype) becomes rank 0's, in place: queued on the device's stream
    (NCCL), no host wait."""
    if _GROUP.size > 1:
        dist.broadcast(x, src=0)
    return x


def broadcast_object(obj: object = None) -> object:
    """Rank 0 passes ``obj``; every rank returns rank 0's object."""
    if _GROUP.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_CONTROL_GROUP)
    return box[0]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        from tandem.errors import ConfigError

        raise ConfigError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator
