"""The Triton kernel behind :func:`fp4select.quantize.fp4_quantize` (imported on first use).

Each program takes ``BLOCK_M`` rows by ``BLOCK_C`` scale columns (16 values each) of the padded
``(ceil128(M), ceil4(K/16))`` scale grid, loads the values as even and odd elements (the low
and high nibble of each output byte), and writes the packed codes and every scale byte of its
tile, padding included: masked loads read 0, a zero block gets scale 0, so the kernel fills
the whole scale buffer and the caller allocates with ``torch.empty``.

Rounding is spelled out in float32 and integer arithmetic, never a hardware conversion, so the
Triton interpreter computes the same bits as the GPU:

* e4m3 (round to nearest even, saturating): clamp to 448, then round to a multiple of the
  value's e4m3 spacing ``u`` (``2**(e-3)`` for a normal value of exponent ``e``, ``2**-9`` below
  ``2**-6``) by adding and subtracting ``1.5 * 2**23 * u`` (one float32 addition rounds to
  nearest even at that spacing); the byte is read from the rounded value's float32 bits.
* e2m1: count the midpoints below the magnitude (strict or inclusive by the tie's even
  neighbour), as ``fp4select.formats.e2m1_encode`` does.
* Divisions use ``div_rn`` (Triton's ``/`` on float32 is approximate on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4select import formats

# The same constants as fp4select.quantize (which imports this module, so not from there).
C_SIXTH = tl.constexpr(float(torch.tensor(1.0 / 6.0, dtype=torch.float32)))
F32_MAX = tl.constexpr(float(torch.finfo(torch.float32).max))


@triton.jit
def _e4m3(v):
    """float32 >= 0 (or NaN) -> (the e4m3 byte as int32, its float32 value)."""
    m = tl.minimum(v, 448.0)
    bits = m.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF  # biased float32 exponent
    exp = tl.maximum(exp, 127 - 6)  # below 2**-6 the spacing is fixed at 2**-9
    # 1.5 * 2**23 * 2**(e-3) = 1.5 * 2**(e+20): float32 bits (e + 20 + 127) << 23 | 0x400000
    magic = (((exp + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (m + magic) - magic
    rb = r.to(tl.int32, bitcast=True)
    rexp = (rb >> 23) & 0xFF
    normal = ((rexp - 127 + 7) << 3) | ((rb >> 20) & 7)
    sub = (r * 512.0).to(tl.int32)  # exact: r is a multiple of 2**-9 below 2**-6
    byte = tl.where(r >= 0.015625, normal, sub)
    byte = tl.where(v != v, 0x7F, byte)
    val = tl.where(v != v, v, r)
    return byte, val


@triton.jit
def _e2m1(v):
    """float32 -> e2m1 code (int32, 0..15): nearest even, saturating, NaN -> 7, sign kept."""
    a = tl.abs(v)
    c = (a > 0.25).to(tl.int32)
    c += (a >= 0.75).to(tl.int32)
    c += (a > 1.25).to(tl.int32)
    c += (a >= 1.75).to(tl.int32)
    c += (a > 2.5).to(tl.int32)
    c += (a >= 3.5).to(tl.int32)
    c += (a > 5.0).to(tl.int32)
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    return tl.where(v != v, 7, c | (sign << 3))


@triton.jit
def _quantize_kernel(
    x_ptr,
    gs_ptr,
    out_ptr,
    sf_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    CP,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    pairs = tl.arange(0, 8)
    r3 = rows[:, None, None]
    k_even = cols[None, :, None] * 16 + 2 * pairs[None, None, :]
    inside = (r3 < M) & (k_even < K)
    base = x_ptr + r3.to(tl.int64) * stride_xm
    x_even = tl.load(base + k_even * stride_xk, mask=inside, other=0.0).to(tl.float32)
    x_odd = tl.load(base + (k_even + 1) * stride_xk, mask=inside, other=0.0).to(tl.float32)

    # amax over the 16 values, a NaN ignored unless all 16 are NaN (as the device's max.f32).
    a_even = tl.abs(x_even)
    a_odd = tl.abs(x_odd)
    amax = tl.max(
        tl.maximum(tl.where(a_even != a_even, -1.0, a_even), tl.where(a_odd != a_odd, -1.0, a_odd)),
        axis=2,
    )
    amax = tl.where(amax < 0.0, float("nan"), amax)

    gs = tl.load(gs_ptr)
    sf_f = amax * (gs * C_SIXTH)
    sf_byte, sf_val = _e4m3(sf_f)
    inv = tl.math.div_rn(1.0, sf_val * tl.math.div_rn(1.0, gs))
    inv = tl.where(inv <= F32_MAX, inv, F32_MAX)  # fmin(., FLT_MAX); NaN -> FLT_MAX
    inv3 = inv[:, :, None]
    lo = _e2m1(x_even * inv3)
    hi = _e2m1(x_odd * inv3)
    packed = (lo | (hi << 4)).to(tl.uint8)
    out_offs = r3.to(tl.int64) * (K // 2) + cols[None, :, None] * 8 + pairs[None, None, :]
    tl.store(out_ptr + out_offs, packed, mask=inside)

    # 128x4 swizzle of the scale grid, padding included.
    r2 = rows[:, None]
    c2 = cols[None, :]
    sf_offs = (
        (r2 // 128).to(tl.int64) * CP * 128
        + (c2 // 4) * 512
        + (r2 % 32) * 16
        + ((r2 % 128) // 32) * 4
        + c2 % 4
    )
    grid_rows = ((M + 127) // 128) * 128
    tl.store(sf_ptr + sf_offs, sf_byte.to(tl.uint8), mask=(r2 < grid_rows) & (c2 < CP))


def _tile(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_C, num_warps): decode-sized inputs spread over more programs."""
    if m <= 16:
        return 16, 8, 2
    return 32, 16, 4


def quantize(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, K) bf16/fp16/fp32, ``gs`` one float32 element on x's device."""
    m, k = x.shape
    rp, cp = formats.padded_sf_shape(m, k // 16, "128x4")
    out = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    sf = torch.empty((rp, cp), dtype=torch.uint8, device=x.device)
    block_m, block_c, warps = _tile(m)
    grid = (triton.cdiv(rp, block_m), triton.cdiv(cp, block_c))
    _quantize_kernel[grid](
        x,
        gs,
        out,
        sf,
        m,
        k,
        x.stride(0),
        x.stride(1),
        cp,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        num_warps=warps,
    )
    return out, sf.view(torch.float8_e4m3fn)
