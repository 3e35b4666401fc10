"""CUDA IPC export and import of one ring tensor, found by GPU UUID rather than device index.

The export uses the same two calls that ``torch.multiprocessing`` uses for CUDA tensors
(``UntypedStorage._share_cuda_`` on the producer, ``reductions.rebuild_cuda_tensor`` on the consumer),
but the result is packed into one opaque byte string instead of being pickled, so it can ride in a
protobuf ``bytes`` field, and the device is sent as a UUID: ``reduce_tensor`` sends the producer's
device *index*, which names a different GPU when the two processes see different
``CUDA_VISIBLE_DEVICES`` (pytorch#149248; SGLang patches the reductions for the same reason).

Keep ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments`` off in both processes: with it torch shares
through pidfd_getfd, which unprivileged containers refuse.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from tandem.ring.posix import shm_path

_MAGIC, _VERSION = b"TRNG", 1
# torch names its cross-process ref-counter file /torch_<pid>_<random>_<n>; torch opens the one a peer's
# export names, so the name is checked first (no path can reach another file).
_TORCH_REF_NAME = re.compile(rb"/?torch_[0-9]+(?:_[0-9]+)*")
_HEADER = struct.Struct("<4sHQQQ?")  # magic, version, storage bytes, storage offset, ref-counter offset, sync


@dataclass
class CudaExport:
    tensor: torch.Tensor  # the owner's ring; must stay alive as long as any drafter may use it
    handle: bytes  # opaque; goes into RingSpec.cuda_ipc_handle
    gpu_uuid: str
    ready_event: torch.cuda.Event  # recorded after each round's writes; the drafter waits on it
    owner_files: list[str]  # /dev/shm files (or globs) that only the owner's death makes garbage


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; LookupError names what is visible instead."""
    visible = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid in visible:
        return visible.index(uuid)
    raise LookupError(f"GPU {uuid} is not visible to this process (it sees {visible or 'no GPU'}); run the "
                      f"drafter with a CUDA_VISIBLE_DEVICES that includes the verifier's GPU")


def _pack(*blobs: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in blobs)


def _unpack(data: bytes, n: int) -> list[bytes]:
    out, at = [], 0
    for _ in range(n):
        (size,) = struct.unpack_from("<I", data, at)
        out.append(data[at + 4:at + 4 + size])
        at += 4 + size
    return out


def export_rows(num_rows: int, row_width: int, dtype: torch.dtype, device: torch.device) -> CudaExport:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        tensor = torch.zeros(num_rows, row_width, dtype=dtype, device=f"cuda:{index}")
        # One interprocess event, recorded after every round's writes: ordering without a host sync.
        ready = torch.cuda.Event(interprocess=True)
        ready.record()
        # _share_cuda_ wraps the storage in torch's cross-process refcount (CudaIPCSentData). That count
        # expects one receiver per export; a restarted drafter re-uses this export, so the owner, not
        # the count, keeps the memory alive: it holds the tensor until close(), at shutdown.
        (_dev, handle, size, offset, ref_handle, ref_offset, event_handle,
         sync) = tensor.untyped_storage()._share_cuda_()
        blob = _HEADER.pack(_MAGIC, _VERSION, size, offset, ref_offset, bool(sync)) + _pack(
            handle, ref_handle, event_handle or b"", ready.ipc_handle())
    return CudaExport(tensor, blob, gpu_uuid(index), ready,
                      [shm_path(ref_handle.decode()), driver_ipc_glob(os.getpid())])


def import_rows(blob: bytes, uuid: str, num_rows: int, row_width: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Open the owner's ring on the same physical GPU; ValueError for a blob from another version."""
    magic, version, size, offset, ref_offset, sync = _HEADER.unpack_from(blob)
    if (magic, version) != (_MAGIC, _VERSION):
        raise ValueError(f"unknown cuda_ipc_handle format {magic!r} v{version}; verifier and drafter must "
                         f"run the same Tandem version")
    handle, ref_handle, event_handle, ready_handle = _unpack(blob[_HEADER.size:], 4)
    if _TORCH_REF_NAME.fullmatch(ref_handle) is None:
        raise ValueError("the export names a ref-counter file that is not torch's")
    if size < num_rows * row_width * dtype.itemsize:
        raise ValueError(f"the exported storage has {size} bytes, [{num_rows}, {row_width}] {dtype} needs more")
    index = local_index(uuid)
    tensor = rebuild_cuda_tensor(torch.Tensor, torch.Size([num_rows, row_width]), (row_width, 1), 0,
                                 torch.UntypedStorage, dtype, index, handle, size, offset, False,
                                 ref_handle, ref_offset, event_handle or None, sync)
    ready = torch.cuda.Event.from_ipc_handle(index, ready_handle)
    return tensor, ready


def driver_ipc_glob(pid: int) -> str:
    """The file the CUDA driver creates in /dev/shm, as ``cuda.shm.<n>.<pid in hex>.<n>``, once a process
    makes its first interprocess event (ours, or the one torch's ``_share_cuda_`` records). The driver
    never unlinks it, not even on a clean exit (seen with torch 2.11+cu130 on an H200)."""
    return shm_path(f"cuda.shm.*.{pid:x}.*")


def ref_counter_path(blob: bytes) -> str:
    """The /dev/shm path of the torch ref-counter file named in an export (tests check it is cleaned)."""
    return shm_path(_unpack(blob[_HEADER.size:], 2)[1].decode())
