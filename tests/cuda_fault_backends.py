"""Backends that fault on a real GPU: a Triton kernel that writes far out of bounds.

Importable by the sandbox child. Triton is imported lazily so that CPU-only machines can
collect the tests that name these backends.
"""

from __future__ import annotations

import functools

import torch

from fp4select.formats import reference_mm_fp4


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def write_out_of_bounds(ptr, offset):
        lanes = tl.arange(0, 128)
        tl.store(ptr + offset + lanes, 1.0)

    return write_out_of_bounds


def illegal_address(
    a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, use_nvfp4, pdl
):
    """Writes 2**40 floats past a real allocation: CUDA reports an illegal memory access."""
    target = torch.empty(128, device=a.device, dtype=torch.float32)
    _kernel()[(1,)](target, 1 << 40)
    torch.cuda.synchronize(a.device)
    return reference_mm_fp4(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, use_nvfp4
    )


def healthy(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, use_nvfp4, pdl):
    return reference_mm_fp4(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, use_nvfp4
    )
