"""Tandem: LLM serving with EAGLE-3 speculative decoding.

This package holds what the verifier and the drafter both use (models, layers, KV cache, attention
backends, tensor-parallel helpers, sampling, the in-process engine, the ``tandem`` command) and the
torch-free helpers the gateway uses. Importing ``tandem`` alone must not import torch: keep this
file free of imports of the torch-using submodules.
"""

__version__ = "0.1.0"
