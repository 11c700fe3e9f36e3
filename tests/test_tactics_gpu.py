"""flashinfer tactics on a real Blackwell GPU: what the CPU fakes can only imitate (issue 22).

NOT RUN by this project yet: it needs an SM100/SM103/SM12x GPU with flashinfer's FP4 backends
(cuDNN frontend, CuTe DSL, the trtllm cubins). Skipped elsewhere. One command:

    python -m pytest -m gpu tests/test_tactics_gpu.py -v -s

Each test prints what it saw, so a failure report carries the tactics, the Ms and the reasons.
It proves, with the real runners, real kernels and flashinfer's real autotuner:

1. a tactic tuned at a bucket's top is checked at every M the bucket serves: each call at
   257, 300, 385, 500 and 512 returns correct numbers, and the calls that fell back are exactly
   those whose tactic the runner's own check refuses (SM12x cute-dsl "raw" tiles at M % 128);
2. a stored tactic the runner cannot run (99, "abc", 1.5, true) serves the default, correctly,
   without cuDNN's silent substitution warning and without CUTLASS/trtllm raising;
3. tuning past ``FP4SELECT_TUNE_TIMEOUT_S`` keeps the backend, at the default, with the reason;
4. flashinfer's "gave up" (-1 after every tactic failed) is recorded as the default with its
   reason;
5. the runner classes the real mm_fp4 uses are those ``DEFAULT_KINDS`` describes (CUTLASS's
   -1 is "config 0"), so no speed-up is claimed against an arbitrary kernel.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import fp4select
from fp4select.backends import flashinfer as fi_backends
from fp4select.backends import flashinfer_tactics as tactics
from fp4select.keys import Problem, environment_for
from fp4select.timing import TimingOptions
from fp4select.validate import check, make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 10,
        reason="needs a Blackwell GPU (SM100/SM103/SM12x)",
    ),
]

N, K = 4096, 4096  # raw SM12x tiles need N % 128 == 0 and K % 256 == 0
BUCKET = 512
SERVED_MS = (257, 300, 385, 500, 512)
TIMING = TimingOptions(budget_s=0.2)


def _problems() -> list[Problem]:
    return [
        Problem(n=N, k=K, m_bucket=BUCKET),
        Problem(n=N, k=K, m_bucket=BUCKET, b_layout="trtllm"),
    ]


def _tuned_backends() -> list:
    env = environment_for(torch.device("cuda"))
    return [
        b
        for b in fi_backends.backends()[0]
        if b.why_unavailable is None or not b.why_unavailable(env)
    ]


@pytest.fixture
def sandboxed(tmp_path):
    fp4select.configure(cache_dir=tmp_path, isolation="subprocess", timing=TIMING)
    tactics._fallbacks.clear()
    yield tmp_path
    fp4select.configure(cache_dir=tmp_path, isolation="inprocess")


def _explain(problem: Problem) -> dict:
    record = fp4select.explain(problem=problem, device="cuda")
    print(
        json.dumps(
            {n: v["detail"].get("tactic") for n, v in record["verdicts"].items()}, default=str
        )
    )
    return record


# -- 1 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("problem", _problems(), ids=["plain", "trtllm-layout"])
def test_1_a_tuned_tactic_serves_every_m_of_its_bucket(sandboxed, problem):
    record = _explain(problem)
    flashinfer_names = {b.name for b in _tuned_backends()}
    checked = 0
    for name, verdict in record["verdicts"].items():
        if name not in flashinfer_names:
            continue
        tactic = verdict["detail"].get("tactic") or {}
        # a tactic must never be the reason a backend fails (it falls back to the default):
        # before issue 22, trtllm raised "unsupported tactic id in run" and SM12x cute-dsl
        # "Invalid SM12x cute-dsl tactic" at the bucket's other M
        assert verdict["status"] not in ("crash", "hang", "cuda-error"), verdict
        assert "tactic" not in (verdict.get("reason") or "").lower(), verdict
        if verdict["status"] != "passed":
            continue
        for m in SERVED_MS:
            inputs = make_inputs(problem, m, "cuda")
            out = fp4select.best_mm_fp4(**inputs.kwargs(problem), backend=name)
            assert check(out, inputs, torch.bfloat16).ok, (name, m, tactic)
            checked += 1
        fallbacks = [f for f in tactics.tactic_fallbacks(problem)]
        print(
            name, tactic.get("tactic"), "default at", tactic.get("default_at"), "served", fallbacks
        )
        if tactic.get("runner") == "Sm12xCuTeFp4GemmRunner" and str(
            tactic.get("tactic", "")
        ).startswith("['raw'"):
            assert {d["m"] for d in tactic["default_at"]} == {257, 385}
            assert {f["m"] for f in fallbacks if f["runner"] == "Sm12xCuTeFp4GemmRunner"} >= {
                300,
                500,
            }
    if not checked:
        pytest.skip(f"no flashinfer backend serves {problem.describe()} on this GPU")
    assert fp4select.stats()["tactic_fallbacks"] == sum(
        f["calls"] for f in tactics.tactic_fallbacks()
    )


# -- 2 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stored", [99, "abc", 1.5, True])
def test_2_a_stored_tactic_the_runner_cannot_run_serves_the_default(sandboxed, stored):
    problem = Problem(n=N, k=K, m_bucket=16)
    record = _explain(problem)
    for backend in _tuned_backends():
        verdict = record["verdicts"].get(backend.name)
        if verdict is None or verdict["status"] != "passed":
            continue
        runner_class = (verdict["detail"].get("tactic") or {}).get("runner")
        served = backend.fast_runner_for(
            problem, {"op": "fp4_gemm", "tactic": stored, "runner": runner_class}
        )
        inputs = make_inputs(problem, 13, "cuda")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = served(*inputs.args(problem))
            torch.cuda.synchronize()
        assert check(out, inputs, torch.bfloat16).ok, backend.name
        assert not [w for w in caught if "tactic failed" in str(w.message)], backend.name


# -- 3 -----------------------------------------------------------------------------------------
def test_3_tuning_past_its_limit_keeps_the_backend_at_the_default(tmp_path):
    fp4select.configure(
        cache_dir=tmp_path, isolation="subprocess", timing=TIMING, tune_timeout_s=0.001
    )
    try:
        record = _explain(Problem(n=N, k=K, m_bucket=256))
    finally:
        fp4select.configure(cache_dir=tmp_path, isolation="inprocess")
    names = {b.name for b in _tuned_backends()}
    tuned = [v for n, v in record["verdicts"].items() if n in names and v["status"] == "passed"]
    assert tuned
    for verdict in tuned:
        tactic = verdict["detail"]["tactic"]
        assert tactic["tactic"] in (-1, None), tactic  # None: a backend with no tactics (cake)
        if tactic["tactic"] == -1:
            assert (
                tactic["fallback"] == "timeout" and "FP4SELECT_TUNE_TIMEOUT_S" in tactic["reason"]
            )


# -- 4 and 5 -----------------------------------------------------------------------------------
def test_4_5_gave_up_is_the_default_and_runner_classes_are_known(monkeypatch):
    from flashinfer.autotuner import AutoTuner

    problem = Problem(n=N, k=K, m_bucket=256)
    args = make_inputs(problem, 256, "cuda").args(problem)
    seen = {}
    for backend in _tuned_backends():
        if backend.name in ("trtllm", "cake"):  # trtllm needs its own layout; cake has no tactics
            continue
        runner = backend.checked_runner_for(problem)
        try:
            record = tactics.tune(runner, problem, args, name=backend.name)
        except Exception as exc:  # not this GPU's backend: nothing to prove here
            print(backend.name, "cannot tune here:", exc)
            continue
        if record.get("runner") is None:
            continue
        seen[backend.name] = record
        assert record["default_kind"] != "unknown", record  # 5: the real class names
        if record["runner"] == "CutlassFp4GemmRunner":
            assert record["default_kind"] == "config 0"

        def fails(self, *a, **k):
            raise RuntimeError("injected: every tactic fails")

        monkeypatch.setattr(AutoTuner, "_instance", None)
        with monkeypatch.context() as m:
            m.setattr(AutoTuner, "_profile_single_kernel", fails)
            gave_up = tactics.tune(runner, problem, args, name=backend.name)
        assert gave_up["tactic"] == -1 and gave_up["fallback"] == "gave-up", gave_up  # 4
        assert "failed" in gave_up["reason"] or "no valid tactic" in gave_up["reason"]
    print(json.dumps(seen, default=str))
    assert seen, "no flashinfer backend could be tuned here"
