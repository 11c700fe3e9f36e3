"""The tactic contract with the installed flashinfer, and the whole tune -> store -> serve loop.

Nothing here needs a GPU. flashinfer's own code runs wherever it can on a CPU: its autotuner
(autotune(), AutoTuner.choose_one, its profile generation, bucket mapping, near-tie settling
and caches) and mm_fp4's body up to and including its choose_one call and the runner call. Only
what needs a GPU is replaced: the per-tactic timer (injected times, so which tactic wins never
depends on machine load), the compute-capability and workspace queries, and the runner itself
(a TunableRunner with known tactics in place of cuDNN's).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import ClassVar

import pytest
import tactic_backends as tb
import torch
from flashinfer import autotuner as fi_autotuner
from flashinfer.autotuner import AutoTuner, TunableRunner
from packaging.version import Version

import fp4select
from fp4select import settings
from fp4select.backends import flashinfer as fi_backends
from fp4select.backends import flashinfer_tactics as tactics
from fp4select.keys import M_BUCKETS, Problem, m_bucket
from fp4select.probe import DEFAULT_SUFFIX, ProbeOptions, Verdict, probe
from fp4select.selector import Decision
from fp4select.timing import TimingOptions
from fp4select.validate import check, make_inputs

HERE = Path(__file__).parent
PROBLEM = Problem(n=64, k=128, m_bucket=16)
FAST = TimingOptions(budget_s=0.02, min_rounds=3, max_rounds=20, target_sample_s=1e-4)


@pytest.fixture(autouse=True)
def fresh_autotuner(monkeypatch):
    """Each test gets its own AutoTuner singleton (flashinfer's caches live on it)."""
    monkeypatch.setattr(AutoTuner, "_instance", None)
    tb.ran.clear()
    tb.profiled.clear()
    yield
    tactics.tuner_api.cache_clear()


class CudnnLikeRunner(TunableRunner):
    """Stands in for cuDNN's runner inside the real mm_fp4: compound tactics, records its calls."""

    calls: ClassVar[list] = []

    def get_valid_tactics(self, inputs, profile):
        return [(0, (7, 1)), (1, (2, 3))]

    def forward(self, inputs, tactic=-1, do_preparation=False, **kwargs):
        if not do_preparation:
            CudnnLikeRunner.calls.append((len(inputs), tactic))
        return inputs[6]


@pytest.fixture
def real_mm_fp4(monkeypatch):
    """flashinfer's mm_fp4, runnable on a CPU up to its runner: GPU queries answered, runner faked."""
    from flashinfer.gemm import gemm_base

    CudnnLikeRunner.calls = []
    monkeypatch.setattr(gemm_base, "get_compute_capability", lambda device: (12, 0))
    for workspace in ("_get_stream_cache_buf", "_get_cache_buf"):  # 0.7.4, 0.7.2
        if hasattr(gemm_base, workspace):
            monkeypatch.setattr(gemm_base, workspace, lambda name, size, device: torch.empty(size))
    monkeypatch.setattr(gemm_base, "_cudnn_gemm_fp4_runner", lambda config: CudnnLikeRunner())
    mm_fp4, why = fi_backends.load()
    assert mm_fp4 is not None, why
    return mm_fp4


def cudnn_dispatcher(problem=PROBLEM, record=None):
    backend = {b.name: b for b in fi_backends.backends()[0]}["cudnn"]
    return backend.fast_runner_for(problem, record)


# -- what the installed flashinfer offers ------------------------------------------------------
def test_installed_flashinfer_offers_the_autotuner_pieces_tactics_use():
    api, why = tactics.tuner_api()
    assert api is not None, why
    assert api.autotune is fi_autotuner.autotune
    assert api.tuner_class is AutoTuner and AutoTuner.get() is AutoTuner.get()
    assert list(AutoTuner.choose_one.__code__.co_varnames[:5]) == [
        "self",
        "custom_op",
        "runners",
        "tuning_config",
        "inputs",
    ]
    assert api.version == importlib.metadata.version("flashinfer-python")
    # 0.7.4 settles near-ties itself (0.7.2 cannot); fp4select keeps flashinfer's default (0:
    # the fastest measured), since a stored tactic needs no cross-process agreement
    assert api.takes_tie_tolerance == (Version(api.version) >= Version("0.7.4"))
    if api.takes_tie_tolerance:
        assert inspect.signature(api.autotune).parameters["tie_tolerance"].default is None
        assert AutoTuner.get()._tie_tolerance == 0.0
    with (
        pytest.raises(ValueError, match="tuning_buckets"),
        fi_autotuner.autotune(True, tuning_buckets=()),
    ):
        pass
    # every flashinfer backend fp4select lists carries the hooks
    for backend in fi_backends.backends()[0]:
        assert backend.tune is tactics.tune and backend.pin is tactics.pinned


def test_mm_fp4_buckets_m_exactly_like_fp4select():
    """A tactic tuned at a bucket's top is served across the bucket: flashinfer must agree."""
    from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets
    from flashinfer.gemm import gemm_base

    assert tactics.bucket_mapping_disagreement() is None
    for name in tactics._MM_FP4_CONFIGS:
        spec = getattr(gemm_base, name).dynamic_tensor_specs[0]
        assert spec.input_idx == (0,) and spec.dim_idx == (0,)  # M is a's first dimension
        for m in (1, 2, 3, 17, 256, 257, 2049, 3072, 3073, 4097, 9000, 1 << 20):
            assert spec.map_to_tuning_buckets(m) == m_bucket(m), (name, m)
    assert set(get_hybrid_num_tokens_buckets(1 << 20)) <= set(M_BUCKETS)


def test_a_flashinfer_that_buckets_m_otherwise_is_not_tuned(monkeypatch):
    from flashinfer.gemm import gemm_base

    spec = gemm_base._MM_FP4_TUNING_CONFIG_128x4.dynamic_tensor_specs[0]
    floor = type(spec)(spec.input_idx, spec.dim_idx, spec.gen_tuning_buckets, lambda m: m // 2 or 1)
    config = type(gemm_base._MM_FP4_TUNING_CONFIG_128x4)(dynamic_tensor_specs=(floor,))
    monkeypatch.setattr(gemm_base, "_MM_FP4_TUNING_CONFIG_128x4", config)
    tactics.bucket_mapping_disagreement.cache_clear()
    try:
        record = tactics.tune(tb.BACKEND.checked_runner_for(PROBLEM), PROBLEM, _args(16))
    finally:
        tactics.bucket_mapping_disagreement.cache_clear()
    assert record["tactic"] is None and "_MM_FP4_TUNING_CONFIG_128x4 maps M=" in record["reason"]
    assert tb.profiled == []


def test_mm_fp4_asks_choose_one_for_fp4_gemm_and_runs_what_it_answers(real_mm_fp4, monkeypatch):
    from flashinfer.gemm import gemm_base

    asked = []

    def spy(self, custom_op, runners, tuning_config, inputs, **kwargs):
        asked.append((custom_op, runners, tuning_config, inputs))
        return runners[0], (1, (2, 3))

    monkeypatch.setattr(AutoTuner, "choose_one", spy)
    args = make_inputs(PROBLEM, 9, "cpu").args(PROBLEM)
    cudnn_dispatcher()(*args)
    [(custom_op, runners, config, inputs)] = asked
    assert custom_op == tactics.OP
    assert len(runners) == 1 and isinstance(runners[0], CudnnLikeRunner)
    assert config is gemm_base._MM_FP4_TUNING_CONFIG_128x4
    assert inputs[0] is args[0] and len(inputs) == 10
    assert CudnnLikeRunner.calls == [(10, (1, (2, 3)))]


# -- the JSON round trip -----------------------------------------------------------------------
@pytest.mark.parametrize("tactic", [-1, 0, 17, (0, (7, 1)), (3, 64, (128, 256, True)), ()])
def test_tactic_round_trips_through_json_as_flashinfer_does(tactic):
    stored = json.loads(json.dumps(fi_autotuner._tactic_to_json(tactic)))
    assert tactics._tactic_to_json(tactic) == fi_autotuner._tactic_to_json(tactic)
    assert tactics._json_to_tactic(stored) == fi_autotuner._json_to_tactic(stored) == tactic
    assert tactics.tactic_of({"op": "fp4_gemm", "tactic": stored, "runner": "R"}) == (tactic, "R")


@pytest.mark.parametrize("record", [None, [], {}, {"reason": "no tactic key"}])
def test_a_record_without_a_tactic_pins_nothing(record):
    runner = tb.BACKEND.checked_runner_for(PROBLEM)
    assert tactics.tactic_of(record) is None
    assert tactics.pinned(runner, record or {}) is runner


def test_an_untuned_record_leaves_the_choice_to_flashinfer():
    record = {"tactic": None, "reason": "not tuned"}
    run = tactics.pinned(tb.BACKEND.checked_runner_for(PROBLEM), record)
    assert run.fp4select_tactic == (None, None)
    run(*_args(16))
    assert tb.ran == [-1]  # flashinfer's cache is empty: its default


@pytest.mark.parametrize(
    "record",
    [
        {"tactic": {"a": 1}, "runner": "TwoTacticRunner"},
        {"tactic": [1, {"x": 2}], "runner": "TwoTacticRunner"},
        {"tactic": 1, "runner": 5},
        {"tactic": 1, "runner": "TwoTacticRunner", "op": "bf16_gemm"},
        {"tactic": [[[[[[[[[[1]]]]]]]]]], "runner": "TwoTacticRunner"},
        {"tactic": "abc", "runner": "TwoTacticRunner"},
        {"tactic": 1.5, "runner": "TwoTacticRunner"},
        {"tactic": True, "runner": "TwoTacticRunner"},
    ],
)
def test_a_malformed_stored_tactic_is_a_miss_served_at_the_default(record, caplog):
    """Type first: "abc", 1.5 and true never reach a runner; one warning, flashinfer's default."""
    assert tactics.record_error(record) is not None
    with caplog.at_level("WARNING", logger="fp4select"):
        assert tactics.tactic_of(record) is None
        run = tactics.pinned(tb.BACKEND.checked_runner_for(PROBLEM), record)
        run(*_args(16))
        run(*_args(16))
    assert tb.ran == [-1, -1] and tb.profiled == []
    assert caplog.text.count("malformed flashinfer tactic record") <= 1


# -- serving the stored tactic -----------------------------------------------------------------
def test_the_bound_dispatcher_hands_the_stored_tactic_to_the_runner_without_choosing(
    real_mm_fp4, monkeypatch
):
    chosen = []
    original = AutoTuner.choose_one

    def spy(self, *args, **kwargs):
        chosen.append(args[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AutoTuner, "choose_one", spy)
    record = {"op": "fp4_gemm", "tactic": [1, [2, 3]], "runner": "CudnnLikeRunner"}
    record = json.loads(json.dumps(record))  # as read back from the store
    run = cudnn_dispatcher(record=record)
    out = run(*make_inputs(PROBLEM, 11, "cpu").args(PROBLEM))
    assert out.shape == (11, PROBLEM.n)
    assert CudnnLikeRunner.calls == [(10, (1, (2, 3)))]
    assert chosen == []  # flashinfer's own choice was never consulted
    assert tactics.installed()
    # the same backend unpinned is flashinfer's choice as before: no cache entry, the default
    cudnn_dispatcher()(*make_inputs(PROBLEM, 11, "cpu").args(PROBLEM))
    assert chosen == ["fp4_gemm"] and CudnnLikeRunner.calls[-1] == (10, -1)


def test_a_pinned_call_inside_an_engine_autotune_tunes_nothing_and_others_tune_as_before():
    """Engines defer to fp4select for the calls it decided, and only for those."""
    record = {"op": "fp4_gemm", "tactic": 0, "runner": "TwoTacticRunner"}
    pinned_run = tb.BACKEND.checked_runner_for(PROBLEM, record)
    plain_run = tb.BACKEND.checked_runner_for(PROBLEM)
    with fi_autotuner.autotune(True):  # an engine's warmup
        pinned_run(*_args(16))
        assert tb.ran == [0] and tb.profiled == []
        plain_run(*_args(16))
    assert tb.profiled  # flashinfer tuned the call fp4select did not pin
    assert tb.ran[-1] == 1  # and served its own winner


def test_a_runner_of_another_class_is_left_to_flashinfer():
    record = {"op": "fp4_gemm", "tactic": 0, "runner": "SomeOtherRunner"}
    tb.BACKEND.checked_runner_for(PROBLEM, record)(*_args(16))
    assert tb.ran == [-1]  # flashinfer's default, not a tactic recorded for another runner


def test_a_new_autotuner_singleton_is_hooked_again_at_the_next_bind():
    record = {"op": "fp4_gemm", "tactic": 1, "runner": "TwoTacticRunner"}
    tb.BACKEND.checked_runner_for(PROBLEM, record)(*_args(16))
    AutoTuner._instance = None
    assert not tactics.installed()
    tb.BACKEND.checked_runner_for(PROBLEM, record)(*_args(16))
    assert tactics.installed() and tb.ran == [1, 1]


# -- tuning ------------------------------------------------------------------------------------
def _args(m, problem=PROBLEM):
    return make_inputs(problem, m, "cpu").args(problem)


def test_tune_picks_the_tactic_flashinfer_measured_fastest_at_the_bucket_only():
    problem = Problem(n=64, k=128, m_bucket=256)
    record = tactics.tune(tb.BACKEND.checked_runner_for(problem), problem, _args(256, problem))
    assert record["tactic"] == 1 and record["runner"] == "TwoTacticRunner"
    assert record["default"] == -1 and record["m"] == 256
    takes = tactics.tuner_api()[0].takes_tie_tolerance
    assert record["tie_tolerance"] == 0.0 and isinstance(takes, bool)  # flashinfer's own rule
    assert sorted(tb.profiled) == [0, 1]  # one profile (the bucket), both tactics
    assert json.loads(json.dumps(record)) == record


def test_tune_says_why_not_where_autotune_takes_no_tuning_buckets(monkeypatch):
    import contextlib

    @contextlib.contextmanager
    def old_autotune(tune_mode=True):  # flashinfer 0.6.0's signature
        yield

    monkeypatch.setattr(fi_autotuner, "autotune", old_autotune)
    tactics.tuner_api.cache_clear()
    record = tactics.tune(tb.BACKEND.checked_runner_for(PROBLEM), PROBLEM, _args(16))
    assert record["tactic"] is None and "takes no tuning_buckets" in record["reason"]
    assert tb.profiled == [] and tb.ran == []
    runner = tb.BACKEND.checked_runner_for(PROBLEM)
    assert tactics.pinned(runner, record) is runner


def test_tactics_env_turns_tuning_off_and_names_itself_when_wrong(monkeypatch, caplog):
    monkeypatch.setenv(tactics.TACTICS_ENV, "default")
    record = tactics.tune(tb.BACKEND.checked_runner_for(PROBLEM), PROBLEM, _args(16))
    assert record["tactic"] is None and record["reason"] == "FP4SELECT_TACTICS=default"
    assert tb.profiled == [] and tb.ran == []
    monkeypatch.setenv(tactics.TACTICS_ENV, "fastest")
    settings.use(None)  # read once per process: read the environment again
    with caplog.at_level("ERROR", logger="fp4select"):
        record = tactics.tune(tb.BACKEND.checked_runner_for(PROBLEM), PROBLEM, _args(16))
    why = "FP4SELECT_TACTICS must be one of ('tune', 'default'), got 'fastest'"
    assert record["tactic"] is None and record["reason"].startswith(why)
    assert why in caplog.text and tb.profiled == []


def test_tune_notes_an_ordinary_failure_and_lets_a_cuda_error_through():
    def fails(*args):
        raise RuntimeError("no plan for this shape")

    record = tactics.tune(fails, PROBLEM, _args(16))
    assert record["tactic"] is None and "no plan for this shape" in record["reason"]

    def faults(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        tactics.tune(faults, PROBLEM, _args(16))


def test_tune_says_so_when_the_backend_never_asks_the_autotuner():
    record = tactics.tune(_no_tuner, PROBLEM, _args(16))
    assert record["tactic"] is None and "has no tactics" in record["reason"]


def _no_tuner(a, b, a_descale, b_descale, alpha, out_dtype, out, *rest):  # like mm_fp4's cake
    return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)


# -- the probe ---------------------------------------------------------------------------------
def test_the_probe_validates_and_times_the_tuned_tactic_and_the_default_beside_it(monkeypatch):
    from fp4select import timing
    from fp4select.backends import emulation

    # The default tactic runs as fast as the tuned one here; on a loaded machine one slow
    # calibration call could still rule it hopeless (a single sample), which is timing's rule
    # (tests/test_timing.py), not what this test is about. It failed so once under load.
    monkeypatch.setattr(timing, "HOPELESS_FACTOR", float("inf"))
    result = probe(PROBLEM, [tb.BACKEND, emulation.BACKEND], "cpu", ProbeOptions(timing=FAST))
    verdict = result.verdicts[tb.NAME]
    assert verdict.passed, verdict.reason
    assert verdict.detail["tactic"]["tactic"] == 1
    assert set(result.timings) == {tb.NAME, emulation.NAME}  # the default is not a candidate
    assert verdict.detail["default_timing"]["samples"] >= FAST.min_rounds
    assert not any(k.endswith(DEFAULT_SUFFIX) for k in result.timings)
    assert set(tb.ran) == {1, -1}  # the tuned tactic and, for the record, the default


def test_validation_runs_at_the_tuned_tactic_at_every_m_of_the_bucket(monkeypatch):
    asked = []
    original = AutoTuner.choose_one

    def spy(self, *args, **kwargs):
        asked.append(self.is_tuning_mode)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AutoTuner, "choose_one", spy)
    problem = Problem(n=64, k=128, m_bucket=256)
    result = probe(problem, [tb.BACKEND], "cpu", ProbeOptions(timing=FAST))
    assert result.verdicts[tb.NAME].passed and result.method.startswith("not timed")
    assert tb.ran == [1] * 5  # the tuning call, then M 129, 193, 256, and 256 into out=
    assert asked == [True]  # validation ran pinned, not on whatever flashinfer's cache holds
    assert result.verdicts[tb.NAME].detail["ms"] == [129, 193, 256]


def test_a_tactic_that_computes_wrong_numbers_is_rejected_and_named(monkeypatch):
    """What is served is what was checked: a wrong tuned tactic fails the backend for the key."""
    forward = tb.TwoTacticRunner.forward

    def wrong_at_1(self, inputs, tactic=-1, do_preparation=False, **kwargs):
        out = forward(self, inputs, tactic, do_preparation, **kwargs)
        if tactic == 1 and out is not None:
            out.zero_()
        return out

    monkeypatch.setattr(tb.TwoTacticRunner, "forward", wrong_at_1)
    result = probe(PROBLEM, [tb.BACKEND], "cpu", ProbeOptions(timing=FAST))
    verdict = result.verdicts[tb.NAME]
    assert verdict.status == "wrong" and verdict.detail["tactic"]["tactic"] == 1


def test_selector_bind_serves_the_tactic_of_a_decision_read_from_disk(inprocess):
    fp4select.register_backend(tb.BACKEND)
    record = {"op": "fp4_gemm", "tactic": 0, "runner": "TwoTacticRunner", "default": -1}
    decision = Decision(
        problem=PROBLEM,
        env={},
        winner=tb.NAME,
        verdicts={tb.NAME: Verdict(tb.NAME, "passed", detail={"tactic": record})},
    )
    again = Decision.from_json(json.loads(json.dumps(decision.to_json())), source="disk")
    assert again.tactic(tb.NAME) == record and again.tactic("emulation") is None
    run = inprocess.runner_for(again, torch.device("cpu"))
    run(*_args(9))
    assert tb.ran == [0] and tb.profiled == []


# -- the whole loop, across processes ---------------------------------------------------------
@pytest.mark.subprocess
def test_tuned_in_the_sandbox_stored_and_served_by_a_new_process_without_tuning(tmp_path):
    cache, log = tmp_path / "cache", tmp_path / "tactics.log"
    env = {**os.environ, tb.LOG_ENV: str(log), "PYTHONPATH": os.pathsep.join(sys.path)}
    tune = f"""
        import json, sys
        sys.path.insert(0, {str(HERE)!r})
        import fp4select, tactic_backends as tb
        from fp4select.keys import Problem
        from fp4select.timing import TimingOptions
        fp4select.configure(cache_dir={str(cache)!r}, isolation="subprocess",
                            timing=TimingOptions(budget_s=0.05, min_rounds=2))
        fp4select.register_backend(tb.BACKEND)
        record = fp4select.explain(problem=Problem(n=64, k=128, m_bucket=16), device="cpu")
        print(json.dumps({{"record": record, "ran": tb.ran, "profiled": tb.profiled,
                          "pid": __import__("os").getpid()}}))
    """
    first = _run(tune, env)
    verdict = first["record"]["verdicts"][tb.NAME]
    assert verdict["status"] == "passed" and verdict["detail"]["tactic"]["tactic"] == 1
    assert first["ran"] == first["profiled"] == []  # tuning and timing ran in the sandbox child
    tuned_lines = log.read_text().splitlines()
    assert "profiled 1" in tuned_lines and "ran 1" in tuned_lines
    log.write_text("")

    serve = f"""
        import json, sys
        sys.path.insert(0, {str(HERE)!r})
        import fp4select, tactic_backends as tb
        from fp4select.keys import Problem
        from fp4select.validate import check, make_inputs
        fp4select.configure(cache_dir={str(cache)!r}, isolation="inprocess")
        fp4select.register_backend(tb.BACKEND)
        problem = Problem(n=64, k=128, m_bucket=16)
        inputs = make_inputs(problem, 11, "cpu")
        out = fp4select.best_mm_fp4(**inputs.kwargs(problem), backend=tb.NAME)
        print(json.dumps({{"ok": check(out, inputs, problem.torch_out_dtype).ok,
                          "ran": tb.ran, "profiled": tb.profiled, "stats": fp4select.stats()}}))
    """
    second = _run(serve, env)
    assert second["ok"] and second["ran"] == [1] and second["profiled"] == []
    assert second["stats"]["tunings"] == 0 and second["stats"]["disk_hits"] == 1
    assert log.read_text().splitlines() == ["ran 1"]


@pytest.mark.subprocess
def test_an_explicitly_named_backend_is_served_at_the_tactic_it_was_checked_at(cache_dir):
    fp4select.configure(cache_dir=cache_dir, isolation="subprocess", timing=FAST)
    try:
        fp4select.register_backend(tb.BACKEND)
        inputs = make_inputs(PROBLEM, 11, "cpu")
        out = fp4select.best_mm_fp4(**inputs.kwargs(PROBLEM), backend=tb.NAME)
    finally:
        fp4select.configure(cache_dir=cache_dir, isolation="inprocess")
    assert check(out, inputs, torch.bfloat16).ok
    assert tb.profiled == [] and tb.ran == [1]  # tuned and checked in the child; pinned here


def _run(code: str, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_check_is_satisfied_by_every_tactic_of_the_fake():
    """The loop above compares tactics, not correctness: every tactic must be right."""
    for tactic in (-1, 0, 1):
        record = {"op": "fp4_gemm", "tactic": tactic, "runner": "TwoTacticRunner"}
        inputs = make_inputs(PROBLEM, 13, "cpu")
        out = tb.BACKEND.checked_runner_for(PROBLEM, record)(*inputs.args(PROBLEM))
        assert check(out, inputs, torch.bfloat16).ok


# -- what explain and verify print -------------------------------------------------------------
def test_explain_shows_the_tactic_and_the_default_time_beside_the_tuned_one(inprocess, capsys):
    from fp4select import cli
    from fp4select.cli.tune import tactic_summary

    fp4select.register_backend(tb.BACKEND)
    assert cli.main(["explain", "--n", "64", "--k", "128", "--m", "9", "--tune"]) == 0
    out = capsys.readouterr().out
    header, *rows = [line for line in out.splitlines() if line.startswith(("backend", tb.NAME))]
    assert "tactic" in header.split()
    [row] = rows
    assert "passed" in row and "1 (default, unknown: " in row and " us)" in row
    record = fp4select.explain(problem=PROBLEM, device="cpu", tune=False)
    verdict = record["verdicts"][tb.NAME]
    assert tactic_summary(verdict)[0].startswith("1 (default, unknown: ")
    untuned = {"detail": {"tactic": {"tactic": None, "reason": "no tuning_buckets"}}}
    assert tactic_summary(untuned) == ("default", "untuned: no tuning_buckets")
    assert tactic_summary({"detail": {}}) == ("-", "")


def test_explain_verify_and_their_json_count_a_tactic_record_by_one_rule():
    """What a record serves is decided in one place: -1 and a malformed tactic (which
    ``pinned`` serves as flashinfer's default) read as the default in every view."""
    from fp4select.backends.flashinfer_tactics import served_as
    from fp4select.cli.checks import tactics_cell
    from fp4select.cli.tune import tactic_summary

    records = [{"tactic": None}, {}, {"tactic": -1}, {"tactic": -1.0}, {"tactic": True}]
    records += [{"tactic": 3}, {"tactic": [1, [2, 3]]}]
    kinds = [served_as(r) for r in records]
    assert kinds == ["untuned"] * 2 + ["default"] * 3 + ["tuned"] * 2
    for record, kind in zip(records, kinds, strict=True):
        assert tactic_summary({"detail": {"tactic": record}})[0].startswith("default") == (
            kind != "tuned"
        )
        cell = tactics_cell([record])
        assert cell.startswith("1/1 tuned" if kind == "tuned" else "0/1 tuned"), (record, cell)
        assert cell.endswith(", 1 default") == (kind == "default"), (record, cell)


def test_verify_reports_per_backend_the_tactics_and_default_versus_tuned_time(
    cache_dir, monkeypatch, capsys
):
    from fp4select import cli
    from fp4select.cli.checks import tactics_cell

    monkeypatch.setenv("FP4SELECT_ISOLATION", "inprocess")
    monkeypatch.setenv("FP4SELECT_TIME_BUDGET_S", "0.02")
    fp4select.register_backend(tb.BACKEND)
    code = cli.main(["verify", "--shape", "128,256", "--m", "16", "--json"])
    report = json.loads(capsys.readouterr().out)
    fp4select.configure(cache_dir=cache_dir, isolation="inprocess")
    assert code == 0, report
    rows = report["backends"][tb.NAME]["tactics"]
    assert rows and all(r["tactic"] == 1 for r in rows)
    timed = [r for r in rows if r["tuned_us"] is not None]
    assert timed and all(r["default_us"] > 0 for r in timed)
    assert report["backends"]["emulation"]["tactics"] == []  # no tactics: nothing claimed
    # the fake's default is of an unknown kind: no speed-up is claimed against it
    assert tactics_cell(rows) == f"{len(rows)}/{len(rows)} tuned"
    assert all(r["served"] == "tuned" and r["default_kind"] == "unknown" for r in rows)
    assert report["backends"][tb.NAME]["tactic_counts"] == {"tuned": len(rows)}
    assert tactics_cell([{"tactic": None, "tuned_us": 2.0, "default_us": 2.0}]) == "0/1 tuned"
    assert tactics_cell([]) == "-"
