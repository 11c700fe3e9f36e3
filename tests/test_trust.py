"""What fp4select must not trust or lose: records from disk, the last resort, shared state."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import pytest
import torch

import fp4select
from fp4select.keys import Problem, environment
from fp4select.probe import FATAL_STATUSES, MalformedRecord, ProbeResult, Verdict
from fp4select.selector import PROTECTED_BACKENDS, Decision, Selector
from fp4select.store import CacheWarning, Store
from fp4select.validate import check, make_inputs

PROBLEM = Problem(n=64, k=128, m_bucket=16)
CPU = torch.device("cpu")


def _tune(selector):
    inputs = make_inputs(PROBLEM, 13, "cpu")
    out = fp4select.best_mm_fp4(**inputs.kwargs(PROBLEM))
    assert check(out, inputs, torch.bfloat16).ok
    return selector.lookup(PROBLEM, CPU)


def _entry_file(cache_dir) -> Path:
    (path,) = Path(cache_dir).rglob("entries/*.json")
    return path


# Each damages one field of a stored decision, keeping the file's key and environment intact
# so only the record's own checks can catch it.
DAMAGE = {
    "margin NaN": lambda r: r["ranking"].update(margin=float("nan")),
    "margin text": lambda r: r["ranking"].update(margin="fast"),
    "winner never passed": lambda r: r.update(winner="cutlass"),
    "winner not a name": lambda r: r.update(winner=7),
    "status unknown": lambda r: r["verdicts"]["emulation"].update(status="great"),
    "worst_ratio text": lambda r: r["verdicts"]["emulation"].update(worst_ratio="small"),
    "m a bool": lambda r: r["verdicts"]["emulation"].update(m=True),
    "verdict not an object": lambda r: r["verdicts"].update(emulation=5),
    "verdict of another backend": lambda r: r["verdicts"]["emulation"].update(backend="x"),
    "negative time": lambda r: r["timings"].update(
        emulation={
            "median_us": -1.0,
            "p10_us": 1.0,
            "p90_us": 1.0,
            "samples": 3,
            "calls_per_sample": 1,
            "method": "wall-clock",
        }
    ),
    "problem flag an int": lambda r: r["problem"].update(use_nvfp4=1),
    "considered not names": lambda r: r.update(considered=[1, 2]),
    "tuning seconds infinite": lambda r: r.update(tuning_seconds=float("inf")),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_record_with_a_bad_field_is_a_miss_with_one_warning(inprocess, case):
    _tune(inprocess)
    path = _entry_file(inprocess.store.root)
    data = json.loads(path.read_text())
    if not data["record"].get("ranking"):
        data["record"]["ranking"] = {"winner": "emulation", "margin": None}
    DAMAGE[case](data["record"])
    path.write_text(json.dumps(data))  # json.dumps writes NaN/Infinity, as a foreign tool may
    fp4select.configure(cache_dir=inprocess.store.root, isolation="inprocess")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decision = fp4select.api.selector().lookup(PROBLEM, CPU)
        assert decision is None
        fp4select.api.selector().lookup(PROBLEM, CPU)
    assert len([w for w in caught if issubclass(w.category, CacheWarning)]) == 1
    # The CLI shows it as invalid instead of crashing on it.
    from fp4select.cli import main

    assert main(["show", "--device", "cpu"]) == 0


def test_a_good_record_round_trips():
    verdict = Verdict("emulation", "passed", "", None, 0.25, True, {"ms": [9, 13, 16]})
    assert Verdict.from_json(json.loads(json.dumps(verdict.to_json()))) == verdict
    with pytest.raises(MalformedRecord, match="status"):
        Verdict.from_json({**verdict.to_json(), "status": "fine"})
    with pytest.raises(MalformedRecord, match="fields"):
        Verdict.from_json({**verdict.to_json(), "extra": 1})


def test_a_probe_result_from_a_pipe_is_checked_too():
    with pytest.raises(MalformedRecord):
        ProbeResult.from_json(
            {
                "verdicts": {"x": {"backend": "x", "status": "passed", "worst_ratio": "?"}},
                "timings": {},
                "method": "none",
                "seconds": 0.0,
                "aborted": False,
            }
        )


def test_a_decision_names_its_winner_only_if_it_passed():
    record = {
        "problem": PROBLEM.to_json(),
        "env": {},
        "winner": "cutlass",
        "verdicts": {"cutlass": {"backend": "cutlass", "status": "wrong", "reason": "zeros"}},
        "timings": {},
    }
    with pytest.raises(MalformedRecord, match="never passed"):
        Decision.from_json(record, source="disk")


# -- the last resort ---------------------------------------------------------------------------
@pytest.mark.parametrize("status", sorted(FATAL_STATUSES))
def test_the_builtin_fallback_is_condemned_for_one_key_at_most(inprocess, status):
    env = environment(None)
    result = ProbeResult(verdicts={"emulation": Verdict("emulation", status, "planted")})
    inprocess._record_fatal(env, PROBLEM, result)
    record = inprocess.store.blacklist(env)["emulation"]
    assert record["scope"] == "key" and record["key"] == PROBLEM.to_json()
    other = Problem(n=64, k=128, m_bucket=32)
    runnable, excluded = inprocess.candidates(other, env, inprocess.registry())
    assert "emulation" in {b.name for b in runnable} and "emulation" not in excluded


def test_an_environment_wide_record_for_the_fallback_is_not_obeyed(inprocess):
    """Written by an older fp4select, by hand, or imported: it may not take the fallback away."""
    env = environment(None)
    inprocess.store.add_to_blacklist(
        env, "emulation", {"reason": "hang on a huge problem", "kind": "hang", "scope": "x"}
    )
    assert "emulation" in PROTECTED_BACKENDS
    decision = _tune(inprocess)
    assert decision.winner == "emulation"


def test_other_backends_are_still_condemned_for_the_environment(inprocess):
    env = environment(None)
    result = ProbeResult(verdicts={"cutlass": Verdict("cutlass", "crash", "SIGSEGV")})
    inprocess._record_fatal(env, PROBLEM, result)
    assert inprocess.store.blacklist(env)["cutlass"]["scope"] == "environment"


# -- shared state across threads --------------------------------------------------------------
def test_threads_share_one_prober(cache_dir, monkeypatch):
    """Two threads starting two sandbox workers would mean two CUDA contexts on one GPU."""
    import fp4select.sandbox.prober as sandbox

    made = []
    real = sandbox.SandboxProber

    class Counting(real):
        def __init__(self, *args, **kwargs):
            made.append(self)
            threading.Event().wait(0.05)  # widen the window a race would need
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(sandbox, "SandboxProber", Counting)
    selector = Selector(Store(cache_dir), isolation="subprocess")
    barrier = threading.Barrier(8)
    probers = []

    def get():
        barrier.wait()
        probers.append(selector.prober())

    threads = [threading.Thread(target=get) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    selector.close()
    assert len(made) == 1 and len({id(p) for p in probers}) == 1


def test_threads_missing_one_key_tune_it_once(inprocess):
    barrier = threading.Barrier(6)
    errors = []

    def call():
        try:
            barrier.wait()
            inputs = make_inputs(PROBLEM, 13, "cpu")
            out = fp4select.best_mm_fp4(**inputs.kwargs(PROBLEM))
            assert check(out, inputs, torch.bfloat16).ok
        except Exception as exc:  # reported below, with the thread's own error
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = fp4select.stats()
    assert stats["tunings"] == 1
    assert stats["memory_hits"] + stats["waited_for_other_process"] + stats["disk_hits"] >= 5
