"""The engine plugins' shared parts, with the real fp4select selector on the CPU.

These need no engine installed; the tests that drive the real SGLang and vLLM are in
test_integrations_sglang.py and test_integrations_vllm.py. The helpers at the top are shared
with those files.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

import fp4select
from fp4select.formats import reference_mm_fp4
from fp4select.integrations import _common
from fp4select.keys import Problem
from fp4select.validate import check, make_inputs

PLAIN_ONLY = "test_plain_only"
SHUFFLED_ONLY = "test_shuffled_only"


def _plain_run(a, b, a_sf, b_sf, alpha, out_dtype, out, block, use_8x4, nvfp4, pdl):
    calls.append(PLAIN_ONLY)
    return reference_mm_fp4(a, b, a_sf, b_sf, alpha, out_dtype, out, block, use_8x4, nvfp4)


def _shuffled_run(a, b, a_sf, b_sf, alpha, out_dtype, out, block, use_8x4, nvfp4, pdl):
    calls.append(SHUFFLED_ONLY)
    return reference_mm_fp4(
        a, b, a_sf, b_sf, alpha, out_dtype, out, block, use_8x4, nvfp4, b_layout="trtllm"
    )


calls: list[str] = []


def register_layout_backends() -> None:
    """Two CPU backends, one per layout family, that compute the right product for their layout.

    With them a CPU run shows which family a call was allowed to choose from: the other
    family's backend must be excluded as "unsupported" by layout, never tried.
    """
    fp4select.register_backend(
        _plain_run, name=PLAIN_ONLY, devices={"cpu"}, b_layouts={"plain"}, preference=1
    )
    fp4select.register_backend(
        _shuffled_run,
        name=SHUFFLED_ONLY,
        devices={"cpu"},
        b_layouts={"trtllm"},
        a_sf_layouts={"128x4", "8x4"},
        out_dtypes={"bfloat16"},
        preference=1,
    )
    calls.clear()


def problem_for(b_layout: str, m: int, *, n: int = 256, k: int = 128, eight_by_four=False):
    return Problem(
        n=n,
        k=k,
        m_bucket=fp4select.m_bucket(m),
        a_sf_layout="8x4" if eight_by_four else "128x4",
        b_layout=b_layout,
        alpha_kind="scalar",
    )


def assert_family(problem: Problem, allowed: str, excluded: str) -> dict:
    """The decision for ``problem`` considered ``allowed`` and excluded ``excluded`` by layout."""
    record = fp4select.explain(problem=problem, device="cpu", tune=False)
    assert record["winner"] is not None, record
    assert allowed in record["considered"], record["considered"]
    assert excluded not in record["considered"], record["considered"]
    verdict = record["verdicts"][excluded]
    assert verdict["status"] == "unsupported", verdict
    # Rejected for the b layout, or (8x4 problems) first for the 8x4 scales only trtllm takes.
    assert "layout" in verdict["reason"], verdict
    return record


def assert_exact(out: torch.Tensor, inputs, problem: Problem) -> None:
    result = check(out, inputs, problem.torch_out_dtype)
    assert result.ok, result.reason


# -- adapter -----------------------------------------------------------------------------------
class _Original:
    """Stands in for flashinfer.mm_fp4 where a test checks what reaches it unchanged."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "original"


@pytest.mark.parametrize(
    "backend, layout, other",
    [
        ("trtllm", "trtllm", PLAIN_ONLY),
        ("cutlass", "plain", SHUFFLED_ONLY),
        ("cudnn", "plain", SHUFFLED_ONLY),
        ("cute-dsl", "plain", SHUFFLED_ONLY),
        ("auto", "plain", SHUFFLED_ONLY),
    ],
)
def test_adapter_selects_within_the_engines_layout_family(inprocess, backend, layout, other):
    register_layout_backends()
    original = _Original()
    mm_fp4 = _common.make_mm_fp4(original, "test-engine")
    problem = problem_for(layout, 5)
    inputs = make_inputs(problem, 5, "cpu")
    out = mm_fp4(
        inputs.a,
        inputs.b,
        inputs.a_descale,
        inputs.b_descale,
        inputs.alpha,
        torch.bfloat16,
        backend=backend,
    )
    assert original.calls == []
    assert_exact(out, inputs, problem)
    allowed = SHUFFLED_ONLY if layout == "trtllm" else PLAIN_ONLY
    assert_family(problem, allowed, other)
    assert other not in calls


def test_adapter_views_uint8_scales_as_e4m3(inprocess):
    # vLLM hands cutlass/cudnn the scale bytes as uint8; the product must not change.
    mm_fp4 = _common.make_mm_fp4(_Original(), "test-engine")
    problem = problem_for("plain", 3)
    inputs = make_inputs(problem, 3, "cpu")
    out = mm_fp4(
        inputs.a,
        inputs.b,
        inputs.a_descale.view(torch.uint8),
        inputs.b_descale.view(torch.uint8),
        inputs.alpha,
        torch.bfloat16,
        use_8x4_sf_layout=False,
        backend="cutlass",
        block_size=16,
        use_nvfp4=True,
    )
    assert_exact(out, inputs, problem)


def test_adapter_passes_unknown_backends_and_keywords_to_flashinfer_unchanged(inprocess):
    original = _Original()
    mm_fp4 = _common.make_mm_fp4(original, "test-engine")
    a = torch.zeros(2, 64, dtype=torch.uint8)
    b = torch.zeros(64, 256, dtype=torch.uint8).T.contiguous().T
    assert mm_fp4(a, b, None, None, None, torch.bfloat16, backend="cake") == "original"
    assert original.calls[-1][1]["backend"] == "cake"
    assert mm_fp4(a, b, None, None, backend="cutlass", brand_new=1) == "original"
    assert original.calls[-1][1]["brand_new"] == 1
    # trtllm's shuffle works in tiles of 128 rows: fp4select's trtllm layout needs N % 128.
    b_odd = torch.zeros(64, 96, dtype=torch.uint8)
    assert mm_fp4(a, b_odd, None, None, backend="trtllm") == "original"
    assert len(original.calls) == 3
    assert fp4select.stats()["tunings"] == 0


def test_adapter_drops_flashinfers_skip_check(inprocess):
    mm_fp4 = _common.make_mm_fp4(_Original(), "test-engine")
    problem = problem_for("plain", 2)
    inputs = make_inputs(problem, 2, "cpu")
    out = mm_fp4(*inputs.args(problem)[:6], backend="cutlass", skip_check=True)
    assert_exact(out, inputs, problem)


def test_adapter_is_marked_so_the_flashinfer_backend_never_takes_it():
    mm_fp4 = _common.make_mm_fp4(_Original(), "test-engine")
    assert mm_fp4.__fp4select__ is True
    # Anything that wraps it with functools.wraps (SGLang's HookRegistry does) keeps the mark.
    import functools

    @functools.wraps(mm_fp4)
    def wrapper(*args, **kwargs):
        return mm_fp4(*args, **kwargs)

    assert wrapper.__fp4select__ is True


# -- switch and version gate ------------------------------------------------------------------
@pytest.mark.parametrize(
    "flag, allow_list, expected",
    [
        (None, None, False),  # installed only: off
        (None, "fp4select", True),
        (None, "other, fp4select", True),
        (None, "other", False),
        (None, "", False),
        ("1", None, True),
        ("0", "fp4select", False),
        ("maybe", "fp4select", True),  # a bad value is ignored (and named in a warning)
    ],
)
def test_plugin_switch(monkeypatch, flag, allow_list, expected):
    for name, value in ((_common.ENABLE_ENV, flag), ("ENGINE_PLUGINS", allow_list)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert _common.plugin_enabled("ENGINE_PLUGINS") is expected


def test_untested_version_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(_common, "_warned_untested", set())
    monkeypatch.delenv(_common.UNTESTED_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="fp4select.integrations"):
        assert _common.version_allowed("Eng", "9.9", ("1.0",)) is False
        assert _common.version_allowed("Eng", "9.9", ("1.0",)) is False
        assert _common.version_allowed("Eng", "1.0", ("1.0",)) is True
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "Eng 9.9 is not a version" in warnings[0].getMessage()
    assert "untouched" in warnings[0].getMessage()
    monkeypatch.setenv(_common.UNTESTED_ENV, "1")
    assert _common.version_allowed("Eng", "9.9", ("1.0",)) is True


# -- patch record ----------------------------------------------------------------------------
def test_patchset_restores_module_and_class_attributes():
    module = types.ModuleType("m")
    module.f = original_f = object()

    class Base:
        def method(self):
            return "base"

    class Child(Base):
        pass

    patches = _common.PatchSet("test")
    patches.set(module, "f", "new")
    patches.set(Child, "method", lambda self: "new")  # inherited: restore deletes it
    assert module.f == "new" and Child().method() == "new"
    assert patches.holds(module, "f") and patches.original(module, "f") is original_f
    restored = patches.restore()
    assert restored[0] == f"{__name__}.{Child.__qualname__}.method" and restored[1] == "m.f"
    assert module.f is original_f
    assert "method" not in vars(Child) and Child().method() == "base"
    assert not patches


def test_patchset_leaves_an_object_someone_bound_later(caplog):
    module = types.ModuleType("m")
    module.f = "orig"
    patches = _common.PatchSet("test")
    patches.set(module, "f", "ours")
    module.f = "theirs"
    with caplog.at_level(logging.WARNING, logger="fp4select.integrations"):
        assert patches.restore() == []
    assert module.f == "theirs"
    assert "rebound by someone else" in caplog.text


# -- tuning at load ---------------------------------------------------------------------------
def test_problems_for_buckets_and_8x4_below_33():
    shapes = [
        _common.LinearShape(256, 128, "bfloat16", "trtllm", small_m_8x4=True),
        _common.LinearShape(256, 128, "bfloat16", "plain"),
    ]
    problems = _common.problems_for(shapes, 100)
    buckets = [1, 2, 4, 8, 16, 32, 64, 128]
    assert [p.m_bucket for p in problems if p.b_layout == "plain"] == buckets
    layouts = {p.m_bucket: p.a_sf_layout for p in problems if p.b_layout == "trtllm"}
    assert layouts == {b: ("8x4" if b <= 32 else "128x4") for b in buckets}


def test_warm_max_m_override(monkeypatch, caplog):
    monkeypatch.delenv(_common.WARM_MAX_M_ENV, raising=False)
    assert _common.warm_max_m(8192) == 8192
    monkeypatch.setenv(_common.WARM_MAX_M_ENV, "64")
    assert _common.warm_max_m(8192) == 64
    monkeypatch.setenv(_common.WARM_MAX_M_ENV, "lots")
    with caplog.at_level(logging.WARNING, logger="fp4select.integrations"):
        assert _common.warm_max_m(8192) == 8192
    assert _common.WARM_MAX_M_ENV in caplog.text


def test_tune_at_load_decides_every_problem_and_closes_the_worker(inprocess, caplog):
    register_layout_backends()
    shapes = [_common.LinearShape(256, 128, "bfloat16", "trtllm", small_m_8x4=True)]
    closed = []
    sel = fp4select.api.selector()
    original_close = sel.close
    sel.close = lambda: (closed.append(True), original_close())
    with caplog.at_level(logging.INFO, logger="fp4select.integrations"):
        summary = _common.tune_at_load("Eng", shapes, 16, torch.device("cpu"))
    assert summary["problems"] == 5 and summary["decided"] == 5 and summary["failed"] == 0
    assert closed == [True]
    assert "[5/5]" in caplog.text and "sandbox worker closed" in caplog.text
    assert fp4select.stats()["tunings"] == 5
    assert_family(problem_for("trtllm", 16, eight_by_four=True), SHUFFLED_ONLY, PLAIN_ONLY)


# -- the W4A4 layer path the engines run on Hopper -------------------------------------------
def layer_operands(n: int, k: int, seed: int = 0):
    """A checkpoint's NVFP4 layer as ModelOpt writes it, and bf16 activations for it."""
    from fp4select import formats

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    qw = formats.quantize_nvfp4(w, None, "linear")
    x = (torch.randn(5, k, generator=g) * 3).to(torch.bfloat16)
    return types.SimpleNamespace(
        weight=qw.data,  # (N, K/2) uint8
        weight_scale=qw.scales,  # (N, K/16) e4m3, linear
        weight_scale_2=(1.0 / qw.global_scale).reshape(1).float(),
        input_scale=(x.abs().max().float() / (448.0 * 6.0)).reshape(1),
        x=x,
    )


def expected_w4a4(ops, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The exact product of the quantized activations and the checkpoint's weight."""
    from fp4select import formats
    from fp4select.quantize import quantize_torch

    a, a_sf = quantize_torch(ops.x.reshape(-1, ops.x.shape[-1]), 1.0 / ops.input_scale)
    w_sf = formats.swizzle_sf(ops.weight_scale, "128x4")
    return formats.reference_mm_fp4(
        a, ops.weight.T, a_sf, w_sf.T, ops.input_scale * ops.weight_scale_2, out_dtype
    )


def test_the_layer_path_returns_the_exact_w4a4_product(inprocess):
    from fp4select.integrations import _layer

    ops = layer_operands(256, 128)
    w_sf = _layer.prepare_weight_scale(ops.weight_scale)
    assert w_sf.shape == (256, 8) and w_sf.dtype == torch.float8_e4m3fn
    out = _layer.linear_nvfp4(
        ops.x.reshape(5, 1, 128),
        ops.weight,
        w_sf,
        1.0 / ops.input_scale,
        ops.input_scale * ops.weight_scale_2,
    )
    assert out.shape == (5, 1, 256) and out.dtype == torch.bfloat16
    assert torch.equal(out.reshape(5, 256), expected_w4a4(ops))
    op = _layer.linear_op()
    assert op is _layer.linear_op()  # registered once
    again = op(
        ops.x,
        ops.weight,
        w_sf,
        1.0 / ops.input_scale,
        ops.input_scale * ops.weight_scale_2,
        torch.bfloat16,
    )
    assert torch.equal(again, out.reshape(5, 256))
    with pytest.raises(ValueError, match="K=64"):
        _layer.linear_nvfp4(ops.x[:, :64], ops.weight, w_sf, ops.input_scale, ops.input_scale)
