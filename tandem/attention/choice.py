"""The choice of attention backend, by name and device (``--attention-backend``)."""

from __future__ import annotations

import logging
import os

import torch

from tandem.attention.backend import AttentionBackend
from tandem.errors import ConfigError
from tandem.layers.fast_path import triton_importable


log = logging.getLogger("tandem.attention")


def resolve_backend(name: str, device: torch.device, latent: bool) -> str:
    """The backend ``make_backend`` builds for ``--attention-backend name``, settled before the weights load (a
    Kimi-K2.5 load is long; a wrong name must not wait for it). Peers' names for what has no path here are taken as
    ``auto`` and said in the log (attention's output is the same whichever kernel computes it): ``triton`` for a dense
    model's eager steps (its CUDA graphs run Tandem's Triton kernels anyway), ``flashinfer`` for MLA, ``triton`` for
    MLA without a GPU (unless TRITON_INTERPRET=1: tests)."""
    if name not in ("auto", "torch", "triton", "flashinfer"):
        raise ValueError(f"unknown attention backend '{name}'; available: auto, flashinfer, triton, torch")
    taken = None
    if latent and name == "flashinfer":
        taken = "FlashInfer has no MLA path here: the Triton latent kernel on a GPU, else the torch reference"
    elif latent and name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        taken = "the Triton latent kernel needs a GPU: the torch reference"
    elif latent and name == "triton" and not triton_importable():
        taken = "triton cannot be imported: the torch reference"
    elif not latent and name == "flashinfer" and device.type != "cuda":
        taken = "FlashInfer needs a GPU: the torch reference"
    elif not latent and name == "flashinfer" and not _flashinfer_importable():
        raise ConfigError("--attention-backend flashinfer: flashinfer cannot be imported (pip install 'tandem[gpu]'), "
                          "or give auto")
    elif not latent and name == "triton":
        taken = ("eager steps run FlashInfer on a GPU where installed, else the torch reference; CUDA graphs run "
                 "Tandem's Triton kernels")
    if taken is None:
        return name
    log.info("--attention-backend %s: taken as auto (%s)", name, taken)
    return "auto"


def _flashinfer_importable() -> bool:
    from tandem.attention.flashinfer_backend import flashinfer_available

    return flashinfer_available()


def make_backend(name: str, device: torch.device, latent: bool = False) -> AttentionBackend:
    """``auto``: FlashInfer on a GPU when it is installed, else the torch reference. ``latent``: for a
    model whose cache holds MLA latents: ``auto`` takes the Triton MLA kernel on a GPU where triton
    imports (tandem.attention.mla_triton_backend), else the torch reference; ``triton`` forces the
    kernel (on the CPU it runs under TRITON_INTERPRET=1: tests)."""
    name = resolve_backend(name, device, latent)
    if latent:
        if name == "triton" or (name == "auto" and device.type == "cuda" and triton_importable()):
            from tandem.attention.mla_triton_backend import TritonMLABackend

            return TritonMLABackend()
        from tandem.attention.mla_torch_backend import TorchMLABackend

        return TorchMLABackend()
    from tandem.attention.flashinfer_backend import FlashInferBackend, flashinfer_available

    if name == "flashinfer" or (name == "auto" and device.type == "cuda" and flashinfer_available()):
        return FlashInferBackend(device)  # (resolve_backend took a flashinfer that cannot serve as auto)
    if name in ("auto", "torch"):
        from tandem.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise AssertionError(name)  # (resolve_backend took every other name)
