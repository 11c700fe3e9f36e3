"""best_mm_fp4's face: flashinfer's exact signature, and clear errors before any kernel runs."""

from __future__ import annotations

import inspect

import pytest
import torch

import fp4select
from fp4select import best_mm_fp4, check_arguments
from fp4select.keys import Problem
from fp4select.validate import make_inputs

flashinfer = pytest.importorskip("flashinfer")


def test_signature_is_flashinfers_plus_keyword_only_extras():
    ours = inspect.signature(best_mm_fp4).parameters
    theirs = inspect.signature(flashinfer.mm_fp4).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, param in theirs.items():
        assert ours[name].kind == param.kind, name
        assert ours[name].default == param.default, name
    extras = list(ours)[len(theirs) :]
    assert extras, "fp4select's own options are expected after flashinfer's"
    for name in extras:
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert ours[name].default is not inspect.Parameter.empty, name


def test_every_backend_flashinfer_lists_is_a_candidate():
    """Dispatch reads flashinfer's runtime list (the Literal in our annotation is documentation)."""
    from typing import get_args

    from fp4select.backends import discover

    listed = get_args(inspect.signature(flashinfer.mm_fp4).parameters["backend"].annotation)
    found = discover().backends
    for name in listed:
        if name != "auto":
            assert found[name].family == "flashinfer", name


PROBLEM = Problem(n=128, k=256, m_bucket=16)


@pytest.fixture
def good():
    return make_inputs(PROBLEM, 13, "cpu").kwargs(PROBLEM)


def _with(good, **changes):
    kwargs = dict(good)
    kwargs.update(changes)
    return kwargs


BAD = [
    ("a", lambda g: {"a": g["a"].numpy()}, TypeError, "a must be a torch.Tensor"),
    ("a dtype", lambda g: {"a": g["a"].to(torch.bfloat16)}, TypeError, "a must hold packed FP4"),
    ("b dtype", lambda g: {"b": g["b"].to(torch.int32)}, TypeError, "b must hold packed FP4"),
    ("a rank", lambda g: {"a": g["a"].unsqueeze(0)}, ValueError, "a must be 2-D"),
    ("b rank", lambda g: {"b": g["b"].reshape(-1)}, ValueError, "b must be 2-D"),
    ("K mismatch", lambda g: {"b": g["b"][:-8]}, ValueError, "K mismatch"),
    ("block size", lambda g: {"block_size": 32}, ValueError, "block_size must be 16 for nvfp4"),
    ("mxfp4 block", lambda g: {"use_nvfp4": False}, ValueError, "block_size must be 32 for mxfp4"),
    ("out dtype", lambda g: {"out_dtype": torch.float32}, ValueError, "out_dtype must be"),
    ("a_descale shape", lambda g: {"a_descale": g["a_descale"][:64]}, ValueError, "a_descale has"),
    (
        "b_descale shape",
        lambda g: {"b_descale": g["b_descale"][:, :64]},
        ValueError,
        "b_descale has",
    ),
    (
        "a_descale dtype",
        lambda g: {"a_descale": g["a_descale"].float()},
        TypeError,
        "a_descale must be",
    ),
    ("alpha dtype", lambda g: {"alpha": g["alpha"].double()}, TypeError, "alpha must be a float32"),
    (
        "alpha size",
        lambda g: {"alpha": torch.ones(5)},
        ValueError,
        "alpha must have 1 element or M=13",
    ),
    (
        "out shape",
        lambda g: {"out": torch.empty(13, 64, dtype=torch.bfloat16)},
        ValueError,
        "out must have shape",
    ),
    (
        "out dtype mismatch",
        lambda g: {"out": torch.empty(13, 128, dtype=torch.float16)},
        TypeError,
        "out must have dtype",
    ),
    (
        "flag type",
        lambda g: {"use_8x4_sf_layout": 1},
        TypeError,
        "use_8x4_sf_layout must be a bool",
    ),
    ("b_layout", lambda g: {"b_layout": "shuffled"}, ValueError, "b_layout must be one of"),
    ("backend type", lambda g: {"backend": None}, TypeError, "backend must be a str"),
    (
        "device",
        lambda g: {"b_descale": g["b_descale"].to("meta")},
        ValueError,
        "b_descale is on meta",
    ),
]


@pytest.mark.parametrize(("case", "change", "error", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named_before_any_kernel_runs(
    inprocess, good, case, change, error, message, monkeypatch
):
    ran = []
    monkeypatch.setattr(fp4select.selector.Selector, "decide", lambda *a, **k: ran.append(a))
    with pytest.raises(error, match=message):
        best_mm_fp4(**_with(good, **change(good)))
    assert ran == []


def test_trtllm_layout_needs_n_multiple_of_128():
    problem = Problem(n=96, k=256, m_bucket=16)
    kwargs = make_inputs(problem, 13, "cpu").kwargs(problem)
    kwargs["b_layout"] = "trtllm"
    with pytest.raises(ValueError, match="N % 128"):
        check_arguments(**kwargs)


def test_unknown_backend_name_lists_the_known_ones(inprocess, good):
    with pytest.raises(ValueError, match=r"backend must be 'auto' or one of .*emulation"):
        best_mm_fp4(**_with(good, backend="no-such-backend"))


def test_over_allocated_a_scales_are_accepted(inprocess):
    """Engines allocate a_descale for whole row tiles beyond M; that is not an error."""
    inputs = make_inputs(PROBLEM, 13, "cpu")
    kwargs = inputs.kwargs(PROBLEM)
    extra = torch.zeros(128, kwargs["a_descale"].shape[1], dtype=kwargs["a_descale"].dtype)
    kwargs["a_descale"] = torch.cat(
        [kwargs["a_descale"].view(torch.uint8), extra.view(torch.uint8)]
    ).view(extra.dtype)
    problem = check_arguments(**kwargs)
    assert problem == PROBLEM


CHECK_SCRIPT = """
import sys, torch, fp4select
from fp4select.keys import Problem
from fp4select.validate import make_inputs
fp4select.configure(cache_dir=sys.argv[1], isolation="inprocess")
p = Problem(n=128, k=256, m_bucket=16)
kwargs = make_inputs(p, 13, "cpu").kwargs(p)
fp4select.best_mm_fp4(**kwargs)
kwargs["alpha"] = kwargs["alpha"].double()  # same shapes, wrong dtype
try:
    fp4select.best_mm_fp4(**kwargs)
    print("not checked")
except TypeError as exc:
    print("checked:", exc)
"""


@pytest.mark.parametrize("mode", ["", "always"])
def test_check_always_rechecks_a_signature_that_passed_once(tmp_path, mode):
    import os
    import subprocess
    import sys

    env = {**os.environ, "FP4SELECT_CHECK": mode}
    proc = subprocess.run(
        [sys.executable, "-c", CHECK_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    if mode == "always":
        assert "checked: alpha must be a float32 tensor" in proc.stdout
    else:
        assert "not checked" in proc.stdout  # the warm path trusts a signature it has seen


def test_flashinfer_runners_reach_flashinfers_own_checks():
    """Our runners call the real mm_fp4 with arguments it binds; on a CPU it stops at the device."""
    from fp4select.backends import flashinfer as fi

    found, why = fi.backends()
    assert why is None and found
    inputs = make_inputs(PROBLEM, 16, "cpu")
    for backend in found:
        for runner in (backend.runner(PROBLEM), backend.dispatcher(PROBLEM)):
            with pytest.raises(Exception) as caught:
                runner(*inputs.args(PROBLEM))
            assert not isinstance(caught.value, TypeError), (backend.name, caught.value)
            frames = [str(entry.path) for entry in caught.traceback]
            assert any("flashinfer" in f and "fp4select" not in f for f in frames), backend.name
