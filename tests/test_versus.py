"""``fp4select.versus`` and ``--vs-bf16``: the served FP4 GEMM beside a dense weight."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import fp4select
from fp4select import versus
from fp4select.cli import main
from fp4select.keys import Problem
from fp4select.validate import make_inputs

PROBLEM = Problem(n=64, k=128, m_bucket=4)


def test_nothing_is_timed_or_tuned_without_a_stored_decision(inprocess):
    record = fp4select.explain(problem=PROBLEM, device="cpu", tune=False, vs_bf16=True)
    assert record["winner"] is None and "vs_bf16" not in record
    assert inprocess.lookup(PROBLEM, torch.device("cpu")) is None  # still untuned


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_the_served_gemm_and_the_dense_one_timed_side_by_side(inprocess, monkeypatch, out_dtype):
    problem = Problem(n=64, k=128, m_bucket=4, out_dtype=out_dtype)
    decision = inprocess.decide(problem, torch.device("cpu"))
    served, dense = [], []
    real_mm, real_linear = fp4select.api.best_mm_fp4, torch.nn.functional.linear

    def mm(*args, **kwargs):
        served.append(kwargs["a"].shape[0])
        return real_mm(*args, **kwargs)

    def linear(x, w):
        dense.append((x.dtype, w.dtype, tuple(x.shape), tuple(w.shape)))
        return real_linear(x, w)

    monkeypatch.setattr(fp4select.api, "best_mm_fp4", mm)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    tunings = fp4select.stats()["tunings"]
    result = fp4select.explain(problem=problem, device="cpu", tune=False, vs_bf16=True)["vs_bf16"]
    assert result["served"] == decision.winner
    assert result["m"] == problem.timing_m() == 4
    assert result["dense_dtype"] == out_dtype
    assert result["method"] == "wall-clock"
    fp4_us, dense_us = result["fp4"]["median_us"], result["dense"]["median_us"]
    assert fp4_us > 0 and dense_us > 0
    assert result["ratio"] == pytest.approx(fp4_us / dense_us)
    # the FP4 side is the public call at the timed M, served by the stored decision (no
    # tuning); the dense side a linear of the same shape in the output dtype
    assert served and set(served) == {4}
    assert fp4select.stats()["tunings"] == tunings
    dtype = problem.torch_out_dtype
    assert dense and set(dense) == {(dtype, dtype, (4, 128), (64, 128))}


def test_the_budget_is_capped_and_the_ratio_is_fp4_over_dense(inprocess, monkeypatch):
    seen = []
    real = versus.timing.time_interleaved

    def spy(calls, device, options, *rest):
        seen.append((sorted(calls), options.budget_s))
        return real(calls, device, options, *rest)

    monkeypatch.setattr(versus.timing, "time_interleaved", spy)
    options = fp4select.records.TimingOptions(budget_s=30.0, min_rounds=2, max_rounds=3)
    calls = []

    def gemm(**kwargs):  # what compare hands best_mm_fp4: its keyword arguments
        calls.append(sorted(kwargs))
        return torch.zeros(kwargs["a"].shape[0], PROBLEM.n, dtype=kwargs["out_dtype"])

    result = versus.compare(PROBLEM, "cpu", gemm, options)
    assert calls and calls[0] == sorted(make_inputs(PROBLEM, 4, "cpu").kwargs(PROBLEM))
    assert seen == [(["dense", "fp4select"], versus.BUDGET_S)]
    assert result["ratio"] == pytest.approx(
        result["fp4"]["median_us"] / result["dense"]["median_us"]
    )


def test_warm_reports_each_key_beside_bf16(cache_dir, capsys):
    args = ["warm", "--device", "cpu", "--shape", "64,128", "--max-m", "2", "--quiet"]
    assert main([*args, "--vs-bf16", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["vs_bf16"]["m"] for r in results] == [1, 2]
    for row in results:
        vs = row["vs_bf16"]
        assert vs["served"] == row["winner"]
        assert vs["ratio"] == pytest.approx(vs["fp4"]["median_us"] / vs["dense"]["median_us"])
    assert main([*args, "--vs-bf16"]) == 0
    out = capsys.readouterr().out
    assert "FP4/dense" in out.splitlines()[0]
    assert "dense: the same product with the weight in the output dtype" in out
    assert main(args) == 0  # without the flag, no comparison
    assert "FP4/dense" not in capsys.readouterr().out


def test_a_dry_run_cannot_compare(cache_dir, capsys):
    code = main(["warm", "--device", "cpu", "--shape", "64,128", "--dry-run", "--vs-bf16"])
    assert code == 2
    assert "--vs-bf16" in capsys.readouterr().err


def test_explain_says_the_ratio_or_that_there_is_no_decision(cache_dir, capsys):
    args = ["explain", "--device", "cpu", "--n", "64", "--k", "128", "--m", "3", "--vs-bf16"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "no decision yet" in out and "vs bfloat16" not in out
    assert main([*args, "--tune"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("vs bfloat16")]
    assert len(line) == 1 and "at M=4" in line[0] and "side by side" in line[0]
    assert main([*args, "--json"]) == 0
    vs = json.loads(capsys.readouterr().out)["vs_bf16"]
    assert vs["served"] == "emulation" and vs["ratio"] > 0


@pytest.mark.subprocess
def test_the_flag_is_in_both_commands_help():
    for command in ("warm", "explain"):
        done = subprocess.run(
            [sys.executable, "-m", "fp4select", command, "--help"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "--vs-bf16" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_both_sides_are_graph_replays_with_cold_l2(inprocess):
    """The comparison times as the selector does there: CUDA-graph replay, cold L2."""
    device = torch.device("cuda")
    problem = Problem(n=4096, k=4096, m_bucket=16)
    decision = inprocess.decide(problem, device)
    result = fp4select.explain(problem=problem, device=device, vs_bf16=True)["vs_bf16"]
    assert result["served"] == decision.winner is not None
    assert result["method"] == "cuda-graph+cold-l2"
    for side in ("fp4", "dense"):
        assert result[side]["method"].startswith("cuda-graph"), result
        assert 0 < result[side]["p10_us"] <= result[side]["median_us"] <= result[side]["p90_us"]


def test_a_comparison_that_fails_is_reported_and_the_rest_go_on(cache_dir, monkeypatch, capsys):
    """Out of memory for the dense weight, say: the key stays served, its row says why."""
    real = versus.compare

    def compare(problem, *args):
        if problem.m_bucket == 2:
            raise RuntimeError("CUDA out of memory (planted)")
        return real(problem, *args)

    monkeypatch.setattr(versus, "compare", compare)
    args = ["warm", "--device", "cpu", "--shape", "64,128", "--max-m", "2", "--quiet", "--vs-bf16"]
    assert main([*args, "--json"]) == 0
    rows = {r["vs_bf16"]["m"]: r["vs_bf16"] for r in json.loads(capsys.readouterr().out)["results"]}
    assert rows[1]["ratio"] > 0
    assert rows[2]["served"] == "emulation" and "ratio" not in rows[2]
    assert rows[2]["why"] == "not timed: RuntimeError: CUDA out of memory (planted)"
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "--vs-bf16 for N=64 K=128 M=2..2" in out and "planted" in out


def test_the_summary_gives_each_shape_the_m_up_to_which_fp4_was_faster():
    from fp4select.cli.tune import versus_summary
    from fp4select.keys import m_bucket

    def key(n, m):
        return Problem(n=n, k=128, m_bucket=m_bucket(m))

    ratios = {
        64: {1: 0.5, 2: 0.8, 4: 1.2, 8: 0.9, 16: 1.5},  # faster to M = 2; not again from 4 on
        128: {1: 0.4, 2: 0.6},  # faster at every M timed
        256: {1: 1.1, 2: 2.0},  # never
    }
    problems = [
        key(n, m) for n in (64, 128, 256, 512) for m in (1, 2, 4, 8, 16) if n == 64 or m <= 2
    ]
    results = [
        {"problem": p.describe(), "vs_bf16": {"ratio": ratios.get(p.n, {}).get(p.timing_m())}}
        for p in problems
    ]
    assert versus_summary(problems, results) == [
        "N=64 K=128 nvfp4: FP4 faster up to M = 2; from M = 4 0.90-1.50x the dense time",
        "N=128 K=128 nvfp4: FP4 faster up to M = 2",
        "N=256 K=128 nvfp4: FP4 from M = 1 1.10-2.00x the dense time",
    ]  # N = 512: nothing timed, no line
