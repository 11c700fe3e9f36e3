"""Tactics against fakes that behave like flashinfer 0.7.4's FP4 runners, through the real mm_fp4.

Each fake (fake_fp4_runners.py) is registered where flashinfer's ``mm_fp4`` builds cuDNN's
runner, so every call goes through the real ``mm_fp4`` body: its 10-input list, its
``AutoTuner.get().choose_one("fp4_gemm", ...)`` and ``runner(inputs=..., tactic=...)``, with
flashinfer's real autotuner (profiles, bucket mapping, near-tie rule, failure handling). Only
the per-tactic timer is injected. Nothing here needs a GPU; what only Blackwell can show is
in test_tactics_gpu.py.
"""

from __future__ import annotations

import dataclasses
import json

import fake_fp4_runners as fr
import pytest
import torch
from flashinfer.autotuner import AutoTuner

import fp4select
from fp4select.backends import flashinfer as fi_backends
from fp4select.backends import flashinfer_tactics as tactics
from fp4select.keys import Problem
from fp4select.probe import ProbeOptions, probe
from fp4select.timing import TimingOptions
from fp4select.validate import check, make_inputs

FAST = TimingOptions(budget_s=0.02, min_rounds=3, max_rounds=20, target_sample_s=1e-4)
BUCKET_512 = Problem(n=128, k=256, m_bucket=512)  # raw tiles valid at M=512, not at 257 or 385
SMALL = Problem(n=128, k=256, m_bucket=16)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(AutoTuner, "_instance", None)
    fr.ran.clear()
    fr.profiled.clear()
    fr.CudnnFp4GemmRunner.substituted = []
    tactics._fallbacks.clear()
    yield
    tactics._fallbacks.clear()


@pytest.fixture
def register(monkeypatch):
    """Put a fake runner where the real mm_fp4 builds cuDNN's; fp4select's "cudnn" calls it."""
    from flashinfer.gemm import gemm_base

    monkeypatch.setattr(gemm_base, "get_compute_capability", lambda device: (12, 0))
    for workspace in ("_get_stream_cache_buf", "_get_cache_buf"):
        if hasattr(gemm_base, workspace):
            monkeypatch.setattr(gemm_base, workspace, lambda name, size, device: torch.empty(size))

    def use(runner_class):
        instance = runner_class()
        monkeypatch.setattr(gemm_base, "_cudnn_gemm_fp4_runner", lambda config: instance)
        cudnn = {b.name: b for b in fi_backends.backends()[0]}["cudnn"]
        # mm_fp4's per-call checks ask the GPU and cuDNN; its body (from the runner list to the
        # runner call) is what these tests are about, so probing calls it as serving does.
        return dataclasses.replace(cudnn, make_checked_runner=cudnn.make_fast_runner)

    return use


def _args(problem, m):
    return make_inputs(problem, m, "cpu").args(problem)


def _probe(backend, problem, events=None):
    report = events.append if events is not None else None
    return probe(problem, [backend], "cpu", ProbeOptions(timing=FAST), report)


# -- 1. a tactic tuned at the bucket's top, served across the bucket ---------------------------
def test_a_raw_tile_tuned_at_512_serves_512_and_falls_back_at_257_and_385(register):
    backend = register(fr.Sm12xCuTeFp4GemmRunner)
    with fr.injected({fr.RAW: 1.0, fr.RAW_SWAP: 1.5, ("independent",): 2.0}):
        result = _probe(backend, BUCKET_512)
    verdict = result.verdicts["cudnn"]
    assert verdict.passed, verdict.reason  # was: the runner raised at 257, backend dropped
    record = verdict.detail["tactic"]
    assert tuple(record["tactic"]) == fr.RAW and record["runner"] == "Sm12xCuTeFp4GemmRunner"
    assert [d["m"] for d in record["default_at"]] == [257, 385]
    assert "validate_tactic rejects it at M=257" in record["default_at"][0]["reason"]
    # validation ran what will be served: default at 257 and 385, the raw tile at 512
    asked = [(r[1], r[3]) for r in fr.ran[1:]]
    assert asked[:3] == [(-1, 257), (-1, 385), (fr.RAW, 512)]

    stored = json.loads(json.dumps(record))
    run = backend.fast_runner_for(BUCKET_512, stored)
    fr.ran.clear()
    tactics._fallbacks.clear()  # the probe's own (257, 385), a process apart in real use
    for m in (500, 512, 384, 500):
        out = run(*_args(BUCKET_512, m))
        assert check(out, make_inputs(BUCKET_512, m, "cpu"), torch.bfloat16).ok
    assert [(r[2], r[3]) for r in fr.ran] == [
        (("independent",), 500),
        (fr.RAW, 512),
        (fr.RAW, 384),  # 384 = 3 x 128: the raw tile is valid there too
        (("independent",), 500),
    ]
    fallbacks = tactics.tactic_fallbacks(BUCKET_512)
    assert [(f["m"], f["calls"]) for f in fallbacks] == [(500, 2)]
    assert tactics.fallback_calls() == 2


def test_a_trtllm_cubin_valid_only_at_some_m_is_checked_per_m_and_never_raises(register):
    backend = register(fr.TrtllmGemmRunner)
    with fr.injected({3: 2.0, 4: 1.5, 5: 1.0}):  # 5 exists only where M % 256 == 0
        result = _probe(backend, BUCKET_512)
    verdict = result.verdicts["cudnn"]
    assert verdict.passed, verdict.reason
    assert verdict.detail["tactic"]["tactic"] == 5
    assert [d["m"] for d in verdict.detail["tactic"]["default_at"]] == [257, 385]
    assert (
        "not among TrtllmGemmRunner's 2 valid tactics at M=257"
        in (verdict.detail["tactic"]["default_at"][0]["reason"])
    )


def test_explain_and_stats_name_the_calls_served_at_the_default(register, inprocess):
    backend = register(fr.TrtllmGemmRunner)
    record = {"op": "fp4_gemm", "tactic": 5, "runner": "TrtllmGemmRunner", "default": -1}
    run = backend.fast_runner_for(BUCKET_512, record)
    with fr.injected({}):
        run(*_args(BUCKET_512, 300))
        run(*_args(BUCKET_512, 512))
    assert fp4select.stats()["tactic_fallbacks"] == 1
    explained = fp4select.explain(problem=BUCKET_512, device="cpu", tune=False)
    [entry] = explained["tactic_fallbacks"]
    assert entry["m"] == 300 and entry["runner"] == "TrtllmGemmRunner" and entry["tactic"] == 5
    assert fp4select.explain(problem=SMALL, device="cpu", tune=False).get("tactic_fallbacks") in (
        None,
        [],
    )


# -- 2. a stored tactic is checked before it serves --------------------------------------------
@pytest.mark.parametrize(
    "runner_class",
    [
        fr.TrtllmGemmRunner,
        fr.CutlassFp4GemmRunner,
        fr.Sm12xCuTeFp4GemmRunner,
        fr.CudnnFp4GemmRunner,
    ],
)
@pytest.mark.parametrize("stored", [99, "abc", 1.5, True, [7, [1, 2]]])
def test_a_stored_tactic_the_runner_cannot_run_serves_the_default(register, runner_class, stored):
    backend = register(runner_class)
    record = {"op": "fp4_gemm", "tactic": stored, "runner": runner_class.__name__}
    run = backend.fast_runner_for(SMALL, json.loads(json.dumps(record)))
    with fr.injected({}):
        for m in (9, 16, 9):
            out = run(*_args(SMALL, m))  # the raising runners raised on every call before
            assert check(out, make_inputs(SMALL, m, "cpu"), torch.bfloat16).ok
    assert [r[1] for r in fr.ran] == [-1, -1, -1]
    assert fr.CudnnFp4GemmRunner.substituted == []  # never silently swapped by the runner


# -- 3. slow tuning keeps the backend, at flashinfer's default, with the reason ----------------
def test_tuning_past_its_time_limit_keeps_the_backend_at_the_default(register, monkeypatch):
    monkeypatch.setenv("FP4SELECT_TUNE_TIMEOUT_S", "1e-9")
    fp4select.settings.use(None)
    backend = register(fr.CutlassFp4GemmRunner)
    events: list = []
    try:
        with fr.injected({0: 3.0, 1: 1.0, 2: 2.0}):
            result = _probe(backend, SMALL, events)
    finally:
        fp4select.settings.use(None)
    verdict = result.verdicts["cudnn"]
    assert verdict.passed, verdict.reason
    record = verdict.detail["tactic"]
    assert record["tactic"] == -1 and record["fallback"] == "timeout"
    assert "FP4SELECT_TUNE_TIMEOUT_S" in record["reason"]
    tune_events = [e for e in events if e.get("phase") == "tune"]
    assert len(tune_events) == 1 + 3  # the phase, then one sign of life per tactic profile
    assert {r[1] for r in fr.ran} == {-1}  # validated at what it will serve


def test_tuning_progress_is_reported_per_tactic(register):
    backend = register(fr.CudnnFp4GemmRunner)
    events: list = []
    with fr.injected({(3, ((1, 0), (7, 2))): 2.0, (5, ()): 1.0}):
        result = _probe(backend, SMALL, events)
    assert result.verdicts["cudnn"].detail["tactic"]["tactic"] == [5, []]
    assert result.verdicts["cudnn"].detail["tactic"]["profiled"] == 3
    assert sum(e.get("phase") == "tune" for e in events) == 1 + 3


def test_tuning_can_be_turned_off_for_named_backends_only(register, monkeypatch):
    monkeypatch.setenv("FP4SELECT_TACTICS", "default:cute-dsl,cudnn")
    fp4select.settings.use(None)
    try:
        backend = register(fr.CutlassFp4GemmRunner)
        with fr.injected({}):
            record = tactics.tune(backend.checked_runner_for(SMALL), SMALL, _args(SMALL, 16))
            other = tactics.tune(
                backend.checked_runner_for(SMALL), SMALL, _args(SMALL, 16), name="cutlass"
            )
            named = tactics.tune(
                backend.checked_runner_for(SMALL), SMALL, _args(SMALL, 16), name="cudnn"
            )
    finally:
        fp4select.settings.use(None)
    assert record["tactic"] == 0 or record["tactic"] is not None  # no name: tuned
    assert other["runner"] == "CutlassFp4GemmRunner" and other["tactic"] is not None
    assert named["tactic"] is None and named["reason"] == "FP4SELECT_TACTICS=default:cute-dsl,cudnn"


# -- 4. flashinfer's "gave up" is recorded as the default, with its reason ---------------------
def test_every_tactic_failing_is_recorded_as_the_default_with_flashinfer_reason(register):
    backend = register(fr.TrtllmGemmRunner)
    with fr.injected({}, fail=(0, 1, 2)):
        record = tactics.tune(backend.checked_runner_for(SMALL), SMALL, _args(SMALL, 16))
    assert record["tactic"] == -1 and record["fallback"] == "gave-up"
    assert "every one of the 3 tactics flashinfer profiled failed" in record["reason"]
    assert tactics.served_as(record) == "default"


def test_an_oom_while_tuning_is_recorded_as_the_default_with_flashinfer_reason(register):
    backend = register(fr.TrtllmGemmRunner)
    with fr.injected({}, fail=MemoryError("fake OOM")):
        record = tactics.tune(backend.checked_runner_for(SMALL), SMALL, _args(SMALL, 16))
    assert record["tactic"] == -1 and record["fallback"] == "gave-up"
    assert "ran out of memory" in record["reason"] and "OOM" in record["reason"]


# -- 5. what the default tactic is -------------------------------------------------------------
def test_cutlass_default_is_config_0_and_no_speed_up_is_claimed_against_it(register):
    from fp4select.cli.checks import tactics_cell

    backend = register(fr.CutlassFp4GemmRunner)
    with fr.injected({0: 3.0, 1: 1.0, 2: 2.0}):
        record = tactics.tune(backend.checked_runner_for(SMALL), SMALL, _args(SMALL, 16))
    assert record["tactic"] == 1 and record["default_kind"] == "config 0"
    row = {"tactic": 1, "served": "tuned", "tuned_us": 1.0, "default_us": 3.0}
    assert tactics_cell([{**row, "default_kind": "config 0"}]) == "1/1 tuned"
    assert tactics_cell([{**row, "default_kind": "heuristic"}]) == "1/1 tuned (3.00x-3.00x)"
    for name in ("CudnnFp4GemmRunner", "TrtllmGemmRunner", "Sm12xCuTeFp4GemmRunner"):
        assert tactics.default_kind(name) == "heuristic"


# -- 7. near-ties: flashinfer's own rule, the fastest ------------------------------------------
def test_a_tactic_within_2_percent_does_not_beat_the_fastest(register):
    backend = register(fr.TrtllmGemmRunner)
    with fr.injected({0: 1.015, 1: 1.0, 2: 1.3}):  # 0 is enumerated first, 1.5% slower
        record = tactics.tune(backend.checked_runner_for(SMALL), SMALL, _args(SMALL, 16))
    assert record["tactic"] == 1 and record["tie_tolerance"] == 0.0


# -- 8. the real mm_fp4 call -------------------------------------------------------------------
def test_tuning_goes_through_the_real_mm_fp4_with_its_ten_inputs(register):
    backend = register(fr.Sm12xCuTeFp4GemmRunner)
    with fr.injected({("independent",): 1.0}) as timed:
        record = tactics.tune(backend.checked_runner_for(SMALL), SMALL, _args(SMALL, 16))
    assert timed == [("independent",)]  # M=16: no TMA tile, no raw tile
    assert record["tactic"] == ["independent"] and record["runner"] == "Sm12xCuTeFp4GemmRunner"
    assert fr.ran and all(r[4] == 10 for r in fr.ran)


# -- 6. engines that autotune under a process group --------------------------------------------
def _two_ranks(scenario: str) -> list[dict]:
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).parent / "_tactics_group_worker.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), "2", str(port), scenario],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{scenario}: a rank hung (a collective joined by one rank only)")
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.subprocess
def test_ranks_that_disagree_on_what_is_pinned_meet_the_same_collectives():
    rank0, rank1 = _two_ranks("pinned")
    assert rank0["ran"][0] == 0  # the stored tactic
    assert rank1["ran"][0] == -1  # untuned, and no group tuning joined for it
    assert rank0["ran"][1] == rank1["ran"][1] == 1  # the engine's op, tuned across the group
    assert rank0["profiled"] == rank1["profiled"] != []  # only the engine's op was tuned


@pytest.mark.subprocess
def test_in_process_tuning_never_joins_the_engine_group():
    rank0, rank1 = _two_ranks("tune")
    assert rank0["profiled"] == [0, 1, *rank1["profiled"]]  # its own tuning, then the engine's


# -- 3. tuning that hangs the sandbox child: kept at the default, not blacklisted ----------------
@pytest.mark.subprocess
def test_tuning_that_outlasts_the_probe_timeout_keeps_the_backend_untuned(cache_dir):
    import tactic_backends as tb

    fp4select.configure(
        cache_dir=cache_dir, isolation="subprocess", timing=FAST, probe_timeout_s=20
    )
    try:
        fp4select.register_backend(tb.SLOW_TUNING)
        record = fp4select.explain(problem=SMALL, device="cpu")
        blacklist = fp4select.api.selector().store.blacklist(
            fp4select.keys.environment_for(torch.device("cpu"))
        )
    finally:
        fp4select.unregister_backend(tb.SLOW_TUNING.name)
        fp4select.configure(cache_dir=cache_dir, isolation="inprocess")
    verdict = record["verdicts"][tb.SLOW_TUNING.name]
    assert verdict["status"] == "passed", verdict
    tactic = verdict["detail"]["tactic"]
    assert tactic["tactic"] == -1 and tactic["fallback"] == "timeout"
    assert "made no progress for 20 s" in tactic["reason"]
    assert tb.SLOW_TUNING.name not in blacklist
