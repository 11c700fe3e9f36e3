"""The word decode kernel (``dequant_bf16_words``) against the byte kernel, on the CPU.

The word kernel must write ``dequant_bf16``'s bits exactly (compared as int32 words, so signed
zeros, infinities and NaNs count), for both formats and scale layouts, at shapes that leave
partial tiles: R = 1, R not a multiple of the tile rows, K/2 = 8 bytes, K/2 not a multiple of
the words per program. ``_decode_into`` must take the byte kernel for views the word kernel
cannot read, and still decode them right. What only a GPU checks: the compiled code
(benchmarks/decode_sweep.py compares the two kernels there before timing them).

Both kernels run under Triton's CPU interpreter in this process: ``triton.jit`` picks the
interpreter when it decorates a function, so a private copy of the kernels module is loaded
while TRITON_INTERPRET=1 and the real module (compiled kernels, if any) is left alone.
"""

from __future__ import annotations

import importlib.util
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fp4select import formats
from fp4select.backends import dequant, triton_fp4

pytestmark = pytest.mark.skipif(
    not triton_fp4.triton_installed(), reason="triton is not installed (pip install triton)"
)

FORMATS = [(True, "128x4"), (True, "8x4"), (False, "128x4"), (False, "8x4")]
FORMAT_IDS = ["nvfp4-128x4", "nvfp4-8x4", "mxfp4-128x4", "mxfp4-8x4"]
# (rows, K/2 bytes, rows per program, words per program, WIDE); NVFP4 K/2 is a multiple of
# 8 bytes, MXFP4 K/2 of 16. 130 rows cross a 128-row scale tile; 72 and 80 bytes (18 and 20
# words) leave a partial words tile, masked past K.
NVFP4_CASES = [(1, 8, 4, 16, False), (37, 72, 8, 16, False), (130, 96, 4, 32, True)]
MXFP4_CASES = [(1, 16, 4, 16, False), (37, 80, 8, 16, True), (130, 96, 4, 32, False)]


@pytest.fixture(scope="module")
def kernels() -> Iterator[types.ModuleType]:
    """A private copy of ``fp4select.backends._triton_kernels`` run by the interpreter (which
    reads TRITON_INTERPRET at launch too, so it stays set while this module's tests run)."""
    spec = importlib.util.find_spec("fp4select.backends._triton_kernels")
    assert spec is not None and spec.origin is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        copy = importlib.util.spec_from_file_location("_fp4select_kernels_interpreted", spec.origin)
        assert copy is not None and copy.loader is not None
        module = importlib.util.module_from_spec(copy)
        copy.loader.exec_module(module)
        yield module


def _inputs(rows: int, kh: int, nvfp4: bool, layout: str, seed: int, max_e8m0: int = 254):
    """Random packed bytes and random valid scale bytes for a whole swizzled buffer: e4m3
    bytes 0..0x7E with either sign (0x7F is NaN), e8m0 bytes 0..``max_e8m0`` (255 is NaN)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, kh), dtype=torch.uint8, generator=g)
    rp, cp = formats.padded_sf_shape(rows, 2 * kh // (16 if nvfp4 else 32), layout)
    if nvfp4:
        scales = torch.randint(0, 0x7F, (rp * cp,), dtype=torch.uint8, generator=g)
        scales |= torch.randint(0, 2, (rp * cp,), dtype=torch.uint8, generator=g) << 7
    else:
        scales = torch.randint(0, max_e8m0 + 1, (rp * cp,), dtype=torch.uint8, generator=g)
    return data, scales, cp


def _bytes_kernel(k: Any, data, scales, cp: int, nvfp4: bool, layout: str) -> torch.Tensor:
    rows, kh = data.shape
    out = torch.full((rows, kh), -1, dtype=torch.int32)  # poisoned: every word is written
    k.dequant_bf16[(k.cdiv(rows, 32), k.cdiv(kh, 64))](
        data, scales, out, rows, kh, data.stride(0), cp,
        NVFP4=nvfp4, SF_8X4=layout == "8x4", BR=32, BKH=64,
    )  # fmt: skip
    return out


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # e8m0 254: 6 * 2**127
@pytest.mark.parametrize(("nvfp4", "layout"), FORMATS, ids=FORMAT_IDS)
def test_the_word_kernel_writes_the_byte_kernels_bits(kernels, nvfp4, layout):
    for seed, (rows, kh, br, bw, wide) in enumerate(NVFP4_CASES if nvfp4 else MXFP4_CASES):
        data, scales, cp = _inputs(rows, kh, nvfp4, layout, seed)
        expected = _bytes_kernel(kernels, data, scales, cp, nvfp4, layout)
        words = data.view(torch.int32)
        out = torch.full((rows, 2 * kh), float("nan"), dtype=torch.bfloat16)
        kernels.dequant_bf16_words[(kernels.cdiv(rows, br), kernels.cdiv(kh // 4, bw))](
            words, scales, out, rows, kh // 4, words.stride(0), cp,
            NVFP4=nvfp4, SF_8X4=layout == "8x4", BR=br, BW=bw, WIDE=wide,
        )  # fmt: skip
        assert torch.equal(out.view(torch.int32), expected), (rows, kh, br, bw, wide)


class _Launches:
    """The kernels module, recording which decode kernel ``_decode_into`` takes."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.taken: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("dequant_"):
            self.taken.append(name)
        return getattr(self.module, name)


def _decode(monkeypatch, kernels, data, scales, nvfp4: bool, layout: str):
    launches = _Launches(kernels)
    monkeypatch.setattr(triton_fp4, "_kernels", launches)
    ws = torch.full((data.shape[0], 2 * data.shape[1]), float("nan"), dtype=torch.bfloat16)
    dequant._decode_into(ws, data, scales, nvfp4, layout)
    return ws, launches.taken


@pytest.mark.parametrize(("nvfp4", "layout"), [FORMATS[0], FORMATS[3]], ids=FORMAT_IDS[::3])
def test_decode_into_takes_the_word_kernel_for_aligned_rows(monkeypatch, kernels, nvfp4, layout):
    data, scales, _ = _inputs(37, 80 if nvfp4 else 96, nvfp4, layout, seed=7)
    ws, taken = _decode(monkeypatch, kernels, data, scales, nvfp4, layout)
    assert taken == ["dequant_bf16_words"]
    reference = formats.dequantize(
        data, scales, 2 * data.shape[1], use_nvfp4=nvfp4, sf_layout=layout, dtype=torch.bfloat16
    )
    assert torch.equal(ws.view(torch.int16), reference.view(torch.int16))


@pytest.mark.parametrize("misalignment", ["pointer", "row stride"])
def test_decode_into_falls_back_to_the_byte_kernel_for_unaligned_views(
    monkeypatch, kernels, misalignment
):
    rows, kh = 9, 40
    data, scales, _ = _inputs(rows, kh, True, "128x4", seed=11)
    if misalignment == "pointer":  # rows of whole words, starting at byte 1
        buffer = torch.zeros(rows * kh + 1, dtype=torch.uint8)
        view = buffer[1:].view(rows, kh)
    else:  # an aligned start, rows 42 bytes apart
        view = torch.zeros(rows, kh + 2, dtype=torch.uint8)[:, :kh]
    view.copy_(data)
    ws, taken = _decode(monkeypatch, kernels, view, scales, True, "128x4")
    assert taken == ["dequant_bf16"]
    reference = formats.dequantize(
        data, scales, 2 * kh, use_nvfp4=True, sf_layout="128x4", dtype=torch.bfloat16
    )
    assert torch.equal(ws.view(torch.int16), reference.view(torch.int16))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 * 2**127
@pytest.mark.parametrize("scale_byte", [240, 241, 254])
def test_mxfp4_scales_up_to_2_to_the_127_decode_as_the_reference(monkeypatch, kernels, scale_byte):
    """Scale times 2**14 overflows float32 from e8m0 byte 241 (the kernels once wrote NaN for
    zeros and infinity for the rest there): the 2**14 goes on the value instead."""
    data, scales, _ = _inputs(4, 32, False, "128x4", seed=3)
    scales.fill_(scale_byte)
    for view in (data, torch.zeros(4, 34, dtype=torch.uint8)[:, :32].copy_(data)):  # both kernels
        ws, _ = _decode(monkeypatch, kernels, view, scales, False, "128x4")
        reference = formats.dequantize(
            data, scales, 64, use_nvfp4=False, sf_layout="128x4", dtype=torch.bfloat16
        )
        assert scale_byte == 254 or torch.isfinite(reference).all()  # 254: 6 * 2**127 is inf
        assert torch.equal(ws.view(torch.int16), reference.view(torch.int16))
