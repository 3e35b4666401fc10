"""FlashInfer attention (flashinfer-python 0.6.x): paged decode, causal paged prefill, and paged
prefill with a custom (tree) mask, over the engine's pool without copying it.

A layer's pool ``[num_pages, page_size, Hkv, D]`` for k and for v is FlashInfer's NHD paged layout,
passed as the ``(k, v)`` tuple. The new tokens' K/V are stored with ``index_copy_`` at
``meta.slot_mapping`` (as the torch reference does), then one wrapper attends:

* decode — every ``q_len`` is 1 and there is no tree mask: ``BatchDecodeWithPagedKVCacheWrapper``;
* causal — no tree mask: ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` (FlashInfer's
  causal mask is bottom-right aligned: new token i sees every cached key and new tokens 0..i);
* masked — some tree mask: the prefill wrapper with ``custom_mask``, each sequence's full
  ``[q_len, kv_len]`` mask (``meta.full_mask``) flattened row-major and concatenated.

FlashInfer's ``plan`` wants head counts, dtypes and the softmax scale, which AttentionMetadata lacks,
so :class:`FlashInferBackend` builds the page arrays in ``plan`` and plans its wrapper at the first
layer's ``forward`` (host work; the eager path only). :class:`FlashInferGraphBackend` knows its shapes
up front: its ``plan`` runs outside the graph before capture and before every replay, and its
``forward`` (store + ``run``) is what a CUDA graph captures. FlashInfer is imported lazily.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from tandem.attention.backend import AttentionBackend
from tandem.attention.metadata import AttentionMetadata
from tandem.staging import upload

WORKSPACE_BYTES = 128 * 1024 * 1024
_CPU = torch.device("cpu")


@functools.cache
def flashinfer_available() -> bool:
    """True when ``import flashinfer`` works (it does not compile anything: kernels JIT on first plan)."""
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA/tvm-ffi install
        return False
    return True


def _flashinfer():
    import flashinfer

    return flashinfer


def new_workspace(device: torch.device | str) -> torch.Tensor:
    """The float workspace every wrapper shares (FlashInfer wants it zeroed before first use)."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _page_arrays(kv_lens: list[int], tables: np.ndarray, page_size: int, device: torch.device):
    """→ kv_indptr (int32, host) [B+1], kv_indices (int32, ``device``) [total pages], last_page_len (int32,
    host) [B], in 1..page_size, from the host's block tables ``tables`` [B, max pages]. Only the pages a
    sequence uses are listed. Built with numpy (a dozen small torch ops per plan were a large share of an eager
    step's host work); the indices reach the device through pinned memory: FlashInfer copies host indices with a
    sync."""
    lens = np.asarray(kv_lens, dtype=np.int64)
    npages = (lens + page_size - 1) // page_size
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(npages, out=indptr[1:])
    last = (lens - (npages - 1) * page_size).astype(np.int32)
    used = np.arange(tables.shape[1]) < npages[:, None]  # row-major: each sequence's first pages, in order
    indices = np.ascontiguousarray(tables[used], dtype=np.int32)
    return torch.from_numpy(indptr), upload(indices, device), torch.from_numpy(last)


def _flat_mask(meta: AttentionMetadata, kv_lens: list[int]) -> torch.Tensor:
    """Host bool [sum q_len * kv_len]: every sequence's full mask, row-major, concatenated."""
    parts = []
    for i, kv_len in enumerate(kv_lens):
        m = meta.full_mask(i, _CPU)
        parts.append((m if m is not None else torch.ones(meta.q_lens[i], kv_len, dtype=torch.bool)).reshape(-1))
    return torch.cat(parts)


def _store(k, v, k_pool, v_pool, slots: torch.Tensor) -> None:
    _, _, num_kv_heads, head_dim = k_pool.shape
    k_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_pool.dtype))


class _Planner:
    """One wrapper plus an event that keeps the next ``plan`` from overwriting the wrapper's pinned
    host staging buffer before the previous plan's asynchronous copy out of it has run."""

    def __init__(self, wrapper, kind: str):
        self.wrapper, self.kind = wrapper, kind
        self._copied: torch.cuda.Event | None = None

    def plan(self, arrays: dict, heads: tuple[int, int, int], page_size: int, q_dtype, kv_dtype, scale: float):
        if self._copied is not None:
            self._copied.synchronize()
        hq, hkv, d = heads
        common = dict(q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=scale)
        if self.kind == "decode":
            self.wrapper.plan(arrays["indptr"], arrays["indices"], arrays["last"], hq, hkv, d, page_size, **common)
        else:
            extra = {"custom_mask": arrays["mask"]} if "mask" in arrays else {"causal": True}
            self.wrapper.plan(arrays["qo_indptr"], arrays["indptr"], arrays["indices"], arrays["last"],
                              hq, hkv, d, page_size, **common, **extra)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(q.contiguous(), (k_pool, v_pool))


def _plan_arrays(meta: AttentionMetadata, kind: str, device: torch.device) -> dict:
    """Host-built FlashInfer plan inputs. With a custom mask everything goes to the device: FlashInfer
    packs the mask there (segment_packbits) with offsets computed from these very tensors."""
    kv_lens = [p + q for p, q in zip(meta.prefix_lens, meta.q_lens)]
    tables = meta.host_block_tables if meta.host_block_tables is not None else meta.block_tables.cpu().numpy()
    indptr, indices, last = _page_arrays(kv_lens, tables, meta.page_size, device)
    arrays = {"indptr": indptr, "indices": indices, "last": last}
    if kind != "decode":
        arrays["qo_indptr"] = torch.from_numpy(np.cumsum([0, *meta.q_lens], dtype=np.int32))
    if kind == "masked":
        arrays = {k: upload(t, device) for k, t in arrays.items()}
        arrays["mask"] = upload(_flat_mask(meta, kv_lens), device)
    return arrays


def _kind(meta: AttentionMetadata) -> str:
    if any(m is not None for m in meta.tree_masks):
        return "masked"
    return "decode" if all(q == 1 for q in meta.q_lens) else "causal"


class FlashInferBackend(AttentionBackend):
    """Eager FlashInfer attention for any batch the engine produces.

    ``decode_tensor_cores`` runs decode on the prefill kernels (faster for GQA groups >= 4, and the same
    JIT module as prefill); ``causal_backend`` "fa2" (default) or "auto" ("fa3" on Hopper) for causal
    prefill. Masked prefill is always "fa2" (FlashInfer's fa3 has no custom mask). FlashInfer's "auto"
    picks its backend at a wrapper's first plan and keeps it, so each kind has its own wrapper.
    """

    name = "flashinfer"

    def __init__(self, device: torch.device | str, workspace: torch.Tensor | None = None, *,
                 decode_tensor_cores: bool = True, causal_backend: str = "fa2"):
        if not flashinfer_available():
            raise RuntimeError("the flashinfer attention backend needs the flashinfer-python package")
        self.device = torch.device(device)
        self.workspace = workspace if workspace is not None else new_workspace(self.device)
        self.decode_tensor_cores, self.causal_backend = decode_tensor_cores, causal_backend
        self._planners: dict[str, _Planner] = {}
        self._kind, self._arrays, self._key = "decode", None, None
        # FlashInfer has no float32 kernels: float32 models (tests, references) use the torch reference.
        from tandem.attention.torch_backend import TorchAttentionBackend

        self._float32 = TorchAttentionBackend()
        self._float32_meta = None

    def _planner(self, kind: str) -> _Planner:
        if kind not in self._planners:
            fi = _flashinfer()
            if kind == "decode":
                w = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores, backend="fa2")
            else:
                w = fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", backend=self.causal_backend if kind == "causal" else "fa2")
            self._planners[kind] = _Planner(w, kind)
        return self._planners[kind]

    def plan(self, meta: AttentionMetadata) -> None:
        self._kind = _kind(meta)
        self._arrays = _plan_arrays(meta, self._kind, self.device)
        self._page_size, self._key = meta.page_size, None  # the wrapper is planned at the first forward

    # Rotary and the K/V store in one Triton kernel (tandem.kernels.rotary_kv), as in the graphs: an eager
    # prefill is host-bound, and the reference rotary is a dozen launches per layer.
    fuses_rotary = True

    def forward_with_rotary(self, q, k, v, positions, rotary, k_pool, v_pool, meta: AttentionMetadata,
                            scale: float) -> torch.Tensor:
        head_dim = q.shape[-1]
        if q.dtype == torch.float32 or head_dim & (head_dim - 1):  # the reference (float32), or no kernel for it
            q, k = rotary(positions, q, k)
            return self.forward(q, k, v, k_pool, v_pool, meta, scale)
        from tandem.kernels.rotary_kv import rotary_and_store

        q = rotary_and_store(q, k, v, rotary.cos, rotary.sin, positions, k_pool, v_pool, meta.slot_mapping,
                             q_out=torch.empty_like(q))
        return self._attend(q, k_pool, v_pool, scale)

    def forward(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.dtype == torch.float32:
            if self._float32_meta is not meta:
                self._float32.plan(meta)
                self._float32_meta = meta
            return self._float32.forward(q, k, v, k_pool, v_pool, meta, scale)
        _store(k, v, k_pool, v_pool, meta.slot_mapping)
        return self._attend(q, k_pool, v_pool, scale)

    def _attend(self, q, k_pool, v_pool, scale: float) -> torch.Tensor:
        """The planned wrapper over the pool (planned at the first layer: it needs the head counts)."""
        key = (q.shape[1], k_pool.shape[2], q.shape[2], q.dtype, k_pool.dtype, float(scale))
        planner = self._planner(self._kind)
        if key != self._key:
            planner.plan(self._arrays, key[:3], self._page_size, key[3], key[4], key[5])
            self._key = key
        return planner.run(q, k_pool, v_pool)


class FlashInferGraphBackend(AttentionBackend):
    """FlashInfer attention for one CUDA graph: ``batch_size`` sequences of exactly ``q_len`` new tokens.

    Every index array FlashInfer reads lives in static buffers (``use_cuda_graph=True`` wrappers), as
    does the KV slot mapping. Use: ``plan(meta)`` then a warm-up ``forward`` outside the graph, capture
    ``forward`` (once per layer); before each replay call ``plan(new_meta)`` outside the graph, with the
    same batch size and q_len and every kv_len <= ``max_kv_len``. ``masked`` (default: q_len > 1) runs
    the custom-mask prefill kernel — tree masks, or causal for sequences without one; q_len == 1
    without mask uses the decode kernel. ``sm_scale`` must equal the ``scale`` the model passes.
    """

    name = "flashinfer-graph"

    def __init__(self, device: torch.device | str, *, batch_size: int, q_len: int, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int, max_kv_len: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, sm_scale: float | None = None, masked: bool | None = None,
                 workspace: torch.Tensor | None = None, decode_tensor_cores: bool = True):
        if not flashinfer_available():
            raise RuntimeError("the flashinfer attention backend needs the flashinfer-python package")
        fi, dev = _flashinfer(), torch.device(device)
        self.device, self.batch_size, self.q_len, self.page_size = dev, batch_size, q_len, page_size
        self.heads, self.max_kv_len = (num_qo_heads, num_kv_heads, head_dim), max_kv_len
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        self.sm_scale = sm_scale if sm_scale is not None else head_dim ** -0.5
        self.masked = q_len > 1 if masked is None else masked
        self.workspace = workspace if workspace is not None else new_workspace(dev)
        B, i32 = batch_size, dict(dtype=torch.int32, device=dev)
        self._slots = torch.zeros(B * q_len, dtype=torch.int64, device=dev)
        bufs = (torch.zeros(B + 1, **i32), torch.zeros(B * -(-max_kv_len // page_size), **i32), torch.ones(B, **i32))
        if q_len == 1 and not self.masked:
            self.kind = "decode"
            w = fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=decode_tensor_cores, backend="fa2",
                paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
        else:
            self.kind = "masked" if self.masked else "causal"
            mask_bufs = {}
            if self.masked:  # packed bits, each sequence's segment padded to a whole byte
                packed = B * -(-q_len * max_kv_len // 8)
                mask_bufs = dict(custom_mask_buf=torch.zeros(packed, dtype=torch.uint8, device=dev),
                                 mask_indptr_buf=torch.zeros(B + 1, **i32))
            w = fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, backend="fa2", qo_indptr_buf=torch.zeros(B + 1, **i32),
                paged_kv_indptr_buf=bufs[0], paged_kv_indices_buf=bufs[1], paged_kv_last_page_len_buf=bufs[2],
                **mask_bufs)
        self._planner = _Planner(w, self.kind)

    def plan(self, meta: AttentionMetadata) -> None:
        """Outside the graph: fill the static buffers for the next replay (or the capture)."""
        if meta.num_seqs != self.batch_size or any(q != self.q_len for q in meta.q_lens):
            raise ValueError(f"this graph backend runs {self.batch_size} sequences of {self.q_len} new tokens, "
                             f"got q_lens {meta.q_lens}")
        if max(p + q for p, q in zip(meta.prefix_lens, meta.q_lens)) > self.max_kv_len:
            raise ValueError(f"a sequence exceeds this graph backend's max_kv_len {self.max_kv_len}")
        if meta.page_size != self.page_size:
            raise ValueError(f"page size {meta.page_size} != {self.page_size}")
        if not self.masked and any(m is not None for m in meta.tree_masks):
            raise ValueError("tree masks need a graph backend built with masked=True")
        self._slots.copy_(meta.slot_mapping, non_blocking=True)
        arrays = _plan_arrays(meta, self.kind, self.device)
        self._planner.plan(arrays, self.heads, self.page_size, self.dtype, self.kv_dtype, self.sm_scale)

    def forward(self, q, k, v, k_pool, v_pool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Capturable: fixed shapes, static buffers, no host synchronisation (``meta`` is not read)."""
        if not math.isclose(scale, self.sm_scale, rel_tol=1e-6):
            raise ValueError(f"scale {scale} differs from the planned sm_scale {self.sm_scale}")
        _store(k, v, k_pool, v_pool, self._slots)
        return self._planner.run(q, k_pool, v_pool)
