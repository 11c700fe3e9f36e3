"""The GPU built-ins' declarations and everything about them a CPU can check without kernels.

torch-scaled-mm cannot run here (it needs FP4 tensor cores): its arguments are checked against
torch's own rules for ``_scaled_mm_v2`` (the meta function, run on fake CUDA tensors), so a
wrong dtype, scale count or swizzle fails here rather than on the first Blackwell machine.
"""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from fp4select.backends import (
    dequant,
    discover,
    torch_scaled_mm,
    triton_fp4,
    triton_hopper,
)
from fp4select.backends.base import Backend
from fp4select.keys import Problem
from fp4select.validate import make_inputs

CPU = {"device": "cpu", "cc": None}
H200 = {"device": "cuda", "cc": 90}
B200 = {"device": "cuda", "cc": 100}
A100 = {"device": "cuda", "cc": 80}


def test_the_gpu_built_ins_are_registered_after_emulation_with_their_families():
    names = list(discover(include_flashinfer=False).backends)
    hopper = [b.name for b in triton_hopper.BACKENDS]
    gpu = [*hopper, "hopper-dequant", *(c.name for c in triton_fp4.CONFIGS)]
    gpu += ["torch-dequant", "torch-scaled-mm"]
    assert names[: 1 + len(gpu)] == ["emulation", *gpu]
    backends = discover(include_flashinfer=False).backends
    # All run GPU code of ours (Triton kernels, a decode pass): unproven, they are probed in
    # the sandbox like any plugin; only emulation is the trusted built-in fallback.
    assert {backends[n].family for n in gpu} == {"native"}
    assert backends["emulation"].family == "builtin"
    # Each is importable by name, so the sandbox child can rebuild it.
    for n in gpu:
        data = backends[n].to_json()
        runner = data["make_checked_runner"] or data["checked_runner"]
        assert runner.startswith("fp4select.backends."), n


def test_each_says_why_it_cannot_run_here():
    for backend in (
        *triton_hopper.BACKENDS,
        dequant.HOPPER_DEQUANT,
        *triton_fp4.BACKENDS,
        dequant.TORCH_DEQUANT,
        torch_scaled_mm.BACKEND,
    ):
        reason = backend.unavailable_reason(CPU)
        assert reason and isinstance(reason, str), backend.name
    assert "8.0" in triton_fp4.why_unavailable({"device": "cuda", "cc": 75})
    assert "9.0" in torch_scaled_mm.why_unavailable(H200)
    assert "Blackwell" in torch_scaled_mm.why_unavailable(H200)
    assert dequant.why_torch_unavailable(H200) is None
    # hopper-dequant needs TMA: Hopper or newer, and a Triton with host tensor descriptors
    assert "9.0" in dequant.why_hopper_unavailable({"device": "cuda", "cc": 80})


def test_hopper_ws_runs_on_sm90_only(monkeypatch):
    monkeypatch.setattr(triton_fp4, "triton_installed", lambda: True)
    assert triton_hopper.ws_why_unavailable(H200) is None  # this Triton has Gluon
    assert "SM90" in triton_hopper.ws_why_unavailable(B200)  # no wgmma on Blackwell
    assert "SM90" in triton_hopper.ws_why_unavailable({"device": "cuda", "cc": 89})
    assert "8.0" in triton_hopper.ws_why_unavailable({"device": "cuda", "cc": 75})
    # Triton 3.5's Gluon takes warp_specialize's partitions apart: the kernel does not compile.
    assert "3.6" in triton_hopper.ws_why_unavailable({**H200, "triton": "3.5.1"})
    for version in ("3.6.0", "3.8.0", "3.10.0+git1234abcd", "not a version", None):
        assert triton_hopper.ws_why_unavailable({**H200, "triton": version}) is None, version
    monkeypatch.setattr(triton_hopper.importlib.util, "find_spec", lambda name: None)
    assert "Gluon" in triton_hopper.ws_why_unavailable(H200)


def test_triton_is_available_on_hopper_when_installed(monkeypatch):
    monkeypatch.setattr(triton_fp4, "triton_installed", lambda: True)
    assert triton_fp4.why_unavailable(H200) is None
    monkeypatch.setattr(triton_fp4, "triton_installed", lambda: False)
    assert triton_fp4.why_unavailable(H200) == "triton is not installed"


def test_scaled_mm_is_available_on_blackwell_iff_torch_has_the_api():
    assert torch_scaled_mm.why_unavailable(B200) == torch_scaled_mm.missing_torch_support()


def test_declarations_exclude_what_the_kernels_do_not_take():
    backends = discover(include_flashinfer=False).backends
    trtllm = Problem(n=256, k=256, m_bucket=1, b_layout="trtllm")
    for name in ("hopper-gemv", "hopper-mma", "hopper-ws"):
        for problem in (trtllm, Problem(n=256, k=256, m_bucket=1, use_nvfp4=False, block_size=32)):
            assert backends[name].rejects(problem, H200), (name, problem)
    gemv = backends["hopper-gemv"]
    assert "M <= 8" in gemv.rejects(Problem(n=256, k=256, m_bucket=16), H200)
    assert "above M = 4" in gemv.rejects(Problem(n=256, k=256, m_bucket=8), H200)
    assert gemv.rejects(Problem(n=256, k=256, m_bucket=4), H200) is None
    assert gemv.rejects(Problem(n=256, k=256, m_bucket=8), A100) is None  # not measured there
    assert backends["hopper-mma"].rejects(Problem(n=256, k=256, m_bucket=256), H200) is None
    assert "M <= 256" in backends["hopper-mma"].rejects(Problem(n=256, k=256, m_bucket=512), H200)
    assert "hopper-prefill" not in backends  # retired: it won no point on the H200
    ws = backends["hopper-ws"]
    assert "M >= 64" in ws.rejects(Problem(n=256, k=256, m_bucket=32), H200)
    assert ws.rejects(Problem(n=256, k=256, m_bucket=64), H200) is None
    assert ws.rejects(Problem(n=256, k=256, m_bucket=512), H200) is None
    assert ws.rejects(Problem(n=256, k=256, m_bucket=2048), H200) is None
    assert "above M = 2048" in ws.rejects(Problem(n=256, k=256, m_bucket=4096), H200)
    assert "multiple of 16" in ws.rejects(Problem(n=256, k=2064, m_bucket=256), H200)
    dequant = backends["hopper-dequant"]
    assert "M >= 512" in dequant.rejects(Problem(n=256, k=256, m_bucket=256), H200)
    assert dequant.rejects(Problem(n=256, k=256, m_bucket=512), H200) is None
    assert dequant.rejects(Problem(n=256, k=256, m_bucket=8192), H200) is None
    for name in ("triton-m64", "torch-dequant", "torch-scaled-mm"):
        assert "trtllm" in backends[name].caps.rejects(trtllm, "cuda")
    sm = backends["torch-scaled-mm"].caps
    assert sm.rejects(Problem(n=256, k=256, m_bucket=1, a_sf_layout="8x4"), "cuda")
    assert sm.rejects(Problem(n=256, k=256, m_bucket=1, alpha_kind="per_token"), "cuda")
    gemv = backends["triton-gemv"].caps
    assert gemv.rejects(Problem(n=256, k=256, m_bucket=8), "cuda")
    assert gemv.rejects(Problem(n=256, k=256, m_bucket=4), "cuda") is None
    assert backends["triton-m16"].caps.rejects(Problem(n=256, k=256, m_bucket=128), "cuda")
    assert (
        backends["triton-m128"].caps.rejects(Problem(n=256, k=256, m_bucket=8192), "cuda") is None
    )


@pytest.mark.parametrize(
    ("m", "n", "kh", "expected"),
    [
        (1, 8192, 4096, 2),  # 128 tiles of 16x64: two splits make two waves of 132 SMs
        (1, 1024, 4096, 16),
        (1, 65536, 4096, 1),
        (1, 1024, 64, 1),  # one K step: nothing to split
    ],
)
def test_split_k_fills_the_sms_and_never_exceeds_the_k_steps(m, n, kh, expected):
    cfg = next(c for c in triton_fp4.CONFIGS if c.name == "triton-m16")
    split = triton_fp4.choose_split(m, n, kh, cfg, 132)
    steps = -(-kh // cfg.block_kh)
    tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    assert 1 <= split <= min(steps, 16)
    assert split == expected
    assert tiles * split <= 2 * 132 or split == 1
    # Equal work per split: the last one is at most one step short.
    per = -(-steps // split)
    assert per * (split - 1) < steps <= per * split


def test_dequant_workspaces_grow_and_outgrown_ones_are_kept_for_captured_graphs():
    dequant.clear_workspaces()
    cache: dict = {}
    device = torch.device("cpu")
    first = dequant.growing(cache, ("k",), 4, 8, torch.bfloat16, device)
    assert first.shape == (4, 8)
    same = dequant.growing(cache, ("k",), 3, 8, torch.bfloat16, device)
    assert same.data_ptr() == first.data_ptr()  # reused, no allocation
    bigger = dequant.growing(cache, ("k",), 5, 8, torch.bfloat16, device)
    assert bigger.shape == (5, 8) and cache[("k",)].shape[0] == 8  # doubled
    assert any(t.data_ptr() == first.data_ptr() for t in dequant._retired)
    dequant.clear_workspaces()


def test_dequant_on_cpu_without_triton_uses_the_reference_decode(monkeypatch):
    monkeypatch.setattr(triton_fp4, "triton_installed", lambda: False)
    problem = Problem(n=72, k=160, m_bucket=8, alpha_kind="per_token")
    inputs = make_inputs(problem, 5, "cpu")
    from fp4select.validate import check

    out = dequant.run_torch(*inputs.args(problem))
    result = check(out, inputs, torch.bfloat16)
    assert result.ok and result.worst_ratio < 0.6, result
    dequant.clear_workspaces()


def test_dequant_refuses_scale_buffers_its_decode_would_misread():
    """The Triton decode reads scales as contiguous storage: a strided view is refused first."""
    problem = Problem(n=128, k=128, m_bucket=8)
    inputs = make_inputs(problem, 5, "cpu")
    args = list(inputs.args(problem))
    doubled = torch.stack([args[2], args[2]], dim=-1).reshape(args[2].shape[0], -1)
    args[2] = doubled[:, ::2]  # the same values, every other byte of a wider buffer
    assert torch.equal(args[2], inputs.args(problem)[2]) and not args[2].is_contiguous()
    with pytest.raises(ValueError, match="a_descale must be a contiguous"):
        dequant.run_torch(*args)
    args = list(inputs.args(problem))
    args[3] = args[3].T.contiguous()  # the row-major (K/16, N) copy instead of the .T view
    with pytest.raises(ValueError, match=r"b_descale must be the \.T view"):
        dequant.run_torch(*args)


# -- torch-scaled-mm's arguments, against torch's own rules -----------------------------------

needs_scaled_mm = pytest.mark.skipif(
    torch_scaled_mm.missing_torch_support() is not None,
    reason=str(torch_scaled_mm.missing_torch_support()),
)


def _fake_cuda_inputs(problem: Problem, m: int):
    """The validator's inputs, moved onto fake CUDA tensors (no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = make_inputs(problem, m, "cpu", with_reference=False)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    tensors = {}
    with mode:
        for name in ("a", "a_descale", "alpha"):
            t = getattr(inputs, name)
            tensors[name] = None if t is None else torch.empty_like(t, device="cuda")
        weight = torch.empty_like(inputs.b.T.contiguous(), device="cuda")
        wscale = torch.empty_like(inputs.b_descale.T.contiguous(), device="cuda")
        tensors["b"], tensors["b_descale"] = weight.T, wscale.T
    return mode, tensors


# From torch 2.14 the op checks its arguments in C++ before any kernel, on the CPU as on CUDA
# (then its CPU kernel refuses the swizzle: as far as a CPU goes); before, only its Python meta
# function can be read without a GPU, on fake CUDA tensors.
CPU_CHECKS = Version(torch.__version__).release >= (2, 14)
CPU_KERNEL_REFUSES = "CPU does not support swizzle."


def _torch_refusal(problem: Problem, m: int) -> str | None:
    """torch's own verdict on what ``scaled_mm_arguments`` builds for ``problem``: the message
    it refuses the arguments with, or None."""
    if CPU_CHECKS:
        inputs = make_inputs(problem, m, "cpu", with_reference=False)
        args, kwargs = torch_scaled_mm.scaled_mm_arguments(
            inputs.a, inputs.b, inputs.a_descale, inputs.b_descale,
            inputs.alpha if problem.use_nvfp4 else None, torch.bfloat16, problem.use_nvfp4,
        )  # fmt: skip
    else:
        mode, t = _fake_cuda_inputs(problem, m)
        with mode:
            args, kwargs = torch_scaled_mm.scaled_mm_arguments(
                t["a"], t["b"], t["a_descale"], t["b_descale"],
                t["alpha"] if problem.use_nvfp4 else None, torch.bfloat16, problem.use_nvfp4,
            )  # fmt: skip
            return _refusal(args, kwargs)
    refusal = _refusal(args, kwargs)
    return None if refusal == CPU_KERNEL_REFUSES else refusal


def _refusal(args, kwargs) -> str | None:
    try:
        torch.nn.functional.scaled_mm(*args, **kwargs)
    except (RuntimeError, ValueError) as exc:  # torch._check raises RuntimeError; C++ ValueError
        return str(exc).splitlines()[0]
    return None


@needs_scaled_mm
def test_torchs_checks_are_read_where_this_torch_runs_them():
    """The oracle below is the right one for this torch: an a scale buffer of the 8x4 size is
    refused by the C++ checks on CPU tensors exactly when CPU_CHECKS says they run."""
    bad = Problem(n=208, k=320, m_bucket=8, a_sf_layout="8x4")
    inputs = make_inputs(bad, 7, "cpu", with_reference=False)
    args, kwargs = torch_scaled_mm.scaled_mm_arguments(
        inputs.a, inputs.b, inputs.a_descale, inputs.b_descale, inputs.alpha, torch.bfloat16, True
    )
    refusal = _refusal(args, kwargs)
    assert (refusal != CPU_KERNEL_REFUSES) == CPU_CHECKS, (torch.__version__, refusal)


@needs_scaled_mm
@pytest.mark.parametrize(
    ("nvfp4", "alpha_kind"), [(True, "scalar"), (True, "none"), (False, "none"), (False, "scalar")]
)
def test_scaled_mm_arguments_satisfy_torchs_shape_and_dtype_rules(nvfp4, alpha_kind):
    problem = Problem(
        n=208,
        k=320,
        m_bucket=8,
        use_nvfp4=nvfp4,
        block_size=16 if nvfp4 else 32,
        alpha_kind=alpha_kind,
    )
    if torch_scaled_mm.BACKEND.caps.rejects(problem, "cuda"):
        pytest.skip(f"not declared with torch {torch.__version__}: the MXFP4 test says why")
    assert _torch_refusal(problem, 7) is None
    mode, t = _fake_cuda_inputs(problem, 7)
    with mode:
        args, kwargs = torch_scaled_mm.scaled_mm_arguments(
            t["a"], t["b"], t["a_descale"], t["b_descale"], t["alpha"], torch.bfloat16, nvfp4
        )
        assert args[0].dtype == torch.float4_e2m1fn_x2 and args[0].stride() == (160, 1)
        assert args[1].dtype == torch.float4_e2m1fn_x2 and args[1].stride() == (1, 160)
        sf = torch.float8_e4m3fn if nvfp4 else torch.float8_e8m0fnu
        scales = [args[i][0] if isinstance(args[i], list) else args[i] for i in (2, 4)]
        assert all(s.dtype == sf and s.is_contiguous() for s in scales)
        assert scales[1].shape == (256, 20 if nvfp4 else 12)  # b's (N, K/block) buffer, padded
        assert kwargs["swizzle_a"] in (
            torch.nn.functional.SwizzleType.SWIZZLE_32_4_4,
            [
                torch.nn.functional.SwizzleType.SWIZZLE_32_4_4,
                torch.nn.functional.SwizzleType.NO_SWIZZLE,
            ],
        )
        out = torch.nn.functional.scaled_mm(*args, **kwargs)  # the meta function's shape
        assert tuple(out.shape) == (7, 208) and out.dtype == torch.bfloat16


@needs_scaled_mm
def test_b_scales_that_are_not_a_T_view_of_one_buffer_are_refused_by_name():
    """torch refuses a block-scale tensor that is not contiguous, and a contiguous (K/16, N)
    tensor holds other bytes than the weight's (N, K/16) swizzled rows: both are refused."""
    problem = Problem(n=208, k=320, m_bucket=8)
    inputs = make_inputs(problem, 7, "cpu", with_reference=False)
    assert inputs.b_descale.T.is_contiguous()
    with pytest.raises(ValueError, match=r"b_descale must be the \.T view"):
        torch_scaled_mm.scaled_mm_arguments(
            inputs.a, inputs.b, inputs.a_descale, inputs.b_descale.contiguous(),
            inputs.alpha, torch.bfloat16, True,
        )  # fmt: skip
    flat = inputs.b_descale.T.reshape(-1)  # a 1-D buffer of the same bytes is taken as it is
    args, _ = torch_scaled_mm.scaled_mm_arguments(
        inputs.a, inputs.b, inputs.a_descale, flat, inputs.alpha, torch.bfloat16, True
    )
    assert args[4][0].data_ptr() == inputs.b_descale.data_ptr()


@needs_scaled_mm
def test_scaled_mm_declares_the_divisibility_torch_checks():
    """N=200 passes every other rule; torch refuses it, so the declaration must exclude it."""
    problem = Problem(n=200, k=320, m_bucket=8)
    assert "N % 16" in torch_scaled_mm.BACKEND.caps.rejects(problem, "cuda")
    refusal = _torch_refusal(problem, 7)
    if refusal is None:
        pytest.skip(f"torch {torch.__version__} checks N % 16 only in its CUDA kernel")
    assert "divisible by 16" in refusal


@needs_scaled_mm
def test_mxfp4_is_declared_exactly_where_torchs_checks_take_its_scales():
    """MXFP4's a scales are 128 x K/32 (1536 for a 7 x 320 a); torch 2.13's meta function counts
    them from the packed K/2 (1024) and refuses them, 2.14's C++ checks take them. If torch
    changes its mind either way, this fails: then move MXFP4_FROM_TORCH."""
    problem = Problem(n=208, k=320, m_bucket=8, use_nvfp4=False, block_size=32, alpha_kind="none")
    declared = torch_scaled_mm.BACKEND.caps.rejects(problem, "cuda") is None
    refusal = _torch_refusal(problem, 7)
    assert declared == (refusal is None), (torch.__version__, refusal)
    if refusal is not None:
        assert "MX scaling" in refusal
    assert [torch_scaled_mm.declared_formats(v) for v in ("2.13.0+cpu", "2.14.1", "2.15.0")] == [
        frozenset({"nvfp4"}),
        frozenset({"nvfp4", "mxfp4"}),
        frozenset({"nvfp4", "mxfp4"}),
    ]


@needs_scaled_mm
def test_scaled_mm_rejects_scales_of_the_wrong_layout_size():
    """An 8x4-sized a scale buffer (not 128-row padded) must not get past torch's checks."""
    refusal = _torch_refusal(Problem(n=208, k=320, m_bucket=8, a_sf_layout="8x4"), 7)
    assert refusal is not None and refusal != CPU_KERNEL_REFUSES


def test_scaled_mm_runner_refuses_8x4_before_reaching_torch():
    with pytest.raises(ValueError, match="8x4"):
        torch_scaled_mm._run(*(None,) * 7, 16, True, True, True)


def test_older_kernels_leave_nvfp4_to_the_hopper_kernels_from_sm90():
    backends = discover(include_flashinfer=False).backends
    a100 = {"device": "cuda", "cc": 80}
    nvfp4 = Problem(n=256, k=256, m_bucket=1)  # inside every triton-* tile's M range
    mxfp4 = Problem(n=256, k=256, m_bucket=1, use_nvfp4=False, block_size=32)
    for cfg in triton_fp4.CONFIGS:
        triton = backends[cfg.name]
        assert "hopper-*" in triton.rejects(nvfp4, H200), cfg.name
        assert "hopper-*" in triton.rejects(nvfp4, B200), cfg.name
        assert triton.rejects(nvfp4, a100) is None, cfg.name  # not measured there: still tried
        assert triton.rejects(mxfp4, H200) is None, cfg.name  # the hopper-* MMAs decline MXFP4
    torch_dequant = backends["torch-dequant"]
    assert "M = 512" in torch_dequant.rejects(nvfp4, H200)
    assert torch_dequant.rejects(Problem(n=256, k=256, m_bucket=512), H200) is None
    assert torch_dequant.rejects(nvfp4, a100) is None
    assert torch_dequant.rejects(mxfp4, H200) is None
    # The hook crosses into the sandbox by name, like the runners.
    data = backends["triton-m16"].to_json()
    assert data["declines"] == "fp4select.backends.triton_fp4:declines"
    assert Backend.from_json(data).declines is triton_fp4.declines


def test_declines_narrow_the_field_only_on_cuda_gpus_from_the_measured_one():
    from fp4select.backends.base import cuda_from

    assert cuda_from(H200, 90) and cuda_from(B200, 90)
    assert not cuda_from(A100, 90)
    assert not cuda_from({"device": "cpu"}, 90)
    assert not cuda_from({"device": "cuda", "cc": None}, 90)  # unknown: left alone
    assert not cuda_from({"device": "cuda", "cc": "90"}, 90)  # not a number: left alone
