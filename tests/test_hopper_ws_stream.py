"""``hopper-ws`` over equal runs of K steps (stream-K): how the runs are cut, on the CPU.

The kernel computes each program's run as ``runs`` does, and the fixup finds a unit's
program with ``owner``; both are checked against the exact reference on the GPU
(``tests/test_hopper_kernels_gpu.py::test_hopper_ws_over_runs_of_k_steps``), and the
kernels' compile for sm90 in ``tests/test_hopper_layout.py``.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("triton.experimental.gluon")

from fp4select.backends import _hopper_ws_stream as stream
from fp4select.backends import hopper_configs


@pytest.mark.parametrize("units", [1, 7, 8, 9, 132 * 8, 132 * 8 + 1, 4032, 8192, 917504])
@pytest.mark.parametrize("sms", [1, 78, 132])
def test_the_runs_cover_every_unit_once_in_order_and_evenly(units, sms):
    programs = stream.programs_for(units, sms)
    assert 1 <= programs <= sms
    assert programs == 1 or units // programs >= stream.MIN_UNITS
    cut = stream.runs(units, programs)
    assert cut[0][0] == 0 and cut[-1][1] == units
    assert all(end == nxt for (_, end), (nxt, _) in itertools.pairwise(cut))
    sizes = {end - first for first, end in cut}
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize(
    "tiles,steps,split,want",
    [
        (128, 64, 1, None),  # 8192 x 8192, M = 512, 128 x 256: 97% of the SMs busy unsplit
        (64, 64, 2, None),  # M = 64: split in two, 97%
        (72, 56, 1, (132, 0)),  # 4608 x 7168, M = 512: 55%, every tile in runs
        (10, 17, 2, (21, 0)),  # 520 x 2080, M = 300: 21 programs of at least 8 steps
        (448, 16, 1, (132, 2)),  # 3.4 waves: two whole tiles a program, 184 tiles in runs
        (528, 32, 1, None),  # four whole waves
    ],
)
def test_runs_are_cut_only_where_the_tiles_leave_sms_idle(tiles, steps, split, want):
    assert stream.plan(tiles, steps, 132, split) == want
    if want is not None:
        programs, whole = want
        assert programs <= tiles * steps // stream.MIN_UNITS
        left = tiles - whole * programs  # the tiles cut into runs: one to two waves' worth
        assert whole == 0 or programs <= left < 2 * programs


@pytest.mark.parametrize(
    "bad",
    [
        dict(block_n=64, block_t=128, stages=5, split=-1),  # 64 rows: consumers alternate steps
        dict(block_n=128, block_t=128, stages=4, split=-1, mma_tokens=128, loader_warp=0, phases=2),
        dict(block_n=128, block_t=128, stages=3, split=-2),
    ],
)
def test_runs_of_k_steps_take_both_consumers_on_every_step(bad):
    assert hopper_configs.WsConfig(128, 256, 3, -1, 256, 0).split == -1
    with pytest.raises(ValueError, match="split must be >= 0, or -1 with block_n >= 128"):
        hopper_configs.WsConfig(**bad)
