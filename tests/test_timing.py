"""Timing on the CPU: interleaved rounds, the budget, the statistics."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fp4select import timing as timing_module
from fp4select.timing import (
    MAX_TIE_TOLERANCE,
    MIN_TIE_TOLERANCE,
    Timing,
    TimingOptions,
    rank,
    summarize,
    time_interleaved,
)

CPU = torch.device("cpu")


def test_candidates_are_interleaved_round_by_round(monkeypatch):
    # On the fake clock: a loaded machine stretching the samples could have them taken again.
    monkeypatch.setattr(timing_module, "time", _FakeClock())
    log = []
    calls = {name: [lambda n=name: log.append(n)] for name in "abc"}
    options = TimingOptions(budget_s=0.0, min_rounds=4, max_rounds=4, target_sample_s=0)
    timings, method = time_interleaved(calls, CPU, options)
    assert method == "wall-clock"
    assert all(t.samples == 4 for t in timings.values())
    sampled = log[-12:]  # after the calibration calls: 4 rounds of 3, order rotating
    rounds = [sampled[i : i + 3] for i in range(0, 12, 3)]
    assert [r[0] for r in rounds] == ["a", "b", "c", "a"]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)


class _FakeClock:
    """``time`` for fp4select.timing: only the calls move it, so no load can stretch a round."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def cost(self, seconds: float):
        """A call that takes ``seconds`` on this clock."""

        def call() -> None:
            self.now += seconds

        return call


def test_the_budget_stops_rounds_once_the_minimum_is_met(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)

    def call() -> None:  # 1/256 s, and budgets of 1/16 s: sums exact in binary
        clock.now += 2.0**-8

    options = TimingOptions(budget_s=2.0**-4, min_rounds=3, max_rounds=10_000, target_sample_s=0)
    timings, _ = time_interleaved({"x": [call]}, CPU, options)
    assert timings["x"].samples == 17  # the first round past the budget, not 10 000
    assert timings["x"].median_us == 1e6 * 2.0**-8
    timings, _ = time_interleaved({"x": [call]}, CPU, dataclasses.replace(options, budget_s=0.0))
    assert timings["x"].samples == 3  # the minimum, though the budget is spent at once


def test_a_sample_measures_at_least_the_time_the_call_takes():
    """A sleep's duration is a floor, whatever the load: the timer may not report less."""
    calls = {"sleepy": [lambda: time.sleep(0.002)]}
    timings, _ = time_interleaved(
        calls, CPU, TimingOptions(budget_s=0.0, min_rounds=3, max_rounds=3, target_sample_s=0)
    )
    assert timings["sleepy"].p10_us >= 2000


def test_rotating_input_sets_are_all_used():
    used = []
    calls = {"x": [lambda i=i: used.append(i) for i in range(3)]}
    time_interleaved(
        calls, CPU, TimingOptions(budget_s=0.0, min_rounds=2, max_rounds=2, target_sample_s=0)
    )
    assert set(used) == {0, 1, 2}


def test_summary_statistics():
    t = summarize([5.0, 1.0, 3.0, 2.0, 4.0], 7, "test")
    assert t.median_us == 3.0 and t.p10_us == pytest.approx(1.4) and t.p90_us == pytest.approx(4.6)
    assert t.calls_per_sample == 7 and t.half_spread == pytest.approx((4.6 - 1.4) / 6)


def _timing(median, p10, p90):
    return Timing(median, p10, p90, 10, 1, "test")


def test_a_slow_noisy_candidate_never_wins_on_preference():
    """The audit's case: 77x slower but noisy, and preferred; it won with margin -98.7%."""
    fast = _timing(10.0, 9.9, 10.1)
    slow_noisy = _timing(770.0, 10.0, 2000.0)
    ranking = rank({"fast": fast, "preferred": slow_noisy}, {"fast": 50, "preferred": 1})
    assert ranking.winner == "fast" and ranking.margin == pytest.approx(76.0)
    assert not ranking.tie_broken_by_preference


def test_a_noisy_fastest_is_reported_and_its_window_capped():
    noisy = _timing(10.0, 5.0, 15.0)  # half-spread 50%
    ranking = rank(
        {"noisy": noisy, "preferred": _timing(10.6, 10.5, 10.7)}, {"noisy": 50, "preferred": 1}
    )
    assert ranking.too_noisy and ranking.tie_window == MAX_TIE_TOLERANCE
    assert ranking.winner == "noisy"  # 6% behind: outside the capped window


medians = st.floats(min_value=0.01, max_value=1e6, allow_nan=False)
spreads = st.floats(min_value=0.0, max_value=5.0, allow_nan=False)


@given(
    st.dictionaries(
        st.sampled_from("abcdefgh"),
        st.tuples(medians, spreads, spreads, st.integers(0, 1000)),
        min_size=1,
    )
)
def test_the_winner_is_never_slower_than_the_cap_allows(candidates):
    timings = {
        n: _timing(m, m * max(0.0, 1 - lo), m * (1 + hi))
        for n, (m, lo, hi, _) in candidates.items()
    }
    preference = {n: p for n, (_, _, _, p) in candidates.items()}
    ranking = rank(timings, preference)
    fastest = min(t.median_us for t in timings.values())
    assert timings[ranking.winner].median_us <= (1 + MAX_TIE_TOLERANCE) * fastest
    assert MIN_TIE_TOLERANCE <= ranking.tie_window <= MAX_TIE_TOLERANCE
    assert ranking.order[0] == ranking.winner and sorted(ranking.order) == sorted(timings)


def test_a_candidate_far_behind_sits_out_the_rounds_after_the_minimum(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)

    cost = clock.cost
    calls = {
        "fast": [cost(2.0**-10)],
        "close": [cost(2.0**-10 * 1.04)],  # could tie with the fastest: sampled to the end
        "separated": [cost(2.0**-10 * 1.15)],  # every sample over 1.10x: only the minimum
        "slow": [cost(2.0**-10 * 1.75)],  # beyond DROP_FACTOR: only the minimum
    }
    options = TimingOptions(budget_s=1.0, min_rounds=3, max_rounds=12, target_sample_s=0)
    timings, _ = time_interleaved(calls, CPU, options)
    assert timings["fast"].samples == timings["close"].samples == 12
    assert timings["separated"].samples == timings["slow"].samples == 3
    assert rank(timings, {}).order == ["fast", "close", "separated", "slow"]


def test_a_noisy_candidate_whose_fast_samples_could_tie_keeps_being_sampled(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)
    noisy = iter([1.0, 1.6, 1.6, 1.0, 1.6, 1.6] * 10)  # median 1.6x, but often as fast

    def fast() -> None:
        clock.now += 2.0**-10

    def jumpy() -> None:
        clock.now += 2.0**-10 * next(noisy)

    options = TimingOptions(budget_s=1.0, min_rounds=3, max_rounds=6, target_sample_s=0)
    timings, _ = time_interleaved({"fast": [fast], "jumpy": [jumpy]}, CPU, options)
    assert timings["jumpy"].samples == 3  # median over DROP_FACTOR: out, however fast its best
    noisy = iter([1.0, 1.2, 1.2] * 10)  # median 1.2x (within DROP_FACTOR), p10 at 1.04x
    timings, _ = time_interleaved({"fast": [fast], "jumpy": [jumpy]}, CPU, options)
    assert timings["jumpy"].samples == 6


def test_no_candidate_sits_out_before_the_minimum_rounds(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)

    cost = clock.cost
    calls = {"fast": [cost(2.0**-10)], "slow": [cost(2.0**-8)]}  # 4x: dropped, not hopeless
    options = TimingOptions(budget_s=1.0, min_rounds=5, max_rounds=5, target_sample_s=0)
    timings, _ = time_interleaved(calls, CPU, options)
    assert timings["slow"].samples == timings["fast"].samples == 5


def test_a_candidate_hopeless_in_calibration_keeps_that_run_as_its_one_sample(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)
    runs = {"fast": 0, "fallback": 0, "compiles": 0}

    def call(name: str, seconds: float):
        def run() -> None:
            runs[name] += 1
            clock.now += seconds

        return run

    first = []

    def compiles_once() -> None:  # its first run pays a one-time cost, 100x its real time
        runs["compiles"] += 1
        clock.now += 2.0**-10 * (100 if not first else 1)
        first.append(1)

    calls = {
        "fast": [call("fast", 2.0**-10)],
        "fallback": [call("fallback", 2.0**-10 * 32)],  # 32x behind, every run
        "compiles": [compiles_once],
    }
    options = TimingOptions(budget_s=1.0, min_rounds=3, max_rounds=6, target_sample_s=0)
    timings, method = time_interleaved(calls, CPU, options)
    assert runs["fallback"] == 3  # calibrated three times, never sampled
    assert timings["fallback"].samples == 1 and timings["fallback"].method == "calibration"
    assert timings["fallback"].median_us == 1e6 * 2.0**-10 * 32
    assert timings["compiles"].samples >= 3 and timings["compiles"].method == method
    assert rank(timings, {}).winner in ("fast", "compiles")


def test_a_candidate_slow_in_its_first_two_calls_is_still_sampled(monkeypatch):
    # The H200 record: a hopper-ws call of about 32 us took 377 us at its second (wall-clock)
    # calibration call, after its first had paid for loading; ruled hopeless, it lost to a
    # candidate 1.06x slower. Its fastest calibration call now decides.
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)
    calls_made = []

    def stalls_twice() -> None:
        calls_made.append(1)
        clock.now += 2.0**-10 * (12 if len(calls_made) <= 2 else 0.95)

    calls = {"rival": [clock.cost(2.0**-10)], "stalls": [stalls_twice]}
    options = TimingOptions(budget_s=1.0, min_rounds=3, max_rounds=3, target_sample_s=0)
    timings, method = time_interleaved(calls, CPU, options)
    assert timings["stalls"].method == method and timings["stalls"].samples == 3
    assert rank(timings, {}).winner == "stalls"


def test_a_hopeless_candidate_stays_hopeless_when_a_rivals_calibration_is_preempted(monkeypatch):
    # A loaded machine preempted the fast candidate's full calibration: against that number the
    # hopeless one looked close, was sampled without a calibration of its own (KeyError), and
    # the key lost every timing (a flaky sandbox test under parallel CI).
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)
    runs = {"fast": 0}

    def fast() -> None:
        runs["fast"] += 1
        clock.now += 2.0**-10 * (50 if runs["fast"] == 2 else 1)  # 2nd run: full calibration

    calls = {"fast": [fast], "fallback": [clock.cost(2.0**-10 * 20)]}
    options = TimingOptions(budget_s=1.0, min_rounds=3, max_rounds=3, target_sample_s=0)
    timings, method = time_interleaved(calls, CPU, options)
    assert timings["fast"].samples == 3 and timings["fast"].method == method
    assert timings["fallback"].samples == 1 and timings["fallback"].method == "calibration"


def test_rounds_end_when_the_rivals_of_the_fastest_are_all_out(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)

    cost = clock.cost
    calls = {"fast": [cost(2.0**-10)], "fallback": [cost(2.0**-5)], "slow": [cost(2.0**-8)]}
    options = TimingOptions(budget_s=100.0, min_rounds=4, max_rounds=1000, target_sample_s=0)
    timings, _ = time_interleaved(calls, CPU, options)
    assert timings["fast"].samples == timings["slow"].samples == 4
    assert timings["fallback"].samples == 1
    alone, _ = time_interleaved({"fast": calls["fast"]}, CPU, options)
    assert alone["fast"].samples == 1000  # no rival to begin with: the budget decides


def test_a_hopeless_candidate_never_runs_once_per_input_set(monkeypatch):
    # At small M the cold-L2 rotation has up to 64 input sets; a fallback 30x behind ran each
    # of them in calibration before it was found hopeless (on the H200: 5 s of a model's warm-up).
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)
    runs = {"fast": 0, "fallback": 0}

    def call(name: str, seconds: float):
        def run() -> None:
            runs[name] += 1
            clock.now += seconds

        return run

    sets = 16
    calls = {
        "fast": [call("fast", 2.0**-10) for _ in range(sets)],
        "fallback": [call("fallback", 2.0**-10 * 30) for _ in range(sets)],
    }
    options = TimingOptions(budget_s=1.0, min_rounds=3, max_rounds=3, target_sample_s=0)
    timings, _ = time_interleaved(calls, CPU, options)
    assert runs["fallback"] == 3  # one call, then two more to rule out a first-call cost
    assert runs["fast"] >= 1 + sets  # one call, then the whole rotation, then the samples
    assert timings["fallback"].method == "calibration"
    assert timings["fallback"].calls_per_sample == 1
    assert timings["fallback"].median_us == 1e6 * 2.0**-10 * 30
    assert timings["fast"].samples == 3


@pytest.mark.parametrize(
    ("stalled_runs", "winner"), [(range(3, 6), "stalls"), (range(3, 99), "rival")]
)
def test_samples_far_slower_than_calibration_are_taken_again_once(
    monkeypatch, stalled_runs, winner
):
    # The H200: a few graphs in a thousand replayed 40-180x slower than their kernels, every
    # replay of their life (a 20 us GEMV read 3.6 ms), so the fastest candidate could lose.
    # Runs 1-2 calibrate, 3-5 are the samples, 6-8 the samples taken again.
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)
    runs = []

    def stalls() -> None:
        runs.append(1)
        clock.now += 2.0**-10 * (100 if len(runs) in stalled_runs else 1)

    calls = {"rival": [clock.cost(2.0**-10 * 1.2)], "stalls": [stalls]}
    options = TimingOptions(budget_s=1.0, min_rounds=3, max_rounds=3, target_sample_s=0)
    timings, method = time_interleaved(calls, CPU, options)
    assert len(runs) == 8  # sampled again once, stalled again or not
    assert timings["stalls"].method == method + "+resampled"
    assert timings["rival"].method == method
    assert rank(timings, {}).winner == winner


@pytest.mark.parametrize(
    ("slow_graph", "winner", "runs"), [(True, "launch_bound", 8), (False, "rival", 6)]
)
def test_a_candidate_far_behind_whose_new_capture_is_far_faster_is_taken_again(
    monkeypatch, slow_graph, winner, runs
):
    # The H200: a hopper-ws tactic whose kernel takes 12.8 us timed 264.7 us from one graph,
    # while launching it eagerly takes about that long, so its calibration could not tell
    # (docs/hopper_kernels.md, 'In turn'). Runs 1-2 calibrate (launch-bound, 50 units), 3-5
    # are the samples (60 units: a stalled graph, or the candidate itself when slow_graph is
    # False), 6 the new capture's first sample, 7-8 the rest taken again.
    clock = _FakeClock()
    monkeypatch.setattr(timing_module, "time", clock)
    unit = 2.0**-10
    made = {"launch_bound": 0, "rival": 0}

    def costing(name: str, calibration: float, samples: float, afterwards: float):
        def call() -> None:
            made[name] += 1
            n = made[name]
            clock.now += unit * (calibration if n <= 2 else samples if n <= 5 else afterwards)

        return call

    calls = {
        "rival": [costing("rival", 40, 2, 2)],
        "launch_bound": [costing("launch_bound", 50, 60, 1 if slow_graph else 60)],
    }
    options = TimingOptions(budget_s=1.0, min_rounds=3, max_rounds=3, target_sample_s=0)
    timings, method = time_interleaved(calls, CPU, options)
    assert made["launch_bound"] == runs and made["rival"] == 5  # the rival: no new capture
    resampled = method + "+resampled"
    assert timings["launch_bound"].method == (resampled if slow_graph else method)
    assert timings["launch_bound"].samples == 3
    assert rank(timings, {}).winner == winner


@pytest.mark.parametrize(
    ("sampled_us", "calibration_us", "stalled"),
    [(3600.0, 20.0, True), (59.0, 19.0, False), (71.0, 20.0, True), (300.0, 120.0, False)],
)
def test_stalled_needs_both_the_factor_and_the_margin(sampled_us, calibration_us, stalled):
    assert timing_module.stalled(sampled_us, calibration_us) is stalled
