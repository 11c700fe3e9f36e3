"""The validator: a correct kernel passes with margin, and every planted fault fails it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp4select import formats
from fp4select.keys import Problem
from fp4select.validate import check, make_inputs

PROBLEMS = [
    Problem(n=96, k=256, m_bucket=64),
    Problem(n=128, k=512, m_bucket=16, out_dtype="float16"),
    Problem(n=128, k=256, m_bucket=8, use_nvfp4=False, block_size=32, alpha_kind="none"),
    Problem(n=256, k=128, m_bucket=32, a_sf_layout="8x4", b_layout="trtllm"),
    Problem(n=64, k=4096, m_bucket=4, alpha_kind="per_token"),
]


def _reference(problem, inputs, compute_dtype=torch.float32, **overrides):
    kwargs = inputs.kwargs(problem)
    del kwargs["enable_pdl"]
    kwargs.update(overrides)
    return formats.reference_mm_fp4(**kwargs, compute_dtype=compute_dtype)


@pytest.mark.parametrize("problem", PROBLEMS, ids=Problem.describe)
def test_a_correct_kernel_passes_with_margin(problem):
    inputs = make_inputs(problem, problem.m_bucket - 1, "cpu")
    for compute in (torch.float32, torch.float64):
        result = check(_reference(problem, inputs, compute), inputs, problem.torch_out_dtype)
        assert result.ok, result.reason
        # One rounding to the output dtype is at most half the bound: a correct kernel lands
        # at or under 0.5 (plus float32 accumulation noise), never near 1.
        assert result.worst_ratio < 0.6
        assert result.rel_error < inputs.aggregate_bound / 2


def test_inputs_are_deterministic_and_depend_on_the_seed():
    problem = PROBLEMS[0]
    first, again = make_inputs(problem, 33, "cpu"), make_inputs(problem, 33, "cpu")
    other = make_inputs(problem, 33, "cpu", seed=1)
    assert torch.equal(first.a, again.a) and torch.equal(first.ref, again.ref)
    assert not torch.equal(first.a, other.a)


def test_every_row_of_the_reference_is_nonzero():
    problem = PROBLEMS[0]
    inputs = make_inputs(problem, 64, "cpu")
    assert bool((inputs.ref != 0).any(dim=1).all())


FAULTS = {
    "nan": lambda out, p, i: out.index_put_(
        (torch.tensor([1]), torch.tensor([2])), torch.tensor(float("nan"), dtype=out.dtype)
    ),
    "inf": lambda out, p, i: out.index_put_(
        (torch.tensor([0]), torch.tensor([0])), torch.tensor(float("inf"), dtype=out.dtype)
    ),
    "zeros": lambda out, p, i: torch.zeros_like(out),
    "one zero row": lambda out, p, i: out.index_fill_(0, torch.tensor([3]), 0),
    "alpha ignored": lambda out, p, i: _reference(p, i, alpha=None),
    "alpha doubled": lambda out, p, i: out * 2,
    "alpha 1% off": lambda out, p, i: out * 1.01,
    "a scales read linear": lambda out, p, i: _reference(p, i, a_descale=_linear_view(p, i)),
    "b read as trtllm-shuffled": lambda out, p, i: _reference(p, i, b_layout="trtllm"),
    "nibbles swapped": lambda out, p, i: _reference(
        p, i, a=((i.a >> 4) | (i.a << 4)).to(torch.uint8)
    ),
    "one block scale wrong": lambda out, p, i: _reference(
        p, i, a_descale=_bump_first_scale(i.a_descale)
    ),
    "wrong dtype": lambda out, p, i: out.float(),
    "a row missing": lambda out, p, i: out[:-1],
}


def _linear_view(problem, inputs):
    """The a scales laid out row-major in a buffer of the swizzled size: the classic mix-up."""
    sf = formats.unswizzle_sf(
        inputs.a_descale, inputs.m, problem.k // problem.block_size, problem.a_sf_layout
    )
    buffer = torch.zeros(inputs.a_descale.numel(), dtype=torch.uint8)
    buffer[: sf.numel()] = sf.contiguous().view(torch.uint8).reshape(-1)
    return buffer.view(inputs.a_descale.dtype).reshape(inputs.a_descale.shape)


def _bump_first_scale(a_descale):
    raw = a_descale.view(torch.uint8).clone()
    raw.view(-1)[0] += 8  # one e4m3 exponent step up: that block's products double
    return raw.view(a_descale.dtype)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_planted_fault_fails(fault):
    problem = Problem(n=128, k=256, m_bucket=16)
    inputs = make_inputs(problem, 13, "cpu")
    good = _reference(problem, inputs)
    bad = FAULTS[fault](good.clone(), problem, inputs)
    result = check(bad, inputs, problem.torch_out_dtype)
    assert not result.ok, (
        f"{fault} slipped through (worst {result.worst_ratio}, rel {result.rel_error})"
    )
    assert result.reason


def test_a_transposed_square_result_fails():
    problem = Problem(n=16, k=128, m_bucket=16)
    inputs = make_inputs(problem, 16, "cpu")
    result = check(_reference(problem, inputs).T.contiguous(), inputs, torch.bfloat16)
    assert not result.ok


def test_a_transposed_rectangular_result_says_so():
    problem = Problem(n=48, k=128, m_bucket=16)
    inputs = make_inputs(problem, 16, "cpu")
    result = check(_reference(problem, inputs).T, inputs, torch.bfloat16)
    assert not result.ok and "transposed" in result.reason


def test_reasons_name_the_fault():
    problem = Problem(n=128, k=256, m_bucket=16)
    inputs = make_inputs(problem, 16, "cpu")
    good = _reference(problem, inputs)
    assert "non-finite" in check(good * float("nan"), inputs, torch.bfloat16).reason
    assert "all zero" in check(torch.zeros_like(good), inputs, torch.bfloat16).reason
    assert "not a tensor" in check(None, inputs, torch.bfloat16).reason


def test_at_large_k_the_aggregate_bound_catches_what_the_elementwise_one_cannot():
    problem = Problem(n=64, k=8192, m_bucket=4)
    inputs = make_inputs(problem, 4, "cpu")
    good = _reference(problem, inputs)
    off = check(good * 1.01, inputs, torch.bfloat16)
    assert off.worst_ratio <= 1.0  # the worst-case accumulation bound is loose at this K ...
    assert not off.ok and "aggregate" in off.reason  # ... the rms one is not


def test_fp16_bound_is_tighter_than_bf16():
    bf = make_inputs(Problem(n=64, k=256, m_bucket=8), 8, "cpu")
    fp = make_inputs(
        dataclasses.replace(Problem(n=64, k=256, m_bucket=8), out_dtype="float16"), 8, "cpu"
    )
    assert bool((fp.tol < bf.tol).all())
