"""Keys: M buckets agree with flashinfer's, and every field of a key changes the key."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp4select.keys import (
    M_BUCKETS,
    Problem,
    bucket_range,
    environment,
    m_bucket,
    validation_ms,
)
from fp4select.store import digest


def _flashinfer_bucket():
    try:
        from flashinfer.fused_moe.utils import map_to_hybrid_bucket_uncapped
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"flashinfer.fused_moe.utils.map_to_hybrid_bucket_uncapped moved: {exc}")
    return map_to_hybrid_bucket_uncapped


def test_buckets_match_flashinfer_for_every_m_up_to_20000():
    theirs = _flashinfer_bucket()
    mismatches = [m for m in range(1, 20001) if m_bucket(m) != theirs(m)]
    assert mismatches == []


@given(st.integers(min_value=1, max_value=2**30))
def test_bucket_contains_m_and_its_range_is_tight(m):
    bucket = m_bucket(m)
    lo, hi = bucket_range(bucket)
    assert lo <= m <= hi == bucket
    if lo > 1:
        assert m_bucket(lo - 1) < bucket


def test_m_below_one_is_an_error():
    with pytest.raises(ValueError, match="M"):
        m_bucket(0)


@pytest.mark.parametrize("bucket", M_BUCKETS[:20])
def test_validation_ms_cover_both_edges_and_an_odd_m(bucket):
    lo, hi = bucket_range(bucket)
    ms = validation_ms(bucket)
    assert ms[0] == lo and ms[-1] == hi
    assert all(lo <= m <= hi for m in ms)
    if hi - lo >= 2:
        assert any(m % 2 == 1 for m in ms)
        assert len(ms) == 3


BASE = Problem(n=4096, k=4096, m_bucket=8)
ALTERNATES = {
    "n": 4097,
    "k": 8192,
    "m_bucket": 16,
    "out_dtype": "float16",
    "block_size": 32,
    "use_nvfp4": False,
    "a_sf_layout": "8x4",
    "b_layout": "trtllm",
    "alpha_kind": "per_token",
    "batch_invariant": True,
}


def test_every_problem_field_is_covered_by_the_test():
    assert set(ALTERNATES) == {f.name for f in dataclasses.fields(Problem)}


@pytest.mark.parametrize("field", sorted(ALTERNATES))
def test_changing_any_problem_field_changes_the_key(field):
    # A batch-invariant problem has one bucket for every M: compare it with its regular twin.
    base = dataclasses.replace(BASE, m_bucket=1) if field == "batch_invariant" else BASE
    # block_size follows the format (16 for nvfp4, 32 for mxfp4): they change together.
    coupled = {"block_size": {"use_nvfp4": False}, "use_nvfp4": {"block_size": 32}}
    changed = dataclasses.replace(base, **{field: ALTERNATES[field]}, **coupled.get(field, {}))
    assert changed.digest() != base.digest()
    assert Problem.from_json(changed.to_json()) == changed


def test_keys_stored_before_batch_invariance_existed_still_match():
    """A regular problem's key has no batch_invariant field, so older entries keep matching."""
    assert "batch_invariant" not in BASE.to_json()
    assert dataclasses.replace(BASE, m_bucket=1, batch_invariant=True).to_json()["batch_invariant"]
    stored = {k: v for k, v in BASE.to_json().items()}
    assert Problem.from_json(stored) == BASE


def test_a_batch_invariant_problem_has_one_bucket_and_spans_every_m():
    with pytest.raises(ValueError, match="m_bucket must be 1"):
        Problem(n=64, k=128, m_bucket=16, batch_invariant=True)
    problem = Problem(n=64, k=128, m_bucket=1, batch_invariant=True)
    assert problem.m_range[0] == 1 and problem.m_range[1] >= 1 << 20
    assert len(problem.validation_ms()) >= 3 and max(problem.validation_ms()) > 256
    assert "batch invariant" in problem.describe()


@pytest.mark.parametrize("field", ["use_nvfp4", "batch_invariant"])
def test_a_flag_read_from_disk_must_be_a_bool(field):
    with pytest.raises(ValueError, match=f"{field} must be a bool"):
        Problem.from_json({**BASE.to_json(), field: 1})


def test_environment_holds_every_version_that_makes_a_kernel():
    env = environment(None)
    for field in (
        "torch",
        "cuda",
        "cudnn",
        "flashinfer",
        "fp4select",
        "triton",
        "schema",
        "gpu",
        "cc",
        "sm_count",
    ):
        assert field in env


@pytest.mark.parametrize("field", sorted(environment(None)))
def test_changing_any_environment_field_changes_the_env_hash(field):
    env = dict(environment(None))
    changed = dict(env, **{field: f"other-{env[field]}"})
    assert digest(changed) != digest(env)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("out_dtype", "float32"),
        ("a_sf_layout", "linear"),
        ("b_layout", "shuffled"),
        ("alpha_kind", "vector"),
        ("n", 0),
        ("m_bucket", 3),
        ("block_size", True),
    ],
)
def test_problem_rejects_values_outside_its_domain(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(BASE, **{field: value})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n": 10**30}, "n must be at most"),
        ({"k": 1 << 40}, "k must be at most"),
        ({"block_size": 7}, "block_size must be 16 for nvfp4"),
        ({"use_nvfp4": False}, "block_size must be 32 for mxfp4"),
        ({"k": 4104}, "multiple of block_size"),
    ],
)
def test_an_impossible_problem_is_refused(changes, message):
    """Keys come from files (records, archives, ranks): one no call could make is refused."""
    with pytest.raises(ValueError, match=message):
        Problem.from_json({**BASE.to_json(), **changes})
