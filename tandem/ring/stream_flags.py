"""Sequence flags in shared host memory that one process's CUDA stream can wait on and another's write.

The drafter and the verifier are two processes on one GPU. For the device to go from one's round to
the other's without a host in between, a stream must wait for the other process's work. Interprocess
events can do it, but a stream waiting on the event of a process that dies with the record still
queued waits forever (measured on an H200: bench/ipc_handoff.py ``--dead-peer``), and nothing can
release it: the verifier would hang with its drafter. These flags can be released: each is a uint64 in
a POSIX shared-memory page that both processes map and pin into their CUDA context; a stream waits
with the driver's ``cuStreamWaitValue64`` (until the flag is ≥ a sequence number) and the other
process's stream writes it with ``cuStreamWriteValue64`` (which fences the writes queued before it, so
the data is visible to whoever the flag releases). Both hosts may queue a whole run ahead, and a host
that gives up on its peer writes the flag itself.

The driver API is reached through ctypes (torch exposes no stream memory operations). Sequence
numbers are uint64 compared with ≥: 32 bits would wrap after 2**32 rounds (weeks of uptime at thousands
of rounds a second), after which every wait would pass at once or never.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_REGISTER_FLAGS = 0x1 | 0x2  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
# CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: the _v2 memory operations' (93 is the deprecated v1 API's, off
# on Linux unless the driver module enables it)
_CAN_USE_64_BIT_MEM_OPS = 122
FLAG_BYTES = 8
_driver = None


class StreamFlagsError(RuntimeError):
    """The CUDA driver refused a stream memory operation or the host registration."""


def _lib():
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise StreamFlagsError(f"the CUDA driver library cannot be loaded: {e}") from None
        for name, args in (("cuMemHostRegister_v2", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)),
                           ("cuMemHostUnregister", (ctypes.c_void_p,)),
                           ("cuMemHostGetDevicePointer_v2", (ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                             ctypes.c_uint)),
                           ("cuStreamWaitValue64_v2", (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)),
                           ("cuStreamWriteValue64_v2", (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)),
                           ("cuDeviceGet", (ctypes.POINTER(ctypes.c_int), ctypes.c_int)),
                           ("cuDeviceGetAttribute", (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int)),
                           ("cuGetErrorString", (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)))):
            fn = getattr(_driver, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
    return _driver


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _lib().cuGetErrorString(result, ctypes.byref(text))
        raise StreamFlagsError(f"{what}: CUDA driver error {result} ({(text.value or b'?').decode()})")


def _require_64_bit_ops(device: torch.device) -> None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle, value = ctypes.c_int(), ctypes.c_int()
    _check(_lib().cuDeviceGet(ctypes.byref(handle), index), f"finding cuda:{index}")
    _check(_lib().cuDeviceGetAttribute(ctypes.byref(value), _CAN_USE_64_BIT_MEM_OPS, handle),
           "asking for 64-bit stream memory operations")
    if not value.value:
        raise StreamFlagsError(f"the driver offers no 64-bit stream memory operations on cuda:{index}")


class StreamFlags:
    """``count`` uint64 flags at the start of ``buffer`` (a shared mapping), pinned and mapped into this
    process's context on ``device``. Keep the object alive while any queued wait or write may use it."""

    def __init__(self, buffer: mmap.mmap, count: int, device: torch.device):
        if count * FLAG_BYTES > len(buffer):
            raise ValueError(f"{count} flags need {count * FLAG_BYTES} bytes; the mapping has {len(buffer)}")
        torch.cuda.init()
        self.device = device
        _require_64_bit_ops(device)
        with torch.cuda.device(device):
            torch.cuda.current_stream().synchronize()  # the primary context is current on this thread
            self._host = (ctypes.c_uint64 * count).from_buffer(buffer)
            self._base = ctypes.addressof(self._host)
            self._buffer, self._length = buffer, len(buffer)
            _check(_lib().cuMemHostRegister_v2(self._base, self._length, _REGISTER_FLAGS), "pinning the flags")
            ptr = ctypes.c_uint64()
            _check(_lib().cuMemHostGetDevicePointer_v2(ctypes.byref(ptr), self._base, 0), "mapping the flags")
        self._device_base = ptr.value
        self.count = count

    def _addr(self, i: int) -> int:
        if not 0 <= i < self.count:
            raise IndexError(f"flag {i} of {self.count}")
        return self._device_base + FLAG_BYTES * i

    def wait(self, stream: torch.cuda.Stream, i: int, seq: int) -> None:
        """Queue on ``stream``: go on once flag ``i`` is ≥ ``seq``."""
        _check(_lib().cuStreamWaitValue64_v2(stream.cuda_stream, self._addr(i), seq, _WAIT_GEQ),
               f"waiting on flag {i}")

    def write(self, stream: torch.cuda.Stream, i: int, seq: int) -> None:
        """Queue on ``stream``: once the work queued before it is done (and its writes visible), set flag
        ``i`` to ``seq``."""
        _check(_lib().cuStreamWriteValue64_v2(stream.cuda_stream, self._addr(i), seq, 0),
               f"writing flag {i}")

    def __getitem__(self, i: int) -> int:
        """The flag's value now, read by the host."""
        self._addr(i)
        return self._host[i]

    def __setitem__(self, i: int, seq: int) -> None:
        """Set the flag from the host (releasing a stream that waits on a peer that gave up)."""
        self._addr(i)
        self._host[i] = seq

    def close(self) -> None:
        """Unpin; only once nothing queued uses the flags any more."""
        if self._host is not None:
            _lib().cuMemHostUnregister(self._base)
            self._host = None
