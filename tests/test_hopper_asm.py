"""The Hopper kernels' inline PTX, proven on the CPU by running its own text.

The Triton interpreter cannot run inline asm, so this file interprets the PTX strings of
``fp4select.backends._hopper_kernels`` instruction by instruction (``prmt``, ``dp4a``, the
shifts and masks, ``mul.rn.f16x2``, the register splits), vectorized over every input that
matters: each decode over all 65,536 patterns of a 16-bit half-word (every pair of bytes, so
every code at every nibble position), the float16 decode at every e4m3 scale too. The expected
values come from ``fp4select.formats`` (the reference everything else is checked against). The
compiled kernels are checked on a GPU by tests/test_hopper_kernels_gpu.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from fp4select import formats

pytest.importorskip("triton", reason="the kernels' module imports triton")
from fp4select.backends import _hopper_kernels as hk

U32 = np.uint32


def _prmt(a, b, c):
    """PTX prmt.b32 default mode: selector nibble i picks byte (low 3 bits) of {b:a}."""
    src = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=U32)
    for i in range(4):
        sel = (c >> U32(4 * i)) & U32(15)
        byte = ((src >> (8 * (sel & U32(7))).astype(np.uint64)) & np.uint64(255)).astype(U32)
        byte = np.where(sel & U32(8), np.where(byte & U32(0x80), U32(0xFF), U32(0)), byte)
        out |= byte << U32(8 * i)
    return out


def _dp4a(a, b, c, a_signed=True):
    acc = c.view(np.int32).astype(np.int64)
    for i in range(4):
        x = ((a >> U32(8 * i)) & U32(255)).astype(np.int64)
        y = ((b >> U32(8 * i)) & U32(255)).astype(np.int64)
        acc += (np.where(x > 127, x - 256, x) if a_signed else x) * np.where(y > 127, y - 256, y)
    return (acc & 0xFFFFFFFF).astype(U32)


def _f16x2_mul(a, b):
    lo = (a & U32(0xFFFF)).astype(np.uint16).view(np.float16) * (b & U32(0xFFFF)).astype(
        np.uint16
    ).view(np.float16)
    hi = (a >> U32(16)).astype(np.uint16).view(np.float16) * (b >> U32(16)).astype(np.uint16).view(
        np.float16
    )
    return lo.view(np.uint16).astype(U32) | (hi.view(np.uint16).astype(U32) << U32(16))


def _e4m3_f16_bits(b: np.ndarray) -> np.ndarray:
    """e4m3 bytes -> the float16 bits of their values (exact: every e4m3 value is a float16)."""
    values = torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e4m3fn).to(torch.float16)
    return values.view(torch.int16).numpy().view(np.uint16).astype(U32)


def run_ptx(asm: str, inputs: dict[int, np.ndarray], lane: int = 0) -> dict[int, np.ndarray]:
    """Interpret one of the kernels' asm blocks; ``inputs`` maps $index -> uint32/uint64 array
    (or int: the same value everywhere, as the decodes' table operands are)."""
    shape = next(v for v in inputs.values() if isinstance(v, np.ndarray)).shape
    regs: dict[str, np.ndarray] = {
        f"${i}": v if isinstance(v, np.ndarray) else np.full(shape, v, U32)
        for i, v in inputs.items()
    }
    regs["%laneid"] = np.full(shape, lane, U32)

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full(shape, int(tok, 0) & 0xFFFFFFFF, dtype=U32)

    body = asm.strip().strip("{}")
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        args = [x.strip() for x in re.split(r",(?![^{]*\})", rest)]
        if op == "mov.b64":  # {lo, hi} <- 64-bit input
            lo, hi = args[0].strip("{}").split(",")
            v = regs[args[1]]
            regs[lo.strip()] = (v & np.uint64(0xFFFFFFFF)).astype(U32)
            regs[hi.strip()] = (v >> np.uint64(32)).astype(U32)
        elif op == "mov.b32" and args[0].startswith("{"):  # {lo16, hi16} <- 32-bit value
            lo, hi = args[0].strip("{}").split(",")
            v = val(args[1])
            regs[lo.strip()] = v & U32(0xFFFF)
            regs[hi.strip()] = v >> U32(16)
        elif op in ("mov.b32", "mov.u32"):
            regs[args[0]] = val(args[1])
        elif op in ("and.b32", "or.b32", "xor.b32"):
            f = {"and.b32": np.bitwise_and, "or.b32": np.bitwise_or, "xor.b32": np.bitwise_xor}
            regs[args[0]] = f[op](val(args[1]), val(args[2]))
        elif op == "shl.b32":
            regs[args[0]] = (val(args[1]).astype(np.uint64) << np.uint64(int(args[2]))).astype(
                np.uint64
            ) & np.uint64(0xFFFFFFFF)
            regs[args[0]] = regs[args[0]].astype(U32)
        elif op in ("shr.b32", "shr.u32"):
            regs[args[0]] = val(args[1]) >> U32(int(args[2]))
        elif op in ("add.u32", "sub.u32", "mul.lo.u32"):
            x, y = val(args[1]).astype(np.int64), val(args[2]).astype(np.int64)
            r = {"add.u32": x + y, "sub.u32": x - y, "mul.lo.u32": x * y}[op]
            regs[args[0]] = (r & 0xFFFFFFFF).astype(U32)
        elif op == "prmt.b32":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op in ("dp4a.s32.s32", "dp4a.u32.s32"):
            signed = op == "dp4a.s32.s32"
            regs[args[0]] = _dp4a(val(args[1]), val(args[2]), val(args[3]), signed)
        elif op == "sub.s32":
            regs[args[0]] = (val(args[1]).astype(np.int64) - val(args[2]).astype(np.int64)) & (
                0xFFFFFFFF
            )
            regs[args[0]] = regs[args[0]].astype(U32)
        elif op == "cvt.rn.f16x2.e4m3x2":  # bytes 0 and 1 of a 16-bit value -> halves 0 and 1
            pair = val(args[1]) & U32(0xFFFF)
            regs[args[0]] = _e4m3_f16_bits(pair & U32(255)) | (
                _e4m3_f16_bits(pair >> U32(8)) << U32(16)
            )
        elif op == "mul.rn.f16x2":
            regs[args[0]] = _f16x2_mul(val(args[1]), val(args[2]))
        else:
            raise AssertionError(f"the interpreter does not know {op!r}: teach it, then trust it")
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


ALL_HALVES = np.arange(1 << 16, dtype=U32)


def _words_64() -> np.ndarray:
    """64-bit words whose four 16-bit quarters each run through all 65,536 patterns."""
    h = ALL_HALVES.astype(np.uint64)
    rot = np.roll(h, 12345)
    return h | (rot << np.uint64(16)) | (np.roll(h, 777) << np.uint64(32)) | (h << np.uint64(48))


def _codes(words: np.ndarray, n: int) -> np.ndarray:
    return np.stack([(words >> np.uint64(4 * i)) & np.uint64(15) for i in range(n)], 1).astype(
        np.int64
    )


def _twice_value(codes: np.ndarray) -> np.ndarray:
    values = formats.e2m1_decode(torch.from_numpy(codes).to(torch.uint8), torch.float64)
    return (2 * values).numpy().astype(np.int64)


def _bytes(words: list[np.ndarray]) -> np.ndarray:
    out = [((w >> U32(8 * i)) & U32(255)).astype(np.int64) for w in words for i in range(4)]
    b = np.stack(out, 1)
    return np.where(b > 127, b - 256, b)


# The decodes' table operands, as ``lane_tables`` gives them.
POS, NEG = hk.TABLE_POS[0], hk.TABLE_NEG[0]


def test_decode_s8_gives_twice_each_codes_value_in_order():
    words = _words_64()
    got = run_ptx(hk._DECODE_S8.value, {4: words, 5: POS, 6: NEG})
    assert np.array_equal(_bytes([got[i] for i in range(4)]), _twice_value(_codes(words, 16)))


def test_decode_u8_gives_each_codes_twice_value_plus_128_in_order():
    words = _words_64()
    got = run_ptx(hk._DECODE_U8.value, {4: words, 5: POS})
    unsigned = np.stack(
        [((got[i] >> U32(8 * j)) & U32(255)).astype(np.int64) for i in range(4) for j in range(4)],
        1,
    )
    assert np.array_equal(unsigned - 128, _twice_value(_codes(words, 16)))


@pytest.mark.parametrize("small", [0, 1, 8, 2**26 - 1])
def test_lane_tables_are_the_tables_first_words_on_every_lane(small):
    for lane in range(32):
        got = run_ptx(hk._LANE_TABLES.value, {2: np.zeros(4, U32), 3: small}, lane=lane)
        assert (got[0] == POS).all() and (got[1] == NEG).all(), (lane, small)
    # past the bound the comment states, the lane shows through: the bound is real
    got = run_ptx(hk._LANE_TABLES.value, {2: np.zeros(4, U32), 3: 2**27}, lane=31)
    assert not (got[0] == POS).all()


def test_decode_w_splits_magnitudes_by_sign():
    words = _words_64()
    got = run_ptx(hk._DECODE_W.value, {8: words, 9: POS})
    codes = _codes(words, 16)
    twice = _twice_value(codes)
    pos = _bytes([got[i] for i in range(4)])
    neg = _bytes([got[i] for i in range(4, 8)])
    assert np.array_equal(pos, np.where(codes < 8, twice, 0))
    assert np.array_equal(neg, np.where(codes >= 8, -twice, 0))
    assert np.array_equal(pos - neg, twice)


def test_the_dot_products_are_exact_integer_sums():
    rng = np.random.default_rng(0)
    w = rng.integers(0, 2**64, size=1 << 15, dtype=np.uint64)
    x = rng.integers(0, 2**64, size=1 << 15, dtype=np.uint64)
    want = (_twice_value(_codes(w, 16)) * _twice_value(_codes(x, 16))).sum(1)
    xs = run_ptx(hk._DECODE_S8.value, {4: x, 5: POS, 6: NEG})
    ws = run_ptx(hk._DECODE_U8.value, {4: w, 5: POS})
    split = run_ptx(hk._DECODE_W.value, {8: w, 9: POS})
    start = run_ptx(hk._MINUS_128_SUM.value, {1 + i: xs[i] for i in range(4)})[0]
    dot4 = run_ptx(
        hk._DOT4U.value,
        {**{1 + i: ws[i] for i in range(4)}, **{5 + i: xs[i] for i in range(4)}, 9: start},
    )
    dot8 = run_ptx(
        hk._DOT8.value,
        {**{1 + i: split[i] for i in range(8)}, **{9 + i: xs[i] for i in range(4)}},
    )
    assert np.array_equal(dot4[0].view(np.int32).astype(np.int64), want)
    assert np.array_equal(dot8[0].view(np.int32).astype(np.int64), want)


def test_word_to_f16_is_exact_at_every_code_and_every_e4m3_scale():
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    scales = scales[torch.isfinite(scales)]
    half = torch.from_numpy(scales.numpy().astype(np.float16).view(np.uint16).astype(np.uint32))
    words = ALL_HALVES | (np.roll(ALL_HALVES, 4321) << U32(16))
    codes = _codes(words.astype(np.uint64), 8)
    values = formats.e2m1_decode(torch.from_numpy(codes).to(torch.uint8), torch.float64).numpy()
    for s_bits, s in zip(half.tolist(), scales.tolist()):
        pair = np.full(words.shape, s_bits | (s_bits << 16), dtype=U32)
        got = run_ptx(hk._WORD_TO_F16.value, {8: words, 9: pair})
        planes = np.stack([got[i].astype(np.uint16).view(np.float16) for i in range(8)], 1)
        assert np.array_equal(planes.astype(np.float64), values * 2.0**-14 * s), s


def _pair_planes(got: dict[int, np.ndarray], half: int) -> np.ndarray:
    return np.stack(
        [((got[i] >> U32(16 * half)) & U32(0xFFFF)).astype(np.uint16) for i in range(8)], 1
    )


def _scales_to_check(scale_bytes: np.ndarray, config: pytest.Config) -> list[int]:
    """Every scale byte with ``--all`` (CI); else every fifth and the edges (zero, the
    smallest subnormals, the smallest normal, the largest, NaN, both signs), which keeps the
    default run under a minute on a loaded 2-core machine."""
    every = config.getoption("run_all")
    edges = {0x00, 0x01, 0x07, 0x08, 0x7E, 0x7F}
    return [b for b in scale_bytes.tolist() if every or b % 5 == 0 or b & 0x7F in edges]


@pytest.mark.parametrize("asm", ["_PAIR_TO_F16", "_PAIR_TO_F16_CVT"])
def test_pair_to_f16_is_exact_at_every_code_and_every_e4m3_scale(asm, pytestconfig):
    """Each half of each output is its own word's code times its own word's scale. The
    conversion by the GPU (``_CVT``) reads only the low byte of each scale: the bits above it
    are set here, and NaN scales come out NaN."""
    bytes_ = torch.arange(256, dtype=torch.uint8)
    finite = torch.isfinite(bytes_.view(torch.float8_e4m3fn).double())
    cvt = asm.endswith("_CVT")
    scale_bytes = (bytes_ if cvt else bytes_[finite]).numpy().astype(np.uint32)
    junk = np.uint32(0xA5C3E700) if cvt else np.uint32(0)
    words0 = ALL_HALVES | (np.roll(ALL_HALVES, 4321) << U32(16))
    words1 = np.roll(words0, 999)
    values = [
        formats.e2m1_decode(
            torch.from_numpy(_codes(w.astype(np.uint64), 8)).to(torch.uint8), torch.float64
        ).numpy()
        for w in (words0, words1)
    ]
    scale_values = bytes_.view(torch.float8_e4m3fn).double().numpy()
    for s0 in _scales_to_check(scale_bytes, pytestconfig):
        s1 = int(scale_bytes[(s0 * 7 + 3) % len(scale_bytes)])  # a different scale for word 1
        got = run_ptx(
            getattr(hk, asm).value,
            {
                8: words0,
                9: words1,
                10: np.full(words0.shape, s0 | junk, U32),
                11: np.full(words0.shape, s1 | (junk << U32(4)), U32),
            },
        )
        for half, (s, v) in enumerate(((s0, values[0]), (s1, values[1]))):
            planes = _pair_planes(got, half).view(np.float16).astype(np.float64)
            want = v * 2.0**-14 * scale_values[s]
            assert np.array_equal(planes, want, equal_nan=True), (s0, s1, half)


def test_a_planted_table_error_is_caught():
    words = _words_64()
    broken = hk._DECODE_S8.value.replace(str(hk.TABLE_POS[1]), str(hk.TABLE_POS[1] ^ 0x100))
    assert broken != hk._DECODE_S8.value
    got = run_ptx(broken, {4: words, 5: POS, 6: NEG})
    assert not np.array_equal(_bytes([got[i] for i in range(4)]), _twice_value(_codes(words, 16)))
