"""Tests for fp4select.formats: bit layouts against plain-Python statements of the rules,
properties of quantize/dequantize/reference_mm_fp4, and agreement with flashinfer's helpers."""

from __future__ import annotations

import importlib
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4select import formats as f

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MAP32 = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27]
MAP32 += [4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31]
E4M3_ONE = 0x38
FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)

# Examples and deadline come from the profile (conftest.py): 25 by default, 150 with --all.
PROPERTY = settings()


# --------------------------------------------------------------------------------------------
# Plain-Python statements of the formats (independent of the module under test)


def py_e2m1(code: int) -> float:
    mag = GRID[code & 7]
    return -mag if code & 8 else mag


def py_e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return math.nan
    if e == 0:
        return sign * m / 8 * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def py_scale(byte: int, use_nvfp4: bool) -> float:
    if use_nvfp4:
        return py_e4m3(byte)
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def py_padded(rows: int, cols: int, layout: str) -> tuple[int, int]:
    if layout == "linear":
        return rows, cols
    rmul = 128 if layout == "128x4" else 8
    return -(-rows // rmul) * rmul, -(-cols // 4) * 4


def py_sf_index(r: int, c: int, rows: int, cols: int, layout: str) -> int:
    _, cp = py_padded(rows, cols, layout)
    if layout == "linear":
        return r * cols + c
    if layout == "128x4":
        return (
            (r // 128) * cp * 128 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        )
    return (r // 8) * cp * 8 + (c // 4) * 32 + (r % 8) * 4 + c % 4


def py_shuffled_row(r: int) -> int:
    """Where the trtllm shuffle puts old row r."""
    return (r // 32) * 32 + MAP32[r % 32]


def py_nearest_e2m1(v: float) -> int:
    """Brute force RNE: nearest grid value, ties to the even code, saturate, keep sign."""
    if math.isnan(v):
        return 7
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(GRID[i] - mag), i % 2))
    return best | (8 if math.copysign(1.0, v) < 0 else 0)


def random_matrix(seed: int, rows: int, k: int, block: int) -> torch.Tensor:
    """randn with a random overall scale, a zero block, an outlier and a tiny block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2.0 ** float(seed % 41 - 20)
    blocks = x.view(rows, k // block, block)
    if seed % 3 == 0:
        blocks[0, 0] = 0.0
    if seed % 5 == 0:
        x[rows // 2, k // 3] *= 300.0
    if seed % 7 == 0:
        blocks[rows - 1, -1] *= 1e-4
    return x


def flashinfer_attr(module: str, name: str):
    """Feature-detect a flashinfer helper; skip (never fail) if it moved."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # flashinfer may fail to import for many reasons on CPU boxes
        pytest.skip(f"cannot import {module} ({exc!r}); the helper moved or flashinfer is absent")
    fn = getattr(mod, name, None)
    if fn is None:
        pytest.skip(f"{module}.{name} no longer exists in this flashinfer (moved or renamed)")
    return fn


# --------------------------------------------------------------------------------------------
# E2M1


def test_grid_constant():
    assert f.E2M1_GRID == GRID


def test_decode_all_codes_and_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = f.e2m1_decode(codes)
    assert vals.dtype == torch.float32
    assert vals.tolist() == [py_e2m1(c) for c in range(16)]
    assert torch.signbit(vals[8])  # code 8 is -0
    assert torch.equal(f.e2m1_encode(vals), codes)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert torch.equal(f.e2m1_encode(f.e2m1_decode(codes, dtype)), codes)


@pytest.mark.parametrize(
    ("tie", "code"),
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)],
)
def test_ties_round_to_even_code(tie, code):
    assert code % 2 == 0
    x = torch.tensor([tie, -tie])
    assert f.e2m1_encode(x).tolist() == [code, code | 8]
    # just off the tie, the nearest grid point wins on either side
    below = torch.nextafter(torch.tensor(tie), torch.tensor(0.0))
    above = torch.nextafter(torch.tensor(tie), torch.tensor(10.0))
    lo = max(i for i in range(8) if GRID[i] < tie)
    assert f.e2m1_encode(below).item() == lo
    assert f.e2m1_encode(above).item() == lo + 1


def test_saturation_and_sign():
    x = torch.tensor([6.0, 6.5, 100.0, 1e30, math.inf, -7.0, -math.inf, -0.0, -1e-9, 1e-9])
    assert f.e2m1_encode(x).tolist() == [7, 7, 7, 7, 7, 15, 15, 8, 8, 0]


def test_nan_encodes_to_code_7():
    x = torch.tensor([math.nan, -math.nan])
    assert f.e2m1_encode(x).tolist() == [7, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_encode_matches_brute_force(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2000, generator=g) * 3, torch.arange(-140, 141) / 20.0]).to(dtype)
    expected = [py_nearest_e2m1(v) for v in x.double().tolist()]
    assert f.e2m1_encode(x).tolist() == expected


def test_encode_rejects_integers():
    with pytest.raises(TypeError, match="x"):
        f.e2m1_encode(torch.arange(3))


# --------------------------------------------------------------------------------------------
# Nibbles


def test_low_nibble_holds_even_element():
    packed = f.pack_nibbles(torch.tensor([1, 2, 15, 0], dtype=torch.uint8))
    assert packed.tolist() == [0x21, 0x0F]
    assert f.unpack_nibbles(torch.tensor([0x21, 0x0F], dtype=torch.uint8)).tolist() == [1, 2, 15, 0]


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 14), generator=g, dtype=torch.uint8)
    packed = f.pack_nibbles(codes)
    assert packed.shape == (3, 5, 7) and packed.dtype == torch.uint8
    assert torch.equal(f.unpack_nibbles(packed), codes)
    if FP4_X2 is not None:
        assert torch.equal(f.unpack_nibbles(packed.view(FP4_X2)), codes)


def test_pack_rejects_odd_k_and_unpack_rejects_float():
    with pytest.raises(ValueError, match="even"):
        f.pack_nibbles(torch.zeros(3, 5, dtype=torch.uint8))
    with pytest.raises(TypeError, match="packed"):
        f.unpack_nibbles(torch.zeros(3, 5))


# --------------------------------------------------------------------------------------------
# Scale-factor layouts

SF_SHAPES = [(1, 1), (3, 5), (8, 4), (37, 9), (128, 4), (129, 3), (200, 13), (256, 8)]


@pytest.mark.parametrize("layout", f.SF_LAYOUTS)
@pytest.mark.parametrize(("rows", "cols"), SF_SHAPES)
def test_sf_index_matches_formula_and_is_a_bijection(rows, cols, layout):
    idx = f.sf_index(rows, cols, layout)
    assert idx.shape == (rows, cols) and idx.dtype == torch.int64
    expected = [[py_sf_index(r, c, rows, cols, layout) for c in range(cols)] for r in range(rows)]
    assert idx.tolist() == expected
    rp, cp = f.padded_sf_shape(rows, cols, layout)
    assert (rp, cp) == py_padded(rows, cols, layout)
    # extended to the padded grid, the formula covers [0, Rp*Cp) exactly once
    full = f.sf_index(rp, cp, layout)
    assert torch.equal(full.flatten().sort().values, torch.arange(rp * cp))
    assert torch.equal(full[:rows, :cols], idx)


@pytest.mark.parametrize("layout", f.SF_LAYOUTS)
@pytest.mark.parametrize(("rows", "cols"), SF_SHAPES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_swizzle_places_by_sf_index_pads_zero_and_round_trips(rows, cols, layout, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    s = torch.randint(1, 120, (rows, cols), generator=g, dtype=torch.uint8).view(dtype)
    sw = f.swizzle_sf(s, layout)
    rp, cp = f.padded_sf_shape(rows, cols, layout)
    assert sw.shape == (rp, cp) and sw.dtype == dtype
    flat = sw.view(torch.uint8).flatten()
    idx = f.sf_index(rows, cols, layout).flatten()
    assert torch.equal(flat[idx], s.view(torch.uint8).flatten())
    pad = torch.ones(rp * cp, dtype=torch.bool)
    pad[idx] = False
    assert not flat[pad].any()
    for buf in (sw, sw.flatten()):
        back = f.unswizzle_sf(buf, rows, cols, layout)
        assert back.dtype == dtype
        assert torch.equal(back.view(torch.uint8), s.view(torch.uint8))


def test_layout_argument_errors():
    with pytest.raises(ValueError, match="layout must be one of"):
        f.padded_sf_shape(4, 4, "4x128")
    with pytest.raises(ValueError, match="layout must be one of"):
        f.swizzle_sf(torch.zeros(2, 2, dtype=torch.uint8), "x")
    with pytest.raises(ValueError, match="elements"):
        f.unswizzle_sf(torch.zeros(100, dtype=torch.uint8), 3, 2, "128x4")
    with pytest.raises(TypeError, match="1-byte"):
        f.swizzle_sf(torch.zeros(2, 2), "128x4")


def test_decode_scales_all_bytes():
    b = torch.arange(256, dtype=torch.uint8)
    e4m3 = f.decode_scales(b, use_nvfp4=True)
    from_fp8 = f.decode_scales(b.view(torch.float8_e4m3fn), use_nvfp4=True)
    expected = torch.tensor([py_e4m3(i) for i in range(256)], dtype=torch.float32)
    for got in (e4m3, from_fp8):
        assert torch.equal(got.nan_to_num(123.0), expected.nan_to_num(123.0))
    ue8 = f.decode_scales(b, use_nvfp4=False)
    assert ue8.dtype == torch.float32
    assert ue8[:255].tolist() == [2.0 ** (i - 127) for i in range(255)]  # exact, incl. 2**-127
    assert math.isnan(ue8[255].item())


# --------------------------------------------------------------------------------------------
# trtllm shuffle


@pytest.mark.parametrize("rows", [32, 64, 256])
def test_trtllm_permutation_matches_map(rows):
    perm = f.trtllm_row_permutation(rows)
    expected = [0] * rows
    for old in range(rows):
        expected[py_shuffled_row(old)] = old
    assert perm.tolist() == expected
    x = torch.arange(rows * 3).reshape(rows, 3)
    sh = f.shuffle_rows_trtllm(x)
    assert all(torch.equal(sh[py_shuffled_row(r)], x[r]) for r in range(rows))
    assert torch.equal(f.unshuffle_rows_trtllm(sh), x)


def test_trtllm_shuffle_needs_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        f.trtllm_row_permutation(48)
    with pytest.raises(ValueError, match="multiple of 128"):
        f.quantize_nvfp4(torch.randn(96, 32), shuffle=True)


# --------------------------------------------------------------------------------------------
# Quantization


def test_quantize_nvfp4_shapes_and_types():
    x = torch.randn(37, 48, dtype=torch.bfloat16)
    q = f.quantize_nvfp4(x)
    assert q.data.shape == (37, 24) and q.data.dtype == torch.uint8
    assert q.scales.shape == (128, 4) and q.scales.dtype == torch.float8_e4m3fn
    assert q.global_scale is not None and q.global_scale.dim() == 0
    assert q.global_scale.dtype == torch.float32
    amax = x.float().abs().max()
    assert torch.equal(q.global_scale, 2688.0 / amax)
    assert (q.sf_layout, q.use_nvfp4, q.shuffled) == ("128x4", True, False)
    # the block holding amax gets the largest e4m3 scale
    assert f.decode_scales(q.scales, True).max().item() == 448.0


def test_quantize_zero_tensor_and_explicit_global_scale():
    q = f.quantize_nvfp4(torch.zeros(3, 32))
    assert q.global_scale.item() == 1.0
    assert not q.data.any() and not q.scales.view(torch.uint8).any()
    x = torch.randn(3, 32)
    q1 = f.quantize_nvfp4(x, global_scale=torch.tensor([7.0]))
    q2 = f.quantize_nvfp4(x, global_scale=7.0)
    assert q1.global_scale.item() == 7.0 and torch.equal(q1.data, q2.data)
    # a global scale far too large saturates the block scales at 448 rather than overflowing
    q3 = f.quantize_nvfp4(x, global_scale=1e9)
    assert f.decode_scales(q3.scales, True).max().item() == 448.0


def test_mxfp4_scale_choice():
    below_8 = 8.0 * (1 - 2.0**-24)  # log2 rounds up to 3 in float32; floor is 2
    x = torch.zeros(5, 32)
    x[0, 3] = 1.0  # floor(log2) 0 -> exp -2 -> byte 125
    x[1, 0] = below_8  # exp 0 -> byte 127
    x[2, 5] = -6.0  # floor 2 -> exp 0 -> byte 127, value 6 exactly
    x[3, 0] = 1e-39  # subnormal: floor(log2) = -130 -> exp -132 -> clamped to -127 -> byte 0
    x[4, 0] = math.nan
    q = f.quantize_mxfp4(x, sf_layout="linear")
    assert q.scales.dtype == torch.uint8 and q.global_scale is None
    assert q.scales[:, 0].tolist() == [125, 127, 127, 0, 255]
    codes = f.unpack_nibbles(q.data)
    assert codes[0, 3].item() == 6  # 1.0 / 2**-2 = 4 -> code 6
    assert codes[1, 0].item() == 7  # 7.99.. saturates to 6
    assert codes[2, 5].item() == 15
    deq = f.dequantize(q.data, q.scales, 32, use_nvfp4=False, sf_layout="linear")
    assert torch.isnan(deq[4]).all()


def half_spacing(y: torch.Tensor) -> torch.Tensor:
    return torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0)).double()


def check_quantization_error(x, q, use_nvfp4: bool) -> None:
    """|x - x_hat| <= unit * half e2m1 spacing, or the saturation excess above 6."""
    rows, k = x.shape
    block = 16 if use_nvfp4 else 32
    deq = f.dequantize(
        q.data, q.scales, k, use_nvfp4=use_nvfp4, sf_layout=q.sf_layout, shuffled=q.shuffled
    ).double()
    sf = q.scales
    if q.shuffled:
        sf = f.unshuffle_rows_trtllm(f.unswizzle_sf(sf, rows, k // block, q.sf_layout))
    else:
        sf = f.unswizzle_sf(sf, rows, k // block, q.sf_layout)
    unit = f.decode_scales(sf, use_nvfp4).double()
    if use_nvfp4:
        unit = unit / q.global_scale.double()
        deq = deq / q.global_scale.double()
    unit = unit.repeat_interleave(block, dim=1)
    xd = x.double()
    err = (xd - deq).abs()
    y = xd.abs() / unit
    allowed = torch.where(y <= 6, half_spacing(y) * unit, (y - 6) * unit)
    allowed = torch.where(unit == 0, xd.abs(), allowed * (1 + 1e-5) + unit * 1e-5)
    assert (err <= allowed).all()
    # saturation is bounded: e4m3 rounding of a normal scale, or the MX floor rule
    sat_cap = 6.0 / (1 - 2.0**-4) if use_nvfp4 else 8.0
    normal = unit > (2.0**-6 / q.global_scale.double() if use_nvfp4 else 0)
    assert (y[normal] <= sat_cap * (1 + 1e-6)).all()


@PROPERTY
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(0, 20).map(lambda i: 2 * i + 1),
    blocks=st.integers(1, 7),
    use_nvfp4=st.booleans(),
    layout=st.sampled_from(f.SF_LAYOUTS),
    shuffle=st.booleans(),
)
def test_quantize_dequantize_error_bound(seed, rows, blocks, use_nvfp4, layout, shuffle):
    block = 16 if use_nvfp4 else 32
    if shuffle:
        rows = 128 * (1 + rows % 2)
    x = random_matrix(seed, rows, block * blocks, block)
    quantize = f.quantize_nvfp4 if use_nvfp4 else f.quantize_mxfp4
    q = quantize(x, sf_layout=layout, shuffle=shuffle)
    assert q.data.shape == (rows, block * blocks // 2)
    assert q.scales.shape == f.padded_sf_shape(rows, blocks, layout)
    check_quantization_error(x, q, use_nvfp4)
    if shuffle:
        plain = quantize(x, sf_layout=layout)
        assert torch.equal(q.data, f.shuffle_rows_trtllm(plain.data))


def test_dequantize_rows_and_nibble_positions():
    data = torch.zeros(3, 16, dtype=torch.uint8)
    data[1, 9] = 0x21  # element 18 -> code 1 (0.5), element 19 -> code 2 (1.0)
    sf = torch.full((3, 2), E4M3_ONE, dtype=torch.uint8)
    sf[1, 1] = 0x40  # 2.0 for block 1 (elements 16..31) of row 1
    deq = f.dequantize(data, f.swizzle_sf(sf, "8x4"), 32, use_nvfp4=True, sf_layout="8x4")
    assert deq[1, 18].item() == 1.0 and deq[1, 19].item() == 2.0
    assert deq.count_nonzero().item() == 2
    top = f.dequantize(
        data, f.swizzle_sf(sf[:2], "linear"), 32, use_nvfp4=True, sf_layout="linear", rows=2
    )
    assert torch.equal(top, deq[:2])
    with pytest.raises(ValueError, match="k must be"):
        f.dequantize(data, sf, 48, use_nvfp4=True, sf_layout="linear")
    half = f.dequantize(data, f.swizzle_sf(sf, "8x4"), 32, use_nvfp4=True, sf_layout="8x4",
                        dtype=torch.bfloat16)  # fmt: skip
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), deq)
    for bad in (torch.int32, "float32"):  # an integer dtype would truncate the products
        with pytest.raises(ValueError, match="dtype must be a floating-point"):
            f.dequantize(data, sf, 32, use_nvfp4=True, sf_layout="linear", dtype=bad)


# --------------------------------------------------------------------------------------------
# reference_mm_fp4


def mm_operands(seed, m, n, blocks, use_nvfp4, a_layout, b_layout):
    block = 16 if use_nvfp4 else 32
    k = block * blocks
    a = random_matrix(seed, m, k, block)
    w = random_matrix(seed + 1, n, k, block)
    quantize = f.quantize_nvfp4 if use_nvfp4 else f.quantize_mxfp4
    qa = quantize(a, sf_layout=a_layout)
    qw = quantize(w, sf_layout="128x4", shuffle=b_layout == "trtllm")
    return qa, qw, k


def expected_mm(qa, qw, k, alpha) -> torch.Tensor:
    kw = {"use_nvfp4": qa.use_nvfp4}
    da = f.dequantize(qa.data, qa.scales, k, sf_layout=qa.sf_layout, **kw).double()
    dw = f.dequantize(qw.data, qw.scales, k, sf_layout="128x4", shuffled=qw.shuffled, **kw)
    exact = da @ dw.double().T
    bound = (da.abs() @ dw.double().abs().T) * (k + 2) * 2.0**-24
    if alpha is not None:
        alpha = alpha.double().reshape(-1, 1) if alpha.numel() > 1 else alpha.double()
        exact, bound = exact * alpha, bound * alpha.abs()
    return exact, bound


@PROPERTY
@given(
    seed=st.integers(0, 10_000),
    m=st.integers(0, 20).map(lambda i: 2 * i + 1),
    n=st.integers(0, 20).map(lambda i: 2 * i + 1),
    blocks=st.integers(1, 7),
    use_nvfp4=st.booleans(),
    a_layout=st.sampled_from(["128x4", "8x4"]),
    b_layout=st.sampled_from(["plain", "trtllm"]),
    alpha_kind=st.sampled_from(["none", "scalar", "row", "float"]),
    b_descale_1d=st.booleans(),
)
def test_reference_mm_matches_float64_of_dequantized(
    seed, m, n, blocks, use_nvfp4, a_layout, b_layout, alpha_kind, b_descale_1d
):
    if b_layout == "trtllm":
        n = 128 * (1 + n % 2)
    qa, qw, k = mm_operands(seed, m, n, blocks, use_nvfp4, a_layout, b_layout)
    g = torch.Generator().manual_seed(seed)
    alpha = {
        "none": None,
        "scalar": (1 / (qa.global_scale * qw.global_scale)).reshape(1)
        if use_nvfp4
        else torch.rand(1, generator=g),
        "row": torch.rand(m, generator=g) + 0.5,
        "float": 0.75,
    }[alpha_kind]
    b_descale = qw.scales.flatten() if b_descale_1d else qw.scales.T
    got = f.reference_mm_fp4(
        qa.data,
        qw.data.T,
        qa.scales,
        b_descale,
        alpha,
        out_dtype=torch.float32,
        block_size=16 if use_nvfp4 else 32,
        use_8x4_sf_layout=a_layout == "8x4",
        use_nvfp4=use_nvfp4,
        b_layout=b_layout,
    )
    assert got.shape == (m, n) and got.dtype == torch.float32
    alpha_t = torch.tensor(alpha) if isinstance(alpha, float) else alpha
    exact, bound = expected_mm(qa, qw, k, alpha_t)
    assert ((got.double() - exact).abs() <= bound + 1e-300).all()
    # out= is honoured (and converted to its dtype)
    out = torch.full((m, n), math.nan, dtype=torch.bfloat16)
    ret = f.reference_mm_fp4(
        qa.data.view(FP4_X2) if FP4_X2 is not None else qa.data,
        qw.data.T,
        qa.scales,
        b_descale,
        alpha,
        torch.bfloat16,
        out,
        16 if use_nvfp4 else 32,
        a_layout == "8x4",
        use_nvfp4,
        b_layout=b_layout,
    )
    assert ret is out
    assert torch.equal(out, got.to(torch.bfloat16))


def test_reference_mm_compute_dtype_float64_is_tighter():
    qa, qw, k = mm_operands(3, 7, 9, 5, True, "128x4", "plain")
    args = (qa.data, qw.data.T, qa.scales, qw.scales.T)
    got = f.reference_mm_fp4(*args, out_dtype=torch.float64, compute_dtype=torch.float64)
    exact, _ = expected_mm(qa, qw, k, None)
    assert torch.allclose(got, exact, rtol=1e-12, atol=0)


def test_reference_mm_argument_errors():
    qa, qw, _ = mm_operands(0, 3, 5, 2, True, "128x4", "plain")
    args = (qa.data, qw.data.T, qa.scales, qw.scales.T)
    with pytest.raises(ValueError, match="block_size"):
        f.reference_mm_fp4(*args, block_size=32)
    with pytest.raises(ValueError, match="b_layout"):
        f.reference_mm_fp4(*args, b_layout="shuffled")
    with pytest.raises(ValueError, match="b_descale"):
        f.reference_mm_fp4(*args[:3], qw.scales)  # forgot the .T
    with pytest.raises(ValueError, match="alpha"):
        f.reference_mm_fp4(*args, torch.ones(2))
    with pytest.raises(ValueError, match="out"):
        f.reference_mm_fp4(*args, out=torch.empty(5, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="b must be"):
        f.reference_mm_fp4(qa.data, qw.data, qa.scales, qw.scales.T)
    with pytest.raises(ValueError, match="multiple of 128"):
        f.reference_mm_fp4(*args, b_layout="trtllm")


# --------------------------------------------------------------------------------------------
# Independent slow implementation: raw bytes, Python loops, formulas written out again


def slow_mm(a, w, a_sf, w_sf, m, n, k, a_layout, use_nvfp4, trtllm):
    """Scalar loop over raw byte lists; w is the (N, K/2) weight as stored (maybe shuffled)."""
    bs = 16 if use_nvfp4 else 32
    c = k // bs

    def value(data, sf, row, kk, rows, layout, phys_row):
        byte = data[phys_row][kk // 2]
        code = byte & 0xF if kk % 2 == 0 else byte >> 4
        scale = sf[py_sf_index(phys_row, kk // bs, rows, c, layout)]
        return py_e2m1(code) * py_scale(scale, use_nvfp4)

    out = [[0.0] * n for _ in range(m)]
    for i in range(m):
        for j in range(n):
            pj = py_shuffled_row(j) if trtllm else j
            out[i][j] = math.fsum(
                value(a, a_sf, i, kk, m, a_layout, i) * value(w, w_sf, j, kk, n, "128x4", pj)
                for kk in range(k)
            )
    return out


@pytest.mark.parametrize(
    ("m", "n", "k", "use_nvfp4", "a_layout", "trtllm"),
    [
        (3, 5, 48, True, "128x4", False),
        (9, 3, 64, True, "8x4", False),
        (2, 7, 96, False, "128x4", False),
        (3, 3, 32, False, "8x4", False),
        (2, 128, 32, True, "128x4", True),
        (1, 128, 64, False, "8x4", True),
    ],
)
def test_reference_mm_matches_scalar_loop_on_random_bytes(m, n, k, use_nvfp4, a_layout, trtllm):
    rng = random.Random(m * 100 + n + k)
    bs = 16 if use_nvfp4 else 32

    def scale_bytes(count):  # random scale bytes, padding included; no NaN encodings
        if use_nvfp4:
            return [rng.choice([b for b in range(1, 0x60)] + [0xB8]) for _ in range(count)]
        return [rng.randint(115, 135) for _ in range(count)]

    a = [[rng.randrange(256) for _ in range(k // 2)] for _ in range(m)]
    w = [[rng.randrange(256) for _ in range(k // 2)] for _ in range(n)]
    ra, ca = f.padded_sf_shape(m, k // bs, a_layout)
    rw, cw = f.padded_sf_shape(n, k // bs, "128x4")
    a_sf, w_sf = scale_bytes(ra * ca), scale_bytes(rw * cw)
    sf_dtype = torch.float8_e4m3fn if use_nvfp4 else torch.uint8
    a_sf_t = torch.tensor(a_sf, dtype=torch.uint8).view(sf_dtype).reshape(ra, ca)
    w_sf_t = torch.tensor(w_sf, dtype=torch.uint8).view(sf_dtype).reshape(rw, cw)
    got = f.reference_mm_fp4(
        torch.tensor(a, dtype=torch.uint8),
        torch.tensor(w, dtype=torch.uint8).T,
        a_sf_t,
        w_sf_t.T,
        None,
        torch.float64,
        block_size=bs,
        use_8x4_sf_layout=a_layout == "8x4",
        use_nvfp4=use_nvfp4,
        b_layout="trtllm" if trtllm else "plain",
        compute_dtype=torch.float64,
    )
    expected = slow_mm(a, w, a_sf, w_sf, m, n, k, a_layout, use_nvfp4, trtllm)
    expected = torch.tensor(expected, dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-300)


def one_hot_scales(rows, cols, layout, positions, fill=0):
    """Swizzled e4m3 buffer built by the Python formula: `fill` everywhere, 1.0 at positions."""
    rp, cp = py_padded(rows, cols, layout)
    buf = [0] * (rp * cp)
    for r in range(rows):
        for c in range(cols):
            buf[py_sf_index(r, c, rows, cols, layout)] = fill
    for r, c in positions:
        buf[py_sf_index(r, c, rows, cols, layout)] = E4M3_ONE
    return torch.tensor(buf, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(rp, cp)


@pytest.mark.parametrize(
    ("layout", "m", "r", "c"),
    [("128x4", 160, 37, 2), ("128x4", 160, 131, 5), ("8x4", 21, 13, 1), ("8x4", 21, 20, 5)],
)
def test_single_a_scale_lights_one_output_row(layout, m, r, c):
    n, k = 3, 96
    a = torch.full((m, k // 2), 0x22, dtype=torch.uint8)  # every element 1.0
    w = torch.full((n, k // 2), 0x22, dtype=torch.uint8)
    a_sf = one_hot_scales(m, k // 16, layout, [(r, c)])
    w_sf = one_hot_scales(n, k // 16, "128x4", [], fill=E4M3_ONE)
    out = f.reference_mm_fp4(
        a, w.T, a_sf, w_sf.T, out_dtype=torch.float32, use_8x4_sf_layout=layout == "8x4"
    )
    expected = torch.zeros(m, n)
    expected[r] = 16.0
    assert torch.equal(out, expected)


@pytest.mark.parametrize(("n", "c"), [(45, 1), (100, 0), (7, 2)])
def test_single_trtllm_weight_row_lights_one_output_column(n, c):
    rows, m, k = 128, 2, 48
    a = torch.full((m, k // 2), 0x22, dtype=torch.uint8)
    a_sf = one_hot_scales(m, k // 16, "128x4", [], fill=E4M3_ONE)
    phys = py_shuffled_row(n)
    # scale side: only the (shuffled) scale of weight row n is non-zero
    w = torch.full((rows, k // 2), 0x22, dtype=torch.uint8)
    w_sf = one_hot_scales(rows, k // 16, "128x4", [(phys, c)])
    out = f.reference_mm_fp4(a, w.T, a_sf, w_sf.T, out_dtype=torch.float32, b_layout="trtllm")
    expected = torch.zeros(m, rows)
    expected[:, n] = 16.0
    assert torch.equal(out, expected)
    # data side: only the (shuffled) data row of weight row n is non-zero
    w = torch.zeros(rows, k // 2, dtype=torch.uint8)
    w[phys] = 0x22
    w_sf = one_hot_scales(rows, k // 16, "128x4", [], fill=E4M3_ONE)
    out = f.reference_mm_fp4(a, w.T, a_sf, w_sf.T, out_dtype=torch.float32, b_layout="trtllm")
    expected[:, n] = float(k)
    assert torch.equal(out, expected)


# --------------------------------------------------------------------------------------------
# Bit-for-bit agreement with flashinfer's pure-PyTorch helpers (feature-detected)


@pytest.mark.parametrize("use_nvfp4", [True, False])
@pytest.mark.parametrize(("rows", "blocks"), [(1, 1), (7, 3), (33, 5)])
@pytest.mark.flashinfer
def test_dequantize_matches_flashinfer_cpu_fallback(use_nvfp4, rows, blocks):
    fi = flashinfer_attr(
        "flashinfer.quantization.fp4_quantization", "_e2m1_and_ufp8sf_scale_to_float_cpu"
    )
    block = 16 if use_nvfp4 else 32
    k = block * blocks
    x = random_matrix(rows * 31 + blocks, rows, k, block)
    quantize = f.quantize_nvfp4 if use_nvfp4 else f.quantize_mxfp4
    q = quantize(x, sf_layout="linear")
    ours = f.dequantize(q.data, q.scales, k, use_nvfp4=use_nvfp4, sf_layout="linear")
    sf_bytes = q.scales.view(torch.uint8)
    ufp8_type = 1 if use_nvfp4 else 0
    theirs = fi(q.data, sf_bytes, torch.tensor([1.0]), block, ufp8_type, False)
    assert torch.equal(ours, theirs)
    if use_nvfp4:
        inv = 1.0 / q.global_scale
        theirs = fi(q.data, sf_bytes, inv.reshape(1), block, ufp8_type, False)
        assert torch.equal(ours * inv, theirs)


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (37, 5), (128, 4), (130, 9)])
@pytest.mark.flashinfer
def test_unswizzle_matches_flashinfer_128x4(rows, cols):
    fi = flashinfer_attr("flashinfer.trace.templates.gemm", "_unswizzle_sf_128x4")
    rp, cp = f.padded_sf_shape(rows, cols, "128x4")
    buf = torch.randint(0, 256, (rp * cp,), generator=torch.Generator().manual_seed(rows))
    buf = buf.to(torch.uint8)
    assert torch.equal(f.unswizzle_sf(buf, rows, cols, "128x4"), fi(buf, rows, cols))


@pytest.mark.parametrize("rows", [32, 128, 384])
@pytest.mark.flashinfer
def test_trtllm_permutation_matches_flashinfer(rows):
    fi = flashinfer_attr("flashinfer.utils", "get_shuffle_matrix_a_row_indices")
    assert torch.equal(f.trtllm_row_permutation(rows), fi(torch.empty(rows, 8), 128))
