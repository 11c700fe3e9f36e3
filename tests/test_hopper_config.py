"""The Hopper kernels' host side on the CPU: configuration by M, the split-K rule, word views."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from fp4select import settings, validate
from fp4select.backends import hopper_args
from fp4select.backends import hopper_configs as hc
from fp4select.backends import hopper_tactics as ht
from fp4select.backends import triton_hopper as th
from fp4select.keys import Problem, m_bucket


def test_each_m_gets_the_configuration_its_table_names():
    assert hc.for_m(hc.GEMV_BY_M, 1) == hc.GEMV_BY_M[0][1]
    assert hc.for_m(hc.GEMV_BY_M, 5) == hc.GEMV_BY_M[1][1]
    assert hc.for_m(hc.MMA_BY_M, 16).block_t == 16
    assert hc.for_m(hc.MMA_BY_M, 17).block_t == 32
    assert hc.for_m(hc.MMA_BY_M, 33).block_t == 64
    assert hc.for_m(hc.MMA_BY_M, 100_000) == hc.MMA_BY_M[-1][1]


def test_split_k_aims_at_two_programs_per_sm():
    cfg = th.MmaConfig(128, 16, 32, 4, 3, 0)
    kw = 8192 // 8
    # The H200 sweep's best splits at M = 16: 4 at N = 8192, 8 at N = 4096, none at N = 28672.
    assert hc.mma_split(16, 8192, kw, cfg, 132) == 4
    assert hc.mma_split(16, 4096, 14336 // 8, cfg, 132) == 8
    assert hc.mma_split(16, 28672, 4096 // 8, cfg, 132) == 1
    assert hc.mma_split(16, 128, kw, cfg, 132) == 16  # capped
    assert hc.mma_split(16, 128, 32, cfg, 132) == 1  # never more splits than K steps
    assert hc.mma_split(16, 8192, kw, th.MmaConfig(128, 16, 32, 4, 3, 3), 132) == 3  # pinned


def test_hopper_ws_splits_k_to_fill_the_sms_once():
    small = hc.WsConfig(128, 128, 2, 0)
    steps = 8192 // 8 // 16  # N = K = 8192, M = 128: 64 tiles of 128 rows, 64 steps
    assert hc.ws_split(64, steps, small, 132) == 2
    assert hc.ws_split(36, 7168 // 128, small, 132) == 3  # 4608 x 7168
    assert hc.ws_split(72, 7168 // 128, small, 132) == 1  # rounded down: not two of 72
    assert hc.ws_split(224, 4096 // 128, small, 132) == 1  # N = 28672: tiles enough
    assert hc.ws_split(2, steps, small, 132) == 8  # every split keeps 8 steps or more
    assert hc.ws_split(2, 20, small, 132) == 2
    assert hc.ws_split(64, steps, hc.WsConfig(128, 16, 8, 3), 132) == 3  # pinned
    # never a program without a step: 7 steps in 4 splits would leave one empty
    assert hc.ws_split(1, 7, hc.WsConfig(128, 16, 8, 4), 132) == 4
    assert hc.ws_split(1, 5, hc.WsConfig(128, 16, 8, 4), 132) == 3
    # every tactic chooses its split; the 128 x 256 one (from M = 129) cuts runs where that pays
    streamed = [c for c in hc.candidates("ws", None) if c.split == -1]
    assert streamed == [hc.WsConfig(128, 256, 3, -1, 256, 0)]
    assert all(c.split == 0 for c in hc.candidates("ws", None) if c not in streamed)


@pytest.mark.parametrize("tokens", [32, 96, 256])  # 256: not the tile's 128
def test_hopper_ws_takes_its_tile_in_one_wgmma_or_in_64_token_halves_only(tokens):
    assert hc.WsConfig(128, 128, 3, 0, 128).mma_tokens == 128
    with pytest.raises(ValueError, match="mma_tokens must be 64 or block_t, got"):
        hc.WsConfig(128, 128, 3, 0, tokens)


@pytest.mark.parametrize(
    "bad",
    [
        dict(loader_warp=2),
        dict(loader_warp=0, block_n=64),  # 64 rows: the second consumer takes alternate steps
    ],
)
def test_hopper_ws_loads_from_its_second_consumer_only_with_128_rows_or_more(bad):
    assert hc.WsConfig(128, 256, 3, 0, 256, 0).loader_warp == 0
    with pytest.raises(ValueError, match="loader_warp must be 1, or 0 with block_n >= 128, got"):
        hc.WsConfig(**dict(block_n=128, block_t=128, stages=3, split=0, mma_tokens=128) | bad)


def test_hopper_ws_takes_stream_k_with_both_consumers_on_every_step_only():
    assert hc.WsConfig(128, 256, 3, -1, 256, 0).split == -1
    assert hc.WsConfig(256, 128, 3, -1, 128, 0).split == -1
    with pytest.raises(ValueError, match="or -1 \\(stream-K\\) with block_n >= 128, got"):
        hc.WsConfig(64, 128, 5, -1, 128)  # 64 rows: the consumers take alternate steps
    with pytest.raises(ValueError, match="split must be >= 0"):
        hc.WsConfig(128, 256, 3, -2, 256, 0)


@pytest.mark.parametrize("units", [1, 7, 8, 9, 132 * 8, 132 * 8 + 1, 672, 4032, 917504])
@pytest.mark.parametrize("programs", [1, 78, 132])
def test_stream_runs_cover_every_unit_once_in_order_and_evenly(units, programs):
    cut = hc.stream_runs(units, programs)
    assert len(cut) == programs
    assert cut[0][0] == 0 and cut[-1][1] == units
    assert all(end == nxt for (_, end), (nxt, _) in itertools.pairwise(cut))
    sizes = [end - first for first, end in cut]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the longer runs first, as ``owner`` reads them


@pytest.mark.parametrize(
    "tiles,steps,split,want",
    [
        (128, 64, 1, None),  # 8192 x 8192, M = 512, 128 x 256: 97% of the SMs busy unsplit
        (64, 64, 2, None),  # split in two as ws_split splits it: 97%
        (72, 56, 1, (132, 0)),  # 4608 x 7168, M = 512: 55%, every tile in runs
        (78, 448, 1, (132, 0)),  # 59%, every tile in runs
        (96, 448, 1, None),  # 4096 x 14336, M = 768: 73%, the last wave too full to cut
        (216, 56, 1, (132, 1)),  # 4608 x 7168, M = 1536: a last wave of 64%
        (224, 32, 1, None),  # 4096 x 4096, M = 1792: a last wave of 70%
        (10, 17, 2, (21, 0)),  # 520 x 2080, M = 300: 21 programs of at least 8 steps
        (36, 16, 2, None),  # 2304 x 4096, M = 512: 72 runs of 8 steps fill no more than 72 tiles
        (144, 56, 1, (132, 1)),  # 4608 x 7168, M = 1024: a whole tile each, 12 in runs
        (448, 16, 1, (132, 3)),  # 3.4 waves: three whole tiles a program, 52 tiles in runs
        (528, 32, 1, None),  # four whole waves
        (0, 56, 1, None),
    ],
)
def test_stream_k_cuts_only_the_last_wave_and_only_where_the_tiles_leave_sms_idle(
    tiles, steps, split, want
):
    assert hc.stream_plan(tiles, steps, 132, split) == want
    if want is not None:
        programs, whole = want
        left = tiles - whole * programs  # the tiles cut into runs: less than a wave's worth
        assert left > 0 and (whole == 0 or left < programs)
        assert whole or tiles * steps // programs >= hc.STREAM_MIN_UNITS


def test_word_views_refuse_rows_that_are_not_aligned():
    a = torch.zeros((3, 33), dtype=torch.uint8)
    assert hopper_args.words(a[:, 1:], torch.int64) is None  # 4-byte rows from an odd offset
    words = hopper_args.words(torch.zeros((3, 32), dtype=torch.uint8), torch.int64)
    assert words is not None and words.shape == (3, 4)


def _record(cfg) -> dict:
    return {"op": ht.OP, "tactic": list(dataclasses.astuple(cfg)), "default": [0]}


def test_pin_runs_a_known_candidate_and_nothing_else():
    for run, cfg in [
        (th.run_gemv, hc.candidates("gemv", 1)[2]),
        (th.run_mma, hc.MMA_TACTICS[1][1][1]),
        (th.run_ws, hc.WS_TACTICS[-1][1][0]),
    ]:
        pinned = ht.pin(run, _record(cfg))
        assert pinned.func is run and pinned.keywords == {"cfg": cfg}
    known = list(dataclasses.astuple(hc.candidates("gemv", 1)[2]))  # (8, 64, 1)
    for bad in (
        {"tactic": [8, 128, 3]},  # not a candidate: the record cannot invent a kernel
        {"tactic": [*known[:2], True]},  # equal to 1, but a bool read from disk is not an int
        {"tactic": [float(v) for v in known]},
        {"tactic": "8 128 2"},
        {},
        ["tactic"],
    ):
        assert ht.pin(th.run_gemv, bad) is th.run_gemv, bad
    assert ht.pin(th.run_gemv, _record(hc.MMA_TACTICS[0][1][0])) is th.run_gemv
    # Each backend pins only its own kind's candidates.
    assert ht.pin(th.run_ws, _record(hc.MMA_TACTICS[-1][1][0])) is th.run_ws
    assert ht.pin(th.run_mma, _record(hc.WS_TACTICS[0][1][0])) is th.run_mma


def test_a_ws_tactic_stored_with_seven_numbers_runs_the_table_s_tile():
    """Before four consumers were retired a ws tactic was stored with a seventh number (phases,
    1 for every candidate): such a decision matches no candidate now, and is not an error."""
    for cfg in hc.candidates("ws", None):
        stored = [*dataclasses.astuple(cfg), 1]
        assert len(stored) == 7
        assert ht.pin(th.run_ws, {"op": ht.OP, "tactic": stored, "default": stored}) is th.run_ws
        assert ht.pin(th.run_ws, _record(cfg)).keywords == {"cfg": cfg}  # six numbers: pinned


@pytest.mark.parametrize(
    "n,m,small",  # the H200 sweep's faster tile at each point (results/hopper_sweep_dq.json, 132 SMs)
    [
        (2560, 512, True),  # 40 large tiles: a third of one wave
        (2560, 2048, True),  # 160 large: 1.2 waves; 320 small: 2.4
        (2560, 8192, False),  # 640 large tiles: 4.8 waves, both fill well
        (8192, 512, False),  # 128 large: one wave, as 256 small
        (4608, 512, False),  # 72 large, 144 small: equally idle; the large tile is faster
        (4608, 2048, True),
        (1280, 2048, False),  # 80 large, 160 small: equally idle
        (1280, 4096, True),
        (7168, 4096, False),
    ],
)
def test_the_dequant_tile_is_the_one_that_fills_the_sms(n, m, small):
    tile = hc.dequant_tile(m, n, 132)
    assert tile == (hc.DEQUANT_SMALL if small else hc.DEQUANT_LARGE), (n, m)
    assert hc.dequant_tile(m, n, 0) in (hc.DEQUANT_SMALL, hc.DEQUANT_LARGE)  # no SM count


def test_every_tactic_candidate_is_a_valid_configuration_for_its_range():
    low = 1
    for limit, cfgs in hc.GEMV_TACTICS:  # the table's configuration is always among them
        assert all(hc.for_m(hc.GEMV_BY_M, m) in cfgs for m in range(low, limit + 1)), limit
        assert hc.candidates("gemv", limit) == cfgs and len(set(cfgs)) == len(cfgs)
        low = limit + 1
    assert set(hc.candidates("gemv", None)) == {c for _, cs in hc.GEMV_TACTICS for c in cs}
    assert len(hc.candidates("gemv", None)) == len(set(hc.candidates("gemv", None)))
    for limit, cfgs in hc.MMA_TACTICS:
        assert hc.for_m(hc.MMA_BY_M, limit) in cfgs
        assert all(c.block_t <= max(16, limit) for c in cfgs), limit
    low = 33
    for limit, cfgs in hc.WS_TACTICS:
        assert all(hc.default("ws", m) == cfgs[0] for m in (low, limit)), limit
        assert all(c.block_t <= 2 * low for c in cfgs), limit  # no tile over half empty
        assert hc.candidates("ws", limit) == cfgs and len(set(cfgs)) == len(cfgs)
        low = limit + 1
    assert hc.WS_TACTICS[-1][0] == th.WS_MAX_M  # the table ends where the backend stops
    assert hc.candidates("prefill", 4096) == ()  # retired: no kind of that name


def test_tuning_keeps_the_table_where_it_cannot_time(monkeypatch):
    problem = Problem(n=64, k=128, m_bucket=m_bucket(3))
    args = validate.make_inputs(problem, 3, "cpu", seed=1, with_reference=False).args(problem)
    record = ht.tune(th.run_gemv, problem, args, name="hopper-gemv")
    default = list(dataclasses.astuple(hc.for_m(hc.GEMV_BY_M, 3)))
    assert record["tactic"] == record["default"] == default
    assert record["reason"] == "tuned on CUDA only"
    monkeypatch.setenv("FP4SELECT_TACTICS", "default:hopper-gemv")
    settings.use(None)
    try:
        record = ht.tune(th.run_gemv, problem, args, name="hopper-gemv")
        assert record["reason"] == "FP4SELECT_TACTICS=default:hopper-gemv"
        other = ht.tune(th.run_mma, problem, args, name="hopper-mma")
        assert other["reason"] == "tuned on CUDA only"
    finally:
        monkeypatch.delenv("FP4SELECT_TACTICS")
        settings.use(None)


def test_a_tactic_far_behind_the_fastest_is_timed_again_and_kept_only_if_it_was_its_graph():
    # The H200: a 12.8 us tile timed 264.7 us from one graph, about what launching it eagerly
    # takes, so the check against its own eager calls could not tell (docs/hopper_kernels.md).
    asked = []

    def retime(cfg):
        asked.append(cfg)
        return {"stalled": 12.0, "slow": 190.0}[cfg]

    times = {"stalled": 264.7, "best": 12.6, "slow": 200.0, "close": 30.0}
    out = ht.retime_stalled(times, retime)
    assert out == {"stalled": 12.0, "best": 12.6, "slow": 200.0, "close": 30.0}
    assert asked == ["stalled", "slow"]  # 30 us: 2.4x, not the stall rule's 3x and 50 us
    assert ht.retime_stalled({}, retime) == {} and len(asked) == 2


def test_only_tritons_out_of_resources_counts_as_a_tile_that_does_not_fit():
    errors = pytest.importorskip("triton.runtime.errors")
    assert ht._out_of_resources(errors.OutOfResources(300_000, 232_448, "shared memory"))
    assert not ht._out_of_resources(RuntimeError("out of resources"))
    fake = type("OutOfResources", (Exception,), {})  # same name, not Triton's
    assert not ht._out_of_resources(fake())


def test_the_candidates_first_calls_run_at_once_and_their_errors_wait_for_the_loop():
    import threading

    together = threading.Barrier(3, timeout=30)  # breaks unless all three calls are in at once
    ran = []

    def run(*args, cfg):
        ran.append((cfg, threading.current_thread().name))
        together.wait()
        if cfg == "bad":
            raise RuntimeError("left for the timed loop")

    ht.compile_ahead(run, ("a",), ("x", "y", "bad"), torch.device("cpu"))
    assert sorted(c for c, _ in ran) == ["bad", "x", "y"]
    assert all(name.startswith("fp4select-compile") for _, name in ran)
    assert not together.broken
    ran.clear()
    ht.compile_ahead(run, ("a",), ("x",), torch.device("cpu"))  # one: nothing to overlap
    assert ran == []


def test_pdl_is_asked_for_by_enable_pdl_and_only_on_cuda():
    problem = Problem(n=64, k=128, m_bucket=m_bucket(3))
    args = validate.make_inputs(problem, 3, "cpu", seed=1, with_reference=False).args(problem)
    assert args[10] is True  # mm_fp4's default
    assert not th._pdl(args, torch.device("cpu"))
    no_pdl = (*args[:10], False)
    assert not th._pdl(no_pdl, torch.device("cuda"))  # decided before any CUDA call
    # Without PDL a launch names nothing of it: a Triton before 3.4 refuses launch_pdl.
    assert th._with_pdl(False) == {}
    assert th._with_pdl(True) == {"PDL": True, "launch_pdl": True}


@pytest.mark.parametrize("n,kw,rows,cols", [(5, 37, 2, 8), (128, 64, 128, 32), (1, 3, 4, 8)])
def test_tiled_words_puts_each_tile_step_in_one_contiguous_run(n, kw, rows, cols):
    w = torch.randint(-(2**31), 2**31 - 1, (n, kw), dtype=torch.int32)
    tiled = hopper_args.tiled_words(w, rows, cols)
    tiles, steps = -(-n // rows), -(-kw // cols)
    assert tiled.shape == (tiles, steps, rows, cols) and tiled.is_contiguous()
    flat = tiled.reshape(-1)
    for t, s, r, c in [
        (0, 0, 0, 0),
        (tiles - 1, steps - 1, rows - 1, cols - 1),
        (0, steps - 1, 0, 1),
    ]:
        row, col = t * rows + r, s * cols + c
        # tile t's step s starts (t * steps + s) * rows * cols words in
        at = ((t * steps + s) * rows + r) * cols + c
        assert flat[at] == (w[row, col] if row < n and col < kw else 0)
    assert torch.equal(tiled.transpose(1, 2).reshape(tiles * rows, steps * cols)[:n, :kw], w)
    assert tiled.transpose(1, 2).reshape(tiles * rows, -1)[n:].count_nonzero() == 0
    assert tiled.transpose(1, 2).reshape(tiles * rows, -1)[:, kw:].count_nonzero() == 0
    tiled.zero_()  # a copy: the caller's weight is not touched
    assert w.count_nonzero() > 0


def test_the_kernels_refuse_a_tiled_weight_that_is_not_this_weights_tiles():
    """A copy of the wrong shape, word or run length is refused before any kernel could read
    past it (the plan is built on the CPU; nothing compiles or runs)."""
    from fp4select import validate
    from fp4select.backends import triton_hopper as th
    from fp4select.keys import Problem, m_bucket

    problem = Problem(n=40, k=512, m_bucket=m_bucket(5))
    args = validate.make_inputs(problem, 5, "cpu", seed=1).args(problem)
    w32 = hopper_args.words(args[1].T, torch.int32)
    w64 = hopper_args.words(args[1].T, torch.int64)
    mma, gemv = th.MmaConfig(16, 16, 16, 1, 1, 1), th.GemvConfig(2, 4, 1)
    bad = [
        (th.run_mma, mma, hopper_args.tiled_words(w32[:20], 16, 16)),  # another weight's rows
        (th.run_mma, mma, hopper_args.tiled_words(w64, 16, 8)),  # 64-bit words
        (th.run_mma, mma, hopper_args.tiled_words(w32, 16, 24)),  # runs of 24 words
        (th.run_mma, mma, hopper_args.tiled_words(w32, 16, 16).transpose(1, 2)),  # a view
        (th.run_gemv, gemv, hopper_args.tiled_words(w32, 2, 4)),  # 32-bit words
        (th.run_gemv, gemv, w64),  # the plain words
    ]
    for run, cfg, tiled in bad:
        with pytest.raises(ValueError, match="tiled must be"):
            run(*args, cfg=cfg, tiled=tiled)
    # hopper-ws reads tiles only with its loader warp, and not in runs of K steps
    for ws in (th.WsConfig(256, 128, 3, 0, 128, 0), th.WsConfig(128, 256, 3, -1, 256, 0)):
        with pytest.raises(ValueError, match="loader warp"):
            th.run_ws(*args, cfg=ws, tiled=hopper_args.tiled_words(w32, ws.block_n, 16))
