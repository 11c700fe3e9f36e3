"""The PTX that decodes two weight words into the float16 planes the tensor cores read.

Shared by ``hopper-mma`` (``_hopper_kernels.pair_to_f16``) and ``hopper-ws`` (``_hopper_ws``),
and kept apart from both so that the Gluon kernels need not import the Triton ones: strings
only (``tests/test_hopper_asm.py`` runs them over every input on the CPU).
"""

from __future__ import annotations

import triton.language as tl


def _plane_pair(byte: int, out_lo: int, out_hi: int) -> str:
    """PTX: byte ``byte`` of words $8 and $9 -> planes 2 * byte and 2 * byte + 1, float16x2.

    One byte permute puts the byte of each word into both bytes of its half-word; the low
    nibble's code then moves to the float16 bits of value * 2**-14 by shifts of 9 and 12, the
    high nibble's by a shift of 3 (its sign is in place), and each half is scaled by its word's
    scale ($10 and $11, folded into ``s``).
    """
    sel = byte | byte << 4 | (4 + byte) << 8 | (4 + byte) << 12
    return f"""
    prmt.b32 t, $8, $9, {sel};
    shl.b32 a, t, 9;
    and.b32 a, a, 0x0E000E00;
    shl.b32 b, t, 12;
    and.b32 b, b, 0x80008000;
    or.b32 v, a, b;
    mul.rn.f16x2 ${out_lo}, v, s;
    shr.b32 a, t, 3;
    and.b32 a, a, 0x0E000E00;
    and.b32 b, t, 0x80008000;
    or.b32 v, a, b;
    mul.rn.f16x2 ${out_hi}, v, s;"""


# Two words at a time (pack=2: $8 = word w, $9 = word w + 1; $10, $11 = their e4m3 scale
# bytes): $p = plane p as float16x2, code p of word w in the low half and of word w + 1 in the
# high half, each value * 2**-14 * its scale. Output p is then the operand register the MMA
# reads for two neighbouring values of K, so nothing is unpacked and packed again, and the
# scale is decoded once per two words. Still elementwise: each half depends on its own word
# and its own scale only, however Triton pairs the elements.
_PLANES = _plane_pair(0, 0, 1) + _plane_pair(1, 2, 3) + _plane_pair(2, 4, 5) + _plane_pair(3, 6, 7)
# The scales in integer arithmetic: their bits moved into float16's and rescaled by 2**8.
_PAIR_TO_F16 = tl.constexpr(
    """{
    .reg .b32 t, a, b, v, s, c;
    shl.b32 t, $11, 16;
    or.b32 t, t, $10;
    and.b32 a, t, 0x007F007F;
    shl.b32 a, a, 7;
    and.b32 b, t, 0x00800080;
    shl.b32 b, b, 8;
    or.b32 s, a, b;
    mov.b32 c, 0x5C005C00;
    mul.rn.f16x2 s, s, c;"""
    + _PLANES
    + """
    }"""
)
# The scales by the GPU's conversion (SM89+): the low byte of $10 and of $11 side by side, two
# e4m3 to float16x2 in one instruction (bits above the low byte of $10 and $11 are ignored, so
# the caller need not mask them). 2 instructions where the above takes 9; a NaN scale (0x7F,
# 0xFF) reads as NaN, as in the reference.
_PAIR_TO_F16_CVT = tl.constexpr(
    """{
    .reg .b32 t, a, b, v, s;
    .reg .b16 lo, hi;
    prmt.b32 t, $10, $11, 0x40;
    mov.b32 {lo, hi}, t;
    cvt.rn.f16x2.e4m3x2 s, lo;"""
    + _PLANES
    + """
    }"""
)
