"""Small holes of issue 21, one test each: a meta-tensor failure, deep records, engines absent."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

import fp4select
from fp4select.backends import flashinfer as _flashinfer_backends
from fp4select.keys import Problem
from fp4select.selector import NoCorrectBackendError
from fp4select.store import CacheWarning, Store, too_deep
from fp4select.validate import check, make_inputs

# flashinfer's first import in a process starts ptxas: done here, at collection, so that no
# test below starts a process (the suite's guard) whichever test file ran first.
_flashinfer_backends.backends()

PROBLEM = Problem(n=64, k=128, m_bucket=16)


def test_a_failed_meta_call_does_not_fail_the_real_cpu_calls(inprocess):
    """Meta tensors share the CPU's environment; their failed decision stayed in memory and
    every later real CPU call of the problem raised NoCorrectBackendError."""
    kwargs = make_inputs(PROBLEM, 13, "cpu").kwargs(PROBLEM)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(NoCorrectBackendError):
        fp4select.best_mm_fp4(**meta)
    out = fp4select.best_mm_fp4(**kwargs)
    inputs = make_inputs(PROBLEM, 13, "cpu")
    assert check(out, inputs, torch.bfloat16).ok


def _nested(depth: int) -> dict:
    deep: dict = {}
    cursor = deep
    for _ in range(depth):
        cursor["x"] = {}
        cursor = cursor["x"]
    return deep


def test_a_decision_nested_200_levels_is_a_miss_and_explain_works(inprocess, cache_dir):
    """950 levels parsed in a plain process, then explain raised RecursionError; the parser's
    own limit depends on the stack, so the store refuses past MAX_DEPTH (32) levels."""
    fp4select.best_mm_fp4(**make_inputs(PROBLEM, 13, "cpu").kwargs(PROBLEM))
    (path,) = Path(cache_dir).rglob("entries/*.json")
    entry = json.loads(path.read_text())
    entry["record"]["verdicts"]["emulation"]["detail"]["deep"] = _nested(200)
    path.write_text(json.dumps(entry))
    fp4select.configure(cache_dir=cache_dir, isolation="inprocess")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = fp4select.explain(problem=PROBLEM, device="cpu", tune=False)
    assert record["source"] == "none"  # refused, not served (and no RecursionError)
    assert any(
        issubclass(w.category, CacheWarning) and "nested deeper than 32" in str(w.message)
        for w in caught
    )


def test_nesting_is_measured_without_recursion():
    assert too_deep(_nested(100000))
    assert not too_deep({"a": [{"b": [1, 2, {"c": None}]}]})
    assert too_deep([[[[1]]]], limit=3) and not too_deep([[[1]]], limit=3)


def test_an_archive_nested_too_deeply_is_refused(tmp_path):
    archive = tmp_path / "a.json"
    archive.write_text(
        json.dumps({"schema": 1, "kind": "fp4select.archive", "entries": [_nested(200)]})
    )
    with pytest.raises(ValueError, match="nested deeper than 32"):
        Store(tmp_path / "cache").import_archive(archive)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_without_sglang_is_patched_is_false_and_patch_declines():
    from fp4select.integrations import sglang

    assert sglang.is_patched() is False
    assert sglang.patch() is False


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_without_vllm_patch_leaves_flashinfer_alone(monkeypatch):
    """Even with untested versions allowed: there is no vLLM to route."""
    import flashinfer

    from fp4select.integrations import vllm

    monkeypatch.setenv("FP4SELECT_ALLOW_UNTESTED_ENGINE", "1")
    before = flashinfer.mm_fp4
    try:
        assert vllm.patch() is False
        assert flashinfer.mm_fp4 is before, "flashinfer.mm_fp4 was patched without vLLM"
        assert vllm.is_patched() is False
    finally:
        vllm.unpatch()
