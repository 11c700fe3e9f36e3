"""The Hopper kernels' configurations: the tile shapes, the table per M, and the tactics.

Design rules:

* Data only (frozen dataclasses of ints) and no imports of torch or triton: the configurations
  are what a tactic record read from disk may name, so they live apart from the code that runs.
* The tables were chosen on the H200 with ``benchmarks/hopper_sweep.py`` (results/hopper_sweep*.json):
  the fastest configuration at N x K = 8192 x 8192, 28672 x 4096 and 4096 x 14336, or within 3%.
  The tactic candidates are the ones that won at some shape; probing times them per shape.
"""

from __future__ import annotations

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


GEMV_BY_M = ((1, GemvConfig(8, 128, 2)), (8, GemvConfig(8, 64, 1)))
MMA_BY_M = (
    (16, MmaConfig(128, 16, 32, 4, 3)),
    (32, MmaConfig(128, 32, 16, 4, 3)),
    (64, MmaConfig(128, 64, 16, 4, 4)),
    (None, MmaConfig(128, 128, 16, 4, 3)),
)
PREFILL = MmaConfig(128, 256, 16, 8, 3, split=1)


def for_m(table: tuple[tuple[int | None, Any], ...], m: int) -> Any:
    for limit, cfg in table:
        if limit is None or m <= limit:
            return cfg
    return table[-1][1]


GEMV_TACTICS = (
    GemvConfig(8, 128, 2),
    GemvConfig(4, 128, 2),
    GemvConfig(4, 256, 4),
    GemvConfig(8, 64, 1),
)
MMA_TACTICS: tuple[tuple[int, tuple[MmaConfig, ...]], ...] = (
    (
        16,
        (
            MmaConfig(128, 16, 32, 4, 3),
            MmaConfig(128, 16, 16, 4, 3),
            MmaConfig(64, 16, 32, 4, 4),
        ),
    ),
    (
        32,
        (
            MmaConfig(128, 32, 16, 4, 3),
            MmaConfig(128, 32, 16, 4, 3, 8),
            MmaConfig(64, 32, 16, 4, 3),
        ),
    ),
    (64, (MmaConfig(128, 64, 16, 4, 4), MmaConfig(128, 64, 16, 4, 3), MmaConfig(64, 64, 16, 4, 3))),
    (
        256,
        (
            MmaConfig(128, 128, 16, 4, 3),
            MmaConfig(128, 128, 16, 8, 3),
            MmaConfig(128, 64, 16, 4, 3),
        ),
    ),
)
PREFILL_TACTICS = (
    PREFILL,
    MmaConfig(128, 128, 16, 4, 3, split=1),
    MmaConfig(256, 128, 16, 8, 3, split=1),
)
# Below this M hopper-prefill never won a sweep point: timing its tiles would only cost warm-up.
PREFILL_TUNED_FROM = 128


def candidates(kind: str, m: int | None) -> tuple[Any, ...]:
    """The tactic candidates of ``kind`` ("gemv", "mma" or "prefill") at M = m; every one when
    m is None."""
    if kind == "gemv":
        return GEMV_TACTICS
    if kind == "prefill":
        return PREFILL_TACTICS if m is None or m >= PREFILL_TUNED_FROM else ()
    if kind != "mma":
        return ()
    if m is None:
        return tuple(c for _, cs in MMA_TACTICS for c in cs)
    for limit, cfgs in MMA_TACTICS:
        if m <= limit:
            return cfgs
    return MMA_TACTICS[-1][1]


def default(kind: str, m: int) -> Any:
    """The table's configuration of ``kind`` at M = m."""
    if kind == "prefill":
        return PREFILL
    return for_m(GEMV_BY_M if kind == "gemv" else MMA_BY_M, m)
