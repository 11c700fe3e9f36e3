"""The Hopper kernels' configurations: the tile shapes, the table per M, and the tactics.

Design rules:

* Data only (frozen dataclasses of ints) and no imports of torch or triton: the configurations
  are what a tactic record read from disk may name, so they live apart from the code that runs.
* The tables were chosen with ``benchmarks/hopper_sweep.py`` (docs/hopper_kernels.md): the
  fastest configuration at N x K = 8192 x 8192, 28672 x 4096 and 4096 x 14336, or within 3%.
  The tactic candidates are the ones that won at some shape; probing times them per shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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
    prefetch: int = 0  # 1: the next step's weight is loaded before this step's math
    evict_first: int = 0  # 1: the weight's loads ask L2 to evict it first (it is read once)
    late: int = 0  # 1: under PDL the next launch is let in after the K loop, not at the start
    pre: int = 0  # 1: a decoded once per call by a kernel of its own (``gemv_a_words``)


@dataclass(frozen=True)
class MmaConfig:
    block_n: int
    block_t: int
    words_per_step: int
    num_warps: int
    num_stages: int
    split: int = 0  # K split across programs; 0: choose from the SM count
    group: int = 8  # weight tiles visited together, sharing activation tiles in L2
    sum_last: int = 0  # 1: a K split is summed by each tile's last program, not a kernel of its own

    def __post_init__(self) -> None:
        _check_step(self.words_per_step)


@dataclass(frozen=True)
class WsConfig:
    """``hopper-ws``'s tile: weight rows (128 or 256: each consumer warpgroup takes half; 64:
    the two take alternate steps), tokens (64, 128 or 256), TMA stages, the K split (1: none;
    0: choose from the SM count; -1: as 0, but where the tiles leave SMs idle, the last wave's
    tiles cut into equal runs of K steps, stream-K: ``stream_plan``; 128 rows or more), the
    tokens one wgmma takes (64: a 128-token tile is
    multiplied in two halves; or block_t: one wgmma over the whole tile), whether a warp
    of its own loads the stages (1) or the second consumer does (0: 8 warps, so 255 registers
    a thread where 12 warps leave 168; 128 rows or more)."""

    block_n: int
    block_t: int
    stages: int
    split: int = 1
    mma_tokens: int = 64
    loader_warp: int = 1

    def __post_init__(self) -> None:
        if self.mma_tokens not in (64, self.block_t):
            raise ValueError(f"mma_tokens must be 64 or block_t, got {self.mma_tokens}")
        if self.loader_warp not in (0, 1) or (not self.loader_warp and self.block_n < 128):
            raise ValueError(f"loader_warp must be 1, or 0 with block_n >= 128, got {self}")
        if self.split < -1 or (self.split == -1 and self.block_n < 128):
            raise ValueError(
                "split must be >= 0 (1: none, 0: from the SM count), or -1 (stream-K) with "
                f"block_n >= 128, got {self}"
            )


@dataclass(frozen=True)
class GemmTile:
    """``hopper-dequant``'s GEMM tile (its decode passes have no choices)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


GEMV_BY_M = ((2, GemvConfig(8, 128, 2, late=1)), (8, GemvConfig(4, 64, 1, late=1, pre=1)))
# Up to 32 tokens the K split is summed by each tile's last program (``sum_last``), which was
# faster than a reduction kernel of its own; 64-token tiles were slower with it (one program
# then reads 128 x 64 partial sums per split). Measured: docs/hopper_kernels.md, 'Fusing
# into `hopper-mma`'s main kernel'.
MMA_BY_M = (
    (16, MmaConfig(128, 16, 32, 4, 3, sum_last=1)),
    (32, MmaConfig(128, 32, 16, 4, 3, sum_last=1)),
    (64, MmaConfig(128, 64, 16, 4, 3)),
    (None, MmaConfig(64, 128, 16, 4, 3)),
)


def for_m(table: tuple[tuple[int | None, Any], ...], m: int) -> Any:
    for limit, cfg in table:
        if limit is None or m <= limit:
            return cfg
    return table[-1][1]


# By M, as the tensor-core ones. At M = 1-2 the four whose best came closest to the best of 16
# configurations at each of ten shapes; at M = 3-8 the prefetching 64-block steps (8 or 4 rows)
# and the 128-block steps that load the weight with evict_first, still the best four of the 16
# there. Each candidate costs deploying a compile and a tuning per key: those that won their
# key nowhere, or cost little to drop, were dropped (here 8 x 256 and 4 x 64 prefetching; in
# MMA_TACTICS 128 x 32 split 8, 128 x 64 of 4 stages, 64 x 64 of either kind). Measured:
# docs/hopper_kernels.md, 'The GEMV's loop converted layouts', 'Which tactics earn their
# compile'.
#
# Under PDL a plain GEMV replayed back to back lost to its own next launch's early programs;
# letting the next launch in after the K loop instead of at the start (``late``) won that
# back, alone and in a graph of layers (quantize, then the GEMV), so all trigger late but
# 4 x 256, which alone was no faster so. Every tiling swept again with the late trigger: 4 x 128
# at M = 1-2 and 4 x 64 at M = 3-8 joined; again with the biased decode, 8 x 256 at M <= 2
# (narrow layers), and the two persistent forms (each program taking row groups in turn), which
# no shape picked any more, left. Measured: docs/hopper_kernels.md, 'PDL's trigger after the
# K loop', 'Every GEMV tiling again', 'The GEMV's decode in fewer instructions'.
#
# From M = 3, a decoded once per call by a kernel of its own (``pre``): the K loop then does
# only the weight's part, which made 4-row programs (twice the programs, half the registers)
# the fastest; the three best took over from the four before (at M = 4 the best before, theirs
# or hopper-mma's, took 1.08x the time of the best of the three).
# At M <= 2 the extra launch costs more than the loop saves. Measured: docs/hopper_kernels.md,
# 'a decoded once per call'.
GEMV_TACTICS: tuple[tuple[int, tuple[GemvConfig, ...]], ...] = (
    (
        2,
        (
            GemvConfig(8, 128, 2, late=1),
            GemvConfig(4, 256, 4),
            GemvConfig(8, 64, 1, late=1),
            GemvConfig(4, 128, 2, late=1),
            GemvConfig(8, 256, 4, late=1),
        ),
    ),
    (
        8,
        (
            GemvConfig(4, 64, 1, late=1, pre=1),
            GemvConfig(4, 64, 1, 1, late=1, pre=1),
            GemvConfig(4, 128, 2, evict_first=1, late=1, pre=1),
        ),
    ),
)
MMA_TACTICS: tuple[tuple[int, tuple[MmaConfig, ...]], ...] = (
    # 64-row tiles use about half the registers of 128-row ones, so four programs fit an SM:
    # split into 4 or 8 (the automatic split makes about two an SM) they were the fastest at
    # most shapes, the 128-row tile at the others (measured: docs/hopper_kernels.md, 'What
    # holds the loop'). The two splits are one compiled kernel.
    (
        16,
        (
            MmaConfig(128, 16, 32, 4, 3, sum_last=1),
            MmaConfig(64, 16, 32, 4, 4, 4, sum_last=1),
            MmaConfig(64, 16, 32, 4, 4, 8, sum_last=1),
        ),
    ),
    # At M = 17-32 likewise a 64-row tile of 32-word steps split into 4 (measured: the same).
    (
        32,
        (
            MmaConfig(128, 32, 16, 4, 3, sum_last=1),
            MmaConfig(64, 32, 32, 4, 3, 4, sum_last=1),
        ),
    ),
    (64, (MmaConfig(128, 64, 16, 4, 3),)),
    # From M = 65 the tiles chosen with each step's wgmma waited for
    # (``_hopper_kernels.retired``): 128 tokens wide, they were slower with the wait and lost
    # to 64 x 128 and 128 x 64 (measured: docs/hopper_kernels.md, the hazard section).
    (
        256,
        (
            MmaConfig(64, 128, 16, 4, 3),
            MmaConfig(128, 64, 16, 4, 3),
        ),
    ),
)
# hopper-dequant's persistent GEMM: 128 x 256 tiles, or 128 x 128 where those fill the last
# wave of SMs so much better that it outweighs the large tile's own speed (``dequant_tile``).
DEQUANT_LARGE = GemmTile(128, 256, 64, 8, 4)
DEQUANT_SMALL = GemmTile(128, 128, 64, 4, 4)
# How much better the small tile must fill the SMs' waves: the margin with which the rule
# names the sweep's faster tile (docs/hopper_kernels.md, '`hopper-dequant`'s GEMM tile').
SMALL_TILE_FILL_GAIN = 1.08


def _wave_fill(tiles: int, sms: int) -> float:
    """The share of the SMs' time a persistent grid of ``tiles`` equal tiles keeps busy."""
    return tiles / (-(-tiles // sms) * sms)


def dequant_tile(m: int, n: int, sms: int) -> GemmTile:
    """The tile whose waves fill the SMs best, the large one unless the small one fills them
    ``SMALL_TILE_FILL_GAIN`` better (a heuristic, not a tactic: timing both at every key cost
    more warm-up than the few percent it found)."""

    def fill(tile: GemmTile) -> float:
        return _wave_fill(-(-m // tile.block_m) * -(-n // tile.block_n), max(sms, 1))

    small_wins = fill(DEQUANT_SMALL) > fill(DEQUANT_LARGE) * SMALL_TILE_FILL_GAIN
    return DEQUANT_SMALL if small_wins else DEQUANT_LARGE


# hopper-ws: its tiles by M (the bucket's top M at most ``limit``), each with K split where its
# tiles leave SMs idle (split 0: ``ws_split``), which narrow layers need.
# - the 128-token tiles take one wgmma over all their tokens (mma_tokens 128), one stage deeper
#   than their halves ran fastest with: faster tile for tile;
# - from M = 129 a tile of 128 weight rows x 256 tokens, which only fits in registers without
#   the loader warp (loader_warp 0: 255 registers a thread, not 168): the fastest tile at most
#   points, and faster than hopper-dequant at M = 2048 on most shapes. Each candidate costs
#   deploying a compile and a tuning per key, so M = 513-2048 time this tile alone;
# - from M = 129 the 128 x 256 tile cuts the last wave of tiles into runs of K steps where it
#   leaves many SMs idle (split -1, stream-K: ``stream_plan``; elsewhere the same kernel as
#   split 0): at M = 512-3072 on six shapes the pick took 0.81-1.0x the time it took split,
#   0.965x in the geomean. The 128 x 128 tile in runs changed the pick at none of those 54
#   points and at 1 of the record's 208, and cost deploying two compiles: it stays split;
# - 64-row tiles (the consumers on alternate steps) and 256 rows x 128 tokens (8 warps) for
#   the narrower layers and M <= 128.
# Measured (every configuration checked first): docs/hopper_kernels.md, '`hopper-ws` splitting
# K', '`hopper-ws` multiplying each plane', 'What held `hopper-ws` at M = 256-512', 'Stream-K'.
WS_TACTICS: tuple[tuple[int, tuple[WsConfig, ...]], ...] = (
    (64, (WsConfig(64, 64, 4, 0),)),  # the fastest ws tile at every M = 64 point timed
    (
        128,
        (
            WsConfig(64, 128, 5, 0, 128),
            WsConfig(128, 128, 3, 0, 128),
            WsConfig(256, 128, 3, 0, 128, 0),
        ),
    ),
    (
        512,
        (
            WsConfig(128, 256, 3, -1, 256, 0),
            WsConfig(128, 128, 3, 0, 128),
            WsConfig(64, 128, 5, 0, 128),  # the fastest of the three at 4096 x 7168, M = 256
        ),
    ),
    (2048, (WsConfig(128, 256, 3, -1, 256, 0),)),
)


def candidates(kind: str, m: int | None) -> tuple[Any, ...]:
    """The tactic candidates of ``kind`` ("gemv", "mma" or "ws") at M = m; every one when m is
    None."""
    if kind not in ("gemv", "mma", "ws"):
        return ()
    table: tuple[tuple[int, tuple[Any, ...]], ...] = {
        "gemv": GEMV_TACTICS, "mma": MMA_TACTICS, "ws": WS_TACTICS
    }[kind]  # fmt: skip
    if m is None:
        return tuple(dict.fromkeys(c for _, cs in table for c in cs))
    for limit, cfgs in table:
        if m <= limit:
            return cfgs
    return table[-1][1]


def default(kind: str, m: int) -> Any:
    """The table's configuration of ``kind`` at M = m."""
    if kind == "ws":
        return candidates("ws", m)[0]
    return for_m(GEMV_BY_M if kind == "gemv" else MMA_BY_M, m)


def mma_split(m: int, n: int, kw: int, cfg: MmaConfig, sms: int) -> int:
    """``hopper-mma``'s K split: cfg's if set, else about two programs an SM."""
    if cfg.split:
        return cfg.split
    # About two programs per SM: each program runs a long serial K loop with 4-8 warps, so
    # fewer leave the SMs waiting on memory (docs/hopper_kernels.md, '`hopper-mma`'s K split').
    tiles = math.ceil(n / cfg.block_n) * math.ceil(m / cfg.block_t)
    steps = math.ceil(kw / cfg.words_per_step)
    split = max(1, min(16, steps, round(2 * sms / max(tiles, 1))))
    per = math.ceil(steps / split)
    return math.ceil(steps / per)


def ws_split(tiles: int, steps: int, cfg: WsConfig, sms: int) -> int:
    """K split: cfg's if positive, else so that the programs fill the SMs at most once (one
    program holds an SM: its registers), each keeping at least 8 steps. Rounded down: 66-88
    tiles split in two (132 SMs) ran slower than unsplit, while fewer tiles gained much
    (measured: docs/hopper_kernels.md, '`hopper-ws` splitting K')."""
    split = cfg.split if cfg.split > 0 else max(1, min(16, steps // 8, sms // max(tiles, 1)))
    per = math.ceil(steps / split)
    return math.ceil(steps / per)  # no program without a step


# Stream-K (``WsConfig.split = -1``, ``_hopper_ws_stream``): K steps a program's run takes at
# least; the share of the SMs' waves the tiles (split as ``ws_split`` splits them) must keep
# busy for nothing to be cut; and the largest share of the SMs the last, partial wave may keep
# busy for its tiles to be cut. On the H200 tiles filling 97% of the SMs ran 1.36x slower cut
# into runs, and 72 tiles on 132 SMs 0.76x. At M = 512-3072, where the tiles left SMs idle, the
# runs gained 2-28% at all 37 points whose last wave kept 9-64% of the SMs busy (both tiles),
# and the 128 x 256 tile lost 3-8% at five of the six where it kept 70-82% (96, 108 and 224
# tiles; docs/hopper_kernels.md, 'Stream-K').
STREAM_MIN_UNITS = 8
STREAM_WAVE_FILL = 0.9
STREAM_LAST_WAVE = 0.66


def stream_runs(units: int, programs: int) -> list[tuple[int, int]]:
    """Each program's units ``[first, end)``, in order: the first ``units % programs`` take one
    more. The kernel and its fixup compute the same runs (``_hopper_ws_stream._first``)."""
    q, r = divmod(units, programs)
    return [(p * q + min(p, r), (p + 1) * q + min(p + 1, r)) for p in range(programs)]


def stream_plan(tiles: int, steps: int, sms: int, split: int) -> tuple[int, int] | None:
    """(programs, whole tiles each takes first), or None where the tiles, K split in ``split``,
    keep ``STREAM_WAVE_FILL`` of the SMs' waves busy, or their last wave more than
    ``STREAM_LAST_WAVE`` of the SMs (then the runs' partial sums cost more than the idle SMs).
    From a whole wave of tiles on, one program an SM takes ``tiles // sms`` whole tiles
    (p, p + sms, ...) and only the last, partial wave's tiles are cut into runs, so that few
    tiles are shared; below a wave every tile is cut, into runs of at least
    ``STREAM_MIN_UNITS`` steps, and only where that keeps more SMs busy than the split tiles
    do (2304 x 4096 at M = 512: 36 tiles split in two and 72 runs of 8 steps both fill 55%;
    the runs took twice the split tiles' time in the first form's sweep)."""
    busy = tiles * split
    if sms < 1 or busy < 1:
        return None
    fill = busy / (-(-busy // sms) * sms)
    if fill >= STREAM_WAVE_FILL or (busy % sms) / sms > STREAM_LAST_WAVE:
        return None
    if tiles >= sms:
        return sms, tiles // sms
    programs = max(1, min(sms, tiles * steps // STREAM_MIN_UNITS))
    return (programs, 0) if programs / sms > fill else None
