"""The hidden-state ring: the verifier writes EAGLE-3 feature rows, the drafter reads them by offset.

Hidden states never travel inside gRPC messages (docs/architecture.md, "The parts"). The verifier owns one ring of
``[num_rows, row_width]`` rows (``row_width`` = 3·H_target) and sends the drafter its ``RingSpec``
once, at handshake; each round's message then carries only ``(offset, rows)`` pairs and the round's
sequence number, and the drafter's reply for round *n* lets the verifier ``release(n)``.

Two backings behind one API: ``posix`` (CPU; a /dev/shm file mapped on both sides and viewed with
``torch.frombuffer``, no copy; ``tandem.ring.posix``) and ``cuda_ipc`` (GPU; one CUDA tensor
exported through CUDA IPC, zero-copy and shared read/write; ``tandem.ring.cuda``).

Only the owner unlinks. ``close()``, a clean exit, an unhandled exception and garbage collection
unlink through ``weakref.finalize`` (which also runs at interpreter exit). SIGTERM and SIGKILL skip
every Python hook, so the owner also starts a watchdog process that unlinks the segment as soon as the
owner has died. The drafter may attach late, crash, and attach again: attaching never creates,
registers or unlinks anything.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tandem.errors import ConfigError, TandemError
from tandem.ring import posix
from tandem.ring.allocator import RingFullError, RowAllocator

__all__ = ["CUDA_IPC", "POSIX", "HiddenRing", "HiddenRingView", "RingAttachError", "RingFullError", "RingSpec",
           "RowAllocator", "dtype_name"]

POSIX = "posix"
CUDA_IPC = "cuda_ipc"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tests turn this off in a child process to prove that the in-process cleanup works on its own.
_START_WATCHDOG = True


class RingAttachError(TandemError, RuntimeError):
    """The drafter cannot attach to the ring named in the handshake (gone, wrong size, wrong GPU)."""


@dataclass(frozen=True)
class RingSpec:
    """Everything an attacher needs, as plain str/int/bytes fields that a protobuf message can carry."""

    kind: str  # POSIX or CUDA_IPC
    name: str  # "tandem-<pid>-<hex>": the /dev/shm file (posix) or a label for logs (cuda_ipc)
    num_rows: int
    row_width: int
    dtype: str  # a key of DTYPES
    owner_pid: int  # the verifier process that created it; for error messages
    cuda_ipc_handle: bytes = b""  # opaque export from tandem.ring.cuda; empty for posix
    gpu_uuid: str = ""  # physical GPU of the ring; empty for posix

    def __post_init__(self) -> None:
        if self.kind not in (POSIX, CUDA_IPC):
            raise ConfigError(f"ring kind must be {POSIX!r} or {CUDA_IPC!r}, got {self.kind!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"ring dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.num_rows <= 0 or self.row_width <= 0:
            raise ConfigError(f"ring shape must be positive, got [{self.num_rows}, {self.row_width}]")
        if self.kind == CUDA_IPC and not (self.cuda_ipc_handle and self.gpu_uuid):
            raise ConfigError("a cuda_ipc ring spec needs cuda_ipc_handle and gpu_uuid")
        try:  # a spec may come from a peer's Hello: its name must be one this project makes
            posix.check_name(self.name)
        except ValueError as e:
            raise ConfigError(f"ring name: {e}") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_width * self.torch_dtype.itemsize

    def to_fields(self) -> dict[str, str | int | bytes]:
        return dataclasses.asdict(self)

    @classmethod
    def from_fields(cls, fields: Mapping[str, object] | object) -> RingSpec:
        """Build from a mapping or from any object with these attributes (a protobuf message);
        absent CUDA fields default to empty, and proto scalar types are coerced."""
        def get(key: str) -> object:
            return fields.get(key) if isinstance(fields, Mapping) else getattr(fields, key, None)

        types = {"cuda_ipc_handle": bytes, "num_rows": int, "row_width": int, "owner_pid": int}
        return cls(**{f.name: types.get(f.name, str)(get(f.name)) for f in dataclasses.fields(cls)
                      if get(f.name) is not None})


def dtype_name(dtype: torch.dtype | str) -> str:
    for name, dt in DTYPES.items():
        if dtype in (name, dt):
            return name
    raise ConfigError(f"ring dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def _as_rows(buf: mmap.mmap, spec: RingSpec) -> torch.Tensor:
    # frombuffer keeps a reference to the mmap, so the mapping lives as long as any view of it does;
    # that is why nobody ever calls mmap.close() (it would unmap under live tensors). A read-only
    # mapping (the drafter's view of the ring) makes torch warn; a write to it would fault, as meant.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=spec.nbytes)
    return raw.view(spec.torch_dtype).view(spec.num_rows, spec.row_width)


def _unlink_owned(owner_pid: int, path: str | None, watchdog: posix.Watchdog | None) -> None:
    """The owner's cleanup; a no-op in a forked child, which inherits the object but not ownership."""
    if os.getpid() != owner_pid:
        return
    if path is not None:
        posix.unlink(path)
    if watchdog is not None:
        watchdog.stop()


# Watchdogs of cuda_ipc rings run until this process dies, even after close(). They remove files
# that outlive the owner: torch's ref-counter file (torch unlinks it on a clean exit but a SIGKILL leaves
# it, and other tensors this process shares may use it until then) and the CUDA driver's IPC file
# (never unlinked by the driver). Both may be needed for as long as this process lives.
_CUDA_GUARDS: list[posix.Watchdog] = []


class HiddenRing:
    """The owner's side (verifier rank 0): allocates rows per round, writes them, frees them on reply."""

    def __init__(self, spec: RingSpec, tensor: torch.Tensor, *, path: str | None = None,
                 watchdog: posix.Watchdog | None = None, ready_event: torch.cuda.Event | None = None):
        """Use ``create``; this wires an already made backing to the allocator and the cleanup."""
        self._spec, self._tensor, self._ready = spec, tensor, ready_event
        self._alloc = RowAllocator(spec.num_rows)
        self._lock = threading.Lock()  # allocate (scheduler) and release (reply handler) race otherwise
        self._seq: int | None = None
        self._finalizer = weakref.finalize(self, _unlink_owned, spec.owner_pid, path, watchdog)

    @classmethod
    def create(cls, num_rows: int, row_width: int, dtype: torch.dtype | str,
               device: torch.device | str = "cpu") -> HiddenRing:
        """A new ring of zeros: /dev/shm for a CPU device, CUDA IPC for a CUDA device."""
        device = torch.device(device)
        fields = dict(name=f"tandem-{os.getpid()}-{secrets.token_hex(4)}", num_rows=num_rows,
                      row_width=row_width, dtype=dtype_name(dtype), owner_pid=os.getpid())
        if device.type == "cpu":
            spec = RingSpec(kind=POSIX, **fields)
            try:
                buf = posix.create_segment(spec.name, spec.nbytes)
            except OSError as e:
                raise TandemError(f"hidden-state ring: {e}") from e
            path = posix.shm_path(spec.name)
            try:
                watchdog = posix.Watchdog([path]) if _START_WATCHDOG else None
            except BaseException:
                posix.unlink(path)
                raise
            return cls(spec, _as_rows(buf, spec), path=path, watchdog=watchdog)
        if device.type == "cuda":
            from tandem.ring import cuda

            export = cuda.export_rows(num_rows, row_width, DTYPES[fields["dtype"]], device)
            spec = RingSpec(kind=CUDA_IPC, cuda_ipc_handle=export.handle, gpu_uuid=export.gpu_uuid, **fields)
            if _START_WATCHDOG:
                _CUDA_GUARDS.append(posix.Watchdog(export.owner_files))
            return cls(spec, export.tensor, ready_event=export.ready_event)
        raise ConfigError(f"hidden-state ring device must be cpu or cuda, got {device}")

    @property
    def spec(self) -> RingSpec:
        return self._spec

    @property
    def tensor(self) -> torch.Tensor:
        """The whole ring, ``[num_rows, row_width]``."""
        if self._tensor is None:
            raise TandemError(f"hidden-state ring {self._spec.name!r} is closed")
        return self._tensor

    @property
    def used_rows(self) -> int:
        with self._lock:
            return self._alloc.used_rows

    def live(self) -> list[tuple[int, int, int]]:
        """``(offset, rows, seq)`` of every unreleased allocation, by offset."""
        with self._lock:
            return self._alloc.live()

    def begin_round(self, seq: int) -> None:
        """Tag the following allocations with round ``seq`` (the number the drafter's reply echoes)."""
        self._seq = seq

    def allocate(self, rows: int, seq: int | None = None) -> int:
        """Reserve ``rows`` contiguous rows for round ``seq`` (default: the current round); returns the
        offset. Raises RingFullError when unreleased rounds leave no run of ``rows`` free rows."""
        seq = self._seq if seq is None else seq
        if seq is None:
            raise TandemError("HiddenRing.allocate needs a round: call begin_round(seq) first")
        with self._lock:
            return self._alloc.allocate(rows, seq)

    def release(self, seq: int) -> int:
        """Free all rows of round ``seq`` (its reply arrived); any order; returns the rows freed."""
        with self._lock:
            return self._alloc.release(seq)

    def release_all(self) -> int:
        """Free every round, e.g. when the drafter died and its in-flight rounds will never be answered."""
        with self._lock:
            return self._alloc.release_all()

    def write(self, offset: int, rows: torch.Tensor) -> None:
        """Copy ``rows`` ([n, row_width], any device, cast to the ring's dtype) into rows ``offset..offset+n``."""
        if rows.dim() != 2 or rows.shape[1] != self._spec.row_width:
            raise ValueError(f"ring rows are {self._spec.row_width} wide, got shape {tuple(rows.shape)}")
        _check_range(self._spec, offset, rows.shape[0])
        self.tensor[offset:offset + rows.shape[0]].copy_(rows)

    def publish(self) -> None:
        """Call after a round's writes, before sending its offsets. On CUDA it records the event that the
        drafter's ``wait_ready`` orders its reads after; on CPU the writes are already visible."""
        if self._ready is not None:
            self._ready.record(torch.cuda.current_stream(self.tensor.device))

    def close(self) -> None:
        """Unlink the segment (idempotent). Attached drafters keep their mapping until they close."""
        self._finalizer()
        self._tensor = self._ready = None

    def __enter__(self) -> HiddenRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HiddenRingView:
    """The attacher's side (drafter): the same rows, read by offset; never unlinks anything."""

    def __init__(self, spec: RingSpec, tensor: torch.Tensor, ready_event: torch.cuda.Event | None = None):
        """Use ``attach``."""
        self._spec, self._tensor, self._ready = spec, tensor, ready_event

    @classmethod
    def attach(cls, spec: RingSpec, writable: bool = True) -> HiddenRingView:
        """Map the owner's ring; RingAttachError (one line, with the cause) if that is impossible.
        ``writable=False``: a read-only mapping (posix), for a reader that never writes (the drafter's ring)."""
        where = f"hidden-state ring {spec.name!r} of verifier pid {spec.owner_pid}"
        if spec.kind == POSIX:
            try:
                return cls(spec, _as_rows(posix.open_segment(spec.name, spec.nbytes, writable), spec))
            except FileNotFoundError:
                raise RingAttachError(f"{where} not found in {posix.SHM_DIR}: the verifier has exited or "
                                      f"closed it; handshake again for the current ring") from None
            except (OSError, ValueError) as e:
                raise RingAttachError(f"cannot attach {where}: {e}") from e
        if not torch.cuda.is_available():
            raise RingAttachError(f"{where} lives on GPU {spec.gpu_uuid}, but this process has no CUDA")
        from tandem.ring import cuda

        try:
            tensor, ready = cuda.import_rows(spec.cuda_ipc_handle, spec.gpu_uuid, spec.num_rows,
                                             spec.row_width, spec.torch_dtype)
        except (LookupError, ValueError, RuntimeError) as e:
            raise RingAttachError(f"cannot attach {where}: {e}") from e
        return cls(spec, tensor, ready)

    @property
    def spec(self) -> RingSpec:
        return self._spec

    @property
    def tensor(self) -> torch.Tensor:
        """The whole ring, ``[num_rows, row_width]``, shared with the owner."""
        if self._tensor is None:
            raise TandemError(f"view of hidden-state ring {self._spec.name!r} is closed")
        return self._tensor

    def wait_ready(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order later GPU work on ``stream`` (default: current) after the owner's last ``publish``."""
        if self._ready is not None:
            self._ready.wait(stream if stream is not None else torch.cuda.current_stream(self.tensor.device))

    def read(self, offset: int, rows: int, *, copy: bool = True) -> torch.Tensor:
        """Rows ``offset..offset+rows``. ``copy=False`` returns a view, valid only until the reply for
        its round is sent (the owner then reuses the rows) and while this view is open."""
        _check_range(self._spec, offset, rows)
        out = self.tensor[offset:offset + rows]
        return out.clone() if copy else out

    def close(self) -> None:
        """Drop this process's mapping (once no returned view is alive). The owner alone unlinks."""
        self._tensor = self._ready = None

    def __enter__(self) -> HiddenRingView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_range(spec: RingSpec, offset: int, rows: int) -> None:
    if rows < 0 or offset < 0 or offset + rows > spec.num_rows:
        raise IndexError(f"rows [{offset}, {offset + rows}) are outside the ring's {spec.num_rows} rows")
