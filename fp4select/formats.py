"""Bit-exact FP4 (NVFP4 / MXFP4) formats, scale-factor layouts and a reference GEMM.

Why one file of ~590 lines: this docstring is the format's specification and the functions
below are its executable definition, kept side by side; the codec, the layouts and the
reference GEMM each read the others' rules.

Every backend that fp4select benchmarks is judged against :func:`reference_mm_fp4`, so this
module is the single source of truth for what the bytes mean.  The rules, exactly:

E2M1 element (4 bits)
    Bit 3 is the sign; bits 0-2 index the magnitudes ``E2M1_GRID = (0, .5, 1, 1.5, 2, 3, 4, 6)``.
    Code 8 is -0 and decodes to ``-0.0``.  Two codes per byte: element ``2i`` in the LOW
    nibble, element ``2i+1`` in the HIGH nibble.  Encoding rounds to nearest with ties to the
    even code (the grid point whose mantissa bit is 0), saturates at +-6 (also for +-inf) and
    keeps the sign of negative values that round to zero.  NaN encodes to code 7 (+6): the
    format has no NaN, a saturated value stays visible in a GEMM output where a zero would
    hide the problem, and this is, as far as we know, what PTX ``cvt.rn.satfinite`` does.

Packed matrices
    ``a`` is ``(M, K/2)`` uint8 row-major; ``b`` is ``(K/2, N)``, the ``.T`` view of a
    row-major ``(N, K/2)`` weight.  ``torch.float4_e2m1fn_x2`` tensors are read as uint8.

NVFP4
    Block of 16 along K, block scale ``float8_e4m3fn``, per-tensor global scale
    ``gsf = 448*6/amax`` (``gsf = 1`` when ``amax == 0``), block scale
    ``sf = e4m3(gsf*amax_block/6)`` (saturated at 448), values
    ``e2m1(x*gsf/float(sf))`` (zeros where ``sf == 0``).  Dequantized value is
    ``e2m1 * float(sf) / gsf``; in a GEMM the global scales come back as
    ``alpha = 1/(gsf_a*gsf_b)`` applied to the output.

MXFP4
    Block of 32, scale UE8M0 stored as uint8 (byte ``b`` means ``2**(b-127)``, 255 is NaN).
    OCP MX scale choice: ``exp = clamp(floor(log2(amax_block)) - 2, -127, 127)``, values
    ``e2m1(x / 2**exp)``; a block containing NaN gets scale byte 255.  No global scale.

Scale-factor layouts, for ``S[R, C]`` with ``C = K/block``, zero padded to ``(Rp, Cp)``:
    ``"128x4"``: ``Rp = ceil128(R)``, ``Cp = ceil4(C)``,
    ``idx = (r//128)*Cp*128 + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4``.
    ``"8x4"``: ``Rp = ceil8(R)``, ``Cp = ceil4(C)``,
    ``idx = (r//8)*Cp*8 + (c//4)*32 + (r%8)*4 + c%4``.
    ``"linear"``: row-major ``(R, C)``, no padding.
    The swizzled buffer is handled as the 2-D ``(Rp, Cp)`` reshape of the flat buffer;
    ``mm_fp4`` takes ``a_descale`` as that tensor and ``b_descale`` as the ``.T`` view of the
    weight's ``(Np, Cp)`` tensor.

trtllm weight shuffle (epilogue tile 128, shuffle block 32)
    Old row ``r`` moves to ``(r//32)*32 + MAP[r%32]`` with ``MAP[i] = (i%4)*8 + i//4``
    (flashinfer's ``srcToDstBlk32RowMap``).  The packed ``(N, K/2)`` weight rows are shuffled
    (``N % 32 == 0``); the scales are shuffled as the LINEAR ``(N, C)`` matrix and then
    swizzled (``N % 128 == 0``).

Decode paths (:func:`dequantize`, :func:`reference_mm_fp4` and the helpers they call) run
inside CUDA graph capture, so they use only shape arithmetic on Python ints and device-side
tensor ops: no ``.item()``, no ``.tolist()``, no host-built tensors, no branching on values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "E2M1_GRID",
    "SF_LAYOUTS",
    "QuantizedMatrix",
    "decode_scales",
    "dequantize",
    "e2m1_decode",
    "e2m1_encode",
    "pack_nibbles",
    "padded_sf_shape",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "reference_mm_fp4",
    "sf_index",
    "shuffle_rows_trtllm",
    "swizzle_sf",
    "trtllm_row_permutation",
    "unpack_nibbles",
    "unshuffle_rows_trtllm",
    "unswizzle_sf",
]

SF_LAYOUTS = ("linear", "128x4", "8x4")
# What a GEMM call may ask for, by name: the vocabulary of a problem key (``keys.Problem``) and of
# a backend's declaration (``backends.base.Capabilities``), which both import it from here.
OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
A_SF_LAYOUTS = ("128x4", "8x4")
B_LAYOUTS = ("plain", "trtllm")
ALPHA_KINDS = ("none", "scalar", "per_token")
E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E2M1_MAX = 6.0
E4M3_MAX = 448.0
TRTLLM_SHUFFLE_BLOCK = 32
TRTLLM_SF_ROWS = 128

# Midpoints between neighbouring grid magnitudes, with whether a value exactly on the midpoint
# rounds UP (true when the upper neighbour has the even code, i.e. mantissa bit 0).
_E2M1_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)
_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)


def _check_layout(layout: str) -> None:
    if layout not in SF_LAYOUTS:
        raise ValueError(f"layout must be one of {SF_LAYOUTS}, got {layout!r}")


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _as_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """Reinterpret a 1-byte tensor as uint8 so index/pad ops work for every 1-byte dtype."""
    if t.element_size() != 1:
        raise TypeError(f"{name} must have a 1-byte dtype, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# --------------------------------------------------------------------------------------------
# E2M1 elements and nibble packing


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round floats to E2M1 codes (0..15) with RNE, satfinite, signed zero, NaN -> 7.

    Counting crossed midpoints (strict or inclusive per tie direction) gives RNE on the
    non-uniform grid without tables, so nothing is copied from the host.
    """
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    # float64 keeps its precision: rounding it to float32 first could move a value onto a tie.
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    mag = xf.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, up_on_tie in _E2M1_MIDPOINTS:
        code += (mag >= midpoint if up_on_tie else mag > midpoint).to(torch.uint8)
    nan = torch.isnan(xf)
    code = torch.where(nan, 7, code)
    negative = torch.signbit(xf) & ~nan
    return code | (negative.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map E2M1 codes to floats; only the low 4 bits are read (checking would need a sync).

    Arithmetic instead of a lookup table keeps the decode free of host-built tensors, which
    matters under CUDA graph capture.  Every grid value is ``q/4`` with small integer ``q``,
    so the result is exact in every float dtype.
    """
    if codes.is_floating_point() or codes.is_complex():
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    c = codes.to(torch.int32) & 0xF
    m = c & 7
    quarter_units = torch.where(m < 2, 2 * m, (2 + (m & 1)) << (m >> 1))
    mag = quarter_units.to(dtype) * 0.25
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``(..., K)`` codes into ``(..., K/2)`` bytes, element 2i in the low nibble."""
    if codes.is_floating_point() or codes.is_complex():
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes last dimension must be even, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Unpack ``(..., K/2)`` bytes (uint8 or float4_e2m1fn_x2) into ``(..., K)`` codes."""
    if packed.dtype != torch.uint8 and packed.dtype != _FP4_X2:
        raise TypeError(f"packed must be uint8 or float4_e2m1fn_x2, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed must have at least one dimension")
    p = packed.view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


# --------------------------------------------------------------------------------------------
# Scale-factor layouts


def padded_sf_shape(rows: int, cols: int, layout: str) -> tuple[int, int]:
    """Shape of the swizzled buffer: kernels read whole 128x4 / 8x4 tiles, so pad to them."""
    _check_layout(layout)
    if rows < 0 or cols < 0:
        raise ValueError(f"rows and cols must be non-negative, got {rows}, {cols}")
    if layout == "linear":
        return rows, cols
    return _ceil_to(rows, 128 if layout == "128x4" else 8), _ceil_to(cols, 4)


def sf_index(rows: int, cols: int, layout: str, device=None) -> torch.Tensor:
    """Flat buffer position of every ``S[r, c]``; the layout formulas written out verbatim.

    :func:`swizzle_sf` uses reshape/permute instead, so the two are independent statements
    of the same layout and the tests check one against the other.
    """
    _, cp = padded_sf_shape(rows, cols, layout)
    r = torch.arange(rows, dtype=torch.int64, device=device).unsqueeze(1)
    c = torch.arange(cols, dtype=torch.int64, device=device).unsqueeze(0)
    if layout == "linear":
        return r * cols + c
    if layout == "128x4":
        return (
            (r // 128) * cp * 128 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        )
    return (r // 8) * cp * 8 + (c // 4) * 32 + (r % 8) * 4 + c % 4


def _tile_view_shape(rp: int, cp: int, layout: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tiled shape of the padded row-major matrix, permutation that gives buffer order)."""
    if layout == "128x4":
        # (r//128, (r%128)//32, r%32, c//4, c%4) -> (r//128, c//4, r%32, (r%128)//32, c%4)
        return (rp // 128, 4, 32, cp // 4, 4), (0, 3, 2, 1, 4)
    # 8x4: (r//8, r%8, c//4, c%4) -> (r//8, c//4, r%8, c%4)
    return (rp // 8, 8, cp // 4, 4), (0, 2, 1, 3)


def swizzle_sf(sf: torch.Tensor, layout: str) -> torch.Tensor:
    """Lay a linear ``(R, C)`` scale matrix out as the ``(Rp, Cp)`` buffer a kernel reads."""
    _check_layout(layout)
    if sf.dim() != 2:
        raise ValueError(f"sf must be 2-D (rows, cols), got shape {tuple(sf.shape)}")
    b = _as_bytes(sf, "sf")
    rows, cols = b.shape
    rp, cp = padded_sf_shape(rows, cols, layout)
    if layout == "linear":
        return sf.contiguous()
    padded = F.pad(b, (0, cp - cols, 0, rp - rows))
    shape, perm = _tile_view_shape(rp, cp, layout)
    out = padded.reshape(shape).permute(perm).reshape(rp, cp)
    return out.view(sf.dtype)


def unswizzle_sf(sf: torch.Tensor, rows: int, cols: int, layout: str) -> torch.Tensor:
    """Recover the linear ``(rows, cols)`` matrix from a swizzled buffer (logical order).

    Any shape is accepted as long as it holds exactly ``Rp*Cp`` elements, because kernels
    and checkpoints disagree on whether the buffer is 1-D or 2-D; transposed views must be
    undone by the caller, since only it knows which view it was handed.
    """
    rp, cp = padded_sf_shape(rows, cols, layout)
    if sf.numel() != rp * cp:
        raise ValueError(
            f"sf must hold {rp}*{cp}={rp * cp} elements for {rows}x{cols} in layout "
            f"{layout!r}, got shape {tuple(sf.shape)}"
        )
    b = _as_bytes(sf, "sf").reshape(-1)
    if layout == "linear":
        return b.reshape(rows, cols).view(sf.dtype).contiguous()
    shape, perm = _tile_view_shape(rp, cp, layout)
    tiled = b.reshape([shape[i] for i in perm])
    inverse = [perm.index(i) for i in range(len(perm))]
    out = tiled.permute(inverse).reshape(rp, cp)[:rows, :cols]
    return out.contiguous().view(sf.dtype)


def without_spare_row_tiles(sf: torch.Tensor, rows: int, cols: int, layout: str) -> torch.Tensor:
    """The buffer less whole row tiles beyond ``rows``, which engines allocate for a's scales.

    fp4select's argument checks accept such a buffer, so every backend must read it as kernels
    do: row tiles are the outermost order of both swizzled layouts, so the tiles the rows need
    are a prefix of the buffer (a view; nothing is copied). Anything else is returned as is,
    for the caller's own size check to refuse.
    """
    if layout == "linear":
        return sf
    rp, cp = padded_sf_shape(rows, cols, layout)
    spare = sf.numel() - rp * cp
    if spare <= 0 or spare % ((128 if layout == "128x4" else 8) * cp) or not sf.is_contiguous():
        return sf
    if sf.dim() == 2 and sf.shape[1] == cp:
        return sf[:rp]
    return sf.reshape(-1)[: rp * cp]


def decode_scales(sf: torch.Tensor, use_nvfp4: bool) -> torch.Tensor:
    """Scale bytes -> float32.  UE8M0 is built from exponent bits so that it is exact.

    ``2**(b-127)`` via ``pow``/``exp2`` relies on the math library being exact; writing the
    IEEE bits directly is exact by construction (byte 0 is the subnormal ``2**-127``).
    """
    b = _as_bytes(sf, "sf")
    if use_nvfp4:
        return b.view(torch.float8_e4m3fn).to(torch.float32)
    e = b.to(torch.int32)
    return torch.where(e == 255, torch.nan, _pow2(e - 127))


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**e`` for integer ``e`` in [-127, 127], written as IEEE bits."""
    bits = torch.where(e > -127, (e + 127) << 23, 1 << 22)
    return bits.to(torch.int32).view(torch.float32)


# --------------------------------------------------------------------------------------------
# trtllm row shuffle


def _check_shuffle_rows(rows: int, multiple: int, what: str) -> None:
    if rows % multiple:
        raise ValueError(
            f"{what} must be a multiple of {multiple} for the trtllm shuffle, got {rows}"
        )


def trtllm_row_permutation(rows: int, device=None) -> torch.Tensor:
    """``perm[new_row] = old_row`` (flashinfer's ``get_shuffle_matrix_a_row_indices``, tile 128).

    Closed form of the inverse of ``MAP[i] = (i%4)*8 + i//4``: ``old%32 = (new%8)*4 + new%32//8``.
    """
    _check_shuffle_rows(rows, TRTLLM_SHUFFLE_BLOCK, "rows")
    new = torch.arange(rows, dtype=torch.int64, device=device)
    j = new % 32
    return new - j + (j % 8) * 4 + j // 8


def shuffle_rows_trtllm(x: torch.Tensor) -> torch.Tensor:
    """Apply the trtllm row shuffle along dim 0 (``out[new] = x[perm[new]]``)."""
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    return x.index_select(0, trtllm_row_permutation(x.shape[0], x.device))


def unshuffle_rows_trtllm(x: torch.Tensor) -> torch.Tensor:
    """Undo :func:`shuffle_rows_trtllm` along dim 0: a gather at the forward map
    ``inv[old_row] = new_row``, not a scatter."""
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    _check_shuffle_rows(x.shape[0], TRTLLM_SHUFFLE_BLOCK, "rows")
    old = torch.arange(x.shape[0], dtype=torch.int64, device=x.device)
    i = old % 32
    return x.index_select(0, old - i + (i % 4) * 8 + i // 4)


# --------------------------------------------------------------------------------------------
# Quantization


@dataclass(frozen=True)
class QuantizedMatrix:
    """A quantized ``(R, K)`` matrix in exactly the form ``mm_fp4`` consumes it."""

    data: torch.Tensor  # (R, K/2) uint8, row-major (rows trtllm-shuffled if `shuffled`)
    scales: torch.Tensor  # (Rp, Cp) swizzled per sf_layout; e4m3 (nvfp4) or uint8 (mxfp4)
    global_scale: torch.Tensor | None  # float32 0-dim (nvfp4) or None (mxfp4)
    sf_layout: str
    use_nvfp4: bool
    shuffled: bool


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``(R, K)`` float -> ``(R, K/block, block)`` float32, validating the shape once."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, K), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    rows, k = x.shape
    if k == 0 or k % block:
        raise ValueError(f"x.shape[1] (K={k}) must be a positive multiple of {block}")
    return x.to(torch.float32).reshape(rows, k // block, block)


def _finish(
    codes: torch.Tensor,
    sf: torch.Tensor,
    global_scale: torch.Tensor | None,
    sf_layout: str,
    use_nvfp4: bool,
    shuffle: bool,
) -> QuantizedMatrix:
    data = pack_nibbles(codes.flatten(1))
    if shuffle:
        _check_shuffle_rows(data.shape[0], TRTLLM_SF_ROWS, "x.shape[0] (shuffled scales)")
        data = shuffle_rows_trtllm(data)
        sf = shuffle_rows_trtllm(sf)
    return QuantizedMatrix(
        data=data,
        scales=swizzle_sf(sf, sf_layout),
        global_scale=global_scale,
        sf_layout=sf_layout,
        use_nvfp4=use_nvfp4,
        shuffled=shuffle,
    )


def quantize_nvfp4(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    sf_layout: str = "128x4",
    shuffle: bool = False,
) -> QuantizedMatrix:
    """Quantize ``(R, K)`` to NVFP4; ``global_scale`` defaults to ``448*6/amax(x)``.

    The global scale maps the tensor's amax onto the largest e4m3 block scale times the
    largest e2m1 value, so block scales use the full e4m3 range.
    """
    _check_layout(sf_layout)
    xb = _blocks(x, NVFP4_BLOCK)
    if global_scale is None:
        amax = xb.abs().amax()
        gsf = torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax, torch.ones_like(amax))
    else:
        gsf = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        if gsf.numel() != 1:
            raise ValueError(f"global_scale must have one element, got shape {tuple(gsf.shape)}")
        gsf = gsf.reshape(())
    amax_block = xb.abs().amax(dim=-1)
    sf = (gsf * amax_block / E2M1_MAX).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf_f = sf.to(torch.float32).unsqueeze(-1)
    scaled = torch.where(sf_f != 0, xb * gsf / sf_f, torch.zeros_like(xb))
    return _finish(e2m1_encode(scaled), sf, gsf, sf_layout, True, shuffle)


def quantize_mxfp4(
    x: torch.Tensor, sf_layout: str = "128x4", shuffle: bool = False
) -> QuantizedMatrix:
    """Quantize ``(R, K)`` to MXFP4 with the OCP MX scale rule (may saturate up to 8 -> 6).

    ``floor(log2(amax))`` comes from ``frexp`` rather than ``log2``: ``log2`` of a value just
    below a power of two can round up to the integer and pick a scale one step too small.
    """
    _check_layout(sf_layout)
    xb = _blocks(x, MXFP4_BLOCK)
    amax_block = xb.abs().amax(dim=-1)
    _, e = torch.frexp(amax_block)
    exp = torch.where(amax_block > 0, e - 1 - 2, -127)
    exp = torch.where(torch.isinf(amax_block), 127, exp).clamp(-127, 127)
    byte = torch.where(torch.isnan(amax_block), 255, exp + 127).to(torch.uint8)
    # Multiplying by the exact power of two 2**-exp rounds exactly like dividing by 2**exp.
    codes = e2m1_encode(xb * _pow2(-exp).unsqueeze(-1))
    return _finish(codes, byte, None, sf_layout, False, shuffle)


# --------------------------------------------------------------------------------------------
# Decoding and the reference GEMM


def dequantize(
    data: torch.Tensor,
    scales: torch.Tensor,
    k: int,
    *,
    use_nvfp4: bool,
    sf_layout: str,
    shuffled: bool = False,
    rows: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(rows, k)`` = e2m1 * block scale in ``dtype``, WITHOUT the global scale (exact in the
    default float32; bfloat16 and float16 round as their kernels' decodes do).

    The global scale is left out because ``mm_fp4`` applies it as ``alpha`` on the output;
    keeping it out here lets a caller mirror exactly what the kernel multiplies.  ``rows``
    (default ``data.shape[0]``) drops trailing padded rows of ``data``.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    _check_layout(sf_layout)
    if data.dim() != 2:
        raise ValueError(f"data must be 2-D (rows, K/2), got shape {tuple(data.shape)}")
    block = NVFP4_BLOCK if use_nvfp4 else MXFP4_BLOCK
    if k <= 0 or k % block or data.shape[1] * 2 != k:
        raise ValueError(
            f"k must be a positive multiple of {block} equal to 2*data.shape[1], "
            f"got k={k} with data shape {tuple(data.shape)}"
        )
    stored_rows = data.shape[0]
    rows = stored_rows if rows is None else rows
    if not 0 <= rows <= stored_rows:
        raise ValueError(f"rows must be in [0, {stored_rows}], got {rows}")
    cols = k // block
    codes = unpack_nibbles(data)
    if shuffled:
        _check_shuffle_rows(stored_rows, TRTLLM_SF_ROWS, "data.shape[0] (shuffled scales)")
        codes = unshuffle_rows_trtllm(codes)
        sf = unshuffle_rows_trtllm(unswizzle_sf(scales, stored_rows, cols, sf_layout))
        codes, sf = codes[:rows], sf[:rows]
    else:
        codes = codes[:rows]
        sf = unswizzle_sf(
            without_spare_row_tiles(scales, rows, cols, sf_layout), rows, cols, sf_layout
        )
    values = e2m1_decode(codes, dtype).reshape(rows, cols, block)
    return (values * decode_scales(sf, use_nvfp4).to(dtype).unsqueeze(-1)).reshape(rows, k)


def check_block_size(block_size: int, use_nvfp4: bool) -> None:
    """``mm_fp4``'s block size: the format's (16 for NVFP4, 32 for MXFP4), or a ValueError."""
    expected = NVFP4_BLOCK if use_nvfp4 else MXFP4_BLOCK
    if block_size != expected:
        fmt = "nvfp4" if use_nvfp4 else "mxfp4"
        raise ValueError(f"block_size must be {expected} for {fmt}, got {block_size}")


def check_out(out: torch.Tensor, m: int, n: int, out_dtype: torch.dtype) -> None:
    """A given ``out`` must be the ``(M, N)`` result in ``out_dtype``, or a ValueError."""
    if tuple(out.shape) != (m, n) or out.dtype != out_dtype:
        raise ValueError(
            f"out must be a ({m}, {n}) {out_dtype} tensor, got {tuple(out.shape)} {out.dtype}"
        )


def reference_mm_fp4(
    a: torch.Tensor,
    b: torch.Tensor,
    a_descale: torch.Tensor,
    b_descale: torch.Tensor,
    alpha: torch.Tensor | float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    block_size: int = 16,
    use_8x4_sf_layout: bool = False,
    use_nvfp4: bool = True,
    *,
    b_layout: str = "plain",
    compute_dtype: torch.dtype = torch.float32,
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """What ``flashinfer.mm_fp4`` should return, with its argument conventions.

    Decoding is exact in float32 (e2m1 times e4m3 / 2**e), so the only rounding is in the
    matmul, the alpha product and the final cast; ``compute_dtype=float64`` removes most of it.
    ``matmul(a, w)`` replaces ``a @ w.T`` on the decoded (M, K) and (N, K) operands.
    """
    if b_layout not in ("plain", "trtllm"):
        raise ValueError(f"b_layout must be 'plain' or 'trtllm', got {b_layout!r}")
    check_block_size(block_size, use_nvfp4)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    m, k_half = a.shape
    if b.shape[0] != k_half:
        raise ValueError(
            f"b must be (K/2, N) with K/2 = a.shape[1] = {k_half}, got shape {tuple(b.shape)}"
        )
    n, k = b.shape[1], 2 * k_half
    np_, cp = padded_sf_shape(n, k // block_size, "128x4")
    if b_descale.dim() == 2:
        if tuple(b_descale.shape) != (cp, np_):
            raise ValueError(
                f"b_descale must be the .T view of the weight's ({np_}, {cp}) scale tensor, "
                f"i.e. shape ({cp}, {np_}), got {tuple(b_descale.shape)}"
            )
        b_descale = b_descale.T
    elif b_descale.dim() != 1:
        raise ValueError(f"b_descale must be 1-D or 2-D, got shape {tuple(b_descale.shape)}")
    a_layout = "8x4" if use_8x4_sf_layout else "128x4"
    a_deq = dequantize(
        a, a_descale, k, use_nvfp4=use_nvfp4, sf_layout=a_layout, dtype=compute_dtype
    )
    w_deq = dequantize(
        b.T,
        b_descale,
        k,
        use_nvfp4=use_nvfp4,
        sf_layout="128x4",
        shuffled=b_layout == "trtllm",
        dtype=compute_dtype,
    )
    result = a_deq @ w_deq.T if matmul is None else matmul(a_deq, w_deq)
    if isinstance(alpha, (int, float)):
        # A Python scalar multiplies directly: no host->device copy inside graph capture.
        result = result * alpha
    elif alpha is not None:
        alpha_t = torch.as_tensor(alpha, device=result.device).to(compute_dtype)
        if alpha_t.numel() == 1:
            result = result * alpha_t.reshape(())
        elif alpha_t.numel() == m:
            result = result * alpha_t.reshape(m, 1)
        else:
            raise ValueError(
                f"alpha must have 1 or M={m} elements, got shape {tuple(alpha_t.shape)}"
            )
    result = result.to(out_dtype)
    if out is None:
        return result
    check_out(out, m, n, out_dtype)
    return out.copy_(result)
