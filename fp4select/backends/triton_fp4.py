"""``triton``: a fused FP4 GEMM in Triton for GPUs without FP4 tensor cores (Hopper, Ada, Ampere).

Design rules:

* Nothing dequantized touches memory. Each program loads packed E2M1 bytes of a and b and
  their block-scale bytes straight from the layouts ``mm_fp4`` takes (a: 128x4 or 8x4; b: the
  ``.T`` view of a row-major ``(N, K/2)`` weight, scales 128x4), decodes them in registers, and
  multiplies on the tensor cores with float32 accumulation. alpha (none, a scalar, a one-element
  tensor or one value per row of a) is applied in the epilogue.
* Exact operands, so only the summation order differs from the reference. NVFP4 is decoded to
  float16 as ``e2m1 * 2**-14`` straight from the nibble's bits (``(c&7)<<9 | (c&8)<<12``) times
  the e4m3 scale (decoded from its bits, exact in float16). Every product e2m1 * e4m3 is a
  multiple of 2**-10 below 2688, so ``* 2**-14`` is a multiple of float16's smallest subnormal:
  exact. The epilogue multiplies the float32 sum by 2**28. MXFP4 scales (2**-127 .. 2**127) do
  not fit float16: its operands are built in float32 and rounded to bfloat16, exact while the
  product stays inside bfloat16's normal range (scale bytes about 8..246).
* K is split into nibbles: within a tile, the dot runs once over the low nibbles and once over
  the high ones (any permutation of K that a and b share leaves the sum unchanged), so no
  interleaving shuffle is needed. Both nibbles of a byte share one block scale.
* Each tile configuration is its own registered candidate (``triton-gemv``, ``triton-m16``,
  ``triton-m64``, ``triton-m128``): the selector picks one per M bucket by measurement, with
  no tactic machinery. ``triton-gemv`` (M <= 4) skips the tensor cores. ``triton-m16`` splits
  K across programs so that a decode GEMM fills every SM; a second small kernel reduces the
  float32 partial sums in a fixed order (deterministic) and finishes with alpha.
* The warm path and CUDA graph capture: a call allocates nothing but the output. The split-K
  workspace is allocated once per (device, N, split) for the largest M declared, outside
  capture; a call that would need one during capture runs without split instead. It is per
  device, not per stream (engines run one GEMM stream per device).
* Importing this module never imports triton; ``why_unavailable`` says why it cannot run (no
  CUDA, no triton, compute capability under 8.0 for bf16/fp16 dots).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fp4select import formats
from fp4select.backends.base import ALL_FORMATS, Backend, Capabilities, Runner, cuda_from
from fp4select.keys import ALPHA_KINDS, OUT_DTYPES, Problem

FAMILY = "native"
MIN_CC = 80


@dataclass(frozen=True)
class TileConfig:
    """One compiled variant: tile sizes in output elements (BM, BN) and packed bytes of K (BKH)."""

    name: str
    block_m: int
    block_n: int
    block_kh: int  # bytes of packed K per step: 2 * block_kh elements
    num_warps: int
    num_stages: int
    split_k: bool
    max_m: int | None
    preference: int
    description: str
    kind: str = "mma"  # "mma": tensor-core tiles; "gemv": CUDA-core dot products for tiny M


CONFIGS: tuple[TileConfig, ...] = (
    TileConfig(
        "triton-gemv",
        4,
        16,
        256,
        4,
        3,
        True,
        4,
        190,
        "CUDA-core GEMV for M <= 4, 16 columns x 512 K per step, split-K",
        "gemv",
    ),
    TileConfig(
        "triton-m16", 16, 64, 128, 4, 4, True, 64, 200, "decode tile 16x64, split-K to fill SMs"
    ),
    TileConfig("triton-m64", 64, 128, 64, 4, 3, False, None, 210, "tile 64x128"),
    TileConfig("triton-m128", 128, 128, 64, 8, 3, False, None, 220, "tile 128x128, 8 warps"),
)
_MAX_SPLIT = 16
_SPLIT_TARGET_WAVES = 2  # aim for this many programs per SM when splitting K

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_kernels: Any = None  # the jitted kernels, built on first use (importing triton is slow)
_workspaces: dict[tuple[Any, ...], torch.Tensor] = {}
_sm_count: dict[int, int] = {}
_split_cache: dict[tuple[int, ...], int] = {}


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def why_unavailable(env: Mapping[str, Any]) -> str | None:
    """Why the Triton kernels cannot run here, or None."""
    if env.get("device") != "cuda":
        return "needs a CUDA GPU (the CPU runs it only under TRITON_INTERPRET=1, for tests)"
    if not triton_installed():
        return "triton is not installed"
    cc = env.get("cc")
    if cc is not None and cc < MIN_CC:
        return f"needs compute capability >= {MIN_CC / 10:.1f} for bf16/fp16 tensor-core dots, got {cc / 10:.1f}"
    return None


def kernels() -> Any:
    global _kernels
    if _kernels is None:
        from fp4select.backends import _triton_kernels

        _kernels = _triton_kernels
    return _kernels


def _sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _sm_count.get(index)
    if count is None:
        count = _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def choose_split(m: int, n: int, kh: int, cfg: TileConfig, sms: int) -> int:
    """Programs along K: enough for about two waves of the SMs, never more than K steps."""
    key = (m, n, kh, cfg.block_m, cfg.block_n, cfg.block_kh, sms)
    split = _split_cache.get(key)
    if split is None:
        tiles = math.ceil(n / cfg.block_n)
        if cfg.kind == "mma":
            tiles *= math.ceil(m / cfg.block_m)
        steps = math.ceil(kh / cfg.block_kh)
        split = max(1, min(_MAX_SPLIT, steps, (_SPLIT_TARGET_WAVES * sms) // max(tiles, 1)))
        # Even work per split: as many splits as divide the steps into equal-or-one-less parts.
        per = math.ceil(steps / split)
        split = math.ceil(steps / per)
        _split_cache[key] = split
    return split


def _workspace(device: torch.device, n: int, split: int, max_m: int) -> torch.Tensor | None:
    key = (device.type, device.index, n, split, max_m)
    ws = _workspaces.get(key)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # never allocate a long-lived buffer inside a graph capture
        ws = _workspaces[key] = torch.empty(split * max_m * n, dtype=torch.float32, device=device)
    return ws


def _counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """Zeroed int32 counts, one per output tile, that a kernel summing its own K split puts
    back to zero (see ``_hopper_kernels._sum_if_last``); None inside a graph capture if none
    was made before. One buffer per tile count, never replaced: a captured graph keeps its
    address."""
    key = ("counts", device.type, device.index, tiles)
    counts = _workspaces.get(key)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _workspaces[key] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return counts


def clear_workspaces() -> None:
    """Drop the split-K workspaces (tests; or to give memory back)."""
    _workspaces.clear()


@dataclass
class Checked:
    """The arguments of one call, checked and resolved for a kernel launch."""

    m: int
    n: int
    kh: int  # bytes of packed K
    cp: int  # scale columns, padded to a multiple of 4
    a_descale: torch.Tensor  # without spare row tiles
    out: torch.Tensor
    alpha_kind: int  # 0 none, 1 a Python number, 2 one element, 3 one per row of a
    alpha_value: float
    alpha_ptr: torch.Tensor


def check_call(
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
) -> Checked:
    """mm_fp4's arguments as the Triton kernels read them, or a ValueError naming the one off."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    m, kh = a.shape
    n = b.shape[1]
    if b.shape[0] != kh:
        raise ValueError(f"b must be (K/2, N) with K/2 = a.shape[1] = {kh}, got {tuple(b.shape)}")
    formats.check_block_size(block_size, use_nvfp4)
    if (2 * kh) % block_size:
        raise ValueError(f"K={2 * kh} must be a multiple of block_size={block_size}")
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise ValueError(
            "a must be row-major (M, K/2) and b the .T view of a row-major (N, K/2) weight, "
            f"got strides {a.stride()} and {b.stride()}"
        )
    layout = "8x4" if use_8x4_sf_layout else "128x4"
    mp, cp = formats.padded_sf_shape(m, 2 * kh // block_size, layout)
    np_ = formats.padded_sf_shape(n, 1, "128x4")[0]
    a_descale = formats.without_spare_row_tiles(a_descale, m, 2 * kh // block_size, layout)
    if a_descale.numel() != mp * cp or not a_descale.is_contiguous():
        raise ValueError(
            f"a_descale must be a contiguous ({mp}, {cp}) scale buffer, got shape "
            f"{tuple(a_descale.shape)} strides {a_descale.stride()}"
        )
    if b_descale.numel() != np_ * cp or not (b_descale.dim() == 1 or b_descale.T.is_contiguous()):
        raise ValueError(
            f"b_descale must be the .T view of a contiguous ({np_}, {cp}) scale tensor, got "
            f"shape {tuple(b_descale.shape)} strides {b_descale.stride()}"
        )
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    else:
        formats.check_out(out, m, n, out_dtype)
    alpha_value = 1.0
    alpha_ptr = out
    if alpha is None:
        alpha_kind = 0
    elif isinstance(alpha, (int, float)):
        alpha_kind, alpha_value = 1, float(alpha)
    else:
        alpha_ptr = alpha
        if alpha.numel() == 1:
            alpha_kind = 2
        elif alpha.numel() == m:
            alpha_kind = 3
        else:
            raise ValueError(f"alpha must have 1 or M={m} elements, got shape {tuple(alpha.shape)}")
    return Checked(m, n, kh, cp, a_descale, out, alpha_kind, alpha_value, alpha_ptr)


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
    *,
    cfg: TileConfig,
    split: int | None = None,
) -> torch.Tensor:
    """mm_fp4's positional order (without backend); enable_pdl means nothing here."""
    c = check_call(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout, use_nvfp4
    )
    m, n, kh, cp, a_descale, out = c.m, c.n, c.kh, c.cp, c.a_descale, c.out
    alpha_kind, alpha_value, alpha_ptr = c.alpha_kind, c.alpha_value, c.alpha_ptr
    if m == 0 or n == 0:
        return out
    if a.dtype != torch.uint8:
        a = a.view(torch.uint8)
    if b.dtype != torch.uint8:
        b = b.view(torch.uint8)
    k = kernels()
    if split is None:
        split = 1
        if cfg.split_k and a.device.type == "cuda":
            split = choose_split(m, n, kh, cfg, _sms(a.device))
    ws = out
    if split > 1:
        limit = cfg.max_m or m
        got = _workspace(a.device, n, split, limit) if m <= limit else None
        if got is None:
            split = 1
        else:
            ws = got
    steps = k.cdiv(kh, cfg.block_kh)
    # fp4_mm and fp4_gemv take the same arguments but for their own tile parameters.
    pointers = (a, b, a_descale, b_descale, alpha_ptr, out, ws)
    sizes = (m, n, kh, a.stride(0), b.stride(1), out.stride(0), out.stride(1), cp)
    common = (*pointers, *sizes, k.cdiv(steps, split), alpha_value)
    meta = {"NVFP4": use_nvfp4, "A_8X4": use_8x4_sf_layout, "ALPHA": alpha_kind}
    meta.update(PARTIALS=split > 1, BN=cfg.block_n, BKH=cfg.block_kh)
    meta.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.kind == "gemv":
        if m > cfg.block_m:
            raise ValueError(f"{cfg.name} takes M <= {cfg.block_m}, got M={m}")
        bm = 1 << (m - 1).bit_length()  # the rows of a, unrolled: the next power of two
        k.fp4_gemv[(k.cdiv(n, cfg.block_n), split)](*common, BM=bm, **meta)
    else:
        grid = (k.cdiv(m, cfg.block_m) * k.cdiv(n, cfg.block_n), split)
        k.fp4_mm[grid](*common, BM=cfg.block_m, GROUP_M=8, INTERPRETED=_INTERPRETED, **meta)
    if split > 1:
        k.reduce_split[(k.cdiv(m, 16), k.cdiv(n, 128))](
            ws, alpha_ptr, out, m, n, out.stride(0), out.stride(1), alpha_value, split,
            ALPHA=alpha_kind, BM=16, BN=128, num_warps=4,
        )  # fmt: skip
    return out


_BY_NAME = {cfg.name: cfg for cfg in CONFIGS}


def make_runner(problem: Problem, name: str) -> Runner:
    return functools.partial(_run, cfg=_BY_NAME[name])


def make_runner_gemv(problem: Problem) -> Runner:
    return make_runner(problem, "triton-gemv")


def make_runner_m16(problem: Problem) -> Runner:
    return make_runner(problem, "triton-m16")


def make_runner_m64(problem: Problem) -> Runner:
    return make_runner(problem, "triton-m64")


def make_runner_m128(problem: Problem) -> Runner:
    return make_runner(problem, "triton-m128")


_MAKERS = {
    "triton-gemv": make_runner_gemv,
    "triton-m16": make_runner_m16,
    "triton-m64": make_runner_m64,
    "triton-m128": make_runner_m128,
}


SUPERSEDED_FROM_CC = 90


def declines(problem: Problem, env: Mapping[str, Any]) -> str | None:
    """NVFP4 from SM90 is left to the ``hopper-*`` kernels: these kernels were never the
    fastest at any shape or M measured (docs/hopper_kernels.md). MXFP4, which the
    ``hopper-*`` tensor-core kernels decline, stays theirs."""
    if problem.use_nvfp4 and cuda_from(env, SUPERSEDED_FROM_CC):
        return "NVFP4 from SM90 is left to the hopper-* kernels, which won every point measured"
    return None


def caps(max_m: int | None = None, min_m: int | None = None) -> Capabilities:
    """What ``check_call`` accepts, declared: the capabilities of every backend that reads its
    call through it (these and ``dequant``'s), bounded in M by ``max_m`` and ``min_m``."""
    return Capabilities(
        formats=ALL_FORMATS,
        a_sf_layouts=frozenset({"128x4", "8x4"}),
        b_layouts=frozenset({"plain"}),
        out_dtypes=frozenset(OUT_DTYPES),
        alpha_kinds=frozenset(ALPHA_KINDS),
        max_m=max_m,
        min_m=min_m,
        devices=frozenset({"cuda"}),
    )


BACKENDS: tuple[Backend, ...] = tuple(
    Backend(
        name=cfg.name,
        make_checked_runner=_MAKERS[cfg.name],
        why_unavailable=why_unavailable,
        caps=caps(cfg.max_m),
        preference=cfg.preference,
        family=FAMILY,
        description=f"Triton fused FP4 GEMM, {cfg.description}",
        declines=declines,
    )
    for cfg in CONFIGS
)
