"""batch_invariant=True: one backend for every M, rows whose bits never depend on the batch."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

import fp4select
from fp4select import best_mm_fp4
from fp4select.backends import discover
from fp4select.backends import flashinfer as flashinfer_backends
from fp4select.formats import reference_mm_fp4
from fp4select.keys import Problem
from fp4select.validate import check, make_inputs, prefix_inputs

flashinfer = pytest.importorskip("flashinfer")
pytestmark = pytest.mark.flashinfer

SHAPE = Problem(n=64, k=128, m_bucket=1, batch_invariant=True)


def _inputs(m, problem=SHAPE):
    return make_inputs(problem, m, "cpu")


def test_best_mm_fp4_takes_the_flag_where_flashinfer_puts_it():
    ours = inspect.signature(best_mm_fp4).parameters["batch_invariant"]
    assert ours.kind is inspect.Parameter.KEYWORD_ONLY and ours.default is False
    theirs = inspect.signature(flashinfer.mm_fp4).parameters.get("batch_invariant")
    if theirs is not None:  # flashinfer 0.7.4 and later
        assert theirs.kind is ours.kind and theirs.default is ours.default


def test_a_batch_invariant_call_is_exact_and_served_by_an_invariant_backend(inprocess):
    data = _inputs(37)
    out = best_mm_fp4(**data.kwargs(SHAPE), batch_invariant=True)
    assert check(out, data, torch.bfloat16).ok
    record = fp4select.explain(problem=SHAPE, device="cpu")
    assert record["winner"] == "emulation"
    verdicts = record["verdicts"]
    # Regular backends never compete: on a CPU they are unavailable; where they could run,
    # their declaration rejects the mode (see the cc what-if test below).
    assert verdicts["cutlass"]["status"] == "unavailable"
    cutlass = discover().backends["cutlass"]
    assert "not batch invariant" in cutlass.rejects(SHAPE, {"device": "cuda"})
    if "flashinfer-batch-invariant" in verdicts:
        assert verdicts["flashinfer-batch-invariant"]["status"] == "unavailable"


def test_rows_have_the_same_bits_whatever_the_batch(inprocess):
    big = _inputs(300)
    full = best_mm_fp4(**big.kwargs(SHAPE), batch_invariant=True)
    for m in (1, 16, 17, 129, 299):
        part = prefix_inputs(big, m, SHAPE)
        rows = best_mm_fp4(**part.kwargs(SHAPE), batch_invariant=True)
        assert torch.equal(rows, full[:m]), m
    assert fp4select.stats()["tunings"] == 1  # one decision for every M


def test_regular_and_invariant_calls_are_different_keys(inprocess):
    regular = Problem(n=64, k=128, m_bucket=64)
    data = make_inputs(regular, 40, "cpu")
    best_mm_fp4(**data.kwargs(regular))
    best_mm_fp4(**data.kwargs(regular), batch_invariant=True)
    assert fp4select.stats()["tunings"] == 2


def test_a_concrete_backend_with_the_flag_is_refused_before_any_kernel(inprocess, monkeypatch):
    ran = []
    monkeypatch.setattr(fp4select.selector.Selector, "decide", lambda *a, **k: ran.append(a))
    with pytest.raises(ValueError, match="batch_invariant=True needs backend='auto'"):
        best_mm_fp4(**_inputs(5).kwargs(SHAPE), backend="emulation", batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        best_mm_fp4(**_inputs(5).kwargs(SHAPE), batch_invariant=1)
    assert ran == []


def _wobbly(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, nvfp4, pdl):
    """Right to within the tolerance, but the last bit of each row depends on M."""
    ref = reference_mm_fp4(a, b, a_descale, b_descale, alpha, torch.float32, None, block_size,
                           use_8x4, nvfp4)  # fmt: skip
    result = (ref * (1 + (a.shape[0] % 2) * 2.0**-12)).to(out_dtype)
    return result if out is None else out.copy_(result)


def test_a_backend_that_claims_invariance_but_varies_with_m_is_rejected(inprocess):
    fp4select.register_backend(
        _wobbly, name="wobbly", devices={"cpu"}, modes={"batch_invariant"}, preference=1
    )
    data = _inputs(37)
    best_mm_fp4(**data.kwargs(SHAPE), batch_invariant=True)
    record = fp4select.explain(problem=SHAPE, device="cpu")
    assert record["verdicts"]["wobbly"]["status"] == "wrong"
    assert "not batch invariant" in record["verdicts"]["wobbly"]["reason"]
    assert record["winner"] == "emulation"


def test_an_invariant_backend_is_chosen_by_preference_not_by_a_race(inprocess, monkeypatch):
    """Speed is not the point of the mode: no timing runs, the preference order decides."""
    fp4select.register_backend(
        _steady, name="steady", devices={"cpu"}, modes={"batch_invariant"}, preference=1
    )
    timed = []
    monkeypatch.setattr(fp4select.probe, "time_backends", lambda *a, **k: timed.append(a))
    best_mm_fp4(**_inputs(9).kwargs(SHAPE), batch_invariant=True)
    record = fp4select.explain(problem=SHAPE, device="cpu")
    assert record["winner"] == "steady" and timed == []


def _steady(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, nvfp4, pdl):
    from fp4select.backends.emulation import _run_invariant

    return _run_invariant(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, nvfp4,
        b_layout="plain",
    )  # fmt: skip


def test_a_capture_time_miss_is_refused_rather_than_served_by_another_kernel(inprocess):
    with pytest.raises(RuntimeError, match=r"batch_invariant=True.*before capture"):
        inprocess.fallback(SHAPE, torch.device("cpu"))


def test_flashinfers_class_is_a_candidate_only_where_flashinfer_has_it():
    names = discover().backends
    has_flag = flashinfer_backends.takes_batch_invariant(flashinfer.mm_fp4)
    assert (flashinfer_backends.INVARIANT_NAME in names) == has_flag
    if not has_flag:
        return
    backend = names[flashinfer_backends.INVARIANT_NAME]
    ccs, why = flashinfer_backends.invariant_ccs()
    if ccs is None:  # a partial install (the H200 run carries only some modules): say so
        assert "cannot tell" in backend.unavailable_reason({"device": "cuda", "cc": 100})
        return
    assert ccs and why == ""
    assert backend.unavailable_reason({"device": "cuda", "cc": ccs[0]}) is None
    assert "SM90" in backend.unavailable_reason({"device": "cuda", "cc": 90})
    assert backend.rejects(SHAPE, {"device": "cuda"}) is None
    regular = Problem(n=64, k=128, m_bucket=16)
    assert "batch-invariant mode" in backend.rejects(regular, {"device": "cuda"})
    per_token = Problem(n=64, k=128, m_bucket=1, batch_invariant=True, alpha_kind="per_token")
    assert "per_token" in backend.rejects(per_token, {"device": "cuda"})


def test_flashinfers_class_is_called_with_its_flag_and_auto(monkeypatch):
    """The runner's arguments bind to the real mm_fp4 and ask for the batch-invariant class."""
    if not flashinfer_backends.takes_batch_invariant(flashinfer.mm_fp4):
        pytest.skip("this flashinfer has no batch_invariant mode")
    from fp4select.backends import flashinfer as fi

    real, _ = fi.load()
    calls = []

    def spy(*args, **kwargs):
        # skip_check is the keyword flashinfer's support decorator adds to mm_fp4's own.
        own = {k: v for k, v in kwargs.items() if k != "skip_check"}
        calls.append(inspect.signature(real).bind(*args, **own).arguments)
        return real(*args, **kwargs)

    monkeypatch.setattr(fi, "load", lambda: (spy, None))
    runner = flashinfer_backends.make_invariant_runner(SHAPE)
    with pytest.raises(ValueError):  # on a CPU, flashinfer's own device check stops it
        runner(*_inputs(3).args(SHAPE))
    assert calls and calls[0]["batch_invariant"] is True and calls[0]["backend"] == "auto"


def test_doctor_reports_a_parameter_flashinfer_has_and_we_do_not(monkeypatch):
    from fp4select.backends import flashinfer as fi
    from fp4select.reports import doctor_report, signature_report

    assert signature_report(flashinfer.mm_fp4)["matches"] is True
    real = flashinfer.mm_fp4

    @functools.wraps(real)
    def newer(*args, future_knob: int = 0, **kwargs):
        return real(*args, **kwargs)

    sig = inspect.signature(real)
    newer.__signature__ = sig.replace(
        parameters=[
            *sig.parameters.values(),
            inspect.Parameter("future_knob", inspect.Parameter.KEYWORD_ONLY, default=0),
        ]
    )
    fi.load.cache_clear()
    monkeypatch.setattr(fi, "load", lambda: (newer, None))
    report = doctor_report(torch.device("cpu"))
    assert report["flashinfer"]["signature"] == {
        "matches": False,
        "only_in_flashinfer": ["future_knob"],
        "different_defaults": [],
    }
    # The backends still list and bind: a new keyword does not break discovery.
    assert report["flashinfer"]["listed_backends"]


def test_where_flashinfer_does_not_say_the_class_is_unavailable_with_the_reason(monkeypatch):
    if not flashinfer_backends.takes_batch_invariant(flashinfer.mm_fp4):
        pytest.skip("this flashinfer has no batch_invariant mode")

    from fp4select.backends import flashinfer as fi

    assert fi.load()[0] is not None  # loaded (and cached) before the module "moves"

    def moved(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(flashinfer_backends.importlib, "import_module", moved)
    reason = flashinfer_backends.invariant_why_unavailable({"device": "cuda", "cc": 100})
    assert "cannot tell where" in reason and "No module named" in reason
