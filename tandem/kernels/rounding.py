"""Rounding to a narrow float inside a kernel, exactly as torch rounds one elementwise op's result.

A reference route in bf16 rounds every product and sum to bf16 before the next op reads it; a fused
kernel that wants the same bits writes ``x.to(bf16).to(float32)`` between its steps. On the GPU the
compiler may fold that round trip away (an H200 run showed 1-ulp differences from the torch route),
so for bf16 the rounding is done on the bits: round to nearest, ties to even, on the top 16 bits of
the float32 word. Other dtypes keep the plain cast (float32 is the identity).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` and held in float32."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)
