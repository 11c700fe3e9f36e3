"""Triton kernels behind ``triton_hopper`` (imported only when one of its backends first runs).

Why one file of ~1110 lines: Triton resolves a kernel's helpers through its module's globals,
and the four kernels share the asm decodes, their pure-Triton twins and the scale helpers; the
asm strings and the twins they must agree with read best side by side.

Design rules:

* Decode whole words, never single nibbles. Weights and activations are read as 32-bit words
  (8 E2M1 values, all in one 16-value scale block) or 64-bit words (one whole NVFP4 block),
  and every value an inline-asm routine returns is derived from one word (and its scale) only:
  ``_PAIR_TO_F16`` takes two words at a time, but each half of each output register comes
  from one of them. So an asm routine is elementwise over words whatever register layout
  Triton picks for the tensor, which is what made the earlier byte-packed decode silently
  wrong inside ``tl.dot``.
* The order of K inside a step is free: a dot product does not care in which order its terms
  come, as long as both operands use the same order. ``_WORD_TO_F16`` returns the 8 values of
  a word as 8 separate tensors ("planes": plane i holds element i of every word); the
  activation is decoded with it and the weight with ``_PAIR_TO_F16``, which returns the same
  planes, so plane i of one meets plane i of the other.
* Exact arithmetic. ``_DECODE_S8`` maps E2M1 codes to the integers 2*value (-12..12) with a
  byte-permute table lookup (``prmt``), ``_DECODE_W`` and ``_DECODE_U8`` the weight's to
  magnitudes by sign or to 128 + 2*value, and ``dp4a`` multiplies: the integer dot product of
  one block is exact, and is scaled by both block scales once, in float32. ``_WORD_TO_F16``
  places each code's bits into a float16 (value * 2**-14, exact, subnormals included) and
  multiplies by the block scale in float16 (exact: the product is a multiple of 2**-24 below
  0.17), so tensor-core products are exact and only the float32 summation order differs from
  the reference. The ``* 2**28`` that undoes both ``2**-14`` is applied to the float32 sum.
* Every asm routine has a pure-Triton twin (``*_twin``) computing the same bits with integer
  arithmetic: the Triton interpreter (the CPU tests) cannot run inline asm, so ``ASM=False``
  selects the twin there. ``tests/test_hopper_asm.py`` proves the asm's bit logic on the CPU by
  emulating ``prmt``, shifts and masks over every input, and the GPU suite runs the asm itself.
* The weight is read where ``mm_fp4`` put it: ``W_TILE_ROWS`` (reading a copy re-laid by
  ``hopper_args.tiled_words``: ``tiled_rows``, ``tiled_at``) is an experiment of
  ``benchmarks/hopper_sweep.py`` that no backend launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The byte-wise kernels' helpers, shared: the swizzled scale index, and one code to float16.
from fp4select.backends._hopper_planes import _PAIR_TO_F16, _PAIR_TO_F16_CVT
from fp4select.backends._triton_kernels import _e2m1_f16 as _code_f16
from fp4select.backends._triton_kernels import _sf_offset as sf_offset
from fp4select.backends._triton_kernels import pdl_start, pdl_trigger

cdiv = triton.cdiv

# E2M1 code -> 2 * value as int8, for the byte-permute lookup: positive codes 0..7, then the
# same magnitudes negated (codes 8..15).
TABLE_POS = (0x03020100, 0x0C080604)  # 0 1 2 3 | 4 6 8 12
TABLE_NEG = (0xFDFEFF00, 0xF4F8FAFC)  # 0 -1 -2 -3 | -4 -6 -8 -12


def _decode_s8(word: str, lo: str, hi: str, tag: str) -> str:
    """PTX: a 32-bit word of 8 E2M1 codes -> two words of 4 int8 (2 * value) each."""
    return f"""
    and.b32 m{tag}, {word}, 0x77777777;
    shr.b32 s{tag}, {word}, 1;
    and.b32 s{tag}, s{tag}, 0x44444444;
    or.b32 s{tag}, s{tag}, 0x32103210;
    prmt.b32 p{tag}, tp0, tp1, m{tag};
    prmt.b32 n{tag}, tn0, tn1, m{tag};
    prmt.b32 {lo}, p{tag}, n{tag}, s{tag};
    shr.b32 m{tag}, m{tag}, 16;
    shr.b32 s{tag}, s{tag}, 16;
    prmt.b32 p{tag}, tp0, tp1, m{tag};
    prmt.b32 n{tag}, tn0, tn1, m{tag};
    prmt.b32 {hi}, p{tag}, n{tag}, s{tag};"""


def _asm(regs: str, tables: str, word: str, body: str) -> str:
    """A decode's PTX: its registers, its tables (the first words from operands, see
    ``_LANE_TABLES``), the 64-bit word split in two, then ``body``."""
    return f"""{{
    .reg .b32 {regs};{tables}
    mov.b64 {{w0, w1}}, {word};{body}
    }}"""


def _pos_table(first: str) -> str:
    return f"""
    mov.b32 tp0, {first}; mov.b32 tp1, {TABLE_POS[1]};"""


def _neg_table(first: str) -> str:
    return f"""
    mov.b32 tn0, {first}; mov.b32 tn1, {TABLE_NEG[1]};"""


# $0..$3 = the 16 codes of the 64-bit word $4 as int8 (2 * value), 4 per word, in order
# (tables' first words: $5, $6).
_DECODE_S8 = tl.constexpr(
    _asm(
        "tp0, tp1, tn0, tn1, w0, w1, mw, sw, pw, nw",
        _pos_table("$5") + _neg_table("$6"),
        "$4",
        _decode_s8("w0", "$0", "$1", "w") + _decode_s8("w1", "$2", "$3", "w"),
    )
)


def _split_w(word: str, p_lo: str, p_hi: str, n_lo: str, n_hi: str) -> str:
    """PTX: 8 codes -> magnitudes (2 * value) of the positive ones and of the negative ones.

    ``prmt`` with a code as selector picks the magnitude from the table when the code's sign
    bit is clear, and replicates the (clear) top bit of the table byte, giving 0, when it is
    set; flipping the sign bits first selects the negative codes instead.
    """
    return f"""
    xor.b32 f, {word}, 0x88888888;
    prmt.b32 {p_lo}, tp0, tp1, {word};
    prmt.b32 {n_lo}, tp0, tp1, f;
    shr.b32 h, {word}, 16;
    shr.b32 f, f, 16;
    prmt.b32 {p_hi}, tp0, tp1, h;
    prmt.b32 {n_hi}, tp0, tp1, f;"""


# $0..$3 = magnitudes of w's positive codes, $4..$7 of its negative codes (16 codes of $8;
# table's first word: $9).
_DECODE_W = tl.constexpr(
    _asm(
        "tp0, tp1, w0, w1, f, h",
        _pos_table("$9"),
        "$8",
        _split_w("w0", "$0", "$1", "$4", "$5") + _split_w("w1", "$2", "$3", "$6", "$7"),
    )
)

# $0 = sum(p . x) - sum(n . x): the signed dot product of one block, from _DECODE_W's 8 words
# ($1..$8) and _DECODE_S8's 4 words ($9..$12).
_DOT8 = tl.constexpr("""{
    .reg .b32 pos, neg;
    dp4a.s32.s32 pos, $1, $9, 0;
    dp4a.s32.s32 neg, $5, $9, 0;
    dp4a.s32.s32 pos, $2, $10, pos;
    dp4a.s32.s32 neg, $6, $10, neg;
    dp4a.s32.s32 pos, $3, $11, pos;
    dp4a.s32.s32 neg, $7, $11, neg;
    dp4a.s32.s32 pos, $4, $12, pos;
    dp4a.s32.s32 neg, $8, $12, neg;
    sub.s32 $0, pos, neg;
    }""")


def _biased_w(word: str, lo: str, hi: str) -> str:
    """PTX: 8 codes -> two words of 4 uint8 (128 + 2 * value): ``_split_w``'s positive and
    negative magnitudes subtracted, 128 added per byte. Each byte of p + 0x80808080 - n lies
    in 116..140, so the 32-bit sum carries nothing across bytes."""
    return f"""
    xor.b32 f, {word}, 0x88888888;
    prmt.b32 p, tp0, tp1, {word};
    prmt.b32 n, tp0, tp1, f;
    sub.u32 p, p, n;
    add.u32 {lo}, p, 0x80808080;
    shr.b32 h, {word}, 16;
    shr.b32 f, f, 16;
    prmt.b32 p, tp0, tp1, h;
    prmt.b32 n, tp0, tp1, f;
    sub.u32 p, p, n;
    add.u32 {hi}, p, 0x80808080;"""


# $0..$3 = the 16 codes of $4 as uint8 128 + 2 * value, 4 per word, in order (table's first
# word: $5).
_DECODE_U8 = tl.constexpr(
    _asm(
        "tp0, tp1, w0, w1, f, h, p, n",
        _pos_table("$5"),
        "$4",
        _biased_w("w0", "$0", "$1") + _biased_w("w1", "$2", "$3"),
    )
)

# $0 = -128 * the sum of the 16 int8 values in words $1..$4: what _DOT4U starts from, so
# that the weight's bias of 128 cancels.
_MINUS_128_SUM = tl.constexpr("""{
    .reg .b32 acc, k;
    mov.b32 k, 0x80808080;
    dp4a.s32.s32 acc, $1, k, 0;
    dp4a.s32.s32 acc, $2, k, acc;
    dp4a.s32.s32 acc, $3, k, acc;
    dp4a.s32.s32 $0, $4, k, acc;
    }""")

# $0 = $9 + the dot product of uint8 words $1..$4 with int8 words $5..$8.
_DOT4U = tl.constexpr("""{
    .reg .b32 acc;
    dp4a.u32.s32 acc, $1, $5, $9;
    dp4a.u32.s32 acc, $2, $6, acc;
    dp4a.u32.s32 acc, $3, $7, acc;
    dp4a.u32.s32 $0, $4, $8, acc;
    }""")

# $0, $1 = the tables' first words (TABLE_POS[0], TABLE_NEG[0]) plus (lane * $3) >> 31, which
# is 0 for 0 <= $3 < 2**26 (the GEMV passes M <= 8) but which ptxas cannot fold: it then
# keeps each table in a register, where it copied an immediate table from a uniform register
# before every prmt (docs/hopper_kernels.md, 'The GEMV's decode in fewer instructions'). A
# lane alone would not do: ptxas knows that lane >> 5 is 0.
_LANE_TABLES = tl.constexpr(
    f"""{{
    .reg .b32 l;
    mov.u32 l, %laneid;
    mul.lo.u32 l, l, $3;
    shr.u32 l, l, 31;
    add.u32 $0, l, {TABLE_POS[0]};
    add.u32 $1, l, {TABLE_NEG[0]};
    }}"""
)


def _pair(shift_m: int, shift_s: int, out_lo: int, out_hi: int) -> str:
    """PTX: codes p and p+4 of the word -> one float16x2 (value * 2**-14 * scale)."""
    mag = f"shl.b32 a, m, {shift_m};" if shift_m >= 0 else f"shr.b32 a, m, {-shift_m};"
    sign = f"shl.b32 b, s, {shift_s};" if shift_s else "mov.b32 b, s;"
    return f"""
    {mag}
    {sign}
    and.b32 a, a, 0x0E000E00;
    and.b32 b, b, 0x80008000;
    or.b32 v, a, b;
    mul.rn.f16x2 v, v, $9;
    mov.b32 {{${out_lo}, ${out_hi}}}, v;"""


# $0..$7 = the 8 codes of word $8 as float16 (value * 2**-14) times the float16x2 scale $9.
_WORD_TO_F16 = tl.constexpr(
    """{
    .reg .b32 m, s, a, b, v;
    and.b32 m, $8, 0x77777777;
    and.b32 s, $8, 0x88888888;"""
    + _pair(9, 12, 0, 4)
    + _pair(5, 8, 1, 5)
    + _pair(1, 4, 2, 6)
    + _pair(-3, 0, 3, 7)
    + """
    }"""
)


@triton.jit
def _s8_value(c):
    """E2M1 code (low 4 bits of an int) -> 2 * value as an int, without tables."""
    m = c & 7
    v = tl.where(m < 4, m, tl.where(m < 6, 2 * m - 4, 4 * m - 16))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _code_byte(q, i: tl.constexpr, BIAS: tl.constexpr):
    """Byte of the word for code i of the int64 ``q``: BIAS + 2 * value (two's complement)."""
    return ((_s8_value(((q >> (4 * i)) & 15).to(tl.int32)) + BIAS) & 255) << (8 * (i % 4))


@triton.jit
def _code_words(q, BIAS: tl.constexpr):
    """The twins of ``_DECODE_S8`` (BIAS 0) and ``_DECODE_U8`` (BIAS 128): 4 words of 4 bytes."""
    return (
        _code_byte(q, 0, BIAS) | _code_byte(q, 1, BIAS) | _code_byte(q, 2, BIAS) | _code_byte(q, 3, BIAS),
        _code_byte(q, 4, BIAS) | _code_byte(q, 5, BIAS) | _code_byte(q, 6, BIAS) | _code_byte(q, 7, BIAS),
        _code_byte(q, 8, BIAS) | _code_byte(q, 9, BIAS) | _code_byte(q, 10, BIAS) | _code_byte(q, 11, BIAS),
        _code_byte(q, 12, BIAS) | _code_byte(q, 13, BIAS) | _code_byte(q, 14, BIAS) | _code_byte(q, 15, BIAS),
    )  # fmt: skip


@triton.jit
def decode_s8(q, tpos, tneg, ASM: tl.constexpr):
    """An int64 word of 16 E2M1 codes -> 4 int32 words of 4 int8 (2 * value) each, in order.

    tpos, tneg: the tables' first words (``lane_tables``)."""
    if ASM:
        return tl.inline_asm_elementwise(
            _DECODE_S8, "=r,=r,=r,=r,l,r,r", [q, tpos, tneg], dtype=(tl.int32,) * 4,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return _code_words(q, 0)


@triton.jit
def _sbyte(w, i: tl.constexpr):
    return ((w << (24 - 8 * i)) >> 24).to(tl.int32)  # sign-extended byte i of an int32


@triton.jit
def _wbyte(w, i: tl.constexpr, UNSIGNED: tl.constexpr):
    if UNSIGNED:
        return (w >> (8 * i)) & 255
    else:
        return _sbyte(w, i)


@triton.jit
def _dot_word_twin(w, x, W_UNSIGNED: tl.constexpr = False):
    """``dp4a`` of one word pair: x's bytes signed, w's signed or (W_UNSIGNED) not."""
    return (
        _wbyte(w, 0, W_UNSIGNED) * _sbyte(x, 0)
        + _wbyte(w, 1, W_UNSIGNED) * _sbyte(x, 1)
        + _wbyte(w, 2, W_UNSIGNED) * _sbyte(x, 2)
        + _wbyte(w, 3, W_UNSIGNED) * _sbyte(x, 3)
    )


@triton.jit
def decode_u8(q, tpos, ASM: tl.constexpr):
    """An int64 word of 16 E2M1 codes -> 4 int32 words of 4 uint8 (128 + 2 * value) each."""
    if ASM:
        return tl.inline_asm_elementwise(
            _DECODE_U8, "=r,=r,=r,=r,l,r", [q, tpos], dtype=(tl.int32,) * 4, is_pure=True,
            pack=1,
        )  # fmt: skip
    else:
        return _code_words(q, 128)


@triton.jit
def lane_tables(like, small, ASM: tl.constexpr):
    """The lookup tables' first words as values held in registers (``_LANE_TABLES``); ``like``
    gives their shape and must be loop-invariant; ``small`` is a runtime int in 0..2**26."""
    if ASM:
        return tl.inline_asm_elementwise(
            _LANE_TABLES, "=r,=r,r,r", [like, small], dtype=(tl.int32, tl.int32), is_pure=True,
            pack=1,
        )  # fmt: skip
    else:
        return like * 0, like * 0  # the twins do not read tables


@triton.jit
def minus_128_sum(x0, x1, x2, x3, ASM: tl.constexpr):
    """-128 times the sum of 16 int8 values (4 words): the start that cancels ``decode_u8``'s bias."""
    if ASM:
        return tl.inline_asm_elementwise(
            _MINUS_128_SUM, "=r,r,r,r,r", [x0, x1, x2, x3], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        total = x0 * 0
        for i in tl.static_range(4):
            total += _sbyte(x0, i) + _sbyte(x1, i) + _sbyte(x2, i) + _sbyte(x3, i)
        return total * -128


@triton.jit
def dot4u(w0, w1, w2, w3, x0, x1, x2, x3, start, ASM: tl.constexpr):
    """``start`` + the dot product of 16 uint8 values of w (4 words) with 16 int8 values of x."""
    if ASM:
        return tl.inline_asm_elementwise(
            _DOT4U,
            "=r,r,r,r,r,r,r,r,r,r",
            [w0, w1, w2, w3, x0, x1, x2, x3, start],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        return (
            start
            + _dot_word_twin(w0, x0, True)
            + _dot_word_twin(w1, x1, True)
            + _dot_word_twin(w2, x2, True)
            + _dot_word_twin(w3, x3, True)
        )


@triton.jit
def _mag_byte(q, i: tl.constexpr, NEG: tl.constexpr):
    """Byte of code i's magnitude (2 * |value|) if its sign is NEG, else 0, in place."""
    c = ((q >> (4 * i)) & 15).to(tl.int32)
    v = _s8_value(c & 7)
    keep = ((c & 8) != 0) == NEG
    return tl.where(keep, v, 0) << (8 * (i % 4))


@triton.jit
def _mag_word(q, first: tl.constexpr, NEG: tl.constexpr):
    return (
        _mag_byte(q, first, NEG)
        | _mag_byte(q, first + 1, NEG)
        | _mag_byte(q, first + 2, NEG)
        | _mag_byte(q, first + 3, NEG)
    )


@triton.jit
def decode_w(q, tpos, ASM: tl.constexpr):
    """An int64 word of 16 codes -> 4 words of positive magnitudes, 4 of negative ones."""
    if ASM:
        return tl.inline_asm_elementwise(
            _DECODE_W, "=r,=r,=r,=r,=r,=r,=r,=r,l,r", [q, tpos], dtype=(tl.int32,) * 8,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return (
            _mag_word(q, 0, False),
            _mag_word(q, 4, False),
            _mag_word(q, 8, False),
            _mag_word(q, 12, False),
            _mag_word(q, 0, True),
            _mag_word(q, 4, True),
            _mag_word(q, 8, True),
            _mag_word(q, 12, True),
        )


@triton.jit
def dot8(p0, p1, p2, p3, n0, n1, n2, n3, x0, x1, x2, x3, ASM: tl.constexpr):
    """(p - n) . x over one block: the exact value 4 * sum w_i x_i."""
    if ASM:
        return tl.inline_asm_elementwise(
            _DOT8,
            "=r,r,r,r,r,r,r,r,r,r,r,r,r",
            [p0, p1, p2, p3, n0, n1, n2, n3, x0, x1, x2, x3],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        pos = _dot_word_twin(p0, x0) + _dot_word_twin(p1, x1) + _dot_word_twin(p2, x2)
        neg = _dot_word_twin(n0, x0) + _dot_word_twin(n1, x1) + _dot_word_twin(n2, x2)
        return pos + _dot_word_twin(p3, x3) - neg - _dot_word_twin(n3, x3)


@triton.jit
def pair_to_f16(q, sb, ASM: tl.constexpr, HW: tl.constexpr = False):
    """Words of 8 E2M1 codes (int32) and their e4m3 scale bytes (int32) -> 8 float16 planes.

    Plane i holds code i of each word (bits 4i..4i+3) times 2**-14 times the word's scale, as
    ``word_to_f16`` does, two words per asm call (see ``_PAIR_TO_F16``). HW: the scales are
    converted by the GPU (``_PAIR_TO_F16_CVT``), which reads only each scale's low byte.
    """
    if ASM and HW:
        return tl.inline_asm_elementwise(
            _PAIR_TO_F16_CVT,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
            [q, sb],
            dtype=(tl.float16,) * 8,
            is_pure=True,
            pack=2,
        )
    elif ASM:
        return tl.inline_asm_elementwise(
            _PAIR_TO_F16,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
            [q, sb & 0xFF],
            dtype=(tl.float16,) * 8,
            is_pure=True,
            pack=2,
        )
    else:
        return word_to_f16(q, e4m3_f16x2(sb & 0xFF), False)


@triton.jit
def word_to_f16(q, s2, ASM: tl.constexpr):
    """A word of 8 E2M1 codes (int32) and a float16x2 scale pair (int32) -> 8 float16 planes.

    Plane i holds code i of the word (bits 4i..4i+3) times 2**-14 times the scale.
    """
    if ASM:
        return tl.inline_asm_elementwise(
            _WORD_TO_F16,
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
            [q, s2],
            dtype=(tl.float16,) * 8,
            is_pure=True,
            pack=1,
        )
    else:
        s = (s2 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        return (
            _code_f16(q) * s,
            _code_f16(q >> 4) * s,
            _code_f16(q >> 8) * s,
            _code_f16(q >> 12) * s,
            _code_f16(q >> 16) * s,
            _code_f16(q >> 20) * s,
            _code_f16(q >> 24) * s,
            _code_f16(q >> 28) * s,
        )


@triton.jit
def e4m3_f16x2(s):
    """e4m3 scale bytes (int32) -> the float16 value in both halves of an int32."""
    bits = ((s & 0x7F) << 7) | ((s & 0x80) << 8)
    h = bits.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0
    b = h.to(tl.uint16, bitcast=True).to(tl.int32)
    return b | (b << 16)


@triton.jit
def _alpha_scale(offs_m, mask_m, alpha_ptr, alpha_value, ALPHA: tl.constexpr):
    """alpha for each row of the output (ones when there is none)."""
    if ALPHA == 1:
        return tl.full(offs_m.shape, 1.0, tl.float32) * alpha_value
    elif ALPHA == 2:
        return tl.full(offs_m.shape, 1.0, tl.float32) * tl.load(alpha_ptr).to(tl.float32)
    elif ALPHA == 3:
        return tl.load(alpha_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    else:
        return tl.full(offs_m.shape, 1.0, tl.float32)


@triton.jit
def sf_row_part(row, cp, LAYOUT_8X4: tl.constexpr):
    """The part of a scale's byte offset that depends on the row only (see ``sf_offset``)."""
    if LAYOUT_8X4:
        return (row // 8) * cp * 8 + (row % 8) * 4
    else:
        return (row // 128) * cp * 128 + (row % 32) * 16 + ((row % 128) // 32) * 4


@triton.jit
def e4m3_bytes_f32(b):
    """e4m3 scale bytes (uint8) -> float32 values, subnormals included."""
    b = b.to(tl.int32)
    bits = ((b & 0x7F) << 20) | ((b & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2**120


@triton.jit
def e4m3_f32(b, HW: tl.constexpr):
    """e4m3 scale bytes (uint8) -> float32. HW: the GPU's conversion (SM89+, two bytes per
    instruction; 0x7F and 0xFF are NaN, as in the reference), else ``e4m3_bytes_f32`` (the
    interpreter's path, and SM80's: Triton refuses float8e4nv there), which reads them as 480.
    """
    if HW:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_bytes_f32(b.to(tl.uint8, bitcast=True))


@triton.jit
def _gemv_row(
    p0,
    p1,
    p2,
    p3,
    n0,
    n1,
    n2,
    n3,
    sw,
    a_ptr,
    sa_ptr,
    r,
    M,
    k,
    k_ok,
    a_col,
    stride_am,
    cp,
    tpos,
    tneg,
    A_8X4: tl.constexpr,
    ASM: tl.constexpr,
    SPLIT: tl.constexpr,
    HW_E4M3: tl.constexpr,
    PRE: tl.constexpr = False,
):
    """One row of a against the decoded weight tile: float32 (R, BK) block contributions.

    SPLIT: p and n hold the weight's positive and negative magnitudes (``decode_w``); else p
    holds its values plus 128 (``decode_u8``) and n is unused. PRE: a_ptr is ``gemv_a_words``'
    workspace (a decoded once per call, for every program), stride_am its planes' stride.
    """
    row = tl.minimum(r, M - 1)
    if PRE:
        base = a_ptr + row * 3 * stride_am + k[None, :]
        lo = tl.load(base, mask=k_ok[None, :], other=0)
        hi = tl.load(base + stride_am, mask=k_ok[None, :], other=0)
        tail = tl.load(base + 2 * stride_am, mask=k_ok[None, :], other=0)
        x0 = lo.to(tl.int32)
        x1 = (lo >> 32).to(tl.int32)
        x2 = hi.to(tl.int32)
        x3 = (hi >> 32).to(tl.int32)
        start = tail.to(tl.int32)
        sa = (tail >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        x = tl.load(a_ptr + row * stride_am + k[None, :], mask=k_ok[None, :], other=0)
        sa = tl.load(sa_ptr + sf_row_part(row, cp, A_8X4) + a_col, mask=k_ok[None, :], other=0)
        sa = e4m3_f32(sa, HW_E4M3)
        x0, x1, x2, x3 = decode_s8(x, tpos, tneg, ASM)
        if not SPLIT:
            start = minus_128_sum(x0, x1, x2, x3, ASM)
    if SPLIT:
        d = dot8(p0, p1, p2, p3, n0, n1, n2, n3, x0, x1, x2, x3, ASM)
    else:
        d = dot4u(p0, p1, p2, p3, x0, x1, x2, x3, start, ASM)
    return d.to(tl.float32) * (sw * sa)


@triton.jit(do_not_specialize=["M"])
def gemv_a_words(
    a_ptr, sa_ptr, ws_ptr, M, KW, stride_am, cp, plane,
    A_8X4: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr, HW_E4M3: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """a decoded once per call for ``gemv_dp4a``'s PRE form: workspace (M, 3, plane) of int64,
    block b of row m as its 16 int8 values (2 * value; [m, 0, b] and [m, 1, b]), then -128 *
    their sum (the start ``dot4u`` needs) with the block's float32 scale above it ([m, 2, b]).

    Every program of the GEMV reads a whole; decoded here, its K loop does a's part of the
    work once per call instead of once per program. ``plane`` (K / 16 rounded up to a multiple
    of 16) lets Triton prove the GEMV's loads aligned: otherwise it loads a in a layout of its
    own and converts each weight tile to it, every step.
    """
    pdl_start(PDL, True)
    sa_ptr = sa_ptr.to(tl.pointer_type(tl.uint8))
    row = tl.program_id(0)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    ok = k < KW
    x = tl.load(a_ptr + row * stride_am + k, mask=ok, other=0)
    sa = tl.load(sa_ptr + sf_offset(row, k, cp, A_8X4), mask=ok, other=0)
    tpos, tneg = lane_tables(k * 0, M, ASM)
    x0, x1, x2, x3 = decode_s8(x, tpos, tneg, ASM)
    start = minus_128_sum(x0, x1, x2, x3, ASM)
    bits = e4m3_f32(sa, HW_E4M3).to(tl.int32, bitcast=True)
    out = ws_ptr + row * 3 * plane + k
    tl.store(out, x0.to(tl.uint32).to(tl.int64) | (x1.to(tl.int64) << 32), mask=ok)
    tl.store(out + plane, x2.to(tl.uint32).to(tl.int64) | (x3.to(tl.int64) << 32), mask=ok)
    tl.store(out + 2 * plane, start.to(tl.uint32).to(tl.int64) | (bits.to(tl.int64) << 32), mask=ok)


@triton.jit
def _gemv_store(
    acc, r, M, rows, N, out_ptr, stride_om, stride_on, alpha_ptr, alpha_value, ALPHA: tl.constexpr
):
    if r < M:
        row = tl.sum(acc, axis=1) * 0.25  # dp4a multiplied 2w by 2x
        if ALPHA == 1:
            row = row * alpha_value
        elif ALPHA == 2:
            row = row * tl.load(alpha_ptr).to(tl.float32)
        elif ALPHA == 3:
            row = row * tl.load(alpha_ptr + r).to(tl.float32)
        ptrs = out_ptr + r * stride_om + rows * stride_on
        tl.store(ptrs, row.to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _scale_cols(k, KW, LAYOUT_8X4: tl.constexpr):
    """Scale byte offsets of blocks ``k``, declared to Triton in aligned pairs.

    Blocks 2j and 2j + 1 have neighbouring scale bytes in both layouts, so the scale tile
    loads two bytes at a time, in the same register layout as the weight's 16-byte loads (two
    words): declared so, no step converts a tile's layout through shared memory (which cost
    the GEMV: docs/hopper_kernels.md, 'The GEMV's loop converted layouts'). Past K the offsets
    point at the padding column beside the last block (the scale grids pad columns to 4) or at
    blocks 0 and 1, so that the declaration holds everywhere; the loads there are masked.
    """
    kc = tl.where(k < (KW + 1) // 2 * 2, k, k & 1)
    # the column's part of the offset here, not in a helper: a hint on a helper's result is
    # lost when the call is inlined
    col = (kc >> 2) * (32 if LAYOUT_8X4 else 512) + (kc & 3)
    return tl.max_contiguous(tl.multiple_of(col, 2), 2)


@triton.jit
def tiled_rows(w_ptr, rows, KW, COLS: tl.constexpr, TILE_ROWS: tl.constexpr):
    """Pointers to ``rows`` (each in range) in ``hopper_args.tiled_words(w, TILE_ROWS, COLS)``'s
    layout, at their first word: words k of a row are then ``tiled_at`` on, so COLS words of
    TILE_ROWS rows are one contiguous run (an experiment: ``hopper_sweep.py``'s family tiled,
    docs/hopper_kernels.md, 'The weight re-laid by tiles')."""
    r = rows.to(tl.int64)
    tile = r // TILE_ROWS
    return w_ptr + ((tile * tl.cdiv(KW, COLS) * TILE_ROWS) + (r - tile * TILE_ROWS))[:, None] * COLS


@triton.jit
def tiled_at(k, k0, TILE_ROWS: tl.constexpr, COLS: tl.constexpr):
    """Words k (a kernel's step, starting at k0) past ``tiled_rows``' pointers. A step of COLS
    words (k0 a multiple of COLS) is one run, TILE_ROWS * k0 words on; other steps cross runs
    (words k // COLS runs of TILE_ROWS rows on, k % COLS into the run)."""
    STEP: tl.constexpr = k.shape[0]
    if STEP == COLS:
        return (k - k0) + k0 * TILE_ROWS
    else:
        return (k // COLS) * (TILE_ROWS * COLS) + k % COLS


@triton.jit
def _gemv_weight(w_rows, sw_rows, k, KW, EVICT_FIRST: tl.constexpr = False, k0=0,
                 TILE_ROWS: tl.constexpr = 0, COLS: tl.constexpr = 0):  # fmt: skip
    """A step's weight words and their scale bytes (zeros past K).

    EVICT_FIRST: the weight streams past L2 (read once) ahead of a's rows, which every program
    reads again (where it pays: docs/hopper_kernels.md, 'The GEMV's weight loads with
    `evict_first`').
    TILE_ROWS: ``w_rows`` come from ``tiled_rows`` with runs of COLS words (``tiled_at``; the
    step starts at block ``k0``).
    """
    k_ok = k < KW
    scales = sw_rows + _scale_cols(k, KW, False)[None, :]
    w_at = w_rows + tiled_at(k, k0, TILE_ROWS, COLS)[None, :] if TILE_ROWS else w_rows + k[None, :]
    if EVICT_FIRST:
        w = tl.load(w_at, mask=k_ok[None, :], other=0, eviction_policy="evict_first")
        sw = tl.load(scales, mask=k_ok[None, :], other=0, eviction_policy="evict_first")
    else:
        w = tl.load(w_at, mask=k_ok[None, :], other=0)
        sw = tl.load(scales, mask=k_ok[None, :], other=0)
    return w, sw


@triton.jit
def _gemv_step(
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, sw, a_ptr, sa_ptr, M, k, KW, stride_am,
    cp, tpos, tneg, A_8X4: tl.constexpr, BM: tl.constexpr, ASM: tl.constexpr,
    HW_E4M3: tl.constexpr, PRE: tl.constexpr = False,
):  # fmt: skip
    """One step of K: the weight tile ``w`` (scales ``sw``) against each row of a.

    One row of a: the weight's magnitudes split by sign (7 integer ops a word, two dp4a a
    word). Several rows share the weight's decode, so each dp4a counts more: its values plus
    128 (9 ops, one dp4a; a's sum times -128 starts each block's chain; docs/hopper_kernels.md,
    'The GEMV's decode in fewer instructions').
    """
    k_ok = k < KW
    swf = e4m3_f32(sw, HW_E4M3)
    tpos = tpos[None, :]  # (BK,) -> (1, BK): broadcast over the rows
    tneg = tneg[None, :]
    if BM == 1:
        p0, p1, p2, p3, n0, n1, n2, n3 = decode_w(w, tpos, ASM)
    else:
        p0, p1, p2, p3 = decode_u8(w, tpos, ASM)
        n0, n1, n2, n3 = p0, p1, p2, p3
    a_col = _scale_cols(k, KW, A_8X4)[None, :]
    # Row r of a against the weight tile, one accumulator per row (BM is at most 8).
    acc0 += _gemv_row(
        p0, p1, p2, p3, n0, n1, n2, n3, swf, a_ptr, sa_ptr, 0,
        M, k, k_ok, a_col, stride_am, cp, tpos, tneg, A_8X4, ASM, BM == 1, HW_E4M3, PRE,
    )  # fmt: skip
    if BM > 1:
        acc1 += _gemv_row(
            p0, p1, p2, p3, n0, n1, n2, n3, swf, a_ptr, sa_ptr, 1,
            M, k, k_ok, a_col, stride_am, cp, tpos, tneg, A_8X4, ASM, BM == 1, HW_E4M3, PRE,
        )  # fmt: skip
    if BM > 2:
        acc2 += _gemv_row(
            p0, p1, p2, p3, n0, n1, n2, n3, swf, a_ptr, sa_ptr, 2,
            M, k, k_ok, a_col, stride_am, cp, tpos, tneg, A_8X4, ASM, BM == 1, HW_E4M3, PRE,
        )  # fmt: skip
        acc3 += _gemv_row(
            p0, p1, p2, p3, n0, n1, n2, n3, swf, a_ptr, sa_ptr, 3,
            M, k, k_ok, a_col, stride_am, cp, tpos, tneg, A_8X4, ASM, BM == 1, HW_E4M3, PRE,
        )  # fmt: skip
    if BM > 4:
        acc4 += _gemv_row(
            p0, p1, p2, p3, n0, n1, n2, n3, swf, a_ptr, sa_ptr, 4,
            M, k, k_ok, a_col, stride_am, cp, tpos, tneg, A_8X4, ASM, BM == 1, HW_E4M3, PRE,
        )  # fmt: skip
        acc5 += _gemv_row(
            p0, p1, p2, p3, n0, n1, n2, n3, swf, a_ptr, sa_ptr, 5,
            M, k, k_ok, a_col, stride_am, cp, tpos, tneg, A_8X4, ASM, BM == 1, HW_E4M3, PRE,
        )  # fmt: skip
        acc6 += _gemv_row(
            p0, p1, p2, p3, n0, n1, n2, n3, swf, a_ptr, sa_ptr, 6,
            M, k, k_ok, a_col, stride_am, cp, tpos, tneg, A_8X4, ASM, BM == 1, HW_E4M3, PRE,
        )  # fmt: skip
        acc7 += _gemv_row(
            p0, p1, p2, p3, n0, n1, n2, n3, swf, a_ptr, sa_ptr, 7,
            M, k, k_ok, a_col, stride_am, cp, tpos, tneg, A_8X4, ASM, BM == 1, HW_E4M3, PRE,
        )  # fmt: skip
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _gemv_store_rows(
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, M, rows, N, out_ptr, stride_om, stride_on,
    alpha_ptr, alpha_value, ALPHA: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    args = (M, rows, N, out_ptr, stride_om, stride_on, alpha_ptr, alpha_value, ALPHA)
    _gemv_store(acc0, 0, *args)
    if BM > 1:
        _gemv_store(acc1, 1, *args)
    if BM > 2:
        _gemv_store(acc2, 2, *args)
        _gemv_store(acc3, 3, *args)
    if BM > 4:
        _gemv_store(acc4, 4, *args)
        _gemv_store(acc5, 5, *args)
        _gemv_store(acc6, 6, *args)
        _gemv_store(acc7, 7, *args)


@triton.jit
def _gemv_rows(g, N, w_ptr, sw_ptr, stride_wn, cp, R: tl.constexpr):
    """Row group g's rows, its weight rows' word pointers and scale rows' byte offsets."""
    rows = g * R + tl.arange(0, R)
    rows_c = tl.where(rows < N, rows, N - 1)
    w_rows = w_ptr + rows_c[:, None].to(tl.int64) * stride_wn
    sw_rows = sw_ptr + sf_row_part(rows_c, cp, False)[:, None]
    return rows, w_rows, sw_rows


# M is not specialized: Triton makes an int argument of 1 a constant, and ptxas then folds
# lane_tables' trick at M = 1 (docs/hopper_kernels.md, 'The GEMV's decode in fewer instructions').
@triton.jit(do_not_specialize=["M"])
def gemv_dp4a(
    a_ptr,  # int64 view of a: (M, K/16), one word per block
    w_ptr,  # int64 view of the weight: (N, K/16)
    sa_ptr,  # uint8 scales of a
    sw_ptr,  # uint8 scales of the weight (128x4)
    alpha_ptr,
    out_ptr,
    M,
    N,
    KW,  # K / 16: blocks per row
    stride_am,  # in words
    stride_wn,  # in words
    stride_om,
    stride_on,
    cp,
    alpha_value,
    A_8X4: tl.constexpr,
    ALPHA: tl.constexpr,
    BM: tl.constexpr,  # rows of a: 1, 2, 4 or 8 (M <= BM)
    R: tl.constexpr,  # weight rows per program
    BK: tl.constexpr,  # blocks per step
    ASM: tl.constexpr,
    PREFETCH: tl.constexpr = False,  # load the next step's weight before this step's math
    PDL: tl.constexpr = False,
    EVICT_FIRST: tl.constexpr = False,
    HW_E4M3: tl.constexpr = False,
    LATE_TRIGGER: tl.constexpr = False,  # under PDL the next launch is let in after the K loop
    PRE: tl.constexpr = False,  # a_ptr is gemv_a_words' workspace (stride_am: its plane)
    W_TILE_ROWS: tl.constexpr = 0,  # > 0: w_ptr is hopper_args.tiled_words(w, this, W_COLS)
    W_COLS: tl.constexpr = 0,  # the tiles' runs, in words (0: BK)
):
    """Small-M product: each program takes R weight rows over the whole K, on the CUDA cores.

    Per block: the exact integer dot product (``dp4a``) of the decoded weight with a's signed
    values (``_gemv_step`` says which decode), then both block scales once, in float32. Each row of a
    has its own accumulator (unrolled: BM is at most 8), reduced once at the end. No tensor
    cores, no shared memory, no split-K.
    """
    pdl_start(PDL, not LATE_TRIGGER)
    # Scale bytes as uint8 whatever their dtype (float8_e4m3fn or uint8): a masked load of
    # float8 cannot take zeros for the masked lanes.
    sa_ptr = sa_ptr.to(tl.pointer_type(tl.uint8))
    sw_ptr = sw_ptr.to(tl.pointer_type(tl.uint8))
    pid = tl.program_id(0)
    kk = tl.arange(0, BK)
    tpos, tneg = lane_tables(kk * 0, M, ASM)
    rows, w_rows, sw_rows = _gemv_rows(pid, N, w_ptr, sw_ptr, stride_wn, cp, R)
    COLS: tl.constexpr = W_COLS if W_COLS else BK
    if W_TILE_ROWS:
        w_rows = tiled_rows(w_ptr, tl.where(rows < N, rows, N - 1), KW, COLS, W_TILE_ROWS)
    acc0 = tl.zeros((R, BK), dtype=tl.float32)
    acc1 = tl.zeros((R, BK), dtype=tl.float32)
    acc2 = tl.zeros((R, BK), dtype=tl.float32)
    acc3 = tl.zeros((R, BK), dtype=tl.float32)
    acc4 = tl.zeros((R, BK), dtype=tl.float32)
    acc5 = tl.zeros((R, BK), dtype=tl.float32)
    acc6 = tl.zeros((R, BK), dtype=tl.float32)
    acc7 = tl.zeros((R, BK), dtype=tl.float32)
    if PREFETCH:
        w, sw = _gemv_weight(w_rows, sw_rows, kk, KW, EVICT_FIRST, 0, W_TILE_ROWS, COLS)
    for k0 in range(0, KW, BK):
        k = k0 + kk
        if PREFETCH:
            w_next, sw_next = _gemv_weight(
                w_rows, sw_rows, k0 + BK + kk, KW, EVICT_FIRST, k0 + BK, W_TILE_ROWS, COLS
            )
        else:
            w, sw = _gemv_weight(w_rows, sw_rows, k, KW, EVICT_FIRST, k0, W_TILE_ROWS, COLS)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gemv_step(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, sw, a_ptr, sa_ptr,
            M, k, KW, stride_am, cp, tpos, tneg, A_8X4, BM, ASM, HW_E4M3, PRE,
        )  # fmt: skip
        if PREFETCH:
            w, sw = w_next, sw_next
    if LATE_TRIGGER:
        pdl_trigger(PDL)
    _gemv_store_rows(
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, M, rows, N, out_ptr,
        stride_om, stride_on, alpha_ptr, alpha_value, ALPHA, BM,
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])  # see mma_planes
def decode_planes(
    a_ptr,  # int32 view of a: (M, K/8)
    sa_ptr,
    out_ptr,  # float16 (XK, MP) workspace: K-major, plane-major inside each step of 8 * BKW
    M,
    MP,  # tokens rounded up to whole tiles: the workspace's row stride
    KW,
    stride_am,
    cp,
    A_8X4: tl.constexpr,
    BR: tl.constexpr,
    BKW: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """a -> float16 (value * 2**-14 * scale) in the order ``mma_planes`` reads.

    Every element of the workspace is written, zeros past M and past K, so that the main loop
    reads whole tiles without masks (masks would stop its loads from being pipelined).
    """
    pdl_start(PDL, True)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    k = tl.program_id(1) * BKW + tl.arange(0, BKW)
    ok = (rows < M)[:, None] & (k < KW)[None, :]
    rows_c = tl.where(rows < M, rows, 0)
    q = tl.load(a_ptr + rows_c[:, None].to(tl.int64) * stride_am + k[None, :], mask=ok, other=0)
    blk = tl.where(k < KW, k // 2, 0)
    sa = tl.load(sa_ptr + sf_offset(rows_c[:, None], blk[None, :], cp, A_8X4))
    s2 = e4m3_f16x2(sa.to(tl.uint8, bitcast=True).to(tl.int32))
    p0, p1, p2, p3, p4, p5, p6, p7 = word_to_f16(q, s2, ASM)
    kk = tl.program_id(1) * BKW * 8 + tl.arange(0, BKW)[None, :]
    base = out_ptr + kk.to(tl.int64) * MP + rows[:, None]
    live = (rows < MP)[:, None]
    tl.store(base + (0 * BKW) * MP, p0, mask=live)
    tl.store(base + (1 * BKW) * MP, p1, mask=live)
    tl.store(base + (2 * BKW) * MP, p2, mask=live)
    tl.store(base + (3 * BKW) * MP, p3, mask=live)
    tl.store(base + (4 * BKW) * MP, p4, mask=live)
    tl.store(base + (5 * BKW) * MP, p5, mask=live)
    tl.store(base + (6 * BKW) * MP, p6, mask=live)
    tl.store(base + (7 * BKW) * MP, p7, mask=live)


@triton.jit
def weight_step(
    w_rows, sw_ptr, rows_n, k0, KW, cp, BKW: tl.constexpr, TILE_ROWS: tl.constexpr = 0,
    COLS: tl.constexpr = 0,
):  # fmt: skip
    """One step's weight words (zeros past K) and, for each word, the 128x4 scale word holding
    its block's scale.

    Each scale word holds 4 blocks (8 weight words) of a row: it is loaded once and broadcast
    in registers (docs/hopper_kernels.md, 'One scale load per 8 weight words'). Words, not
    bytes: an 8-bit load sends the decoded tile through shared memory.
    Past K the scales of block 0 stand in (a valid scale times the zero words there).
    TILE_ROWS: ``w_rows`` come from ``tiled_rows`` with runs of COLS words (``tiled_at``).
    """
    k = k0 + tl.arange(0, BKW)
    if TILE_ROWS:
        at = tiled_at(k, k0, TILE_ROWS, COLS)
        wq = tl.load(w_rows + at[None, :], mask=(k < KW)[None, :], other=0)
    else:
        wq = tl.load(w_rows + k[None, :], mask=(k < KW)[None, :], other=0)
    j = k0 // 8 + tl.arange(0, BKW // 8)
    blk = tl.where(j * 8 < KW, j * 4, 0)
    sw8 = tl.load(sw_ptr + (sf_offset(rows_n[:, None], blk[None, :], cp, False) >> 2))
    BN: tl.constexpr = sw8.shape[0]
    return wq, tl.reshape(tl.broadcast_to(sw8[:, :, None], (BN, BKW // 8, 8)), (BN, BKW))


@triton.jit
def plane_major(w0, w1, w2, w3, w4, w5, w6, w7, BN: tl.constexpr, BKW: tl.constexpr):
    """8 planes of (BN, BKW) -> one (BN, 8 * BKW) operand, plane p's word w at p * BKW + w.

    Joined in this order the planes stay in the registers the MMA reads (word-major goes
    through shared memory), and the step's wgmma are issued back to back.
    """
    w = tl.join(
        tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7))
    )
    return tl.reshape(tl.permute(tl.reshape(w, (BN, BKW, 8)), (0, 2, 1)), (BN, 8 * BKW))


@triton.jit
def retired(acc, ASM: tl.constexpr):
    """``acc`` through an identity Triton cannot see into, so that the step's wgmma are waited
    for before the next step's decode.

    A dot whose result only feeds the next dot is left in flight across the loop's back edge,
    and Triton 3.6 with its ptxas (12.8) then lets the next step's loads and decode reuse the
    registers the in-flight wgmma still read as its left operand (triton-lang/triton#9433;
    ``tools/wgmma_hazards.py`` finds 79-467 such writes per tactic). With a use of its own the
    dot is waited for (``wgmma.wait_group 0``) and none are left; ptxas drops the move itself.
    """
    if ASM:
        return tl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return acc


# Not specialized on M or the K steps per split: they only bound masks and the loop, and each
# distinct divisibility was a compile of its own (47 compiles for Llama-3.1-8B's warm-up).
@triton.jit(do_not_specialize=["M", "iters_per_split"])
def mma_planes(
    x_ptr,  # float16 (XK, MP) from decode_planes (same BKW)
    w_ptr,  # int32 view of the weight: (N, K/8)
    sw_ptr,  # int32 view of the weight's 128x4 scales: four blocks' scales per word
    shift_ptr,  # int32 (BKW,): 8 * ((i // 2) % 4), the byte of a scale word for word i of a step
    alpha_ptr,
    out_ptr,
    part_ptr,  # float32 (split, M, N) partial sums when PARTIALS
    M,
    N,
    KW,  # K / 8: words per row
    MP,  # the workspace's row stride: M rounded up to whole BT tiles
    stride_wn,  # in words
    stride_om,
    stride_on,
    cp,
    iters_per_split,
    alpha_value,
    count_ptr,  # int32, one per tile, zeros between calls: split programs arrived (SUM_LAST)
    ALPHA: tl.constexpr,
    PARTIALS: tl.constexpr,
    BN: tl.constexpr,  # weight rows per tile (the MMA's large side)
    BT: tl.constexpr,  # tokens per tile (the MMA's small side)
    BKW: tl.constexpr,  # words per step (8 * BKW values of K)
    GROUP: tl.constexpr,
    ASM: tl.constexpr,
    HW_E4M3: tl.constexpr = False,  # the weight's scales converted by the GPU (SM89+)
    SUM_LAST: tl.constexpr = False,  # the last split program of a tile sums the partials
    PDL: tl.constexpr = False,
    W_TILE_ROWS: tl.constexpr = 0,  # > 0: w_ptr is hopper_args.tiled_words(w, this, W_COLS)
    W_COLS: tl.constexpr = 0,  # the tiles' runs, in words (0: BKW)
):
    """Tensor-core product with the operands swapped: out^T = W . A^T, the weight decoded in
    the main loop, a read already decoded (``decode_planes``).

    The decoded weight tile is the dot's left operand, so N fills the MMA's 64-row side and
    the tokens (few, in decode) its narrow side; it is decoded in the registers the MMA reads,
    so nothing decoded goes to memory. Program axis 1 splits K (partial sums reduced after);
    tiles are visited in groups of GROUP weight tiles so that consecutive programs share
    activation tiles in L2. Under PDL the next launch is let in after the K loop, not at the
    start: its programs would otherwise sit on the SMs this loop streams through
    (docs/hopper_kernels.md, 'PDL's trigger after the K loop').
    """
    pdl_start(PDL, False)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_n = tl.cdiv(N, BN)
    grid_t = tl.cdiv(M, BT)
    in_group = GROUP * grid_t
    first_n = (pid // in_group) * GROUP
    size = tl.minimum(grid_n - first_n, GROUP)
    pid_n = first_n + (pid % in_group) % size
    pid_t = (pid % in_group) // size
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_t = pid_t * BT + tl.arange(0, BT)
    rows_n = tl.where(offs_n < N, offs_n, 0)
    kw = tl.arange(0, BKW)
    # Loaded, not computed: Triton 3.6 decodes the weight straight into the MMA's register
    # layout only when every input of the decode comes from memory; a value derived from
    # tl.arange there sends the decoded tile through shared memory, one store per value.
    shift = tl.load(shift_ptr + kw)[None, :]
    COLS: tl.constexpr = W_COLS if W_COLS else BKW
    if W_TILE_ROWS:
        w_rows = tiled_rows(w_ptr, rows_n, KW, COLS, W_TILE_ROWS)
    else:
        w_rows = w_ptr + rows_n[:, None].to(tl.int64) * stride_wn
    x_cols = x_ptr + offs_t[None, :]  # no clamp: the workspace is whole tiles wide
    kx = tl.arange(0, 8 * BKW)
    # At least one step: a loop that may run zero times leaves a path where the accumulator
    # is set outside the MMA, and ptxas then serializes every wgmma of the loop.
    tl.assume(iters_per_split > 0)
    acc = tl.zeros((BN, BT), dtype=tl.float32)
    for i in range(0, iters_per_split):
        k0 = (pid_k * iters_per_split + i) * BKW
        wq, sw = weight_step(w_rows, sw_ptr, rows_n, k0, KW, cp, BKW, W_TILE_ROWS, COLS)
        w = plane_major(*pair_to_f16(wq, sw >> shift, ASM, HW_E4M3), BN, BKW)
        xb = x_cols + (k0 * 8 + kx)[:, None].to(tl.int64) * MP
        acc = retired(tl.dot(w, tl.load(xb), acc), ASM)
    acc = acc * 268435456.0  # 2**28: both operands carry 2**-14
    pdl_trigger(PDL)
    mask_t = offs_t < M
    mask = (offs_n[:, None] < N) & mask_t[None, :]
    if PARTIALS:
        ptrs = part_ptr + pid_k * M * N + offs_t[None, :] * N + offs_n[:, None]
        tl.store(ptrs, acc, mask=mask)
        if SUM_LAST:
            _sum_if_last(
                part_ptr, count_ptr + pid, alpha_ptr, out_ptr, offs_n, offs_t, mask, M, N,
                stride_om, stride_on, alpha_value, ALPHA,
            )  # fmt: skip
    else:
        acc = acc * _alpha_scale(offs_t, mask_t, alpha_ptr, alpha_value, ALPHA)[None, :]
        ptrs = out_ptr + offs_t[None, :] * stride_om + offs_n[:, None] * stride_on
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_if_last(
    part_ptr, count_ptr, alpha_ptr, out_ptr, offs_n, offs_t, mask, M, N, stride_om, stride_on,
    alpha_value, ALPHA: tl.constexpr,
):  # fmt: skip
    """The split-K sum, by the tile's last program to arrive (no kernel of its own).

    Each program has stored its partial sums; the barrier makes all its threads' stores
    precede the count's release, and the last arrival (acquire) adds every split's partials
    in split order, as ``reduce_split`` does, so the result does not depend on arrival order.
    It puts the count back to zero for the next call (graph replays reuse the counts).
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    split = tl.num_programs(1)
    if arrived == split - 1:
        tl.store(count_ptr, 0)
        base = part_ptr + offs_t[None, :] * N + offs_n[:, None]
        total = tl.zeros(mask.shape, dtype=tl.float32)
        for s in range(0, split):
            total += tl.load(base + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
        total = total * _alpha_scale(offs_t, offs_t < M, alpha_ptr, alpha_value, ALPHA)[None, :]
        ptrs = out_ptr + offs_t[None, :] * stride_om + offs_n[:, None] * stride_on
        tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
