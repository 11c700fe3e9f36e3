"""Timing on the CPU: interleaved rounds, the budget, the statistics."""

from __future__ import annotations

import time

import pytest
import torch

from fp4select.timing import TimingOptions, summarize, time_interleaved

CPU = torch.device("cpu")


def test_candidates_are_interleaved_round_by_round():
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


def test_the_budget_stops_rounds_once_the_minimum_is_met():
    calls = {"sleepy": [lambda: time.sleep(0.002)]}
    start = time.perf_counter()
    timings, _ = time_interleaved(
        calls, CPU, TimingOptions(budget_s=0.05, min_rounds=3, max_rounds=10_000, target_sample_s=0)
    )
    elapsed = time.perf_counter() - start
    assert 3 <= timings["sleepy"].samples < 100
    assert elapsed < 1.0


def test_a_slower_candidate_measures_slower():
    calls = {"fast": [lambda: time.sleep(0.0005)], "slow": [lambda: time.sleep(0.002)]}
    timings, _ = time_interleaved(
        calls, CPU, TimingOptions(budget_s=0.1, min_rounds=5, target_sample_s=0)
    )
    assert timings["slow"].median_us > 2 * timings["fast"].median_us


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
