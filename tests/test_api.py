"""best_mm_fp4's face: flashinfer's exact signature, and clear errors before any kernel runs."""

from __future__ import annotations

import inspect

import pytest
import torch

import fp4select
from fp4select import best_mm_fp4, check_arguments
from fp4select.keys import Problem
from fp4select.validate import make_inputs

# Only the tests marked flashinfer need it (they compare with its API); the argument checks and
# the warm path's refusals run without it, as fp4select does.


@pytest.fixture
def flashinfer():
    return pytest.importorskip("flashinfer")


@pytest.mark.flashinfer
def test_signature_is_flashinfers_plus_keyword_only_extras(flashinfer):
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


@pytest.mark.flashinfer
def test_every_backend_flashinfer_lists_is_a_candidate(flashinfer):
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
    # and served: the reference reads the row tiles M needs, as kernels do
    assert torch.equal(best_mm_fp4(**kwargs), best_mm_fp4(**inputs.kwargs(PROBLEM)))


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
print("bound", fp4select.stats()["bound_signatures"])
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("mode", ["", "always"])
def test_a_bad_call_after_a_good_one_is_refused_in_both_check_modes(tmp_path, mode):
    """FP4SELECT_CHECK=always re-checks every call; the default binds, and still refuses."""
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
    assert "checked: alpha must be a float32 tensor" in proc.stdout
    assert f"bound {0 if mode == 'always' else 1}" in proc.stdout


# Bad calls that keep every shape of a good call the same: the first call refuses each; a
# warm signature must refuse each as well, with the same error, before any kernel runs.
SAME_SHAPE_BAD = [
    ("alpha float64", lambda g: {"alpha": g["alpha"].double()}, TypeError, "alpha must be a f"),
    ("a_descale None", lambda g: {"a_descale": None}, TypeError, "a_descale must be a torch"),
    ("b_descale None", lambda g: {"b_descale": None}, TypeError, "b_descale must be a torch"),
    ("a int8", lambda g: {"a": g["a"].view(torch.int8)}, TypeError, "a must hold packed FP4"),
    (
        "a column-major",
        lambda g: {"a": g["a"].t().contiguous().t()},
        ValueError,
        "a must be row-major contiguous",
    ),
    (
        "a_descale too small",
        lambda g: {"a_descale": g["a_descale"].reshape(-1)[: g["a_descale"].numel() // 2]},
        ValueError,
        "a_descale has",
    ),
    (
        "a_descale float16",
        lambda g: {"a_descale": torch.zeros(g["a_descale"].shape, dtype=torch.float16)},
        TypeError,
        "a_descale must be",
    ),
    ("flag as int", lambda g: {"use_8x4_sf_layout": 0}, TypeError, "use_8x4_sf_layout must be"),
    ("pdl as int", lambda g: {"enable_pdl": 1}, TypeError, "enable_pdl must be a bool"),
    ("block as float", lambda g: {"block_size": 16.0}, TypeError, "block_size must be an int"),
    ("a on meta", lambda g: {"a": g["a"].to("meta")}, ValueError, "is on cpu but a is on meta"),
    (
        "a_descale on meta",
        lambda g: {"a_descale": g["a_descale"].to("meta")},
        ValueError,
        "a_descale is on meta",
    ),
    (
        "b_descale on meta",
        lambda g: {"b_descale": g["b_descale"].to("meta")},
        ValueError,
        "b_descale is on meta",
    ),
    (
        "out float16",
        lambda g: {"out": torch.empty(13, 128, dtype=torch.float16)},
        TypeError,
        "out must have dtype",
    ),
]


@pytest.mark.parametrize(
    ("case", "change", "error", "message"), SAME_SHAPE_BAD, ids=[b[0] for b in SAME_SHAPE_BAD]
)
def test_the_warm_path_refuses_what_the_first_call_refuses(
    warm_path, good, case, change, error, message, monkeypatch
):
    good = dict(good, out=torch.empty(13, 128, dtype=torch.bfloat16))
    best_mm_fp4(**good)  # binds this signature
    with pytest.raises(error, match=message):
        best_mm_fp4(**_with(good, **change(good)))  # cold: nothing bound for it
    fp4select.reset()
    best_mm_fp4(**good)
    assert _bound_entries(warm_path) == 1
    ran = _spy_on_bound_runners()
    with pytest.raises(error, match=message):
        best_mm_fp4(**_with(good, **change(good)))  # warm: the good call's runner is bound
    assert ran == [], "a kernel ran before the bad argument was refused"


def _spy_on_bound_runners(fail: BaseException | None = None) -> list:
    """Replace every runner bound so far by one that records its call (and may fail)."""
    ran: list = []

    def spy(runner):
        def run(*args):
            ran.append(args)
            if fail is not None:
                raise fail
            return runner(*args)

        return run

    api = fp4select.api
    for signature, runner in list(api._checked.items()):
        api._checked[signature] = spy(runner)
    for key, (guard, runner) in list(api._bound.items()):
        api._bound[key] = (guard, spy(runner))
    for key, runner in list(api._native_bound.items()):
        api._native_bound[key] = spy(runner)
    return ran


def _bound_entries(warm_path: str) -> int:
    """How many warm entries the path that serves this test holds (and that it is the one)."""
    api = fp4select.api
    if warm_path == "native":
        assert api._native_key is not None and not api._bound, "the C++ key did not serve"
        return len(api._native_bound)
    assert api._native_key is None and not api._native_bound
    return len(api._bound)


def test_a_row_major_b_of_the_same_shape_is_refused():
    """N == K/2: a row-major (K/2, N) b has b.T's shape but is another matrix."""
    square = Problem(n=128, k=256, m_bucket=16)
    kwargs = make_inputs(square, 13, "cpu").kwargs(square)
    assert kwargs["b"].shape[0] == kwargs["b"].shape[1]
    check_arguments(**kwargs)
    with pytest.raises(ValueError, match="b must be the transposed view"):
        check_arguments(**dict(kwargs, b=kwargs["b"].contiguous()))


def test_a_row_major_b_is_refused_on_the_warm_path_too(warm_path):
    square = Problem(n=128, k=256, m_bucket=16)
    kwargs = make_inputs(square, 13, "cpu").kwargs(square)
    best_mm_fp4(**kwargs)
    with pytest.raises(ValueError, match="b must be the transposed view"):
        best_mm_fp4(**dict(kwargs, b=kwargs["b"].contiguous()))


def test_an_error_inside_the_backend_is_explained_by_the_checks(warm_path, good, monkeypatch):
    """A bound runner that fails on arguments its signature did not cover: the checks speak."""
    best_mm_fp4(**good)
    ran = _spy_on_bound_runners(fail=KeyError("the kernel's own error"))
    # Arguments that pass every check: the backend's own error comes through unchanged.
    with pytest.raises(KeyError, match="the kernel's own error"):
        best_mm_fp4(**good)
    assert len(ran) == 1
    # A device mismatch the signature does not see (a descale moved between calls of one
    # signature is impossible: devices are in it), so plant one through the runner instead:
    monkeypatch.setattr(
        fp4select.api, "check_arguments", lambda *a, **k: (_ for _ in ()).throw(ValueError("x"))
    )
    with pytest.raises(ValueError, match="x"):
        best_mm_fp4(**good)


@pytest.mark.flashinfer
def test_flashinfer_runners_reach_flashinfers_own_checks(flashinfer):
    """Our runners call the real mm_fp4 with arguments it binds; on a CPU it stops at the device."""
    from fp4select.backends import flashinfer as fi

    found, why = fi.backends()
    assert why is None and found
    inputs = make_inputs(PROBLEM, 16, "cpu")
    for backend in found:
        for runner in (backend.checked_runner_for(PROBLEM), backend.fast_runner_for(PROBLEM)):
            with pytest.raises(Exception) as caught:
                runner(*inputs.args(PROBLEM))
            assert not isinstance(caught.value, TypeError), (backend.name, caught.value)
            frames = [str(entry.path) for entry in caught.traceback]
            assert any("flashinfer" in f and "fp4select" not in f for f in frames), backend.name


def test_a_new_view_of_the_same_weight_is_served_without_checking_again(warm_path, monkeypatch):
    """vLLM passes a fresh weight.T every call: the full signature matches it, no re-check."""
    problem = Problem(n=128, k=256, m_bucket=16)
    inputs = make_inputs(problem, 13, "cpu")
    weight = inputs.b.T  # the (N, K/2) row-major weight
    kwargs = inputs.kwargs(problem)
    best_mm_fp4(**dict(kwargs, b=weight.T))
    checked = []
    real = fp4select.api.check_arguments
    monkeypatch.setattr(
        fp4select.api, "check_arguments", lambda *a, **k: checked.append(1) or real(*a, **k)
    )
    for _ in range(3):
        out = best_mm_fp4(**dict(kwargs, b=weight.T))
    assert checked == [] and fp4select.stats()["bound_signatures"] == 1
    from fp4select.validate import check

    assert check(out, inputs, torch.bfloat16).ok


def test_a_weight_that_is_freed_and_replaced_is_not_mistaken_for_it(warm_path):
    """Identity is checked through a weak reference: a new tensor at a reused id is new."""
    problem = Problem(n=128, k=256, m_bucket=16)
    kwargs = make_inputs(problem, 13, "cpu").kwargs(problem)
    best_mm_fp4(**dict(kwargs, b=kwargs["b"].T.clone().T))  # a temporary weight, then freed
    import gc

    gc.collect()
    with pytest.raises(ValueError, match="b must be the transposed view"):
        for _ in range(50):  # a row-major b may land at the freed weight's id: still refused
            best_mm_fp4(**dict(kwargs, b=kwargs["b"].contiguous()))


def test_a_weight_changed_in_place_is_checked_again(warm_path):
    """Nothing is taken by identity: the guard sees b's new strides on the warm path."""
    square = Problem(n=128, k=256, m_bucket=16)
    kwargs = make_inputs(square, 13, "cpu").kwargs(square)
    b = kwargs["b"].T.clone().T  # its own storage, the transposed (1, K/2) strides
    best_mm_fp4(**dict(kwargs, b=b))
    ran = _spy_on_bound_runners()
    b.t_()  # in place: now row-major-looking strides on the same object
    b.t_()
    best_mm_fp4(**dict(kwargs, b=b))  # unchanged after two transposes: served
    assert len(ran) == 1
    b.set_(b.contiguous())  # same object, same shape, row-major now: another matrix
    with pytest.raises(ValueError, match="b must be the transposed view"):
        best_mm_fp4(**dict(kwargs, b=b))
    assert len(ran) == 1


def _engine_call(kwargs, weight, weight_scale, **changes):
    """As vLLM calls mm_fp4: fresh views of the weight and its scales on every call."""
    return best_mm_fp4(**dict(kwargs, b=weight.t(), b_descale=weight_scale.t(), **changes))


def test_fresh_views_of_a_weight_are_served_without_the_full_signature(warm_path, monkeypatch):
    problem = Problem(n=128, k=256, m_bucket=16)
    inputs = make_inputs(problem, 13, "cpu")
    kwargs = inputs.kwargs(problem)
    weight, weight_scale = kwargs["b"].t().clone(), kwargs["b_descale"].t().clone()
    first = _engine_call(kwargs, weight, weight_scale)
    assert _bound_entries(warm_path) == 1
    read = []
    real = fp4select.api._signature
    monkeypatch.setattr(fp4select.api, "_signature", lambda *a: read.append(1) or real(*a))
    for _ in range(3):
        assert torch.equal(_engine_call(kwargs, weight, weight_scale), first)
    assert read == [] and _bound_entries(warm_path) == 1


@pytest.mark.parametrize(
    ("case", "view", "error", "message"),
    [
        ("row-major view", lambda w: w.view(w.shape[1], w.shape[0]), ValueError, "transposed"),
        ("int8 view", lambda w: w.view(torch.int8).t(), TypeError, "b must hold packed FP4"),
    ],
)
def test_another_view_of_a_bound_weight_is_checked_again(warm_path, case, view, error, message):
    square = Problem(n=128, k=256, m_bucket=16)
    kwargs = make_inputs(square, 13, "cpu").kwargs(square)
    weight, weight_scale = kwargs["b"].t().clone(), kwargs["b_descale"].t().clone()
    _engine_call(kwargs, weight, weight_scale)
    ran = _spy_on_bound_runners()
    with pytest.raises(error, match=message):
        best_mm_fp4(**dict(kwargs, b=view(weight), b_descale=weight_scale.t()))
    assert ran == []


def test_the_warm_path_never_reads_alpha_s_value(warm_path, monkeypatch):
    """alpha == 0 is an alpha like any other (truth-testing it would also sync the GPU)."""
    problem = Problem(n=128, k=256, m_bucket=16)
    kwargs = make_inputs(problem, 13, "cpu").kwargs(problem)
    kwargs["alpha"] = torch.zeros(1)
    assert not best_mm_fp4(**kwargs).any()
    read = []
    real = fp4select.api._signature
    monkeypatch.setattr(fp4select.api, "_signature", lambda *a: read.append(1) or real(*a))
    for _ in range(3):
        assert not best_mm_fp4(**kwargs).any()
    assert read == [], "a zero alpha was not served by the warm path"


def test_alternating_variants_of_one_key_build_no_guard_after_the_first_two(warm_path, monkeypatch):
    """Two a_descale allocations the checks both accept, call after call: no rebuilt guard."""
    kwargs = make_inputs(PROBLEM, 13, "cpu").kwargs(PROBLEM)
    tight = kwargs["a_descale"]
    extra = torch.zeros(128, tight.shape[1], dtype=torch.uint8)
    roomy = torch.cat([tight.view(torch.uint8), extra]).view(tight.dtype)
    built, read = [], []
    real_guard, real_signature = fp4select.tensor_guard.guard, fp4select.api._signature
    monkeypatch.setattr(
        fp4select.tensor_guard, "guard", lambda *t: built.append(1) or real_guard(*t)
    )
    monkeypatch.setattr(
        fp4select.api, "_signature", lambda *a: read.append(1) or real_signature(*a)
    )
    first = best_mm_fp4(**dict(kwargs, a_descale=tight))
    best_mm_fp4(**dict(kwargs, a_descale=roomy))
    assert len(built) == (0 if warm_path == "native" else 2)  # the C++ key needs no guard
    assert _bound_entries(warm_path) == (2 if warm_path == "native" else 1)
    built.clear(), read.clear()
    for _ in range(3):
        assert torch.equal(best_mm_fp4(**dict(kwargs, a_descale=tight)), first)
        best_mm_fp4(**dict(kwargs, a_descale=roomy))
    assert built == [] and read == []


def test_check_arguments_takes_every_parameter_of_best_mm_fp4_with_its_default():
    """doctor's signature report reads best_mm_fp4's parameters off check_arguments."""
    import inspect

    ours = inspect.signature(best_mm_fp4).parameters
    checked = inspect.signature(check_arguments).parameters
    assert set(ours) == set(checked)
    assert {n: p.default for n, p in ours.items()} == {n: checked[n].default for n in ours}


def test_the_warm_tables_start_again_past_their_bound_and_serve_right(warm_path, monkeypatch):
    """An eager prefill brings a new M most calls: the tables stay bounded, and a call they
    forgot is checked and bound again, with the right result."""
    monkeypatch.setattr(fp4select.api, "_MAX_SIGNATURES", 2)
    problem = Problem(n=128, k=256, m_bucket=16)
    from fp4select.validate import check

    for m in (13, 14, 15, 13):
        inputs = make_inputs(problem, m, "cpu", seed=m)
        out = best_mm_fp4(**inputs.kwargs(problem))
        assert check(out, inputs, torch.bfloat16).ok, m
        assert fp4select.stats()["bound_signatures"] <= 2
    assert fp4select.stats()["bound_signatures"] == 2  # 15 started the tables again; 13 rebound
