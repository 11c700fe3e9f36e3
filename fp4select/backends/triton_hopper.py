"""``hopper-*``: NVFP4 kernels for GPUs without FP4 tensor cores that decode whole words.

Why one file of ~720 lines: each path's plan (what a call launches: its checks, split, grid
and kernels; ``hopper_launch``) sits beside the path's registration, because a module of
plans between ``triton_fp4`` and the registry would put every importer of the backends a
level deeper than issue 17's bound of ten allows; the call's views and the splits' arithmetic
are modules of their own (``hopper_args``, ``hopper_configs``).

Three candidates, each for its own range of M, all on the layout ``mm_fp4`` receives (a: 128x4
or 8x4 scales; b: the ``.T`` view of a row-major ``(N, K/2)`` weight with 128x4 scales):

* ``hopper-gemv`` (M <= 8; from SM90 buckets to M = 4): CUDA cores. Each block of 16 values
  is one exact integer dot product (byte-permute table decode, ``dp4a``), scaled once by both
  block scales (``GemvConfig``: the tactics' forms; from M = 3 a is decoded first, once a
  call). ``hopper-mma`` won every point at M = 5..8, so from SM90 no time is spent on it there.
* ``hopper-mma`` (M <= 256): tensor cores with the operands swapped (weight rows fill the
  MMA's large side, tokens its small side), the weight decoded in registers from packed words,
  with split-K where N alone leaves SMs idle. a is decoded once per call into a float16
  workspace in the kernel's K order and the weight inside the main loop, so no decoded copy
  of the weight exists in memory.
* ``hopper-ws`` (SM90 only, buckets M = 33-2048): the same product warp-specialized in Gluon
  (``_hopper_ws``): two consumer warpgroups decode and multiply in turn, fed by TMA, with
  split-K (``hopper_configs.ws_split``) where its tiles alone leave SMs idle; or, with
  ``WsConfig.split = -1`` (an experiment in no tactic table), its last wave of tiles cut into
  equal runs of K steps (``_hopper_ws_stream``, ``hopper_configs.stream_plan``).
* The configuration of each is a tactic (``hopper_tactics``), timed per shape when probed.

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
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import torch
from packaging.version import InvalidVersion, Version

from fp4select.backends import (
    hopper_args,
    hopper_configs,
    hopper_launch,
    hopper_tactics,
    triton_fp4,
)
from fp4select.backends.base import Backend, Capabilities, cuda_from
from fp4select.backends.hopper_configs import (
    GEMV_BY_M,
    MMA_BY_M,
    GemvConfig,
    MmaConfig,
    WsConfig,
    for_m,
)
from fp4select.backends.hopper_launch import Launch, Plan
from fp4select.keys import ALPHA_KINDS, OUT_DTYPES, Problem

FAMILY = "native"
# hopper-ws takes the buckets from M = 33 to 2048 (those ending below WS_MIN_M or starting
# above WS_MAX_M are declined): it won points at M = 64-2048; above, hopper-dequant was as fast
# or faster, so hopper-ws is not worth its tuning time when deploying there (measured:
# docs/hopper_kernels.md, 'What held `hopper-ws` at M = 256-512').
WS_MIN_M = 64
WS_MAX_M = 2048
# Gluon's warp_specialize takes (function, args) pairs from Triton 3.6; 3.5's takes them apart,
# and the kernel does not compile there. .ci/run's triton step compiles it from 3.6 on.
WS_MIN_TRITON = "3.6"
ASM = True  # False runs every decode through its pure-Triton twin (the CPU tests set it)

_kernels: Any = None
_ws_kernels: Any = None


def kernels() -> Any:
    global _kernels
    if _kernels is None:
        from fp4select.backends import _hopper_kernels

        _kernels = _hopper_kernels
    return _kernels


def why_unavailable(env: Mapping[str, Any]) -> str | None:
    return triton_fp4.why_unavailable(env)


def ws_kernels() -> Any:
    global _ws_kernels
    if _ws_kernels is None:
        from fp4select.backends import _hopper_ws

        _ws_kernels = _hopper_ws
    return _ws_kernels


def ws_why_unavailable(env: Mapping[str, Any]) -> str | None:
    why = why_unavailable(env)
    if why is not None:
        return why
    if env.get("cc") != 90:
        return f"needs SM90 (wgmma through Gluon's Hopper API), got SM{env.get('cc')}"
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if _older_than(env.get("triton"), WS_MIN_TRITON):
        return (
            f"needs Triton >= {WS_MIN_TRITON} (Gluon's warp_specialize as it takes its "
            f"partitions from 3.6), found {env.get('triton')}"
        )
    return None


def _older_than(version: object, minimum: str) -> bool:
    """Whether a version read from the environment is below ``minimum``; an unreadable one is
    not (the sandbox's compile then says what is wrong)."""
    try:
        return Version(str(version)) < Version(minimum)
    except InvalidVersion:
        return False


def ws_declines(problem: Problem, env: Mapping[str, Any]) -> str | None:
    if problem.k % 32:
        return (
            f"K = {problem.k}: TMA reads weight rows of K / 2 bytes, which must be a multiple of 16"
        )
    if problem.m_range[0] > WS_MAX_M:
        return f"above M = {WS_MAX_M} the dequant candidates serve (faster where measured)"
    return None


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
    views = hopper_args.operand_words(args, dtype)
    return (c, None, None) if views is None else (c, views[0], views[1])


# From this compute capability the GPU converts e4m3 itself (``cvt``), and Triton lets a kernel
# ask for it (float8e4nv); below, the GEMV converts its scales in integer arithmetic.
HW_E4M3_FROM_CC = 89
_device_flags: dict[int, tuple[bool, bool]] = {}


def _flags(device: torch.device) -> tuple[bool, bool]:
    """(PDL possible, e4m3 converted by the GPU) for a CUDA device, found once per device: the
    launch path reads them on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    flags = _device_flags.get(index)
    if flags is None:
        major, minor = torch.cuda.get_device_capability(index)
        cc = 10 * major + minor
        pdl = cc >= 90 and triton_fp4.kernels().PDL_SUPPORTED
        flags = _device_flags[index] = (pdl, cc >= HW_E4M3_FROM_CC)
    return flags


def pdl_possible(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch with PDL: a CUDA GPU of SM90+ and a Triton with
    grid dependency control (the activation quantizer asks too)."""
    return device.type == "cuda" and _flags(device)[0]


def _pdl(args: tuple[Any, ...], device: torch.device) -> bool:
    """Launch with programmatic dependent launch: as mm_fp4's ``enable_pdl`` asks, where the
    GPU has it (SM90+) and this Triton can express it. It hides the launch gap between the
    kernels of a call (and before the first), about a microsecond each."""
    return bool(args[10]) and pdl_possible(device)


def _e4m3_in_hardware(device: torch.device) -> bool:
    """The GPU's e4m3 conversion, not integer arithmetic: fewer instructions, no slower in the
    GEMV or the MMA loop (docs/hopper_kernels.md, 'Converting the weight's scales'); NaN is NaN."""
    return ASM and device.type == "cuda" and _flags(device)[1]


def _with_pdl(pdl: bool) -> dict[str, bool]:
    """A launch's PDL arguments: none at all without PDL, because a Triton older than 3.4
    refuses ``launch_pdl`` as an unknown keyword (and ``PDL`` defaults to False)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {}


def launch_path(env: Mapping[str, Any]) -> str:
    """How the ``hopper-*`` kernels launch in ``env``, with PDL or without and why (for doctor:
    grid dependency control is a Triton 3.4+ feature, so the installed Triton matters as well
    as the GPU), and how the kernels convert the weight's scales (``_e4m3_in_hardware``)."""
    why = why_unavailable(env)
    if why:
        return f"not run here: {why}"
    scales = (
        "; the e4m3 scales converted by the GPU's cvt"
        if cuda_from(env, HW_E4M3_FROM_CC)
        else "; the e4m3 scales converted in integer arithmetic (the GPU's cvt: SM89+)"
    )
    if not cuda_from(env, 90):
        return f"without PDL: it needs SM90 or newer (this is SM{env.get('cc')})" + scales
    if not triton_fp4.kernels().PDL_SUPPORTED:
        return "without PDL: this Triton has no grid dependency control (Triton 3.4+ has)" + scales
    return (
        "with PDL where mm_fp4's enable_pdl is True (the default): the GEMV, the a decode and "
        "the split-K reduction always, the tensor-core main loop at M <= 16" + scales
    )


def _tile_rows(
    tiled: torch.Tensor | None, n: int, kw: int, step: int, word: torch.dtype
) -> dict[str, int]:
    """The kernels' ``W_TILE_ROWS`` and ``W_COLS`` for ``tiled``, the (N, ``kw``) weight words
    re-laid by ``hopper_args.tiled_words`` (none for the plain rows): tiles of any number of
    rows, runs of the kernel's step or a power-of-two multiple or fraction of it. Any other
    tensor is refused here, before a kernel could read past it."""
    if tiled is None:
        return {}
    rows, cols = (int(tiled.shape[2]), int(tiled.shape[3])) if tiled.dim() == 4 else (0, 0)
    whole = (-(-n // rows), -(-kw // cols), rows, cols) if rows and cols else None
    if (
        tiled.dtype != word
        or not tiled.is_contiguous()
        or tuple(tiled.shape) != whole
        or cols & (cols - 1)
        or (cols % step and step % cols)
    ):
        raise ValueError(
            f"tiled must be hopper_args.tiled_words(w, rows, cols) of this weight's {word} words "
            f"({n} x {kw}), cols a power of two that divides or is divided by {step}; got "
            f"{tiled.dtype} of shape {tuple(tiled.shape)}"
        )
    return {"W_TILE_ROWS": rows} | ({"W_COLS": cols} if cols != step else {})


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _gemv_plan(
    args: tuple[Any, ...], cfg: GemvConfig | None, tiled: torch.Tensor | None = None
) -> Plan:
    """``tiled``: the weight's words as ``hopper_args.tiled_words(w, rows, cols)`` read in its
    place, an experiment of ``benchmarks/hopper_sweep.py`` (``_tile_rows``)."""
    c, a64, w64 = _checked_words(args, "hopper-gemv", torch.int64)
    if c.m > 8:
        raise ValueError(f"hopper-gemv takes M <= 8, got M={c.m}")
    m, n, kw, cp = c.m, c.n, c.kh // 8, c.cp
    if m == 0 or n == 0:
        return hopper_args.nothing_to_do(m, n)
    if a64 is None or w64 is None:
        return _fallback
    cfg = cfg or for_m(GEMV_BY_M, m)
    pdl = _pdl(args, c.out.device)
    k, a8x4 = kernels(), args[8]
    hw = {"HW_E4M3": True} if _e4m3_in_hardware(c.out.device) else {}
    a_stride, w_stride = a64.stride(0), w64.stride(0)
    words = k.cdiv(kw, 16) * 16  # a decoded once per call, into (M, 3, words) (cfg.pre)
    decode = Launch(
        k.gemv_a_words, (m, k.cdiv(kw, 256)),
        A_8X4=a8x4, BK=256, ASM=ASM, **hw, **_with_pdl(pdl), num_warps=2,
    ) if cfg.pre else None  # fmt: skip
    main = Launch(
        k.gemv_dp4a, (k.cdiv(n, cfg.rows_per_program),),
        A_8X4=a8x4, ALPHA=c.alpha_kind, BM=_next_pow2(m), R=cfg.rows_per_program,
        BK=cfg.blocks_per_step, ASM=ASM, PREFETCH=bool(cfg.prefetch), **_with_pdl(pdl), **hw,
        **({"EVICT_FIRST": True} if cfg.evict_first else {}), **({"PRE": True} if cfg.pre else {}),
        **({"LATE_TRIGGER": True} if cfg.late and pdl else {}),
        **_tile_rows(tiled, n, kw, cfg.blocks_per_step, torch.int64), num_warps=cfg.num_warps,
    )  # fmt: skip

    def run(args: tuple[Any, ...]) -> torch.Tensor:
        direct = main.direct and (decode is None or decode.direct)
        views = hopper_args.operand_words(args, torch.int64, direct=direct)
        if views is None:  # an offset the plan's key does not tell apart
            return _fallback(args)
        (a_words, w_words), x_stride = views, a_stride
        if tiled is not None:
            w_words = tiled
        out, alpha_ptr, alpha_value = hopper_args.per_call(args, m, n)
        if decode is not None:
            x = torch.empty((m, 3, words), dtype=torch.int64, device=out.device)
            decode(a_words, args[2], x, m, kw, a_stride, cp, words)
            a_words, x_stride = x, words
        main(
            a_words, w_words, args[2], args[3], alpha_ptr, out,
            m, n, kw, x_stride, w_stride, out.stride(0), out.stride(1), cp, alpha_value,
        )  # fmt: skip
        return out

    return run


def run_gemv(
    *args: Any, cfg: GemvConfig | None = None, tiled: torch.Tensor | None = None
) -> torch.Tensor:
    """``hopper-gemv``: mm_fp4's positional order (without backend)."""
    return _gemv_plan(args, cfg, tiled)(args)


def fast_gemv(*args: Any, cfg: GemvConfig | None = None) -> torch.Tensor:
    """``run_gemv`` planned once per kind of call (``hopper_launch``): the warm path's."""
    return hopper_launch.planned("gemv", _gemv_plan, args, cfg)


def _a_planes(
    a8x4: bool, steps: int, bkw: int, m: int, mp: int, kh: int, cp: int, pdl: bool, a_stride: int
) -> tuple[Launch, Callable[[tuple[Any, ...], torch.Tensor, torch.device], torch.Tensor]]:
    """a decoded into the float16 workspace the main loops read: (steps * 8 * bkw, mp), K-major,
    zeros past M and K. Per call, from the caching allocator (a graph capture takes it from the
    graph's pool): a function of the call's arguments, beside its launch."""
    k = kernels()
    decode = Launch(
        k.decode_planes, (k.cdiv(mp, 32), steps),
        A_8X4=a8x4, BR=32, BKW=bkw, ASM=ASM, **_with_pdl(pdl), num_warps=4,
    )  # fmt: skip

    def planes(args: tuple[Any, ...], a32: torch.Tensor, device: torch.device) -> torch.Tensor:
        x = torch.empty((steps * bkw * 8, mp), dtype=torch.float16, device=device)
        decode(a32, args[2], x, m, mp, kh // 4, a_stride, cp)
        return x

    return decode, planes


def _planes_call(
    args: tuple[Any, ...],
    launches: tuple[Launch | None, ...],
    planes: Callable[[tuple[Any, ...], torch.Tensor, torch.device], torch.Tensor],
    m: int,
    n: int,
) -> (
    tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor] | None
):
    """What both tensor-core plans read per call: whether every launch is direct, the weight
    and its scales as words (the call's own tensors once direct), out, alpha's tensor and
    number, and a decoded into its planes; None where a view fails."""
    direct = hopper_launch.all_direct(launches)
    views = hopper_args.operand_words(args, torch.int32, with_scales=True, direct=direct)
    if views is None:
        return None
    a32, w32, sw32 = views
    out, alpha_ptr, alpha_value = hopper_args.per_call(args, m, n)
    return direct, w32, sw32, out, alpha_ptr, alpha_value, planes(args, a32, out.device)


def _partials(c: triton_fp4.Checked, split: int) -> torch.Tensor | None:
    """The float32 workspace a K split writes its partial sums to ((split, M, N)), or None:
    no split, or none can be made here (inside a graph capture): the caller runs unsplit."""
    if split <= 1:
        return None
    return triton_fp4._workspace(c.out.device, c.n, split, max(c.m, 128))


def _reduction(c: triton_fp4.Checked, split: int, pdl: bool) -> Launch:
    """out = alpha * the sum of the splits' partial sums, in a fixed order. Called with
    (partial sums, alpha's tensor, out, M, N, out's strides, alpha's number, split)."""
    k = kernels()
    return Launch(
        triton_fp4.kernels().reduce_split, (k.cdiv(c.m, 16), k.cdiv(c.n, 128)),
        ALPHA=c.alpha_kind, BM=16, BN=128, **_with_pdl(pdl), num_warps=4,
    )  # fmt: skip


def _planes_plan(
    args: tuple[Any, ...],
    name: str,
    cfg: MmaConfig,
    hw_e4m3: bool | None = None,
    tiled: torch.Tensor | None = None,
) -> Plan:
    """a decoded once into float16 planes, then the weight decoded in the tensor-core loop
    (``hw_e4m3=False``: the weight's scales in integer arithmetic, SM80's path, for sweeps;
    ``tiled``: the weight's words as ``hopper_args.tiled_words(w, rows, cols)`` read in its
    place, an experiment of ``benchmarks/hopper_sweep.py``: ``_tile_rows``)."""
    c, a32, w32 = _checked_words(args, name, torch.int32)
    m, n, kw, cp = c.m, c.n, c.kh // 4, c.cp
    if m == 0 or n == 0:
        return hopper_args.nothing_to_do(m, n)
    shifts = hopper_args.shift_table(c.out.device)
    if a32 is None or w32 is None or hopper_args.scale_words(args[3]) is None or shifts is None:
        return _fallback
    k = kernels()
    pdl = _pdl(args, c.out.device)
    # The main loop joins PDL with the narrowest token tiles only: faster with 16-token tiles,
    # slower with 32- and 64-token ones (docs/hopper_kernels.md, 'Programmatic dependent launch').
    # The a decode and the split-K reduction take it always (one compile each, not two):
    # next to a main loop launched without it, it changes nothing.
    pdl_main = pdl and cfg.block_t <= 16
    bkw = cfg.words_per_step
    sms = triton_fp4._sms(c.out.device) if c.out.device.type == "cuda" else 1
    split = hopper_configs.mma_split(m, n, kw, cfg, sms)
    parts = _partials(c, split)
    split = 1 if parts is None else split
    per_split = k.cdiv(k.cdiv(kw, bkw), split)
    steps = per_split * split  # what the programs read, past K included (zeros)
    mp = k.cdiv(m, cfg.block_t) * cfg.block_t
    decode, planes = _a_planes(args[8], steps, bkw, m, mp, c.kh, cp, pdl, a32.stride(0))
    tiles = k.cdiv(n, cfg.block_n) * k.cdiv(m, cfg.block_t)
    counts = triton_fp4._counts(c.out.device, tiles) if parts is not None and cfg.sum_last else None
    hw = _e4m3_in_hardware(c.out.device) if hw_e4m3 is None else hw_e4m3
    main = Launch(
        k.mma_planes, (tiles, split),
        ALPHA=c.alpha_kind, PARTIALS=split > 1, BN=cfg.block_n, BT=cfg.block_t, BKW=bkw,
        GROUP=cfg.group, ASM=ASM, HW_E4M3=hw, SUM_LAST=counts is not None, **_with_pdl(pdl_main),
        **_tile_rows(tiled, n, kw, bkw, torch.int32),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    reduce = _reduction(c, split, pdl) if parts is not None and counts is None else None
    w_stride, last = w32.stride(0), shifts if counts is None else counts
    launches = (decode, main, reduce)

    def run(args: tuple[Any, ...]) -> torch.Tensor:
        call = _planes_call(args, launches, planes, m, n)
        if call is None:  # an offset the plan's key does not tell apart
            return _fallback(args)
        _, w32, sw32, out, alpha_ptr, alpha_value, x = call
        if tiled is not None:
            w32 = tiled
        main(
            x, w32, sw32, shifts, alpha_ptr, out, out if parts is None else parts,
            m, n, kw, mp, w_stride, out.stride(0), out.stride(1), cp, per_split, alpha_value, last,
        )  # fmt: skip
        if reduce is not None:
            reduce(parts, alpha_ptr, out, m, n, out.stride(0), out.stride(1), alpha_value, split)
        return out

    return run


def _run_planes(
    args: tuple[Any, ...], name: str, cfg: MmaConfig, hw_e4m3: bool | None = None
) -> torch.Tensor:
    return _planes_plan(args, name, cfg, hw_e4m3)(args)


@functools.cache
def _ws_tile_layouts(block_n: int, bkw: int, tokens: int) -> tuple[Any, Any]:
    """hopper-ws' TMA tiles' shared layouts (weight words, a's planes): built once per tile."""
    from triton.experimental.gluon import language as gl

    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, bkw], gl.int32)
    return w_layout, gl.NVMMASharedLayout.get_default_for([8 * bkw, tokens], gl.float16)


def _ws_plan(
    args: tuple[Any, ...], cfg: WsConfig | None, tiled: torch.Tensor | None = None
) -> Plan:
    """A call TMA cannot read (K not a multiple of 32, a misaligned view) or with alpha a Python
    number (see ``_hopper_ws``) runs ``hopper-mma``'s kernel instead. ``tiled``: the weight's
    words as ``hopper_args.tiled_words(w, block_n, 16)`` read in its place (tiles with the
    loader warp, K split but not in runs), an experiment of ``benchmarks/hopper_sweep.py``."""
    c, a32, w32 = _checked_words(args, "hopper-ws", torch.int32)
    cfg = cfg or hopper_configs.default("ws", c.m)
    m, n, kw, cp = c.m, c.n, c.kh // 4, c.cp
    if m == 0 or n == 0:
        return hopper_args.nothing_to_do(m, n)
    if tiled is not None and (not cfg.loader_warp or cfg.split == -1):
        raise ValueError(f"tiled takes a tile with the loader warp, not in runs: got {cfg}")
    # TMA reads the weight's rows: its base and row stride must be multiples of 16 bytes, and
    # only whole 16-word steps were run on the GPU (K a multiple of 32).
    # alpha kind 1 is a Python number, which the kernel does not take (_hopper_ws).
    if (a32 is None or w32 is None or hopper_args.scale_words(args[3]) is None or c.kh % 16
            or c.alpha_kind == 1 or (w32.stride(0) * 4) % 16 or w32.data_ptr() % 16):  # fmt: skip
        return _planes_plan(args, "hopper-ws", for_m(MMA_BY_M, m))
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    k, ws = kernels(), ws_kernels()
    bkw, bn, bt = ws.STEP_WORDS, cfg.block_n, cfg.block_t
    steps = k.cdiv(kw, bkw)
    tiles = k.cdiv(n, bn) * k.cdiv(m, bt)
    sms = triton_fp4._sms(c.out.device)
    split = hopper_configs.ws_split(tiles, steps, cfg, sms)
    stream = _ws_stream(c, cfg, tiles, steps, sms, split) if cfg.split == -1 else None
    parts = None if stream else _partials(c, split)
    split = 1 if parts is None else split
    per_split = k.cdiv(steps, split)
    mp = k.cdiv(m, bt) * bt
    # As in hopper-mma, a's decode and the split-K reduction take PDL when asked; so does the
    # Gluon main loop, waiting for the decode (docs/hopper_kernels.md, 'PDL for `hopper-ws`').
    pdl = _pdl(args, c.out.device)
    decode, planes = _a_planes(args[8], steps, bkw, m, mp, c.kh, cp, pdl, a32.stride(0))
    xw = cfg.mma_tokens
    w_layout, x_layout = _ws_tile_layouts(bn, bkw, xw)
    w_shape, w_strides = list(w32.shape), list(w32.stride())
    meta = _tile_rows(tiled, n, kw, bkw, torch.int32)
    if tiled is not None:  # its tiles' steps as rows of bkw words, each box one contiguous run
        if meta != {"W_TILE_ROWS": bn}:
            raise ValueError(f"tiled must be tiled_words(w, {bn}, {bkw}), got {tuple(tiled.shape)}")
        w_shape, w_strides = [tiled.numel() // bkw, bkw], [bkw, 1]
    x_shape = [steps * bkw * 8, mp]  # the planes' workspace (_a_planes), row-major
    reduce = _reduction(c, split, pdl) if parts is not None else None
    alpha_stride = ws.ALPHA_STRIDE[c.alpha_kind]
    if stream is None:
        # 4 warps: the first consumer; the second (and the loader warp) partitions of their own
        main = Launch(
            ws.mma_ws, (tiles, split),
            BN=bn, BT=bt, BKW=bkw, STAGES=cfg.stages, GROUP=ws.TILE_GROUP,
            OWN_LOADS=not cfg.loader_warp, **({"W_TILED": True} if tiled is not None else {}),
            **_with_pdl(pdl), num_warps=4, maxnreg=ws.launch_regs(cfg.loader_warp),
        )  # fmt: skip
        launches = (decode, main, reduce)
    else:
        launches = (decode, *stream[0])

    def run(args: tuple[Any, ...]) -> torch.Tensor:
        call = _planes_call(args, launches, planes, m, n)
        if call is None:  # an offset the plan's key does not tell apart
            return _fallback(args)
        direct, w32, sw32, out, alpha_ptr, alpha_value, x = call
        if tiled is not None:
            w32 = tiled.view(-1, bkw)
        describe = _unchecked if direct else TensorDescriptor
        w_desc = describe(w32, w_shape, w_strides, [bn, bkw], w_layout)
        x_desc = describe(x, x_shape, [mp, 1], [8 * bkw, xw], x_layout)
        if stream is not None:  # whole tiles, then runs of K steps (``_ws_stream``)
            stream[1](w_desc, x_desc, sw32, alpha_ptr, out, alpha_stride)
            return out
        if parts is None:  # scaled by alpha and stored in out
            dst, s0, s1, a_stride = out, out.stride(0), out.stride(1), alpha_stride
        else:  # float32 partial sums, (split, M, N), as reduce_split reads them
            dst, s0, s1, a_stride = parts, n, 1, -1
        main(
            w_desc, x_desc, sw32, alpha_ptr, dst, m, n, kw, cp, s0, s1,
            a_stride, per_split, m * n,
        )  # fmt: skip
        if reduce is not None:
            reduce(parts, alpha_ptr, out, m, n, out.stride(0), out.stride(1), alpha_value, split)
        return out

    return run


def _ws_stream(
    c: triton_fp4.Checked, cfg: WsConfig, tiles: int, steps: int, sms: int, split: int
) -> tuple[tuple[Launch, Launch], Callable[..., None]] | None:
    """``WsConfig.split = -1``'s launches (``_hopper_ws_stream``: the main kernel, then the fixup
    of the tiles the runs share) and the call that makes them with a call's descriptors and
    tensors; None where ``stream_plan`` cuts nothing or no workspace can be made (inside a graph
    capture, if none was made before): the tiles then run K split in ``split``."""
    planned = hopper_configs.stream_plan(tiles, steps, sms, split)
    if planned is None:
        return None
    programs, whole = planned
    parts = triton_fp4._workspace(c.out.device, cfg.block_n * cfg.block_t, 2, programs)
    if parts is None:
        return None
    from fp4select.backends import _hopper_ws_stream as stream

    first_tile = whole * programs
    q, r = divmod((tiles - first_tile) * steps, programs)
    group = ws_kernels().TILE_GROUP
    main = Launch(
        stream.mma_ws_stream, (programs,),
        BN=cfg.block_n, BT=cfg.block_t, BKW=ws_kernels().STEP_WORDS, STAGES=cfg.stages,
        GROUP=group, OWN_LOADS=not cfg.loader_warp, num_warps=4,
        maxnreg=ws_kernels().launch_regs(cfg.loader_warp),
    )  # fmt: skip
    fixup = Launch(
        stream.stream_fixup, (tiles - first_tile, cfg.block_t // stream.FIXUP_COLUMNS),
        BN=cfg.block_n, BT=cfg.block_t, CT=stream.FIXUP_COLUMNS, GROUP=group, num_warps=4,
    )  # fmt: skip
    m, n, kw, cp = c.m, c.n, c.kh // 4, c.cp

    def run(w_desc: Any, x_desc: Any, sw32: Any, alpha_ptr: Any, out: Any, a_stride: int) -> None:
        s0, s1 = out.stride(0), out.stride(1)
        main(
            w_desc, x_desc, sw32, alpha_ptr, out, parts, m, n, kw, cp, s0, s1, a_stride,
            steps, whole, q, r,
        )  # fmt: skip
        fixup(parts, alpha_ptr, out, m, n, s0, s1, a_stride, steps, first_tile, q, r)

    return (main, fixup), run


def _unchecked(
    base: Any, shape: list[int], strides: list[int], block: list[int], layout: Any
) -> Any:
    """A Gluon TensorDescriptor made without its constructor's checks, for a direct launch: the
    launcher reads only its base's data pointer, shape, strides and padding, and the plan's
    first calls built the checked descriptors of the same geometry (the key fixes it) from
    the word views, which the base need not be then (the views and the checks cost a direct
    call about what one of its launches does)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    made = object.__new__(TensorDescriptor)
    made.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block, layout=layout)
    return made


def run_ws(
    *args: Any, cfg: WsConfig | None = None, tiled: torch.Tensor | None = None
) -> torch.Tensor:
    """``hopper-ws``: mm_fp4's positional order (without backend)."""
    return _ws_plan(args, cfg, tiled)(args)


def fast_ws(*args: Any, cfg: WsConfig | None = None) -> torch.Tensor:
    """``run_ws`` planned once per kind of call (``hopper_launch``): the warm path's."""
    return hopper_launch.planned("ws", _ws_plan, args, cfg)


def _mma_plan(
    args: tuple[Any, ...], cfg: MmaConfig | None, tiled: torch.Tensor | None = None
) -> Plan:
    return _planes_plan(args, "hopper-mma", cfg or for_m(MMA_BY_M, _rows(args)), tiled=tiled)


def run_mma(
    *args: Any, cfg: MmaConfig | None = None, tiled: torch.Tensor | None = None
) -> torch.Tensor:
    """``hopper-mma``: mm_fp4's positional order (without backend)."""
    return _mma_plan(args, cfg, tiled)(args)


def fast_mma(*args: Any, cfg: MmaConfig | None = None) -> torch.Tensor:
    """``run_mma`` planned once per kind of call (``hopper_launch``): the warm path's."""
    return hopper_launch.planned("mma", _mma_plan, args, cfg)


def _rows(args: tuple[Any, ...]) -> int:
    a = args[0]
    return int(a.shape[0]) if isinstance(a, torch.Tensor) and a.dim() == 2 else 0


def fast_gemv_runner(problem: Problem) -> Any:
    return fast_gemv


def fast_mma_runner(problem: Problem) -> Any:
    return fast_mma


def fast_ws_runner(problem: Problem) -> Any:
    return fast_ws


GEMV_MAX_M = 4  # from SM90, the buckets it competes in (see the module rules)
MEASURED_FROM_CC = 90  # the H200's measurements narrow the field from here on only


def gemv_declines(problem: Problem, env: Mapping[str, Any]) -> str | None:
    if cuda_from(env, MEASURED_FROM_CC) and problem.m_range[0] > GEMV_MAX_M:
        return f"from SM90, above M = {GEMV_MAX_M} hopper-mma serves (faster at every point)"
    return None


def _caps(max_m: int | None, min_m: int | None = None) -> Capabilities:
    return Capabilities(
        formats=frozenset({"nvfp4"}),
        a_sf_layouts=frozenset({"128x4", "8x4"}),
        b_layouts=frozenset({"plain"}),
        out_dtypes=frozenset(OUT_DTYPES),
        alpha_kinds=frozenset(ALPHA_KINDS),
        max_m=max_m,
        min_m=min_m,
        devices=frozenset({"cuda"}),
    )


BACKENDS: tuple[Backend, ...] = (
    Backend(
        name="hopper-gemv",
        checked_runner=run_gemv,
        make_fast_runner=fast_gemv_runner,
        why_unavailable=why_unavailable,
        caps=_caps(8),
        declines=gemv_declines,
        preference=180,
        family=FAMILY,
        description="NVFP4 GEMV for M <= 8: table decode of whole words, exact dp4a dot products",
        tune=hopper_tactics.tune,
        pin=hopper_tactics.pin,
    ),
    Backend(
        name="hopper-mma",
        checked_runner=run_mma,
        make_fast_runner=fast_mma_runner,
        why_unavailable=why_unavailable,
        caps=_caps(256),
        preference=185,
        family=FAMILY,
        description="NVFP4 tensor-core GEMM for M <= 256, operands swapped, split-K",
        tune=hopper_tactics.tune,
        pin=hopper_tactics.pin,
    ),
    Backend(
        name="hopper-ws",
        checked_runner=run_ws,
        make_fast_runner=fast_ws_runner,
        why_unavailable=ws_why_unavailable,
        caps=_caps(None, min_m=WS_MIN_M),
        declines=ws_declines,
        preference=187,
        family=FAMILY,
        description="NVFP4 GEMM for M = 33-2048 on SM90: hopper-mma's product, warp-specialized ping-pong in Gluon",
        tune=hopper_tactics.tune,
        pin=hopper_tactics.pin,
    ),
)
