"""``torch-dequant``: decode a and b into bfloat16 workspaces, one cuBLAS GEMM, then alpha.

For large M the GEMM dominates and cuBLAS is hard to beat, so paying one decode pass per
operand is the cheapest way to full tensor-core speed on GPUs without FP4 tensor cores.

Design rules:

* Exact operands: an NVFP4 value (e2m1 times e4m3) has at most 6 significant bits and fits
  bfloat16 exactly; MXFP4 values do while they stay in bfloat16's normal range. The result
  differs from the reference only by cuBLAS's summation order and the output rounding(s).
* One rounding to the output dtype. Without alpha and with bfloat16 output, cuBLAS writes
  ``out`` directly. Otherwise the product is taken in float32 (``mm.dtype_out`` into a reused
  float32 workspace), then multiplied by alpha into ``out``: rounding to bfloat16 before
  alpha would round twice (up to the validator's whole bound), and a raw float16 sum could
  overflow before alpha scales it down.
* Workspaces are reused per device and shape, never kept per layer: b's is keyed by (device,
  N, K), a's by (device, K) and grown to the largest M seen. A workspace is never freed once
  made (a captured CUDA graph may still write to it), and never grown during a capture: a call
  that needs more during capture decodes into a temporary from the graph's own pool.
  Workspaces are per device, not per stream.
* The decode is a Triton kernel when triton is installed (one pass, no temporaries), else the
  reference decode in torch. CUDA only: on the CPU this is exactly what ``emulation`` already
  does (decode, then multiply), slower in bfloat16, so it would add a candidate and no speed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fp4select import formats
from fp4select.backends import triton_fp4
from fp4select.backends.base import ALL_FORMATS, Backend, Capabilities
from fp4select.keys import ALPHA_KINDS, OUT_DTYPES

NAME = "torch-dequant"

_b_workspaces: dict[tuple[Any, ...], torch.Tensor] = {}
_a_workspaces: dict[tuple[Any, ...], torch.Tensor] = {}
_f32_workspaces: dict[tuple[Any, ...], torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown workspaces a captured graph may still use
_has_mm_out_dtype: bool | None = None


def why_unavailable(env: Mapping[str, Any]) -> str | None:
    if env.get("device") != "cuda":
        return "CUDA only: on the CPU, decode-then-multiply is what emulation already is"
    return None


def clear_workspaces() -> None:
    """Drop every workspace (tests). Not safe while a captured graph that used them lives."""
    _b_workspaces.clear()
    _a_workspaces.clear()
    _f32_workspaces.clear()
    _retired.clear()


def _growing(
    cache: dict[tuple[Any, ...], torch.Tensor],
    key: tuple[Any, ...],
    rows: int,
    cols: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A (rows, cols) view of a reused buffer that grows (doubling) to the largest rows seen."""
    ws = cache.get(key)
    if ws is not None and ws.shape[0] >= rows:
        return ws[:rows]
    capacity = max(rows, 2 * ws.shape[0]) if ws is not None else rows
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty((rows, cols), dtype=dtype, device=device)  # from the graph's pool
    if ws is not None:
        _retired.append(ws)
    ws = cache[key] = torch.empty((capacity, cols), dtype=dtype, device=device)
    return ws[:rows]


def _decode_into(
    ws: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, use_nvfp4: bool, layout: str
) -> None:
    rows, kh = data.shape
    cp = formats.padded_sf_shape(rows, 2 * kh // (16 if use_nvfp4 else 32), layout)[1]
    if triton_fp4.triton_installed():
        k = triton_fp4.kernels()
        k.dequant_bf16[(k.cdiv(rows, 32), k.cdiv(kh, 64))](
            data if data.dtype == torch.uint8 else data.view(torch.uint8),
            scales,
            ws.view(torch.int32),
            rows,
            kh,
            data.stride(0),
            cp,
            NVFP4=use_nvfp4,
            SF_8X4=layout == "8x4",
            BR=32,
            BKH=64,
            num_warps=4,
        )
        return
    ws.copy_(
        formats._dequantize(data, scales, 2 * kh, use_nvfp4, layout, False, None, torch.bfloat16)
    )


def _mm_f32(x: torch.Tensor, w_t: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """``x @ w_t`` accumulated and returned in float32, into the reused workspace ``ws``.

    cuBLAS does this in one call (``mm.dtype_out``); a build without it (the CPU) multiplies
    float32 copies instead, which is exact for these operands too.
    """
    global _has_mm_out_dtype
    if _has_mm_out_dtype is not False:
        try:
            torch.ops.aten.mm.dtype_out(x, w_t, torch.float32, out=ws)
            _has_mm_out_dtype = True
            return ws
        except (RuntimeError, NotImplementedError, AttributeError):
            _has_mm_out_dtype = False
    return torch.mm(x.float(), w_t.float(), out=ws)


def _run(
    a: torch.Tensor,
    b: torch.Tensor,
    a_descale: torch.Tensor,
    b_descale: torch.Tensor,
    alpha: torch.Tensor | float | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None,
    block_size: int,
    use_8x4_sf_layout: bool,
    use_nvfp4: bool,
    enable_pdl: bool,
) -> torch.Tensor:
    """mm_fp4's positional order (without backend); enable_pdl means nothing here."""
    c = triton_fp4.check_call(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout, use_nvfp4
    )
    m, n, kh, out = c.m, c.n, c.kh, c.out
    device = a.device
    k = 2 * kh
    w = _growing(_b_workspaces, (device, n, k), n, k, torch.bfloat16, device)
    _decode_into(w, b.T, b_descale.T if b_descale.dim() == 2 else b_descale, use_nvfp4, "128x4")
    x = _growing(_a_workspaces, (device, k), m, k, torch.bfloat16, device)
    _decode_into(x, a, c.a_descale, use_nvfp4, "8x4" if use_8x4_sf_layout else "128x4")
    if alpha is None and out_dtype == torch.bfloat16:
        return torch.mm(x, w.T, out=out)  # cuBLAS rounds once, to bfloat16
    # Otherwise the product stays in float32 until alpha is applied: one rounding to the
    # output dtype (bfloat16 then alpha would round twice, which can reach the validator's
    # whole bound), and no float16 overflow of a raw sum that alpha scales down.
    result = _mm_f32(x, w.T, _growing(_f32_workspaces, (device, n), m, n, torch.float32, device))
    if alpha is None:
        return out.copy_(result)
    if c.alpha_kind == 1:
        return torch.mul(result, c.alpha_value, out=out)
    factor = c.alpha_ptr.reshape(m, 1) if c.alpha_kind == 3 else c.alpha_ptr.reshape(())
    return torch.mul(result, factor, out=out)


BACKEND = Backend(
    name=NAME,
    checked_runner=_run,
    why_unavailable=why_unavailable,
    caps=Capabilities(
        formats=ALL_FORMATS,
        a_sf_layouts=frozenset({"128x4", "8x4"}),
        b_layouts=frozenset({"plain"}),
        out_dtypes=frozenset(OUT_DTYPES),
        alpha_kinds=frozenset(ALPHA_KINDS),
        devices=frozenset({"cuda"}),
    ),
    preference=300,
    family="native",  # a Triton decode kernel: unproven code runs in the sandbox
    description="decode a and b to bfloat16 workspaces, cuBLAS GEMM, alpha",
)
