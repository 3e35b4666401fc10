"""The choice of attention backend, by name and device (``--attention-backend``)."""

from __future__ import annotations

import torch

from tandem.attention.backend import AttentionBackend
from tandem.layers.fast_path import triton_importable


def make_backend(name: str, device: torch.device, latent: bool = False) -> AttentionBackend:
    """``auto``: FlashInfer on a GPU when it is installed, else the torch reference. ``latent``: for a
    model whose cache holds MLA latents: ``auto`` takes the Triton MLA kernel on a GPU where triton
    imports (tandem.attention.mla_triton_backend), else the torch reference; ``triton`` forces the
    kernel (on the CPU it runs under TRITON_INTERPRET=1: tests)."""
    if latent:
        if name not in ("auto", "torch", "triton"):
            raise ValueError(f"attention backend '{name}' has no MLA path; use auto, torch or triton")
        if name == "triton" or (name == "auto" and device.type == "cuda" and triton_importable()):
            from tandem.attention.mla_triton_backend import TritonMLABackend

            return TritonMLABackend()
        from tandem.attention.mla_torch_backend import TorchMLABackend

        return TorchMLABackend()
    from tandem.attention.flashinfer_backend import FlashInferBackend, flashinfer_available

    if name == "flashinfer" or (name == "auto" and device.type == "cuda" and flashinfer_available()):
        if not flashinfer_available():
            raise ValueError("attention backend 'flashinfer' asked for, but flashinfer cannot be imported "
                             "(pip install 'tandem[gpu]')")
        return FlashInferBackend(device)
    if name in ("auto", "torch"):
        from tandem.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend '{name}'; available: auto, torch, flashinfer")
