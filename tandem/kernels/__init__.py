"""Triton kernels for the GPU path: paged attention (decode, tree verification, fixed-width extension),
rotary fused with the KV store, RMSNorm (optionally fused with the residual add) and SwiGLU; quantized
linears (dequant_gemm.py) and the fused MoE (fused_moe.py) are imported from their modules.

Each wrapper takes torch tensors, checks shapes on the host (no device synchronisation) and
launches a fixed number of programs, so every one of them can be captured in a CUDA graph. Plain
torch references live in the tests (tests/test_kernels.py, tests/gpu/test_kernels_gpu.py);
``python -m tandem.kernels.compile_check`` builds them all for sm_90 on a machine with no GPU.

Importing this package imports triton and decorates the kernels, so import it lazily, on the GPU
path only: CPU tests run the kernels under the interpreter, which must be switched on
(TRITON_INTERPRET=1) before the first import. ``import tandem`` does not import it.
"""

from tandem.kernels.activation import silu_and_mul
from tandem.kernels.norm import rms_norm
from tandem.kernels.paged_attention import default_num_splits, paged_attention
from tandem.kernels.rotary_kv import rotary_and_store, store_kv

__all__ = ["default_num_splits", "paged_attention", "rms_norm", "rotary_and_store", "silu_and_mul", "store_kv"]
