"""The Triton kernel behind :func:`fp4select.quantize.fp4_quantize` (imported on first use).

One launch writes both outputs whole: the packed codes and every byte of the padded
``(ceil128(M), ceil4(K/16))`` 128x4-swizzled scale buffer, so the caller allocates with
``torch.empty`` and no fill runs apart. The grid, for a :class:`fp4select.quantize.QuantConfig`:

* ``(ceil(M / BLOCK_M), ceil(CP / BLOCK_C))`` quantizing programs, each ``BLOCK_M`` rows by
  ``BLOCK_C`` scale columns (16 values each). With ``split`` a block's 16 values are loaded
  as one contiguous run (vector loads) and split into even and odd elements (the low and high
  nibble of each output byte) in registers; without it even and odd elements are loaded apart.
* with ``pad_programs``, one more row of programs that only store the zero scales of the
  padding rows ``M .. ceil128(M)`` (no load, no arithmetic): at decode sizes those are most of
  the scale grid (127 of 128 rows at M = 1). Without it the quantizing tiles cover the padding
  rows too and compute them from zeros (``benchmarks/quant_sweep.py``'s baseline).

Padding bytes (rows >= M, columns >= K/16) are written as 0 whatever the global scale (an
infinite one makes a zero block's scale NaN, never the padding's), as ``swizzle_sf`` pads.

Rounding is spelled out in float32 and integer arithmetic, never a hardware conversion, so the
Triton interpreter computes the same bits as the GPU:

* e4m3 (round to nearest even, saturating): clamp to 448, then round to a multiple of the
  value's e4m3 spacing ``u`` (``2**(e-3)`` for a normal value of exponent ``e``, ``2**-9`` below
  ``2**-6``) by adding and subtracting ``1.5 * 2**23 * u`` (one float32 addition rounds to
  nearest even at that spacing); the byte is read from the rounded value's float32 bits.
* e2m1: count the midpoints below the magnitude (strict or inclusive by the tie's even
  neighbour), as ``fp4select.formats.e2m1_encode`` does.
* Divisions use ``div_rn`` (Triton's ``/`` on float32 is approximate on the GPU).

A launch is kept per kind of call (``_launches``), keyed as ``hopper_launch`` keys the GEMMs'
plans, so that an eager call that repeats a shape launches from the compiled kernel without
Triton's per-call binding (``hopper_launch.Launch``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from fp4select.backends._triton_kernels import gdc_launch_dependents, pdl_start
from fp4select.backends.hopper_launch import MAX_PLANS, Launch, metadata_key

if TYPE_CHECKING:
    from fp4select.quantize import QuantConfig

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
def _sf_offsets(r2, c2, CP):
    """Byte offset of scale ``[r, c]`` in the 128x4-swizzled buffer of ``CP`` columns."""
    return (
        (r2 // 128).to(tl.int64) * CP * 128
        + (c2 // 4) * 512
        + (r2 % 32) * 16
        + ((r2 % 128) // 32) * 4
        + c2 % 4
    )


@triton.jit
def _zero_padding_rows(sf_ptr, M, CP, cols, BLOCK_C: tl.constexpr):
    """Scale rows ``M .. ceil128(M)`` of these columns: zeros (fewer than 128 rows)."""
    r2 = M + tl.arange(0, 128)[:, None]
    c2 = cols[None, :]
    grid_rows = ((M + 127) // 128) * 128
    zeros = tl.zeros((128, BLOCK_C), dtype=tl.uint8)
    tl.store(sf_ptr + _sf_offsets(r2, c2, CP), zeros, mask=(r2 < grid_rows) & (c2 < CP))


@triton.jit
def _quantize_tile(
    x_ptr,
    gs_ptr,
    out_ptr,
    sf_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    CP,
    pid_m,
    cols,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPLIT: tl.constexpr,
):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.arange(0, 8)
    r3 = rows[:, None, None]
    c3 = cols[None, :, None]
    KB = K // 16
    inside = (r3 < M) & (c3 < KB)
    base = x_ptr + r3.to(tl.int64) * stride_xm
    if SPLIT:
        k16 = c3 * 16 + tl.arange(0, 16)[None, None, :]
        x = tl.load(base + k16 * stride_xk, mask=inside, other=0.0).to(tl.float32)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_C, 8, 2)))
    else:
        k_even = c3 * 16 + 2 * pairs[None, None, :]
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
    out_offs = r3.to(tl.int64) * (K // 2) + c3 * 8 + pairs[None, None, :]
    tl.store(out_ptr + out_offs, packed, mask=inside)

    # This tile's scales, swizzled; rows >= M and columns >= K/16 are padding: 0.
    r2 = rows[:, None]
    c2 = cols[None, :]
    sf_byte = tl.where((r2 < M) & (c2 < KB), sf_byte, 0).to(tl.uint8)
    grid_rows = ((M + 127) // 128) * 128
    tl.store(sf_ptr + _sf_offsets(r2, c2, CP), sf_byte, mask=(r2 < grid_rows) & (c2 < CP))


# M and TILES_M change with every batch size: no recompile for their divisibility by 16.
@triton.jit(do_not_specialize=["M", "TILES_M"])
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
    TILES_M,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPLIT: tl.constexpr,
    PAD_PROGRAMS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # The GEMM this feeds may launch before this kernel waits for the layer before it (it
    # waits for us in its own pdl_start), hiding its launch (docs/hopper.md, 'In a chain of
    # layers').
    if PDL:
        gdc_launch_dependents()
    pdl_start(PDL, False)
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if PAD_PROGRAMS and pid_m == TILES_M:
        _zero_padding_rows(sf_ptr, M, CP, cols, BLOCK_C)
    else:
        _quantize_tile(
            x_ptr,
            gs_ptr,
            out_ptr,
            sf_ptr,
            M,
            K,
            stride_xm,
            stride_xk,
            CP,
            pid_m,
            cols,
            BLOCK_M,
            BLOCK_C,
            SPLIT,
        )


def grid(m: int, cp: int, cfg: QuantConfig) -> tuple[int, int, int]:
    """(BLOCK_M, programs along rows, programs along scale columns) for an (m, ...) input."""
    rp = -(-m // 128) * 128
    if not cfg.pad_programs:
        return cfg.block_m, -(-rp // cfg.block_m), -(-cp // cfg.block_c)
    block_m = min(cfg.block_m, 1 << (m - 1).bit_length())  # no tile larger than M needs
    tiles = -(-m // block_m)
    return block_m, tiles + (rp > m), -(-cp // cfg.block_c)


# (the call's key) -> (the launch, BLOCK_M): see the module docstring.
_launches: dict[tuple, tuple[Launch, int]] = {}


def quantize(
    x: torch.Tensor, gs: torch.Tensor, cfg: QuantConfig, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (M, K) bf16/fp16/fp32, ``gs`` one float32 element on x's device; ``pdl``:
    launch with programmatic dependent launch (SM90+, a Triton with ``launch_pdl``)."""
    m, k = x.shape
    rp, cp = -(-m // 128) * 128, -(-k // 64) * 4
    out = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    sf = torch.empty((rp, cp), dtype=torch.float8_e4m3fn, device=x.device)
    if m == 0:  # nothing to write, and a grid of no programs is not a launch
        return out, sf
    # Everything Triton specializes the kernel on, and everything the grid depends on.
    cuda = x.device.type == "cuda"
    key = (metadata_key(x, gs), cfg, pdl, torch.cuda.current_device() if cuda else -1)
    kept = _launches.get(key)
    if kept is None:
        block_m, programs_m, programs_c = grid(m, cp, cfg)
        kept = Launch(
            _quantize_kernel, (programs_m, programs_c),
            BLOCK_M=block_m, BLOCK_C=cfg.block_c, SPLIT=cfg.split, PAD_PROGRAMS=cfg.pad_programs,
            num_warps=cfg.num_warps, **({"PDL": True, "launch_pdl": True} if pdl else {}),
        ), block_m  # fmt: skip
        if not (cuda and torch.cuda.is_current_stream_capturing()):
            if len(_launches) >= MAX_PLANS:
                _launches.clear()
            _launches[key] = kept
    launch, block_m = kept
    # The kernel stores scale bytes: the JIT compiles it for a byte view; a direct launch reads
    # only the pointer (hopper_launch's rules), so the scales go as they are returned.
    sf_bytes = sf if launch.direct else sf.view(torch.uint8)
    launch(x, gs, out, sf_bytes, m, k, x.stride(0), x.stride(1), cp, -(-m // block_m))
    return out, sf
