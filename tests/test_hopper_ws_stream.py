"""``hopper-ws``'s last wave in runs of K steps (stream-K): the kernels' index arithmetic on the CPU.

Gluon kernels do not run in Triton's interpreter, so the functions that cut the units
(``_first``, ``owner``, ``_unit``) run here from their own source, with ``gl``'s
``where``/``minimum``/``maximum`` taken by numpy, and the loops of ``_loader``, ``_consumer``
and ``stream_fixup`` are walked with their bounds as written there: every (tile, step) must be
loaded in the order the consumers take it, summed once, and every tile stored once. The GPU
checks the kernels against the exact reference (``tests/test_hopper_kernels_gpu.py::
test_hopper_ws_over_runs_of_k_steps``), and their compile for sm90 is read in
``tests/test_hopper_layout.py``.
"""

from __future__ import annotations

import inspect
import types
from typing import ClassVar

import numpy as np
import pytest

pytest.importorskip("triton.experimental.gluon")

from fp4select.backends import _hopper_ws_stream as stream
from fp4select.backends import hopper_configs


class _NumpyGl:
    where = staticmethod(np.where)
    minimum = staticmethod(np.minimum)
    maximum = staticmethod(np.maximum)

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)


def _plain(jitted, **helpers):
    """A jitted function's own Python, with ``gl`` taken by numpy (and jitted helpers it
    calls by their plain forms)."""
    fn = jitted.fn
    scope = dict(fn.__globals__, gl=_NumpyGl, **helpers)
    return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__)


first, owner, unit = _plain(stream._first), _plain(stream.owner), _plain(stream._unit)
tile_at = _plain(stream.tile_at)
advance = _plain(stream._advance, tile_at=tile_at)
BN, BT, GROUP, STAGES = 128, 256, 8, 3


def _walk(tiles: int, steps: int, sms: int, split: int):
    """What each program loads and sums, and what the fixup adds, as the kernels' loops do."""
    programs, whole = hopper_configs.stream_plan(tiles, steps, sms, split)
    S, P = steps, programs
    M, N = 256 * 3, BN * -(-tiles // 3)  # tiles of BN x BT: three a column of weight tiles
    first_tile = whole * P
    q, r = divmod((tiles - first_tile) * S, P)
    base = whole * P * S
    stored: dict[int, list] = {}  # tile -> who stored it
    slots: dict[tuple[int, int], tuple[int, int, int]] = {}  # (program, slot) -> (tile, k0, k1)
    for p in range(P):
        u0, u1 = base + int(first(p, q, r)), base + int(first(p + 1, q, r))
        assert (u0 - base, u1 - base) == hopper_configs.stream_runs((tiles - first_tile) * S, P)[p]
        total = whole * S + u1 - u0
        loads = [tuple(map(int, unit(g, p, P, whole, u0, S))) for g in range(total)]
        # the loading consumer's cursor (``_advance``) from unit STAGES on, as the kernel keeps
        # it: the same units, and each tile's first row and token
        # the loader warp's cursor (``_advance``) from unit 0, the loading consumer's from unit
        # STAGES, as the kernel keeps them: the same units, and each tile's first row and token
        for start in (0, STAGES):
            if total > start:
                cursor = (*unit(start, p, P, whole, u0, S),)
                cursor = (*cursor, *tile_at(cursor[0], M, N, BN, BT, GROUP))
            for g in range(start, total):
                t, i, off_n, off_t = map(int, cursor)
                assert (t, i) == loads[g] and (off_n, off_t) == tuple(
                    map(int, tile_at(t, M, N, BN, BT, GROUP))
                )
                if g + 1 < total:
                    cursor = advance(
                        *cursor, g, P, whole * S, u0 // S, u0 % S, S, M, N, BN, BT, GROUP
                    )  # fmt: skip
        taken = []  # (tile, step) in the consumers' order: stage g % STAGES is g-th unit's
        for n in range(whole):
            t = p + n * P
            taken += [(t, i) for i in range(S)]
            stored.setdefault(t, []).append(("whole", p))
        t_end = int(np.where(u1 > u0, (u1 - 1) // S + 1, u0 // S))
        for t in range(u0 // S, t_end):
            k0, k1 = max(u0 - t * S, 0), min(u1 - t * S, S)
            assert 0 <= k0 < k1 <= S
            taken += [(t, i) for i in range(k0, k1)]
            if k1 - k0 == S:
                stored.setdefault(t, []).append(("run", p))
            else:
                slot = int(t * S > u0)
                assert (p, slot) not in slots  # at most a first and a last partial tile
                slots[p, slot] = (t, k0, k1)
        assert taken == loads
    for t in range(tiles - first_tile):
        p_first, p_last = int(owner(t * S, q, r)), int(owner(t * S + S - 1, q, r))
        if p_first == p_last:
            continue
        covered = []
        for p in range(p_first, p_last + 1):
            slot = int(t * S > int(first(p, q, r)))
            tile, k0, k1 = slots[p, slot]
            assert tile == first_tile + t
            covered += range(k0, k1)
        assert sorted(covered) == list(range(S))  # each step's sums added once
        stored.setdefault(first_tile + t, []).append(("fixup", t))
    assert sorted(stored) == list(range(tiles))
    assert all(len(who) == 1 for who in stored.values()), stored
    return programs, whole, len(slots)


@pytest.mark.parametrize(
    "tiles,steps,split",
    [
        (72, 56, 1),  # below a wave: every tile in runs
        (78, 448, 1),
        (10, 17, 2),  # few units: programs of 8 or more
        (144, 56, 1),  # a whole tile each, 12 in runs
        (133, 16, 1),  # one tile in runs over 132 programs: most runs empty (q = 0)
        (133, 200, 1),
        (448, 16, 1),  # three whole tiles each
        (300, 7, 1),  # runs shorter than a tile's steps, tiles shared by many
        (1, 64, 1),  # one tile over 8 programs
    ],
)
def test_every_step_is_loaded_in_order_summed_once_and_every_tile_stored_once(tiles, steps, split):
    programs, whole, partials = _walk(tiles, steps, 132, split)
    assert programs >= 1 and (whole == 0 or programs == 132)
    assert partials <= 2 * programs  # two slots a program: its run's first and last tile


def test_the_walk_can_fail(monkeypatch):
    """The checks above can fail: a loader taking a run's units in another order than the
    consumers, a fixup that skips a tile's last sharer, a loading consumer's cursor that
    steps to the wrong whole tile."""
    real_unit, real_owner = unit, owner

    def swapped(g, p, P, whole, u0, S):  # a run's first two units loaded the other way round
        g = g + 1 if g == whole * S else g - 1 if g == whole * S + 1 else g
        return real_unit(g, p, P, whole, u0, S)

    monkeypatch.setitem(globals(), "unit", swapped)
    with pytest.raises(AssertionError):
        _walk(72, 56, 132, 1)
    monkeypatch.setitem(globals(), "unit", real_unit)
    _walk(72, 56, 132, 1)
    monkeypatch.setitem(globals(), "owner", lambda u, q, r: real_owner(u, q, r) - (u % 56 == 55))
    with pytest.raises(AssertionError):
        _walk(72, 56, 132, 1)
    monkeypatch.setitem(globals(), "owner", real_owner)
    real_advance = advance

    def whole_tiles_in_a_row(t, i, off_n, off_t, g, P, *rest):  # forgets the stride P
        return real_advance(t, i, off_n, off_t, g, 1, *rest)

    _walk(144, 56, 132, 1)
    monkeypatch.setitem(globals(), "advance", whole_tiles_in_a_row)
    with pytest.raises(AssertionError):
        _walk(300, 7, 132, 1)  # two whole tiles a program


@pytest.mark.parametrize("sms", [1, 7, 78, 132])
def test_owner_inverts_the_runs(sms):
    for units in (1, 7, 8, 100, 672, 4032):
        programs = min(sms, units)
        q, r = divmod(units, programs)
        runs = hopper_configs.stream_runs(units, programs)
        for p, (lo, hi) in enumerate(runs):
            assert int(first(p, q, r)) == lo
            assert all(int(owner(u, q, r)) == p for u in range(lo, hi))


class _Recorded:
    """A ``hopper_launch.Launch`` that records its kernel, grid, options and arguments instead
    of launching (no GPU here): the plan's host side runs as it would on one."""

    calls: ClassVar[list] = []

    def __init__(self, fn, grid, **options):
        self.fn, self.grid, self.options, self.direct = fn, grid, options, False

    def __call__(self, *args):
        self.calls.append((self.fn, self.grid, self.options, args))


@pytest.mark.parametrize(
    "n,k,m,kernel,grid",
    [
        (4608, 7168, 1024, "mma_ws_stream", (132,)),  # 144 tiles: a whole one each, 12 in runs
        (4608, 7168, 512, "mma_ws_stream", (132,)),  # 72 tiles, all in runs
        (8192, 8192, 512, "mma_ws", (128, 1)),  # 128 tiles fill the SMs: nothing cut
    ],
)
def test_the_plan_launches_each_kernel_with_every_parameter_it_declares(
    monkeypatch, n, k, m, kernel, grid
):
    """``_ws_plan`` for ``split = -1`` on the CPU, its launches recorded: the stream kernel and
    its fixup where ``stream_plan`` cuts (the runs' sizes as the plan says), ``mma_ws`` where
    it does not, and every launch passing each of its kernel's parameters exactly once."""
    from fp4select import validate
    from fp4select.backends import triton_fp4, triton_hopper
    from fp4select.keys import Problem, m_bucket

    monkeypatch.setattr(triton_hopper, "Launch", _Recorded)
    monkeypatch.setattr(triton_fp4, "_sms", lambda device: 132)
    monkeypatch.setattr(_Recorded, "calls", [])
    problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
    inputs = validate.make_inputs(problem, m, "cpu", seed=1, with_reference=False)
    cfg = hopper_configs.WsConfig(128, 256, 3, -1, 256, 0)
    triton_hopper.run_ws(*inputs.args(problem), cfg=cfg)
    launched = {fn.fn.__name__: (g, options, args) for fn, g, options, args in _Recorded.calls}
    assert "decode_planes" in launched and launched[kernel][0] == grid
    for fn, _, options, args in _Recorded.calls:
        params = inspect.signature(fn.fn).parameters
        given = list(params)[: len(args)] + [o for o in options if o in params]
        required = [p for p, v in params.items() if v.default is inspect.Parameter.empty]
        assert len(given) == len(set(given)) and set(required) <= set(given), fn.fn.__name__
    if kernel == "mma_ws_stream":
        tiles, steps = -(-n // 128) * -(-m // 256), k // 2 // 4 // 16
        programs, whole = hopper_configs.stream_plan(tiles, steps, 132, 1)
        args = launched["mma_ws_stream"][2]
        assert args[-4:] == (steps, whole, *divmod((tiles - whole * programs) * steps, programs))
        assert launched["stream_fixup"][0] == (tiles - whole * programs, 256 // 16)
        assert "mma_ws" not in launched and "reduce_split" not in launched
