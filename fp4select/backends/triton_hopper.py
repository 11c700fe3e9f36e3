"""``hopper-*``: NVFP4 kernels for GPUs without FP4 tensor cores that decode whole words.

Three candidates, each for its own range of M, all on the layout ``mm_fp4`` receives (a: 128x4
or 8x4 scales; b: the ``.T`` view of a row-major ``(N, K/2)`` weight with 128x4 scales):

* ``hopper-gemv`` (M <= 8): CUDA cores. Each block of 16 values is one exact integer dot
  product (byte-permute table decode, ``dp4a``), scaled once by both block scales.
* ``hopper-mma`` (M <= 128): tensor cores with the operands swapped (weight rows fill the
  MMA's large side, tokens its small side), both decoded in registers from packed words, with
  split-K where N alone leaves SMs idle.
* ``hopper-prefill`` (any M, built for M >= 128): a is decoded once per call into a float16
  workspace in the kernel's K order; the weight is decoded inside the main loop, so no
  decoded copy of the weight ever exists in memory.

Design rules:

* NVFP4 only: MXFP4 scales (2**-127 .. 2**127) do not fit float16, and its int8 path would
  need a different scale decode. ``rejects`` says so and the ``triton-*`` kernels and
  ``torch-dequant`` serve MXFP4.
* Exactness as in ``_hopper_kernels``: only the float32 summation order differs from the
  reference.
* Word views need 8-byte aligned rows: a call whose a or weight cannot be viewed as 64-bit
  (32-bit for the MMA kernels) words, which a sliced tensor may not, is handed to the
  byte-wise ``triton-m64`` kernel instead of failing.
* Importing this module never imports triton; the kernels load on first use.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import torch

from fp4select import settings as settings_mod
from fp4select.backends import triton_fp4
from fp4select.backends.base import Backend, Capabilities, Runner
from fp4select.backends.flashinfer_tactics import untuned_by_setting
from fp4select.keys import ALPHA_KINDS, OUT_DTYPES, Problem

FAMILY = "native"
ASM = True  # False runs every decode through its pure-Triton twin (the CPU tests set it)

_kernels: Any = None


def kernels() -> Any:
    global _kernels
    if _kernels is None:
        from fp4select.backends import _hopper_kernels

        _kernels = _hopper_kernels
    return _kernels


def why_unavailable(env: Mapping[str, Any]) -> str | None:
    return triton_fp4.why_unavailable(env)


_SHIFTS = 128  # the longest step, in words, that a kernel reads a shift table for


def _check_step(words: int) -> None:
    """A step must cover whole scale words (8 data words) and fit the shift table."""
    if words % 8 or not 8 <= words <= _SHIFTS:
        raise ValueError(f"words_per_step must be a multiple of 8 in 8..{_SHIFTS}, got {words}")


@dataclass(frozen=True)
class GemvConfig:
    rows_per_program: int
    blocks_per_step: int
    num_warps: int


@dataclass(frozen=True)
class MmaConfig:
    block_n: int
    block_t: int
    words_per_step: int
    num_warps: int
    num_stages: int
    split: int = 0  # K split across programs; 0: choose from the SM count
    group: int = 8  # weight tiles visited together, sharing activation tiles in L2

    def __post_init__(self) -> None:
        _check_step(self.words_per_step)


# Chosen per M from benchmarks/hopper_sweep.py on the H200 (results/hopper_sweep.json): the
# fastest configuration at N x K = 8192 x 8192, 28672 x 4096 and 4096 x 14336, or within 3%.
GEMV_BY_M = ((1, GemvConfig(8, 128, 2)), (8, GemvConfig(8, 64, 1)))
MMA_BY_M = (
    (16, MmaConfig(128, 16, 16, 4, 3)),
    (32, MmaConfig(64, 32, 16, 4, 3)),
    (64, MmaConfig(64, 64, 16, 4, 3)),
    (None, MmaConfig(128, 128, 16, 8, 3)),
)
PREFILL = MmaConfig(128, 128, 16, 8, 4, split=1)


def _for_m(table: tuple[tuple[int | None, Any], ...], m: int) -> Any:
    for limit, cfg in table:
        if limit is None or m <= limit:
            return cfg
    return table[-1][1]


def _words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The (rows, K/2) byte matrix ``t`` viewed as words of ``dtype``, or None if misaligned."""
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    try:
        return t.view(dtype)
    except RuntimeError:
        return None


def _scale_words(scales: torch.Tensor) -> torch.Tensor | None:
    """The swizzled scale bytes' storage viewed as int32 words, or None if it cannot be.

    The kernels index the 128x4 layout from the data pointer, so only the storage matters:
    ``scales`` may be the row-major tensor or its ``.T``.
    """
    raw = scales.view(torch.uint8)
    if not raw.is_contiguous():
        raw = raw.T
    if not raw.is_contiguous() or raw.numel() % 4 or raw.data_ptr() % 4:
        return None
    return raw.reshape(-1).view(torch.int32)


_shift_tables: dict[tuple[str, int | None], torch.Tensor] = {}


def _shift_table(device: torch.device) -> torch.Tensor | None:
    """int32 ``8 * ((i // 2) % 4)``: the byte of a scale word that word i of a step needs."""
    key = (device.type, device.index)
    table = _shift_tables.get(key)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # never copy to the device inside a graph capture
        steps = torch.arange(_SHIFTS, dtype=torch.int32)
        table = _shift_tables[key] = (8 * ((steps // 2) % 4)).to(device)
    return table


def _fallback(args: tuple[Any, ...]) -> torch.Tensor:
    return triton_fp4._run(*args, cfg=triton_fp4._BY_NAME["triton-m64"])


def _checked_words(
    args: tuple[Any, ...], name: str, dtype: torch.dtype
) -> tuple[triton_fp4.Checked, torch.Tensor | None, torch.Tensor | None]:
    """The call's arguments checked, and a and the weight viewed as words (None: misaligned)."""
    a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, a8x4, use_nvfp4, _ = args
    c = triton_fp4.check_call(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, a8x4, use_nvfp4
    )
    if not use_nvfp4:
        raise ValueError(f"{name} takes NVFP4 only (use_nvfp4=True)")
    return c, _words(a, dtype), _words(b.T, dtype)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def run_gemv(*args: Any, cfg: GemvConfig | None = None) -> torch.Tensor:
    """``hopper-gemv``: mm_fp4's positional order (without backend)."""
    c, a64, w64 = _checked_words(args, "hopper-gemv", torch.int64)
    b_descale, a8x4 = args[3], args[8]
    if c.m > 8:
        raise ValueError(f"hopper-gemv takes M <= 8, got M={c.m}")
    if c.m == 0 or c.n == 0:
        return c.out
    if a64 is None or w64 is None:
        return _fallback(args)
    cfg = cfg or _for_m(GEMV_BY_M, c.m)
    k = kernels()
    k.gemv_dp4a[(k.cdiv(c.n, cfg.rows_per_program),)](
        a64,
        w64,
        c.a_descale,
        b_descale,
        c.alpha_ptr,
        c.out,
        c.m,
        c.n,
        c.kh // 8,
        a64.stride(0),
        w64.stride(0),
        c.out.stride(0),
        c.out.stride(1),
        c.cp,
        c.alpha_value,
        A_8X4=a8x4,
        ALPHA=c.alpha_kind,
        BM=_next_pow2(c.m),
        R=cfg.rows_per_program,
        BK=cfg.blocks_per_step,
        ASM=ASM,
        num_warps=cfg.num_warps,
    )
    return c.out


def _mma_split(m: int, n: int, kw: int, cfg: MmaConfig, sms: int) -> int:
    if cfg.split:
        return cfg.split
    # About two programs per SM: each program runs a long serial K loop with 4-8 warps, so
    # fewer leave the SMs waiting on memory (measured: 63 -> 47 us at N = K = 8192, M = 16).
    tiles = math.ceil(n / cfg.block_n) * math.ceil(m / cfg.block_t)
    steps = math.ceil(kw / cfg.words_per_step)
    split = max(1, min(16, steps, round(2 * sms / max(tiles, 1))))
    per = math.ceil(steps / split)
    return math.ceil(steps / per)


def _run_planes(args: tuple[Any, ...], name: str, cfg: MmaConfig) -> torch.Tensor:
    """a decoded once into float16 planes, then the weight decoded in the tensor-core loop."""
    c, a32, w32 = _checked_words(args, name, torch.int32)
    b_descale, a8x4 = args[3], args[8]
    if c.m == 0 or c.n == 0:
        return c.out
    sw32 = _scale_words(b_descale)
    shifts = _shift_table(c.out.device)
    if a32 is None or w32 is None or sw32 is None or shifts is None:
        return _fallback(args)
    k = kernels()
    kw = c.kh // 4
    bkw = cfg.words_per_step
    sms = triton_fp4._sms(c.out.device) if c.out.device.type == "cuda" else 1
    split = _mma_split(c.m, c.n, kw, cfg, sms)
    ws = c.out
    if split > 1:
        got = triton_fp4._workspace(c.out.device, c.n, split, max(c.m, 128))
        if got is None:
            split = 1
        else:
            ws = got
    per_split = k.cdiv(k.cdiv(kw, bkw), split)
    steps = per_split * split  # what the programs read, past K included (zeros)
    mp = k.cdiv(c.m, cfg.block_t) * cfg.block_t
    # Per call, from the caching allocator (a graph capture takes it from the graph's pool).
    x = torch.empty((steps * bkw * 8, mp), dtype=torch.float16, device=c.out.device)
    k.decode_planes[(k.cdiv(mp, 32), steps)](
        a32,
        c.a_descale,
        x,
        c.m,
        mp,
        kw,
        a32.stride(0),
        c.cp,
        A_8X4=a8x4,
        BR=32,
        BKW=bkw,
        ASM=ASM,
        num_warps=4,
    )
    grid = (k.cdiv(c.n, cfg.block_n) * k.cdiv(c.m, cfg.block_t), split)
    k.mma_planes[grid](
        x,
        w32,
        sw32,
        shifts,
        c.alpha_ptr,
        c.out,
        ws,
        c.m,
        c.n,
        kw,
        mp,
        w32.stride(0),
        c.out.stride(0),
        c.out.stride(1),
        c.cp,
        per_split,
        c.alpha_value,
        ALPHA=c.alpha_kind,
        PARTIALS=split > 1,
        BN=cfg.block_n,
        BT=cfg.block_t,
        BKW=bkw,
        GROUP=cfg.group,
        ASM=ASM,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        triton_fp4.kernels().reduce_split[(k.cdiv(c.m, 16), k.cdiv(c.n, 128))](
            ws,
            c.alpha_ptr,
            c.out,
            c.m,
            c.n,
            c.out.stride(0),
            c.out.stride(1),
            c.alpha_value,
            split,
            ALPHA=c.alpha_kind,
            BM=16,
            BN=128,
            num_warps=4,
        )
    return c.out


def run_mma(*args: Any, cfg: MmaConfig | None = None) -> torch.Tensor:
    """``hopper-mma``: mm_fp4's positional order (without backend)."""
    return _run_planes(args, "hopper-mma", cfg or _for_m(MMA_BY_M, _rows(args)))


def run_prefill(*args: Any, cfg: MmaConfig | None = None) -> torch.Tensor:
    """``hopper-prefill``: mm_fp4's positional order (without backend)."""
    return _run_planes(args, "hopper-prefill", cfg or PREFILL)


def _rows(args: tuple[Any, ...]) -> int:
    a = args[0]
    return int(a.shape[0]) if isinstance(a, torch.Tensor) and a.dim() == 2 else 0


# -- tactics: the configuration each shape runs at, chosen when the backend is probed --------
#
# The tables above hold one configuration per range of M, chosen at three shapes; the best one
# differs by shape (the H200 sweeps: up to a fifth). Like flashinfer's autotuner, the probe times
# a few candidates at the bucket's top M and the winner is stored with the decision as data:
# ``{"tactic": [ints], "default": [ints]}``. ``pin`` accepts only a configuration from the
# candidate lists below, so a record read from disk can choose among known kernels, never
# name a new one.

OP = "hopper"
GEMV_TACTICS = (
    GemvConfig(8, 128, 2),
    GemvConfig(4, 128, 2),
    GemvConfig(4, 256, 4),
    GemvConfig(8, 64, 1),
)
MMA_TACTICS: tuple[tuple[int, tuple[MmaConfig, ...]], ...] = (
    (
        16,
        (MmaConfig(128, 16, 16, 4, 3), MmaConfig(64, 16, 32, 4, 3), MmaConfig(64, 16, 16, 4, 3, 4)),
    ),
    (32, (MmaConfig(64, 32, 16, 4, 3), MmaConfig(128, 32, 16, 8, 3))),
    (64, (MmaConfig(64, 64, 16, 4, 3), MmaConfig(128, 64, 16, 8, 3))),
    (
        128,
        (MmaConfig(128, 128, 16, 8, 3), MmaConfig(128, 64, 16, 8, 3), MmaConfig(64, 64, 16, 4, 3)),
    ),
)
_TUNE_BUDGET_S = 0.05  # per candidate, after its first (compiling) call


def _candidates(run: Callable[..., Any], m: int) -> tuple[Any, ...]:
    if run is run_gemv:
        return GEMV_TACTICS
    if run is run_mma:
        for limit, cfgs in MMA_TACTICS:
            if m <= limit:
                return cfgs
        return MMA_TACTICS[-1][1]
    return ()


def _default(run: Callable[..., Any], m: int) -> Any:
    return _for_m(GEMV_BY_M, m) if run is run_gemv else _for_m(MMA_BY_M, m)


def _time_us(calls: Sequence[Callable[[], Any]], device: torch.device, budget_s: float) -> float:
    """Median of a few CUDA-event samples, each call taking the next input set in turn."""
    calls[0]()  # compile, and the first launch's cost, out of the samples
    torch.cuda.synchronize(device)
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))  # ms per round -> us per call
    return statistics.median(samples)


def _input_copies(args: Sequence[Any], device: torch.device) -> list[tuple[Any, ...]]:
    """``args`` and copies of its weight, enough that the weight is read from HBM, not L2."""
    b = args[1]
    per_set = b.numel() * b.element_size()
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    copies = max(0, min(3, math.ceil(2 * l2 / max(per_set, 1)) - 1))
    sets = [tuple(args)]
    for _ in range(copies):
        sets.append((args[0], b.clone(), args[2], args[3].clone(), *args[4:]))
    return sets


def tune(
    runner: Callable[..., Any],
    problem: Any,
    args: Sequence[Any],
    *,
    name: str | None = None,
    progress: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Time each candidate configuration at these arguments; the record of the fastest.

    ``FP4SELECT_TACTICS=default`` (or ``default:NAME``) and batch-invariant problems keep the
    table's configuration; so does a CPU tensor (the interpreter's tests). Candidates left past
    ``FP4SELECT_TUNE_TIMEOUT_S`` are not timed.
    """
    a = args[0]
    m = int(a.shape[0])
    run = getattr(runner, "func", runner)
    default = _default(run, m)
    record: dict[str, Any] = {
        "op": OP,
        "tactic": list(astuple(default)),
        "default": list(astuple(default)),
    }
    try:
        settings = settings_mod.current()
    except ValueError as exc:
        return record | {"reason": f"{exc}; not tuned"}
    if untuned_by_setting(settings.tactics, name):
        return record | {"reason": f"FP4SELECT_TACTICS={settings.tactics}"}
    if getattr(problem, "batch_invariant", False):
        return record | {"reason": "batch-invariant problems keep the table's configuration"}
    if a.device.type != "cuda" or not _candidates(run, m):
        return record | {"reason": "tuned on CUDA only"}
    sets = _input_copies(args, a.device)
    started = time.perf_counter()
    timed: dict[str, float] = {}
    best, best_us = default, math.inf
    for cfg in _candidates(run, m):
        if time.perf_counter() - started > settings.tune_timeout_s:
            record["reason"] = (
                f"stopped after {settings.tune_timeout_s:g} s (FP4SELECT_TUNE_TIMEOUT_S)"
            )
            break
        if progress is not None:
            progress()
        calls = [functools.partial(run, *s, cfg=cfg) for s in sets]
        us = _time_us(calls, a.device, _TUNE_BUDGET_S)
        timed[" ".join(map(str, astuple(cfg)))] = round(us, 2)
        if us < best_us:
            best, best_us = cfg, us
    return record | {"tactic": list(astuple(best)), "timed_us": timed}


def pin(runner: Callable[..., Any], record: Mapping[str, Any]) -> Callable[..., Any]:
    """``runner`` at the record's configuration, if it is one of the candidates; else as is."""
    run = getattr(runner, "func", runner)
    wanted = record.get("tactic") if isinstance(record, Mapping) else None
    if not isinstance(wanted, list) or not all(type(v) is int for v in wanted):
        return runner
    known = GEMV_TACTICS if run is run_gemv else tuple(c for _, cs in MMA_TACTICS for c in cs)
    for cfg in known:
        if list(astuple(cfg)) == wanted:
            return functools.partial(run, cfg=cfg)
    return runner


def _caps(max_m: int | None) -> Capabilities:
    return Capabilities(
        formats=frozenset({"nvfp4"}),
        a_sf_layouts=frozenset({"128x4", "8x4"}),
        b_layouts=frozenset({"plain"}),
        out_dtypes=frozenset(OUT_DTYPES),
        alpha_kinds=frozenset(ALPHA_KINDS),
        max_m=max_m,
        devices=frozenset({"cuda"}),
    )


def make_runner_gemv(problem: Problem) -> Runner:
    return run_gemv


def make_runner_mma(problem: Problem) -> Runner:
    return run_mma


def make_runner_prefill(problem: Problem) -> Runner:
    return run_prefill


BACKENDS: tuple[Backend, ...] = (
    Backend(
        name="hopper-gemv",
        make_checked_runner=make_runner_gemv,
        why_unavailable=why_unavailable,
        caps=_caps(8),
        preference=180,
        family=FAMILY,
        description="NVFP4 GEMV for M <= 8: table decode of whole words, exact dp4a dot products",
        tune=tune,
        pin=pin,
    ),
    Backend(
        name="hopper-mma",
        make_checked_runner=make_runner_mma,
        why_unavailable=why_unavailable,
        caps=_caps(128),
        preference=185,
        family=FAMILY,
        description="NVFP4 tensor-core GEMM for M <= 128, operands swapped, split-K",
        tune=tune,
        pin=pin,
    ),
    Backend(
        name="hopper-prefill",
        make_checked_runner=make_runner_prefill,
        why_unavailable=why_unavailable,
        caps=_caps(None),
        preference=188,
        family=FAMILY,
        description="NVFP4 GEMM for large M: a decoded once, the weight decoded in the main loop",
    ),
)
