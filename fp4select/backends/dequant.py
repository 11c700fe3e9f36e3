"""Decode a and the weight into bfloat16 workspaces, then one GEMM: two candidates for large M.

* ``torch-dequant``: cuBLAS, which takes alpha only as a host number while callers pass a
  device tensor, so with alpha (or float16 out) the product goes through a float32 workspace
  and a second pass applies alpha.
* ``hopper-dequant``: a persistent Triton GEMM fed by TMA (SM90+, a Triton with host tensor
  descriptors), as fast as cuBLAS at large M (docs/hopper_kernels.md), scaling its float32
  tile in registers.

For large M the GEMM dominates, so one decode pass per operand is the cheapest way to full
tensor-core speed on GPUs without FP4 tensor cores.

Design rules:

* Exact operands: an NVFP4 value (e2m1 times e4m3) has at most 6 significant bits and fits
  bfloat16 exactly; MXFP4 values do while they stay in bfloat16's normal range. The result
  differs from the reference only by the GEMM's summation order and one rounding to the
  output dtype: the float32 sum times alpha, rounded once (bfloat16 then alpha would round
  twice, which can reach the validator's whole bound, and a raw float16 sum could overflow
  before alpha scales it down).
* Workspaces are reused per device and shape, never kept per layer: b's is keyed by (device,
  N, K), a's by (device, K) and grown to the largest M seen. A workspace is never freed once
  made (a captured CUDA graph may still write to it), and never grown during a capture: a call
  that needs more during capture decodes into a temporary from the graph's own pool.
  Workspaces are per device, not per stream.
* The decode is a Triton kernel when triton is installed (one pass, no temporaries), else the
  reference decode in torch. CUDA only: on the CPU this is what ``emulation`` already does.
* ``hopper-dequant`` writes with masked stores, so any ``out`` the checks accept (strided
  too) is written in place; its workspaces' rows (K bfloat16 values) are a multiple of 16
  bytes for every K the checks accept, as TMA requires. Its tile is
  ``hopper_configs.dequant_tile``'s. It declines buckets ending below ``MIN_M``: there its
  decode passes alone cost more than the kernels that decode in registers take.
* Importing this module never imports triton.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import astuple
from typing import Any

import torch

from fp4select import formats
from fp4select.backends import hopper_args, hopper_launch, triton_fp4
from fp4select.backends.base import Backend, cuda_from
from fp4select.backends.hopper_configs import GemmTile, dequant_tile
from fp4select.backends.hopper_launch import Launch
from fp4select.keys import Problem

MIN_CC = 90
MIN_M = 512


_b_workspaces: dict[tuple[Any, ...], torch.Tensor] = {}
_a_workspaces: dict[tuple[Any, ...], torch.Tensor] = {}
_f32_workspaces: dict[tuple[Any, ...], torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown workspaces a captured graph may still use


def clear_workspaces() -> None:
    """Drop every workspace (tests). Not safe while a captured graph that used them lives."""
    _b_workspaces.clear()
    _a_workspaces.clear()
    _f32_workspaces.clear()
    _retired.clear()


def growing(
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


# The word kernel's tile (rows, words per program, warps): the decode sweep's fastest
# (measured: docs/hopper_kernels.md, 'The dequant paths' decode').
WORDS_TILE = (8, 128, 4)


def _words(data: torch.Tensor) -> torch.Tensor | None:
    """``data`` (uint8) viewed as int32 words, or None where its rows are not whole 4-byte
    words at 4-byte aligned addresses (what the word kernel reads)."""
    aligned = data.data_ptr() % 4 == 0 and data.storage_offset() % 4 == 0
    if not aligned or data.shape[1] % 4 or data.stride(1) != 1 or data.stride(0) % 4:
        return None
    return data.view(torch.int32)


def _decoder(
    rows: int, kh: int, words: bool, use_nvfp4: bool, layout: str
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """What decodes a (rows, K/2 packed bytes) operand and its scales into a bfloat16
    (rows, K) workspace: the word kernel where ``words`` (``_words`` can view the operand), in
    fewer instructions per value and with wider accesses, else the byte kernel. Called with
    (data, scales, workspace); its launches are kept (``hopper_launch``)."""
    cp = formats.padded_sf_shape(rows, 2 * kh // (16 if use_nvfp4 else 32), layout)[1]
    k = triton_fp4.kernels()
    meta = {"NVFP4": use_nvfp4, "SF_8X4": layout == "8x4"}
    if words:
        br, bw, warps = WORDS_TILE
        by_words = Launch(
            k.dequant_bf16_words, (k.cdiv(rows, br), k.cdiv(kh // 4, bw)),
            **meta, BR=br, BW=bw, WIDE=False, num_warps=warps,
        )  # fmt: skip

        def decode_words(data: torch.Tensor, scales: torch.Tensor, ws: torch.Tensor) -> None:
            view = _words(_bytes(data))
            if view is None:  # an offset the plan's key did not tell apart: the byte kernel
                _decoder(rows, kh, False, use_nvfp4, layout)(data, scales, ws)
                return
            by_words(view, scales, ws, rows, kh // 4, view.stride(0), cp)

        return decode_words
    by_bytes = Launch(
        k.dequant_bf16, (k.cdiv(rows, 32), k.cdiv(kh, 64)), **meta, BR=32, BKH=64, num_warps=4
    )

    def decode_bytes(data: torch.Tensor, scales: torch.Tensor, ws: torch.Tensor) -> None:
        raw = _bytes(data)
        by_bytes(raw, scales, ws.view(torch.int32), rows, kh, raw.stride(0), cp)

    return decode_bytes


def _bytes(data: torch.Tensor) -> torch.Tensor:
    return data if data.dtype == torch.uint8 else data.view(torch.uint8)


def _word_view_possible(data: torch.Tensor) -> bool:
    return _words(_bytes(data)) is not None


def _decode_into(
    ws: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, use_nvfp4: bool, layout: str
) -> None:
    """Decode ``data`` (R, K/2 packed bytes) and its scales into the bfloat16 (R, K) ``ws``:
    the Triton kernels where triton is installed, else the reference decode in torch."""
    rows, kh = data.shape
    if triton_fp4.triton_installed():
        _decoder(rows, kh, _word_view_possible(data), use_nvfp4, layout)(data, scales, ws)
        return
    ws.copy_(
        formats.dequantize(
            data, scales, 2 * kh, use_nvfp4=use_nvfp4, sf_layout=layout, dtype=torch.bfloat16
        )
    )


def decoded(
    c: triton_fp4.Checked,
    a: torch.Tensor,
    b: torch.Tensor,
    b_descale: torch.Tensor,
    use_8x4_sf_layout: bool,
    use_nvfp4: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a and the weight of a checked call decoded into this device's bfloat16 workspaces:
    (M, K) and (N, K), row-major."""
    device, k = a.device, 2 * c.kh
    w = growing(_b_workspaces, (device, c.n, k), c.n, k, torch.bfloat16, device)
    _decode_into(w, b.T, _weight_scales(b_descale), use_nvfp4, "128x4")
    x = growing(_a_workspaces, (device, k), c.m, k, torch.bfloat16, device)
    _decode_into(x, a, c.a_descale, use_nvfp4, "8x4" if use_8x4_sf_layout else "128x4")
    return x, w


_has_mm_out_dtype: bool | None = None


def torch_declines(problem: Problem, env: Mapping[str, Any]) -> str | None:
    """From SM90, NVFP4 buckets below ``MIN_M`` go to the kernels that decode in registers:
    they beat this at every such point measured (docs/hopper_kernels.md)."""
    if cuda_from(env, MIN_CC) and problem.use_nvfp4 and problem.m_range[1] < MIN_M:
        return f"below M = {MIN_M}, NVFP4 from SM90 is left to the hopper-* kernels"
    return None


def why_torch_unavailable(env: Mapping[str, Any]) -> str | None:
    if env.get("device") != "cuda":
        return "CUDA only: on the CPU, decode-then-multiply is what emulation already is"
    return None


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


def run_torch(
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
    m, n, out = c.m, c.n, c.out
    device = a.device
    x, w = decoded(c, a, b, b_descale, use_8x4_sf_layout, use_nvfp4)
    if alpha is None and out_dtype == torch.bfloat16:
        return torch.mm(x, w.T, out=out)  # cuBLAS rounds once, to bfloat16
    # Otherwise float32 until alpha is applied: one rounding (the module's rules).
    result = _mm_f32(x, w.T, growing(_f32_workspaces, (device, n), m, n, torch.float32, device))
    if alpha is None:
        return out.copy_(result)
    if c.alpha_kind == 1:
        return torch.mul(result, c.alpha_value, out=out)
    factor = c.alpha_ptr.reshape(m, 1) if c.alpha_kind == 3 else c.alpha_ptr.reshape(())
    return torch.mul(result, factor, out=out)


TORCH_DEQUANT = Backend(
    name="torch-dequant",
    checked_runner=run_torch,
    why_unavailable=why_torch_unavailable,
    declines=torch_declines,
    caps=triton_fp4.caps(),
    preference=300,
    family="native",  # a Triton decode kernel: unproven code runs in the sandbox
    description="decode a and b to bfloat16 workspaces, cuBLAS GEMM, alpha",
)


def _descriptor_class() -> Any:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def why_hopper_unavailable(env: Mapping[str, Any]) -> str | None:
    cc = env.get("cc")
    if env.get("device") == "cuda" and cc is not None and cc < MIN_CC:
        return f"needs TMA (compute capability >= 9.0), got {cc / 10:.1f}"
    why = triton_fp4.why_unavailable(env)
    if why:
        return why
    if _descriptor_class() is None:
        return "this Triton has no host tensor descriptors (triton.tools.tensor_descriptor)"
    return None


def _weight_scales(b_descale: torch.Tensor) -> torch.Tensor:
    return b_descale.T if b_descale.dim() == 2 else b_descale


def _hopper_plan(args: tuple[Any, ...], cfg: GemmTile | None) -> Callable[..., torch.Tensor]:
    """``hopper-dequant``'s plan (``hopper_launch``): the call checked, its decoders and tile
    chosen, its launches made; run with the call's arguments."""
    a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, a8x4, use_nvfp4, _ = args
    c = triton_fp4.check_call(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, a8x4, use_nvfp4
    )
    m, n, big_k = c.m, c.n, 2 * c.kh
    if m == 0 or n == 0:
        return hopper_args.nothing_to_do(m, n)
    decode_w = _decoder(n, c.kh, _word_view_possible(b.T), use_nvfp4, "128x4")
    decode_a = _decoder(m, c.kh, _word_view_possible(a), use_nvfp4, "8x4" if a8x4 else "128x4")
    descriptor = _descriptor_class()
    sms = triton_fp4._sms(a.device) if a.device.type == "cuda" else 1
    bm, bn, bk, warps, stages = astuple(cfg or dequant_tile(m, n, sms))
    mm = Launch(
        triton_fp4.kernels().mm_tma_alpha, (min(sms, -(-m // bm) * -(-n // bn)),),
        ALPHA=c.alpha_kind, BM=bm, BN=bn, BK=bk, GROUP=8, UPCAST=a.device.type != "cuda",
        num_warps=warps, num_stages=stages,
    )  # fmt: skip

    def run(args: tuple[Any, ...]) -> torch.Tensor:
        out, alpha_ptr, alpha_value = hopper_args.per_call(args, m, n)
        device = out.device
        w = growing(_b_workspaces, (device, n, big_k), n, big_k, torch.bfloat16, device)
        decode_w(args[1].T, _weight_scales(args[3]), w)
        x = growing(_a_workspaces, (device, big_k), m, big_k, torch.bfloat16, device)
        decode_a(args[0], args[2], x)
        mm(
            descriptor.from_tensor(x, [bm, bk]), descriptor.from_tensor(w, [bn, bk]),
            alpha_ptr, out, m, n, big_k, out.stride(0), out.stride(1), alpha_value,
        )  # fmt: skip
        return out

    return run


def run_hopper(*args: Any, cfg: GemmTile | None = None) -> torch.Tensor:
    """mm_fp4's positional order (without backend); enable_pdl means nothing here. ``cfg``:
    the GEMM's tile (the sweeps name one), else ``dequant_tile``'s."""
    return _hopper_plan(args, cfg)(args)


def fast_hopper(*args: Any, cfg: GemmTile | None = None) -> torch.Tensor:
    """``run_hopper`` planned once per kind of call (``hopper_launch``): the warm path's."""
    return hopper_launch.planned("dequant", _hopper_plan, args, cfg)


def fast_hopper_runner(problem: Problem) -> Any:
    return fast_hopper


HOPPER_DEQUANT = Backend(
    name="hopper-dequant",
    checked_runner=run_hopper,
    make_fast_runner=fast_hopper_runner,
    why_unavailable=why_hopper_unavailable,
    caps=triton_fp4.caps(min_m=MIN_M),
    preference=290,
    family="native",  # Triton kernels: unproven code runs in the sandbox
    description="decode a and b to bfloat16 workspaces, persistent TMA GEMM with alpha in it",
)

BACKENDS = (HOPPER_DEQUANT, TORCH_DEQUANT)
