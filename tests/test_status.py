"""Verdict statuses are one enum, and caches written before it still load byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fp4select
from fp4select._version import __version__
from fp4select.probe import FATAL_STATUSES, STATUSES, MalformedRecord, Status, Verdict
from fp4select.sandbox.attempt import CHILD_STATUSES
from fp4select.selector import Decision
from fp4select.validate import check, make_inputs

# Every status string fp4select has ever written, as it was written before the enum existed.
OLD_STRINGS = [
    "passed",
    "wrong",
    "error",
    "oom",
    "unsupported",
    "cuda-error",
    "crash",
    "hang",
    "unavailable",
    "blacklisted",
]
# Statuses added since the enum: a cache written before them never holds them.
ADDED = ["skipped"]


def _old_record() -> str:
    """A stored decision, as the JSON text of a cache written with bare strings."""
    verdicts = {
        f"b{i}": {
            "backend": f"b{i}",
            "status": status,
            "reason": "" if status == "passed" else f"why {status}",
            "m": None if status == "passed" else 16,
            "worst_ratio": 0.25 if status == "passed" else None,
            "deterministic": True if status == "passed" else None,
            "detail": {"ms": [9, 13, 16]} if status == "passed" else {},
        }
        for i, status in enumerate(OLD_STRINGS)
    }
    record = {
        "problem": fp4select.keys.Problem(n=64, k=128, m_bucket=16).to_json(),
        "env": {"device": "cpu"},
        "winner": "b0",
        "verdicts": verdicts,
        "timings": {},
        "ranking": {
            "winner": "b0",
            "order": ["b0"],
            "margin": None,
            "tie_broken_by_preference": False,
        },
        "method": "not timed: one correct candidate",
        "considered": sorted(verdicts),
        "created": "2026-11-01T00:00:00+00:00",
        "tuning_seconds": 0.5,
        "isolation": "inprocess",
        "fp4select": __version__,
        "source": "disk",
    }
    return json.dumps(record, sort_keys=True)


def test_the_enum_holds_exactly_the_strings_written_before_it_and_those_added_since():
    assert sorted(s.value for s in Status) == sorted(OLD_STRINGS + ADDED)
    assert frozenset(OLD_STRINGS + ADDED) == STATUSES
    assert {"crash", "hang", "cuda-error"} == FATAL_STATUSES
    assert "crash" not in CHILD_STATUSES and "hang" not in CHILD_STATUSES
    assert "skipped" not in CHILD_STATUSES  # the selector gives it; a child sending it is refused


def test_a_member_is_its_string_in_comparisons_text_and_json():
    status = Status.CUDA_ERROR
    assert status == "cuda-error" and Status("cuda-error") is status
    assert {"cuda-error": 1}[status] == 1 and {status: 1}["cuda-error"] == 1
    # Messages, tables and logs show the text, on every Python (3.12 changed the default).
    assert str(status) == f"{status}" == format(status) == "cuda-error"
    assert f"{status:>12}" == "  cuda-error"
    assert json.dumps({status: status}) == '{"cuda-error": "cuda-error"}'


def test_a_verdict_built_from_a_string_holds_the_member_and_refuses_an_unknown_one():
    verdict = Verdict("x", "oom")
    assert verdict.status is Status.OOM
    assert type(verdict.to_json()["status"]) is str  # plain JSON data, not the enum
    with pytest.raises(ValueError, match="great"):
        Verdict("x", "great")


def test_a_cache_written_with_bare_strings_loads_and_writes_back_the_same_bytes():
    text = _old_record()
    decision = Decision.from_json(json.loads(text), source="disk")
    assert [v.status for v in decision.verdicts.values()] == [Status(s) for s in OLD_STRINGS]
    assert all(isinstance(v.status, Status) for v in decision.verdicts.values())
    assert json.dumps(decision.to_json(), sort_keys=True) == text
    assert json.dumps(decision.to_json(), sort_keys=True, indent=2) == json.dumps(
        json.loads(text), sort_keys=True, indent=2
    )


@pytest.mark.parametrize("status", ["great", "PASSED", "Status.PASSED", "", 3, None, ["passed"]])
def test_an_unknown_status_read_from_disk_is_refused_as_before(status):
    data = {**json.loads(_old_record())["verdicts"]["b0"], "status": status}
    with pytest.raises(MalformedRecord) as caught:
        Verdict.from_json(data)
    expected = sorted(OLD_STRINGS + ADDED)
    assert str(caught.value) == f"verdict.status must be one of {expected}: {status!r}"


def test_a_stored_entry_keeps_plain_strings_on_disk_and_loads_again(inprocess, cache_dir):
    problem = fp4select.keys.Problem(n=64, k=128, m_bucket=16)
    inputs = make_inputs(problem, 13, "cpu")
    out = fp4select.best_mm_fp4(**inputs.kwargs(problem))
    assert check(out, inputs, torch.bfloat16).ok
    (path,) = Path(cache_dir).rglob("entries/*.json")
    stored = json.loads(path.read_text())["record"]
    statuses = {v["status"] for v in stored["verdicts"].values()}
    assert "passed" in statuses and statuses <= set(OLD_STRINGS)
    fresh = fp4select.configure(cache_dir=cache_dir, isolation="inprocess")
    decision = fresh.lookup(problem, torch.device("cpu"))
    assert decision is not None and decision.source == "disk"
    again = {k: v for k, v in decision.to_json().items() if k != "source"}
    assert json.dumps(again, sort_keys=True) == json.dumps(
        {k: v for k, v in stored.items() if k != "source"}, sort_keys=True
    )


def test_a_verdicts_cause_is_kept_and_left_out_when_empty():
    """``cause`` (why a backend could not compete, as data) round-trips; empty, records read as
    they did before the field existed."""
    plain = Verdict("x", Status.UNAVAILABLE, "no GPU")
    assert "cause" not in plain.to_json()
    skipped = Verdict("cake", Status.UNAVAILABLE, "any words", cause="experimental")
    assert skipped.to_json()["cause"] == "experimental"
    assert Verdict.from_json(skipped.to_json()) == skipped
    with pytest.raises(MalformedRecord, match=r"verdict\.cause must be a string"):
        Verdict.from_json({**skipped.to_json(), "cause": 3})
