"""The warm path's planned ``hopper-*`` runners on a CUDA GPU: after a call's first launch
through Triton's JIT, its kernels launch from what was compiled, with the checked runners'
bits, each call reading its own tensors, in and out of CUDA graphs.

The plans' keys and bookkeeping are tested on the CPU (``tests/test_hopper_launch.py``).
"""

from __future__ import annotations

import pytest
import torch

from fp4select import validate
from fp4select.backends import dequant, hopper_launch, triton_hopper
from fp4select.backends import hopper_configs as hc
from fp4select.keys import Problem, m_bucket

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (checked runner, planned runner, cfg or None for the table's, N, K, M, alpha kind):
# the GEMV with and without a's own decode, the MMA kernel with its reduction kernel and with
# the last program's sum, hopper-ws unsplit and split, and hopper-ws handing a Python alpha to
# the MMA kernel; hopper-dequant.
CASES = [
    (triton_hopper.run_gemv, triton_hopper.fast_gemv, None, 4096, 4096, 1, "scalar"),
    (triton_hopper.run_gemv, triton_hopper.fast_gemv, None, 520, 2064, 3, "per_token"),
    (triton_hopper.run_mma, triton_hopper.fast_mma, hc.MmaConfig(128, 16, 32, 4, 3, 4), 4096, 4096, 16, "none"),
    (triton_hopper.run_mma, triton_hopper.fast_mma, hc.MmaConfig(64, 32, 32, 4, 3, 4, 8, 1), 520, 2064, 33, "per_token"),
    (triton_hopper.run_ws, triton_hopper.fast_ws, None, 4096, 4096, 256, "scalar"),
    (triton_hopper.run_ws, triton_hopper.fast_ws, hc.WsConfig(64, 128, 4, 2), 520, 2080, 64, "per_token"),
    (triton_hopper.run_ws, triton_hopper.fast_ws, None, 520, 2080, 200, "number"),
    (dequant.run_hopper, dequant.fast_hopper, None, 4096, 4096, 600, "scalar"),
    (dequant.run_hopper, dequant.fast_hopper, None, 520, 2064, 515, "per_token"),
]  # fmt: skip


def _args(problem: Problem, m: int, seed: int, alpha: str) -> tuple[validate.ProbeInputs, tuple]:
    inputs = validate.make_inputs(problem, m, "cuda", seed=seed)
    args = list(inputs.args(problem))
    if alpha == "number":
        args[4] = float(inputs.alpha.item())
    return inputs, tuple(args)


def _problem(n: int, k: int, m: int, alpha: str) -> Problem:
    kind = "scalar" if alpha == "number" else alpha
    return Problem(n=n, k=k, m_bucket=m_bucket(m), alpha_kind=kind)


@pytest.fixture
def wrapped_launches(monkeypatch):
    """How many launches went through the Python wrapper of Triton's compiled launcher
    (``CudaLauncher.__call__``), which the raw form skips; None where this Triton's launcher
    is not the one the raw form was written against."""
    from triton.backends.nvidia import driver

    if getattr(driver, "_BASE_ARGS_FORMAT", None) != hopper_launch._RAW_LAUNCH_FORMAT:
        return None
    count = [0]
    call = driver.CudaLauncher.__call__

    def counted(self, *args, **kwargs):
        count[0] += 1
        return call(self, *args, **kwargs)

    monkeypatch.setattr(driver.CudaLauncher, "__call__", counted)
    return count


@pytest.fixture
def jit_runs(monkeypatch):
    """The names of the kernels launched through Triton's JIT (``JITFunction.run``)."""
    from triton.runtime.jit import JITFunction

    names: list[str] = []
    run = JITFunction.run

    def counted(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    return names


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1].__name__}-M{c[5]}-{c[6]}")
def test_a_planned_runner_gives_the_checked_runners_bits_and_skips_the_jit(
    case, jit_runs, wrapped_launches
):
    """Call 1 plans and compiles, call 2 takes the direct launches with word views, calls 3
    and 4 the direct launches with the call's own tensors: each must read its own."""
    checked, planned, cfg, n, k, m, alpha = case
    hopper_launch.clear_plans()
    problem = _problem(n, k, m, alpha)
    kw = {} if cfg is None else {"cfg": cfg}
    for seed in (1, 2, 3, 4):
        inputs, args = _args(problem, m, seed, alpha)
        jit_runs.clear()
        if wrapped_launches is not None:
            wrapped_launches[0] = 0
        got = planned(*args, **kw)
        fast_launches = list(jit_runs)
        if wrapped_launches is not None and seed > 1:
            assert wrapped_launches[0] == 0, "Triton 3.6's launcher called through its wrapper"
        want = checked(*args, **kw)
        torch.cuda.synchronize()
        assert torch.equal(got, want), (seed, case)
        assert validate.check(got, inputs, problem.torch_out_dtype).ok, (seed, case)
        if seed == 1:
            assert fast_launches, "the first call launches through the JIT"
        else:
            assert fast_launches == [], f"launched through the JIT again: {fast_launches}"
    hopper_launch.clear_plans()


def test_a_planned_runner_writes_into_a_given_strided_out():
    hopper_launch.clear_plans()
    m, n = 33, 520
    problem = _problem(n, 2064, m, "scalar")
    for seed in (1, 2):
        inputs, args = _args(problem, m, seed, "scalar")
        out = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda").T
        got = triton_hopper.fast_mma(*args[:6], out, *args[7:])
        assert got is out
        assert validate.check(out, inputs, problem.torch_out_dtype).ok, seed
    hopper_launch.clear_plans()


CHECKED = {
    triton_hopper.fast_gemv: triton_hopper.run_gemv,
    triton_hopper.fast_mma: triton_hopper.run_mma,
    triton_hopper.fast_ws: triton_hopper.run_ws,
    dequant.fast_hopper: dequant.run_hopper,
}


@pytest.mark.parametrize(
    ("planned", "m"),
    [(triton_hopper.fast_gemv, 2), (triton_hopper.fast_mma, 16), (triton_hopper.fast_ws, 256), (dequant.fast_hopper, 600)],
)  # fmt: skip
def test_a_plan_first_made_in_a_capture_is_not_kept_and_replays_right(planned, m):
    hopper_launch.clear_plans()
    problem = _problem(4096, 4096, m, "scalar")
    _, args = _args(problem, m, 5, "scalar")
    out = torch.empty((m, 4096), dtype=torch.bfloat16, device="cuda")
    call = (*args[:6], out, *args[7:])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles, outside the capture (as engines warm up)
        CHECKED[planned](*call)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planned(*call)
    assert hopper_launch._plans == {}
    fresh, new = _args(problem, m, 6, "scalar")  # new values into the captured tensors
    for held, value in zip(call[:5], new[:5]):
        held.copy_(value)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert validate.check(out, fresh, problem.torch_out_dtype).ok
    planned(*call)  # eagerly: kept now
    assert len(hopper_launch._plans) == 1
    hopper_launch.clear_plans()


def test_the_quantizer_launches_a_repeated_shape_from_its_compiled_kernel(jit_runs):
    from fp4select import _quantize_triton, quantize

    _quantize_triton._launches.clear()
    gs = torch.tensor([0.7], device="cuda")
    for seed in (1, 2, 3, 4):  # the JIT, then direct with a byte view, then with the scales
        torch.manual_seed(seed)
        x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
        jit_runs.clear()
        got = quantize.fp4_quantize(x, gs)
        launched = list(jit_runs)
        want = quantize.quantize_torch(x, gs)
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]), seed
        assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), seed
        if seed == 1:
            assert launched, "the first call launches through the JIT"
        else:
            assert launched == [], f"launched through the JIT again: {launched}"


@pytest.mark.parametrize("planned", [triton_hopper.fast_ws, dequant.fast_hopper])
def test_a_kept_plan_keeps_no_tensor_of_its_calls(planned):
    import gc
    import weakref

    hopper_launch.clear_plans()
    problem = _problem(520, 2080, 600, "per_token")
    inputs, args = _args(problem, 600, 1, "per_token")
    refs = [weakref.ref(t) for t in args if isinstance(t, torch.Tensor)]
    out = planned(*args)
    refs.append(weakref.ref(out))
    assert len(hopper_launch._plans) == 1
    del inputs, args, out
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    hopper_launch.clear_plans()


@pytest.fixture
def encodings(monkeypatch):
    """The base pointer of every TMA descriptor Triton 3.6 encodes (``make_tensordesc_arg``);
    skipped where the launcher is not the one the raw form was written against."""
    from triton.backends.nvidia import driver

    if getattr(driver, "_BASE_ARGS_FORMAT", None) != hopper_launch._RAW_LAUNCH_FORMAT:
        pytest.skip("not Triton 3.6's launcher: descriptors are Triton's own business")
    log: list[int] = []
    encode = driver.make_tensordesc_arg

    def logged(desc, meta):
        log.append(desc.base.data_ptr())
        return encode(desc, meta)

    monkeypatch.setattr(driver, "make_tensordesc_arg", logged)
    return log


@pytest.mark.parametrize(
    "planned, m", [(triton_hopper.fast_ws, 256), (dequant.fast_hopper, 600)], ids=["ws", "dequant"]
)
def test_a_plans_tma_descriptors_are_encoded_once_for_the_same_tensors(planned, m, encodings):
    """The same weight on every call: encoded by the first direct launch, then reused, with
    the checked runner's bits (hopper-dequant's descriptors are on its kept workspaces, so
    from the third call nothing is encoded at all)."""
    hopper_launch.clear_plans()
    problem = _problem(4096, 4096, m, "scalar")
    inputs, args = _args(problem, m, 1, "scalar")
    want = CHECKED[planned](*args)
    per_call = []
    for _ in range(4):
        before = len(encodings)
        got = planned(*args)
        per_call.append(encodings[before:])
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        assert validate.check(got, inputs, problem.torch_out_dtype).ok
    weight = args[1].data_ptr()
    later = [p for call in per_call[1:] for p in call]
    if planned is triton_hopper.fast_ws:
        assert later.count(weight) == 1, per_call  # the first direct launch's encoding
    else:
        assert per_call[2:] == [[], []], per_call
    hopper_launch.clear_plans()
