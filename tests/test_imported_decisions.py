"""Decisions from another machine (an archive, a bundle) are proven here before they serve."""

from __future__ import annotations

import json

import fake_backends
import pytest
import torch

import fp4select
from fp4select.backends import flashinfer as _flashinfer_backends
from fp4select.keys import Problem, environment
from fp4select.selector import PROTECTED_BACKENDS
from fp4select.store import Store
from fp4select.store.archive import ALWAYS_PROTECTED
from fp4select.validate import check, make_inputs

# flashinfer's first import in a process starts ptxas: done here, at collection, so that no
# test below starts a process (the suite's guard) whichever test file ran first.
_flashinfer_backends.backends()

PROBLEM = Problem(n=64, k=128, m_bucket=16)


@pytest.fixture(autouse=True)
def _deterministic_timings(injected_timings):
    """The winner of the build machine follows from given medians, never from a race."""


def register(*names):
    for name in names:
        fp4select.register_backend(getattr(fake_backends, name), name=name, devices={"cpu"})


def call(m=13):
    inputs = make_inputs(PROBLEM, m, "cpu")
    return fp4select.best_mm_fp4(**inputs.kwargs(PROBLEM)), inputs


def _bundle(tmp_path, inprocess, flip_to=None, **edit):
    """Tune on "the build machine" (this cache), export it, and forget it here; ``flip_to``
    rewrites the winner to a backend that failed validation, its verdict edited to passed."""
    call()
    archive = tmp_path / "bundle.json"
    inprocess.store.export_archive(archive)
    data = json.loads(archive.read_text())
    (entry,) = data["entries"]
    record = entry["record"]
    if flip_to is not None:
        assert record["verdicts"][flip_to]["status"] == "wrong"
        record["winner"] = flip_to
        record["verdicts"][flip_to].update(status="passed", reason="", m=None)
        record["ranking"] = {"winner": flip_to, "margin": None}
    record.update(edit)
    archive.write_text(json.dumps(data))
    inprocess.store.clear()
    fp4select.reset()
    return archive


def _fresh_selector(cache_dir):
    from conftest import FAST_TIMING

    return fp4select.configure(cache_dir=cache_dir, isolation="inprocess", timing=FAST_TIMING)


def test_an_imported_winner_that_fails_here_never_serves(inprocess, tmp_path, cache_dir):
    """The attack: a bundle whose winner is a backend that returns zeros, its verdict edited to
    "passed" (and claiming it was proven). Imported from Python, then called."""
    register("fast", "wrong_fast")
    archive = _bundle(tmp_path, inprocess, flip_to="wrong_fast", proven_here="2026-01-01")
    Store(cache_dir).import_archive(archive)
    sel = _fresh_selector(cache_dir)
    out, inputs = call()
    assert check(out, inputs, torch.bfloat16).ok, "an unproven imported winner served"
    record = fp4select.explain(problem=PROBLEM, device="cpu", tune=False)
    assert record["winner"] == "fast" and "imported" not in record
    assert sel.counters.as_dict()["proofs"] == 1 and sel.counters.as_dict()["tunings"] == 1


def test_an_imported_winner_is_proven_once_then_served(inprocess, tmp_path, cache_dir):
    register("fast", "slow")
    archive = _bundle(tmp_path, inprocess)
    result = Store(cache_dir).import_archive(archive)
    assert result.entries_written == 1
    (stored,) = [r for _, _, r in Store(cache_dir).iter_entries()]
    assert stored["imported"] is True and stored.get("proven_here") is None
    sel = _fresh_selector(cache_dir)
    assert fp4select.explain(problem=PROBLEM, device="cpu", tune=False)["source"] == "none"
    out, inputs = call()
    assert check(out, inputs, torch.bfloat16).ok
    counters = sel.counters.as_dict()
    assert counters["proofs"] == 1 and counters["tunings"] == 0
    (stored,) = [r for _, _, r in Store(cache_dir).iter_entries()]
    assert "imported" not in stored and stored["proven_here"] and stored["winner"] == "fast"
    sel = _fresh_selector(cache_dir)  # another process: read from disk, proven already
    call()
    assert sel.counters.as_dict()["proofs"] == 0 and sel.counters.as_dict()["disk_hits"] == 1


def test_an_archive_can_never_blacklist_emulation_whoever_imports_it(tmp_path):
    archive = tmp_path / "a.json"
    env = environment(None)
    archive.write_text(
        json.dumps(
            {
                "schema": 1,
                "kind": "fp4select.archive",
                "entries": [],
                "blacklist": [
                    {"env": env, "backend": "emulation", "record": {"reason": "r", "kind": "hang"}}
                ],
            }
        )
    )
    store = Store(tmp_path / "cache")
    result = store.import_archive(archive)  # from Python, no protected_backends given
    assert result.blacklist_protected == ("emulation",) and result.blacklist_written == 0
    assert store.blacklist(env) == {}
    assert ALWAYS_PROTECTED == PROTECTED_BACKENDS


@pytest.mark.subprocess
def test_the_proof_runs_in_the_sandbox(inprocess, tmp_path, cache_dir):
    """With subprocess isolation (the default) the imported winner is validated in the child."""
    from conftest import FAST_TIMING

    register("fast", "wrong_fast")
    archive = _bundle(tmp_path, inprocess, flip_to="wrong_fast")
    Store(cache_dir).import_archive(archive)
    sel = fp4select.configure(cache_dir=cache_dir, isolation="subprocess", timing=FAST_TIMING)
    try:
        out, inputs = call()
        assert check(out, inputs, torch.bfloat16).ok
        record = fp4select.explain(problem=PROBLEM, device="cpu", tune=False)
        assert record["winner"] != "wrong_fast" and record["isolation"] == "subprocess"
        assert sel.counters.as_dict()["proofs"] == 1
    finally:
        sel.close()
