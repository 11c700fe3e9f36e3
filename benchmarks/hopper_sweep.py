"""Sweep the Hopper kernels' configurations in one GPU run: correctness, then speed.

The configurations come in families (``--families``; ``--help`` and FAMILY_HELP below list
them): by default every configuration of ``hopper-gemv``, of ``hopper-mma`` (``prefill``: its
large tiles, the retired ``hopper-prefill``'s) and the older ``triton-*`` candidates; on request
``hopper-ws``'s tiles, ``hopper-dequant``'s, the product's own tactics and variants of them.
For each shape and M, every configuration of the families asked for that applies is checked
against the exact reference (``validate.check``), then all that passed are timed side by side
with bf16 cuBLAS, ``torch-dequant`` (from M = 64, or with ``old``) and ``hopper-dequant`` (from
M = 256, unless ``dq`` times its tiles) (CUDA-graph replay, inputs rotated to keep L2 cold).
Prints one line per point (the best configuration of each family, bf16, and the ratio) and
writes ``benchmarks/results/hopper_sweep.json``. Used to choose each backend's configuration
table and tactic candidates; ``bench_gpu.py`` is the benchmark of record.

    python benchmarks/hopper_sweep.py [--shapes 8192x8192,...] [--ms 1,16,...]
        [--families gemv,mma,prefill,old,floor] [--name hopper_sweep]

``floor`` (not in the default families) times, for the small-M tensor-core tilings, what the
tiling costs without part of its work: ``floor-loads`` reads the weight and scale words and
nothing else (plain loads: Triton pipelines loads only into a dot), ``floor-mma`` also runs
the MMA on undecoded words, its loads pipelined as in ``mma_planes``. They compute nothing useful
(their results are not checked); they say whether a tiling is bound by its reads, its decode or
its MMA.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import math
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl
from _common import dumps, machine, sweep_points

from fp4select import formats, timing, validate
from fp4select.backends import _hopper_kernels as hk
from fp4select.backends import (
    dequant,
    hopper_args,
    hopper_configs,
    hopper_tactics,
    triton_fp4,
    triton_hopper,
)
from fp4select.backends._hopper_kernels import plane_major, weight_step
from fp4select.keys import Problem, m_bucket
from fp4select.timing import TimingOptions

SHAPES = [(8192, 8192), (28672, 4096), (4096, 14336)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 4096]
OPTIONS = TimingOptions(budget_s=0.12, min_rounds=5, max_rounds=15)

# What --families can name (--help prints it): each family is one block of variants(), which
# says at which M it runs; "nopdl" and "late" add to what "tactics" times.
FAMILY_HELP = {
    "gemv": "hopper-gemv at the tilings in GEMV",
    "mma": "hopper-mma at the tilings in MMA",
    "prefill": "hopper-mma at the large tiles in PREFILL (the retired hopper-prefill's)",
    "old": "the older kernels in OLD, and torch-dequant below M = 64 too",
    "tactics": "the product's own tactic candidates (hopper_configs.candidates)",
    "nopdl": "with tactics: each tactic also launched without PDL",
    "late": "with tactics: each GEMV tactic also with PDL's other trigger",
    "late3": "every GEMV tiling here (GEMV, GEMV2, GEMV3) with PDL's late trigger",
    "gemv2": "hopper-gemv at GEMV2: with and without the next step's weight loaded ahead",
    "evict": "the GEMV tactics with their weight loads' evict_first toggled",
    "floor": "the small-M hopper-mma tilings' loads alone, and with the MMA (no decode)",
    "gfloor": "each GEMV tactic's loads alone, with a's rows and scales and without",
    "wide": "hopper-mma at WIDE: tiles of 64-256 tokens, deeper pipelines",
    "occ": "hopper-mma at OCC: small tiles split for more programs an SM",
    "ws": "hopper-ws at the tiles in WS",
    "wsw": "hopper-ws at WSW: one wgmma over the whole 128-token tile",
    "dq": "hopper-dequant at each GEMM tile in DQ, in place of its own choice",
    "pre": "hopper-gemv at PRE with a decoded once per call by a kernel of its own",
    "mid": "from M = 513 (above 2048 too): hopper-ws at every tile of its M <= 512 tactics",
    "stream": "from M = 256: hopper-ws's 128 x 256 and 128 x 128 tiles with the last wave cut "
    "into runs of K steps (split -1), and split as today",
    "tiled": "to M = 64: the GEMV and mma tactics reading the weight re-laid by tiles (each "
    "program's step one contiguous run; and tiles of 16 rows x 128 bytes, one copy for all), "
    "beside the same tactics on the plain layout; to M = 16 also the mma tactics' loads alone "
    "on each layout; from M = 33 hopper-ws's tactics with a loader warp on their own tiles",
}
# The default families.
FAMILIES = ("gemv", "mma", "prefill", "old")
# The older kernels that family "old" times: each up to an M (None: at every M).
OLD = {"triton-gemv": 4, "triton-m16": 64, "triton-m64": None}
# Families removed since, by the commit that still holds them (check it out to run one again):
#   7686ed2  "deep": the small-M tilings with 4-6 stages and longer steps
#            "wsk": hopper-ws tiles with K split (chosen from the SM count, or 2-3)
#            "wso": hopper-ws tiles without its loader warp, beyond its tactics
#            "ready1": the 64-row ws tactics with the kernel before ef16896's ready barriers
#            "fuse": the mma tactics with sum_last toggled
#            "int": the mma tactics' scales converted in integer arithmetic, not by cvt
#            "gemv3": GEMV3 with PDL's early trigger ("late3" times it with the late one)
#   ae7441c  "persist", "persist3": the GEMV's persistent form
#   9285391  "u8": the GEMV's biased decode and tables in registers, beside its earlier decode
#   35430a8  "stages": the GEMV tactics' loads pipelined 2-4 deep through shared memory
#   b739cf1  "nospec": the GEMV candidates with M specialized (Triton's constant for 1) and not
#   8738e79  "regs": the GEMV tactics with registers capped at 168 or 128 a thread (no better)
#   54a055e  "direct": a Gluon kernel loading the weight straight into the MMA's registers
#   e9917bd  "gemvb": the GEMV tactics with the kernel before its scale tiles took the weight's
#            register layout; "hw": with the GPU's e4m3 conversion (since the product's)
#   15e63df  "wss": hopper-ws tiles of 16-32 tokens
#   5a144e9 "ws4"; 223faa6 "even" (and "stream" in its first form: all tiles in runs below
#   two waves); b21f449 "split"; d1cc168 "pfa"; 16a57e7 "gluon";
#   c39225c "chunk"; 0f021bd "ss", "ov"; ed53485 "stages" (the mma's, not today's);
#   25e0248 "overlap"; 1cc5dc7 "mreg": the mma tactics to M = 32 with registers capped;
#   32bb1d3 "order": the ws tactics with their consumers issuing in turn (the 64-row ones since);
#   5fa76e3 "alt": 128 x 128 ws tiles, each consumer all rows on alternate steps;
#   56996f9 "x64": the 64-row ws tiles (taking turns) beyond their tactics, M = 65-512
#   b9bea34 "flight": the ws tactics decoding their next step while this step's wgmma runs
#   81b000f "wspdl": the ws tactics launched under PDL (since their own form) and without
#   e0fea9a "wstrig": the ws tactics under PDL letting the next kernel launch at their start
#   b784645 "wslast": the 64-row ws tactics summing a K split in their last program
#   5e72b05 "early": the pre GEMV tactics loading their first weight step before PDL's wait
#   69c4b1c "earlyw": the ws tactics asking for their weight before PDL's wait (since their own)
#   9047eae "persist" (not ae7441c's): the 128-row ws tiles persistent, no tile cut


# hopper-gemv's tilings (families gemv, gemv2, late3).
GEMV = [
    triton_hopper.GemvConfig(r, bk, w)
    for r, bk, w in [(4, 128, 2), (4, 256, 2), (8, 128, 2), (4, 256, 4), (2, 256, 2), (8, 64, 1)]
]
# hopper-gemv with the next step's weight loaded before this step's math, beside without.
GEMV2 = [
    triton_hopper.GemvConfig(r, bk, w, pf)
    for r, bk, w in [(8, 128, 2), (4, 128, 2), (4, 256, 4), (8, 64, 1), (2, 256, 2), (4, 64, 1)]
    for pf in (0, 1)
] + [triton_hopper.GemvConfig(8, 32, 1, 1), triton_hopper.GemvConfig(16, 64, 2, 1)]
# More hopper-gemv tilings beyond its tactics, timed by "late3" (first swept, with PDL's early
# trigger, as family "gemv3": results/hopper_sweep_gemv3.json, the sweep of commit e9917bd).
GEMV3 = [
    triton_hopper.GemvConfig(*t)
    for t in [
        (16, 128, 2),
        (16, 256, 4),
        (8, 256, 4),
        (8, 256, 2),
        (4, 256, 2),
        (4, 128, 1),
        (16, 64, 1),
        (8, 64, 1),
        (8, 128, 2, 1),
        (4, 256, 4, 1),
        (4, 64, 1),
        (2, 128, 1),
    ]
]
# hopper-gemv with a decoded once per call (family pre; PDL's late trigger): the M <= 2 and
# M = 3-8 tactics' tilings, and fewer rows a program (more programs, fewer registers), which
# a's decode in the loop had made dear.
PRE = [
    triton_hopper.GemvConfig(*t, late=1, pre=1)
    for t in [
        (8, 128, 2),
        (4, 256, 4),
        (8, 64, 1),
        (4, 128, 2),
        (8, 256, 4),
        (4, 64, 1),
        (2, 256, 2),
        (2, 128, 1),
        (8, 64, 1, 1),
        (4, 128, 2, 0, 1),
        (8, 128, 2, 0, 1),
        (4, 64, 1, 1),
        (2, 64, 1),
        (4, 128, 1),
    ]
]

# hopper-mma's tilings (families mma, prefill, wide, occ; floor: MMA's without their decode).
# Every tiling is checked first; the one- and two-warp tilings (mma.sync instead of wgmma)
# were measured slower at every M (results/hopper_sweep_small.json) and stay for comparison.
# The steps of 32 and 64 words (128-256 bytes of each weight row per step) test whether small M
# is bound by 64-byte reads per row (docs/hopper_kernels.md; timed in
# results/hopper_sweep_final.json).
MMA = [
    triton_hopper.MmaConfig(bn, bt, bkw, w, st, sp)
    for bn, bt, bkw, w, st, sp in [
        (128, 16, 16, 4, 3, 0),
        (128, 16, 32, 4, 3, 0),
        (128, 16, 32, 8, 3, 0),
        (64, 16, 32, 4, 3, 0),
        (64, 16, 64, 4, 3, 0),
        (128, 32, 32, 8, 3, 0),
        (128, 16, 16, 4, 3, 8),
        (128, 16, 16, 4, 4, 0),
        (128, 16, 16, 4, 4, 8),
        (128, 16, 16, 4, 4, 16),
        (128, 16, 16, 8, 4, 0),
        (64, 16, 16, 4, 3, 0),
        (64, 16, 16, 4, 4, 0),
        (64, 16, 16, 4, 4, 8),
        (64, 16, 16, 1, 3, 4),
        (64, 16, 16, 2, 3, 0),
        (64, 16, 16, 2, 3, 4),
        (64, 16, 32, 2, 3, 4),
        (64, 16, 16, 2, 3, 8),
        (64, 16, 16, 2, 4, 4),
        (32, 16, 16, 1, 3, 0),
        (32, 16, 16, 1, 3, 4),
        (32, 16, 32, 1, 3, 4),
        (32, 16, 16, 1, 3, 8),
        (128, 32, 16, 4, 3, 0),
        (128, 32, 16, 4, 3, 8),
        (64, 32, 16, 4, 3, 0),
        (64, 32, 16, 2, 3, 0),
        (64, 32, 16, 2, 3, 4),
        (32, 32, 16, 1, 3, 4),
        (128, 64, 16, 4, 3, 0),
        (128, 64, 16, 8, 3, 0),
        (64, 64, 16, 4, 3, 0),
        (64, 64, 16, 2, 3, 0),
        (64, 64, 16, 2, 3, 2),
        (128, 128, 16, 4, 3, 0),
        (128, 128, 16, 8, 3, 0),
    ]
]
PREFILL = [
    triton_hopper.MmaConfig(bn, bt, bkw, w, st, 1, g)
    for bn, bt, bkw, w, st, g in [
        (128, 128, 16, 8, 3, 8),
        (128, 128, 16, 8, 4, 8),
        (128, 128, 16, 4, 3, 8),
        (128, 256, 16, 8, 3, 8),
        (256, 128, 16, 8, 3, 8),
        (128, 64, 16, 4, 4, 8),
    ]
]
# One-warpgroup tiles 64 weight rows tall and up to 256 tokens wide (twice the programs of the
# 128-row tiles at the same M, each weight row decoded once per 256 tokens), and deeper steps.
WIDE = [
    triton_hopper.MmaConfig(bn, bt, bkw, w, st, sp)
    for bn, bt, bkw, w, st, sp in [
        (64, 256, 16, 4, 3, 1),
        (64, 256, 8, 4, 4, 1),
        (64, 256, 16, 4, 2, 1),
        (64, 256, 16, 4, 3, 0),
        (64, 128, 16, 4, 3, 1),
        (64, 128, 16, 4, 4, 1),
        (64, 128, 8, 4, 5, 1),
        (64, 128, 16, 4, 3, 0),
        (64, 64, 16, 4, 4, 1),
        (128, 256, 8, 8, 4, 1),
        (128, 128, 16, 4, 3, 1),
        (128, 128, 16, 4, 3, 0),
        (128, 256, 16, 8, 3, 1),
        # deeper pipelines: with each step's wgmma waited for (``retired``), loads in flight
        # are what a warpgroup overlaps with its own math
        (64, 128, 16, 4, 5, 1),
        (128, 64, 16, 4, 5, 1),
        (128, 128, 16, 8, 5, 1),
        (64, 64, 16, 4, 5, 1),
    ]
]
# Tiles whose registers leave room for 3-7 programs an SM, split so that there are that many
# (the table's split gives about two an SM).
OCC = [
    hopper_configs.MmaConfig(bn, bt, bkw, 4, st, sp, sum_last=int(bt <= 32))
    for bn, bt, bkw, st, sp in [
        (64, 16, 32, 4, 0),
        (64, 16, 32, 4, 4),
        (64, 16, 32, 4, 8),
        (128, 16, 16, 3, 0),
        (128, 16, 16, 3, 8),
        (128, 16, 16, 3, 16),
        (128, 16, 16, 4, 8),
        (64, 16, 16, 4, 8),
        (64, 16, 16, 4, 16),
        (128, 16, 32, 3, 0),
        (128, 16, 32, 3, 8),
        (128, 32, 16, 3, 0),
        (64, 32, 16, 3, 0),
        (64, 32, 16, 3, 4),
        (64, 32, 16, 3, 8),
        (64, 32, 32, 3, 4),
        (128, 64, 16, 4, 0),
        (64, 64, 16, 3, 0),
        (64, 64, 16, 3, 2),
        (64, 64, 16, 3, 4),
    ]
]

# hopper-ws's tiles (families ws, wsw). WS: tiles beyond its tactics, as (weight rows, tokens,
# stages). Its first two forms (one consumer partition, waiting for each step's MMA or not) are
# in git history (61a5875).
WS = [(128, 128, 3), (128, 128, 2), (128, 64, 4), (64, 128, 3), (64, 128, 4), (64, 64, 4)]
# 256 rows: a's tiles read once for twice the weight rows (results/hopper_sweep_ws256.json: 256 x
# 128 became a tactic, dfc57dd). At M = 256-512 the 128-row tiles move about 5 TB/s from L2
# into shared memory, four fifths of it a's float16 tiles (docs/hopper_kernels.md), which these
# halve per weight row.
WS += [(256, 64, 4), (256, 128, 3), (256, 128, 2)]
# hopper-ws with one wgmma over a 128-token tile (m64n128k16) where the tactics run two over its
# halves (m64n64k16): half the MMA instructions, each register operand read once, not twice.
# (256 tokens, or 256 rows with whole-tile MMAs, spill at the 168 registers 12 warps allow.)
WSW = [
    hopper_configs.WsConfig(bn, 128, st, sp, 128)
    for bn, st, sp in [(128, 2, 0), (128, 3, 0), (128, 4, 0), (64, 4, 0), (64, 5, 0), (64, 3, 0)]
]
WSW += [hopper_configs.WsConfig(256, 128, 3, 0), hopper_configs.WsConfig(128, 128, 3, 2, 128)]

# hopper-dequant's GEMM tiles (family dq), as (BM, BN, BK, warps, stages); `dequant_tile`
# chooses between the third and the fifth (hopper_configs.DEQUANT_SMALL, DEQUANT_LARGE).
DQ = [
    (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (256, 128, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 128, 8, 3),
    (64, 256, 64, 4, 4),
    (128, 64, 64, 4, 4),
]


@triton.jit
def _floor(
    x_ptr, w_ptr, sw_ptr, out_ptr, N, KW, MP, stride_wn, cp, iters,
    BN: tl.constexpr, BT: tl.constexpr, BKW: tl.constexpr, MMA: tl.constexpr,
    TILE_ROWS: tl.constexpr = 0, COLS: tl.constexpr = 0,
):  # fmt: skip
    """``mma_planes``' loads (and with MMA its tensor-core work) without the decode; TILE_ROWS:
    from the weight re-laid by tiles (runs of COLS words), as ``mma_planes`` reads it."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows_n = tl.where(offs_n < N, offs_n, 0)
    kx = tl.arange(0, 8 * BKW)
    if TILE_ROWS:
        w_rows = hk.tiled_rows(w_ptr, rows_n, KW, COLS, TILE_ROWS)
    else:
        w_rows = w_ptr + rows_n[:, None].to(tl.int64) * stride_wn
    tl.assume(iters > 0)
    acc = tl.zeros((BN, BT), dtype=tl.float32)
    bits = tl.zeros((BN, BKW), dtype=tl.int32)
    for i in range(0, iters):
        k0 = (pid_k * iters + i) * BKW
        wq, sw = weight_step(w_rows, sw_ptr, rows_n, k0, KW, cp, BKW, TILE_ROWS, COLS)  # its own
        if MMA:
            h = ((wq ^ sw) & 0x3FF).to(tl.float16)  # finite: the MMA still runs on every word
            w = plane_major(h, h, h, h, h, h, h, h, BN, BKW)
            xb = x_ptr + tl.arange(0, BT)[None, :] + (k0 * 8 + kx)[:, None].to(tl.int64) * MP
            acc = tl.dot(w, tl.load(xb), acc)
        else:
            bits = bits ^ wq ^ sw
    acc += tl.sum(bits, axis=1).to(tl.float32)[:, None]
    ptrs = out_ptr + pid_k * N * BT + offs_n[:, None] * BT + tl.arange(0, BT)[None, :]
    tl.store(ptrs, acc, mask=(offs_n < N)[:, None])


def run_floor(
    *args, cfg: triton_hopper.MmaConfig, mma: bool, tiles: tuple[int, int] | None = None
) -> torch.Tensor:
    """Launch ``_floor`` on mm_fp4's arguments with ``cfg``'s tiling and split (tiles: from the
    weight re-laid by tiles of (rows, words))."""
    b, b_descale = args[1], args[3]
    n, kh = b.shape[1], b.shape[0]
    w32 = b.T.view(torch.int32)
    if tiles:
        w32 = _tiled(w32, *tiles)
    sw32 = hopper_args.scale_words(b_descale)
    kw = kh // 4
    sms = triton_fp4._sms(b.device)
    split = hopper_configs.mma_split(cfg.block_t, n, kw, cfg, sms)
    iters = triton.cdiv(triton.cdiv(kw, cfg.words_per_step), split)
    cp = formats.padded_sf_shape(n, kh // 8, "128x4")[1]  # scale columns, whole tiles
    x = torch.zeros(
        (iters * split * cfg.words_per_step * 8, cfg.block_t), dtype=torch.float16, device=b.device
    )
    out = torch.empty((split, n, cfg.block_t), dtype=torch.float32, device=b.device)
    _floor[(triton.cdiv(n, cfg.block_n), split)](
        x, w32, sw32, out, n, kw, cfg.block_t, w32.stride(0), cp, iters,
        BN=cfg.block_n, BT=cfg.block_t, BKW=cfg.words_per_step, MMA=mma,
        TILE_ROWS=tiles[0] if tiles else 0, COLS=tiles[1] if tiles else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


# The weights re-laid by tiles (family tiled), by (data pointer, word type, rows, columns):
# made on a variant's first call with each input set, before any is timed (``point``), and
# dropped at the next point, whose tensors may reuse the addresses.
_TILED: dict[tuple[int, torch.dtype, int, int], torch.Tensor] = {}


def _tiled(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    key = (w.data_ptr(), w.dtype, rows, cols)
    if key not in _TILED:
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a tiled weight would be made inside a graph capture")
        _TILED[key] = hopper_args.tiled_words(w, rows, cols)
    return _TILED[key]


# The layout one copy could serve every tactic from: tiles of 16 rows x 128 bytes (32 int32
# words, 16 int64 words), 2 KB runs.
SHARED = (16, 128)


def run_tiled(*args, kind: str, cfg, shared: bool = False) -> torch.Tensor:
    """The GEMV, mma or ws tactic ``cfg`` reading the weight re-laid by tiles: of a program's
    rows and step (each step it reads one contiguous run), or with ``shared`` ``SHARED``'s
    (GEMV and mma only: ``hopper-ws`` reads its tiles by 2-D TMA boxes)."""
    word = torch.int64 if kind == "gemv" else torch.int32
    if shared:
        tiles = (SHARED[0], SHARED[1] // word.itemsize)
    elif kind == "gemv":
        tiles = (cfg.rows_per_program, cfg.blocks_per_step)
    elif kind == "ws":
        tiles = (cfg.block_n, triton_hopper.ws_kernels().STEP_WORDS)
    else:
        tiles = (cfg.block_n, cfg.words_per_step)
    w = _tiled(args[1].T.view(word), *tiles)
    run = {"gemv": triton_hopper.run_gemv, "mma": triton_hopper.run_mma, "ws": triton_hopper.run_ws}
    return run[kind](*args, cfg=cfg, tiled=w)


@triton.jit
def _gemv_floor(
    a_ptr, w_ptr, sa_ptr, sw_ptr, out_ptr, M, N, KW, stride_am, stride_wn, cp,
    BM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, A: tl.constexpr,
):  # fmt: skip
    """``gemv_dp4a``'s loads (its own helpers: the weight and its scales, with A also a's rows
    and scales), none of its decode or dot products: what the tiling's memory traffic costs."""
    sa_ptr = sa_ptr.to(tl.pointer_type(tl.uint8))
    sw_ptr = sw_ptr.to(tl.pointer_type(tl.uint8))
    kk = tl.arange(0, BK)
    rows, w_rows, sw_rows = hk._gemv_rows(tl.program_id(0), N, w_ptr, sw_ptr, stride_wn, cp, R)
    bits = tl.zeros((R, BK), dtype=tl.int64)
    for k0 in range(0, KW, BK):
        k = k0 + kk
        w, sw = hk._gemv_weight(w_rows, sw_rows, k, KW)
        bits = bits ^ w ^ sw.to(tl.int64)
        if A:
            a_col = hk._scale_cols(k, KW, False)[None, :]
            for r in tl.static_range(BM):
                row = tl.minimum(r, M - 1)
                ok = (k < KW)[None, :]
                x = tl.load(a_ptr + row * stride_am + k[None, :], mask=ok, other=0)
                sa = tl.load(sa_ptr + hk.sf_row_part(row, cp, False) + a_col, mask=ok, other=0)
                bits = bits ^ x ^ sa.to(tl.int64)
    tl.store(out_ptr + rows, tl.sum(bits, axis=1).to(tl.float32), mask=rows < N)


def run_gemv_floor(*args, cfg: triton_hopper.GemvConfig, with_a: bool) -> torch.Tensor:
    """Launch ``_gemv_floor`` on mm_fp4's arguments with ``cfg``'s tiling (128x4 a-scales)."""
    c, a64, w64 = triton_hopper._checked_words(args, "floor", torch.int64)
    out = torch.empty(c.n, dtype=torch.float32, device=w64.device)
    _gemv_floor[(triton.cdiv(c.n, cfg.rows_per_program),)](
        a64, w64, c.a_descale, args[3], out, c.m, c.n, c.kh // 8, a64.stride(0), w64.stride(0),
        c.cp, BM=triton_hopper._next_pow2(c.m), R=cfg.rows_per_program, BK=cfg.blocks_per_step,
        A=with_a, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


# Family tiled at M <= 16: tilings beyond the tactics, on both layouts, in case the re-laid
# weight streams faster with deeper rings, other steps or more warps than the tactics chose
# for the rows' layout.
TILED_EXTRA = [
    hopper_configs.MmaConfig(bn, 16, bkw, w, st, sp, sum_last=1)
    for bn, bkw, w, st, sp in [
        (128, 32, 4, 4, 0),
        (128, 16, 4, 4, 0),
        (128, 32, 8, 3, 0),
        (64, 64, 4, 3, 4),
        (128, 32, 4, 3, 8),
    ]
]


# hopper-ws's tiles that family "stream" times in runs (WsConfig.split = -1) and split as today.
STREAM = (
    hopper_configs.WsConfig(128, 256, 3, 0, 256, 0),
    hopper_configs.WsConfig(128, 128, 3, 0, 128),
)


def variants(m: int, families: tuple[str, ...] = FAMILIES) -> dict[str, functools.partial]:
    """What ``point`` checks and times at M = m: each name (its family first) to a call that
    takes mm_fp4's arguments. One block per family, each with the M it runs at."""
    out: dict[str, functools.partial] = {}
    if m <= 8 and "gemv" in families:
        for c in GEMV:
            out[f"gemv r{c.rows_per_program} bk{c.blocks_per_step} w{c.num_warps}"] = (
                functools.partial(triton_hopper.run_gemv, cfg=c)
            )
    if m <= 256 and "mma" in families:
        for c in MMA:
            if c.block_t >= 2 * max(16, m) and c.block_t > 16:
                continue
            out[
                f"mma n{c.block_n} t{c.block_t} kw{c.words_per_step} w{c.num_warps} st{c.num_stages} s{c.split}"
            ] = functools.partial(triton_hopper.run_mma, cfg=c)
    if m >= 64 and "prefill" in families:
        for c in PREFILL:
            out[
                f"prefill n{c.block_n} t{c.block_t} kw{c.words_per_step} w{c.num_warps} st{c.num_stages} g{c.group}"
            ] = functools.partial(triton_hopper.run_mma, cfg=c)
    if m <= 16 and "floor" in families:
        for c in MMA:
            if c.block_t == 16 and c.num_warps >= 4:
                tiling = f"n{c.block_n} t16 kw{c.words_per_step} w{c.num_warps} st{c.num_stages} s{c.split}"
                for mma in (False, True):
                    out[f"floor-{'mma' if mma else 'loads'} {tiling}"] = functools.partial(
                        run_floor, cfg=c, mma=mma
                    )
    if m <= 8 and "gfloor" in families:  # each GEMV candidate's loads alone, with a and without
        for c in hopper_configs.candidates("gemv", m):
            tiling = " ".join(map(str, dataclasses.astuple(c)))
            for with_a in (False, True):
                name = f"floor-gemv{'-a' if with_a else ''} {tiling}"
                out[name] = functools.partial(run_gemv_floor, cfg=c, with_a=with_a)
    if m <= 8 and "gemv2" in families:
        for c in GEMV2:
            out[
                f"gemv2 r{c.rows_per_program} bk{c.blocks_per_step} w{c.num_warps} pf{c.prefetch}"
            ] = functools.partial(triton_hopper.run_gemv, cfg=c)
    if m >= 64 and "wide" in families:
        for c in WIDE:
            if c.block_t <= 2 * m:
                name = f"wide n{c.block_n} t{c.block_t} kw{c.words_per_step} w{c.num_warps} st{c.num_stages} s{c.split}"
                out[name] = functools.partial(triton_hopper.run_mma, cfg=c)
    if m <= 8 and "late3" in families:  # every GEMV tiling swept before, with PDL's late
        # trigger (the earlier sweeps ran them with the early one; hopper_sweep_late3b.json,
        # _late3c.json and _late4.json ran this)
        for c in dict.fromkeys(GEMV + GEMV2 + GEMV3):
            cc = dataclasses.replace(c, late=1)
            name = "late3 " + " ".join(map(str, dataclasses.astuple(cc)))
            out[name] = functools.partial(triton_hopper.run_gemv, cfg=cc)
    if m <= 8 and "pre" in families:
        for c in PRE:
            out["pre " + " ".join(map(str, dataclasses.astuple(c)))] = functools.partial(
                triton_hopper.run_gemv, cfg=c
            )
    if m <= 4 and "evict" in families:  # the GEMV's weight loads with evict_first, beside
        for c in hopper_configs.candidates("gemv", m):
            cc = dataclasses.replace(c, evict_first=1 - c.evict_first)
            name = "evict " + " ".join(map(str, dataclasses.astuple(cc)))
            out[name] = functools.partial(triton_hopper.run_gemv, cfg=cc)
    if m >= 32 and "ws" in families:  # hopper-ws's kernel at every tile, below its buckets too
        for bn, bt, st in WS:
            if bt <= 2 * m:
                cfg = hopper_configs.WsConfig(bn, bt, st)
                out[f"ws {bn} {bt} {st}"] = functools.partial(triton_hopper.run_ws, cfg=cfg)
    if m >= 33 and "wsw" in families:  # hopper-ws's tiles, each step one wgmma over the
        # whole 128-token tile instead of two over its 64-token halves
        for c in WSW:
            if c.block_t <= 2 * m:
                name = "wsw " + " ".join(map(str, dataclasses.astuple(c)))
                out[name] = functools.partial(triton_hopper.run_ws, cfg=c)
    if m >= 512 and "dq" in families:
        for t in DQ:
            cfg = hopper_configs.GemmTile(*t)
            out["dq " + "x".join(map(str, t))] = functools.partial(dequant.run_hopper, cfg=cfg)
    for name, limit in (OLD if "old" in families else {}).items():
        if limit is None or m <= limit:
            out[name] = triton_fp4.make_runner(Problem(n=1, k=16, m_bucket=1), name)
    if m <= 64 and "occ" in families:  # smaller tiles split further: more programs per SM
        for c in OCC:
            if c.block_t >= m and (c.block_t == 16 or c.block_t < 2 * m):
                out["occ " + " ".join(map(str, dataclasses.astuple(c)))] = functools.partial(
                    triton_hopper.run_mma, cfg=c
                )
    if m > 512 and "mid" in families:  # tiles that may fill the SMs' waves better than
        # 128 x 256 between the powers of two (fp4select warm --vs-bf16 on Llama-3.1-8B's shapes)
        for c in hopper_configs.candidates("ws", 512):
            name = "mid " + " ".join(map(str, dataclasses.astuple(c)))
            out[name] = functools.partial(triton_hopper.run_ws, cfg=c)
    if m >= 256 and "stream" in families:  # the tiles' last wave in runs (stream-K), beside
        # the same tiles split as today, where the waves leave SMs idle between the powers of two
        for c in STREAM:
            for split in (-1, 0):
                cfg = dataclasses.replace(c, split=split)
                name = ("stream " if split < 0 else "ws ") + " ".join(
                    map(str, dataclasses.astuple(cfg))
                )
                out[name] = functools.partial(triton_hopper.run_ws, cfg=cfg)
    if m <= 64 and "tiled" in families:  # each tactic on both layouts, side by side
        kinds = (["gemv"] if m <= 8 else []) + ["mma"]
        runs = {"gemv": triton_hopper.run_gemv, "mma": triton_hopper.run_mma}
        for kind in kinds:
            extra = TILED_EXTRA if kind == "mma" and m <= 16 else []
            for c in (*hopper_configs.candidates(kind, m), *extra):
                tactic = " ".join(map(str, dataclasses.astuple(c)))
                out[f"{kind} {tactic}"] = functools.partial(runs[kind], cfg=c)
                out[f"tiled-{kind} {tactic}"] = functools.partial(run_tiled, kind=kind, cfg=c)
                out[f"shared-{kind} {tactic}"] = functools.partial(
                    run_tiled, kind=kind, cfg=c, shared=True
                )
                if kind == "mma" and m <= 16 and c not in extra:  # loads alone, each layout
                    own = (c.block_n, c.words_per_step)
                    for tiles, label in ((None, ""), (own, "-tiled"), ((16, 32), "-shared")):
                        name = f"floor-loads{label} {tactic}"
                        out[name] = functools.partial(run_floor, cfg=c, mma=False, tiles=tiles)
    if 33 <= m <= 2048 and "tiled" in families:  # hopper-ws's tiles with the loader warp
        for c in hopper_configs.candidates("ws", m):
            if c.loader_warp and c.split != -1:
                tactic = " ".join(map(str, dataclasses.astuple(c)))
                out[f"ws {tactic}"] = functools.partial(triton_hopper.run_ws, cfg=c)
                out[f"tiled-ws {tactic}"] = functools.partial(run_tiled, kind="ws", cfg=c)
    if "tactics" in families:  # the product's own tactic candidates at this M
        kinds = [("gemv", triton_hopper.run_gemv)] if m <= 8 else []
        kinds += [("mma", triton_hopper.run_mma)] if m <= 256 else []
        kinds += [("ws", triton_hopper.run_ws)] if 33 <= m <= 2048 else []
        for kind, run in kinds:
            for c in hopper_configs.candidates(kind, m):
                name = f"{kind} " + " ".join(map(str, dataclasses.astuple(c)))
                out[name] = functools.partial(run, cfg=c)
                if "nopdl" in families:  # the same, launched without PDL
                    out[name + " nopdl"] = functools.partial(_without_pdl, run, cfg=c)
                if "late" in families and kind == "gemv":  # the other trigger under PDL
                    # (hopper_sweep_late.json ran the mma tactics' too, before ``mma_planes``
                    # let the next launch in after its K loop always: ab05436)
                    other = dataclasses.replace(c, late=1 - c.late)
                    out[name + (" late" if other.late else " early")] = functools.partial(
                        run, cfg=other
                    )
    if m >= 64 or "old" in families:
        out["torch-dequant"] = dequant.run_torch
    if m >= 256 and "dq" not in families:
        out["hopper-dequant"] = dequant.run_hopper
    return out


def _without_pdl(run, *args, cfg):
    """``run`` as mm_fp4 with enable_pdl=False."""
    return run(*args[:10], False, cfg=cfg)


def compile_ahead(runs: dict[str, functools.partial], args: tuple) -> None:
    """Every variant's first call at once, one thread each, as tactic tuning does (their
    compiles overlap); outputs and errors are left for the checked calls that follow."""
    hopper_tactics.compile_ahead(_call, args, list(runs.values()), args[0].device)


def _call(*args, cfg: functools.partial):
    return cfg(*args)  # compile_ahead passes each variant as its "configuration"


def family(name: str) -> str:
    return name.split(" ")[0]


def is_new(name: str) -> bool:
    """Whether a variant counts for the printed ``new`` time: everything but bf16, the older
    kernels (``old``'s and ``torch-dequant``) and the floors, which compute nothing useful."""
    f = family(name)
    return f not in ("bf16", "torch-dequant", *OLD) and not f.startswith("floor")


def point(n: int, k: int, m: int, device: torch.device, families: tuple[str, ...]) -> dict:
    problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
    _TILED.clear()
    first = validate.make_inputs(problem, m, device, seed=11, with_reference=m * n * k <= 2**34)
    runs = variants(m, families)
    compile_ahead(runs, first.args(problem))
    verdicts = {}
    passed = {}
    for name, fn in runs.items():
        try:
            out = fn(*first.args(problem))
            torch.cuda.synchronize()
            if name.startswith("floor"):
                verdicts[name] = ("unchecked: a floor, not a product", None)
            elif first.ref.numel():
                res = validate.check(out, first, problem.torch_out_dtype)
                verdicts[name] = ("ok" if res.ok else "WRONG " + res.reason, res.worst_ratio)
                if not res.ok:
                    continue
            else:
                verdicts[name] = ("unchecked", None)
            passed[name] = fn
        except Exception as exc:
            verdicts[name] = (f"error {type(exc).__name__}: {str(exc)[:300]}", None)
    nbytes = first.nbytes() + m * n * 2
    sets = [first] + [
        validate.make_inputs(problem, m, device, seed=11 + i, with_reference=False)
        for i in range(1, timing.input_sets_for_cold_l2(device, nbytes, True))
    ]
    calls = {
        nm: [functools.partial(fn, *s.args(problem)) for s in sets] for nm, fn in passed.items()
    }
    for fns in calls.values():  # each variant once on each input set before any is timed:
        for fn in fns:  # what a first call makes (family tiled's copies) is not made in a graph
            fn()
    dq = []
    for s in sets[: min(len(sets), 4)]:
        a = formats.dequantize(s.a, s.a_descale, k, use_nvfp4=True, sf_layout="128x4")
        w = formats.dequantize(s.b.T, s.b_descale.T, k, use_nvfp4=True, sf_layout="128x4")
        dq.append((a.to(torch.bfloat16), w.to(torch.bfloat16)))
    calls["bf16"] = [functools.partial(torch.mm, a, w.T) for a, w in dq]
    times, _ = timing.time_interleaved(calls, device, OPTIONS)
    us = {nm: t.median_us for nm, t in times.items()}
    return {"n": n, "k": k, "m": m, "us": us, "verdicts": verdicts}


def _re_laid(name: str) -> str | None:
    """The re-laid layout a variant of family tiled reads ("tiled" or "shared"), else None."""
    return next((x for x in name.partition(" ")[0].split("-") if x in ("tiled", "shared")), None)


def layout_ratios(rows: list[dict]) -> dict[str, dict[int, list[float]]]:
    """Family tiled's answer: for each re-laid layout ("tiled", "shared", and their loads
    alone), by M, the geomean, least and most of each variant's time over the same variant's
    on the plain layout, over every shape and tactic both ran (and were exact) at."""
    found: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        us = row["us"]
        for name, t in us.items():
            head, _, rest = name.partition(" ")  # e.g. "shared-mma", "floor-loads-tiled"
            layout = _re_laid(name)
            plain = layout and us.get(
                "-".join(x for x in head.split("-") if x != layout) + " " + rest
            )
            if plain:
                found.setdefault(head, {}).setdefault(row["m"], []).append(t / plain)
    return {
        label: {
            m: [math.exp(sum(map(math.log, r)) / len(r)), min(r), max(r), len(r)]
            for m, r in sorted(by_m.items())
        }
        for label, by_m in sorted(found.items())
    }


def write(args: argparse.Namespace, device: torch.device, rows: list[dict]) -> None:
    """The JSON of the points so far: written after each, so a call's timeout keeps them."""
    record = {
        "benchmark": "hopper_sweep",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "timing": OPTIONS.to_json(),
        "rows": rows,
    }
    ratios = layout_ratios(rows)
    if ratios:
        record["layout_ratios"] = {
            k: {str(m): v for m, v in by_m.items()} for k, by_m in ratios.items()
        }
    path = Path(args.out) / f"{args.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="families (* the defaults):\n"
        + "\n".join(f"{'*' if f in FAMILIES else ' '} {f:8} {h}" for f, h in FAMILY_HELP.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--time-limit-s", type=float, default=420)
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help="comma-separated, of those below"
    )
    parser.add_argument("--name", default="hopper_sweep", help="the JSON's file name, less .json")
    args = parser.parse_args()
    families = tuple(args.families.split(","))
    unknown = [f for f in families if f not in FAMILY_HELP]
    if unknown:  # a removed family would otherwise add nothing to the sweep, silently
        parser.error(
            f"unknown families {unknown}: for a removed one, {Path(__file__).name}'s comment"
            ' "Families removed since" names the commit that holds it'
        )
    device = torch.device("cuda")
    started = time.perf_counter()
    rows = []
    for n, k, m in sweep_points(args.shapes, args.ms, args.time_limit_s):
        try:
            row = point(n, k, m, device, families)
        except Exception:
            print(f"{n}x{k} M={m} failed:\n{traceback.format_exc()}")
            continue
        rows.append(row)
        write(args, device, rows)
        us = row["us"]
        best: dict[str, tuple[float, str]] = {}
        for nm, t in us.items():
            f = family(nm)
            if f not in best or t < best[f][0]:
                best[f] = (t, nm)
        new = min((t for nm, t in us.items() if is_new(nm)), default=float("nan"))
        wrong = [nm for nm, v in row["verdicts"].items() if not v[0].startswith(("ok", "unch"))]
        print(
            f"{n:5d}x{k:5d} M={m:5d} bf16={us['bf16']:7.1f} new={new:7.1f} "
            f"ratio={new / us['bf16']:5.2f} | "
            + " ".join(
                f"{f}={t:.1f}[{nm[len(f) :].strip()}]" for f, (t, nm) in sorted(best.items())
            )
            + (f" | BAD {wrong}: {[row['verdicts'][w][0][:120] for w in wrong]}" if wrong else ""),
            flush=True,
        )
    write(args, device, rows)
    for label, by_m in layout_ratios(rows).items():  # family tiled's answer, in one table
        print(
            f"{label:22} time / plain: "
            + " ".join(
                f"M={m}: {g:.3f} ({lo:.2f}-{hi:.2f}, {n})" for m, (g, lo, hi, n) in by_m.items()
            )
        )
    print(f"wrote {Path(args.out) / args.name}.json in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
