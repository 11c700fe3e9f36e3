"""What only a GPU can show: graph capture and replay, event timing with cold L2, and a real
CUDA fault that must kill only the sandbox child. Skipped where no CUDA device is visible;
run on the lent H200 (see README, "Verified on").
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import cuda_fault_backends
import pytest
import torch

import fp4select
from fp4select import timing
from fp4select.backends import discover, emulation
from fp4select.keys import Problem
from fp4select.probe import ProbeOptions, probe
from fp4select.validate import check, make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROBLEM = Problem(n=4096, k=4096, m_bucket=16)


@pytest.fixture(params=["python", "native"])
def cuda_inprocess(request, tmp_path):
    """In-process tuning, with the warm path served by the Python path or the C++ key."""
    native = {"native": "off"}
    if request.param == "native":
        native = {"native": "auto", "native_dir": request.getfixturevalue("native_dir")}
    sel = fp4select.configure(
        cache_dir=tmp_path,
        isolation="inprocess",
        timing=timing.TimingOptions(budget_s=0.3),
        **native,
    )
    assert (fp4select.api._native_key is not None) == (request.param == "native")
    yield sel
    fp4select.configure(cache_dir=tmp_path, isolation="inprocess")


def test_the_native_key_tells_cuda_tensors_apart_and_never_syncs(native_dir):
    from fp4select import native_key

    key = native_key.load(native_dir)
    a = torch.zeros(16, 64, dtype=torch.uint8, device="cuda")
    assert key(a) == key(torch.ones(16, 64, dtype=torch.uint8, device="cuda"))
    assert key(a) != key(a.cpu())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a sync or an allocation here would break the capture
        inside = key(a, None, a)
    assert inside == key(a, None, a)


def test_a_proven_candidate_is_chosen_on_this_gpu(cuda_inprocess):
    inputs = make_inputs(PROBLEM, 13, "cuda")
    out = fp4select.best_mm_fp4(**inputs.kwargs(PROBLEM))
    assert check(out, inputs, torch.bfloat16).ok
    record = fp4select.explain(problem=PROBLEM, device="cuda")
    verdicts = record["verdicts"]
    assert verdicts[record["winner"]]["status"] == "passed"
    # emulation is a fallback on CUDA: run only when no kernel passes. Its error, checked alone.
    passed = [n for n, v in verdicts.items() if v["status"] == "passed" and n != "emulation"]
    assert verdicts["emulation"]["status"] == ("skipped" if passed else "passed")
    alone = probe(PROBLEM, [emulation.BACKEND], "cuda", ProbeOptions(validate_only=True))
    assert alone.verdicts["emulation"].passed and alone.verdicts["emulation"].worst_ratio < 0.6
    # The built-in GPU kernels run and are right on every CUDA GPU we support (SM80+); from
    # SM90 the older ones leave NVFP4 at this M to the hopper-* kernels, without being tried.
    cc = torch.cuda.get_device_capability()
    older = ["torch-dequant"]
    if importlib.util.find_spec("triton") is not None:
        older.append("triton-m16")
        assert record["winner"] != "emulation"
        if cc[0] >= 9:  # measured there; below SM90 they run through Triton's mma.sync path
            assert verdicts["hopper-mma"]["status"] == "passed", verdicts["hopper-mma"]
    for name in older:
        if cc[0] >= 9:
            assert verdicts[name]["status"] == "unsupported", verdicts[name]
            assert "hopper-*" in verdicts[name]["reason"], verdicts[name]
        else:
            assert verdicts[name]["status"] == "passed", verdicts[name]
    if cc[0] * 10 + cc[1] < 100:  # Hopper and older: no FP4 tensor cores
        assert verdicts["torch-scaled-mm"]["status"] == "unavailable"
        backends = discover().backends
        for name, verdict in verdicts.items():
            if backends[name].family == "flashinfer":  # no flashinfer FP4 kernel may be tried
                assert verdict["status"] == "unavailable", (name, verdict)


def test_the_warm_path_is_captured_and_replayed_in_a_cuda_graph(cuda_inprocess):
    inputs = make_inputs(PROBLEM, 16, "cuda")
    kwargs = inputs.kwargs(PROBLEM)
    eager = fp4select.best_mm_fp4(**kwargs)  # tunes and binds
    tunings = fp4select.stats()["tunings"]
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp4select.best_mm_fp4(**{**kwargs, "out": out})  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fp4select.best_mm_fp4(**{**kwargs, "out": out})
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert fp4select.stats()["tunings"] == tunings


def test_a_miss_during_capture_falls_back_without_tuning(cuda_inprocess):
    problem = Problem(n=2048, k=1024, m_bucket=32)
    inputs = make_inputs(problem, 32, "cuda")
    kwargs = inputs.kwargs(problem)
    out = torch.empty(32, 2048, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp4select.best_mm_fp4(**{**kwargs, "out": out})
    graph.replay()
    torch.cuda.synchronize()
    assert check(out, inputs, torch.bfloat16).ok
    stats = fp4select.stats()
    assert stats["tunings"] == 0 and stats["fallbacks"] == 1
    (decision,) = fp4select.tune_pending()
    assert decision.winner is not None and fp4select.stats()["tunings"] == 1
    assert decision.verdicts[decision.winner].passed


def test_timing_uses_graph_replay_with_cold_l2_and_ranks_a_slower_candidate_lower():
    device = torch.device("cuda")
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    calls = {
        "one": [lambda: x @ x],
        "two": [lambda: (x @ x, x @ x)],
    }
    timings, method = timing.time_interleaved(calls, device, timing.TimingOptions(budget_s=0.3))
    assert method.startswith("cuda-graph") and method.endswith("+cold-l2")
    ratio = timings["two"].median_us / timings["one"].median_us
    assert 1.6 < ratio < 2.4
    assert timing.rank(timings, {"one": 50, "two": 10}).winner == "one"


def _stalled(replay):
    """``replay`` made to sleep on the GPU first (torch.cuda._sleep: about 25 ms)."""

    def stalled() -> None:
        torch.cuda._sleep(50_000_000)
        replay()

    return stalled


@pytest.mark.parametrize("timer", ["selector", "tactics"])
def test_a_graph_stalled_for_its_life_is_captured_again(monkeypatch, timer):
    # On the H200 a few graphs in a thousand replayed 40-180x slower than their kernels for
    # their whole life (fp4select/_stalls.py): the timing must capture once more, not rank it.
    from fp4select.backends import hopper_tactics

    device = torch.device("cuda")
    x = torch.randn(1 << 20, device=device)
    made = []
    if timer == "selector":
        real_sampler = timing._Sampler

        def sampler(*args, **kwargs):
            made.append(real_sampler(*args, **kwargs))
            if len(made) == 1:  # its graph's every replay stalls
                graph = made[0].graph
                made[0].graph = type(
                    "Stalled", (), {"replay": staticmethod(_stalled(graph.replay))}
                )
            return made[-1]

        monkeypatch.setattr(timing, "_Sampler", sampler)
        options = timing.TimingOptions(budget_s=0.0, min_rounds=3, max_rounds=3)
        timings, method = timing.time_interleaved({"a": [lambda: x * 2]}, device, options)
        assert timings["a"].method == method + "+resampled"
        us = timings["a"].median_us
    else:
        real_graphed = hopper_tactics._graphed

        def graphed(*args):
            made.append(real_graphed(*args))
            return _stalled(made[0]) if len(made) == 1 else made[-1]

        monkeypatch.setattr(hopper_tactics, "_graphed", graphed)
        us = hopper_tactics._time_us([lambda: x * 2], device, 0.0)
    assert len(made) == 2  # captured again, once
    assert us < 1000  # the stalled graph took about 25 ms a call


@pytest.mark.parametrize("timer", ["selector", "tactics"])
def test_timing_graphs_give_their_memory_back(timer):
    # Each capture takes a memory pool of its own. Captured without emptying the allocator's
    # cache first, the pools of dead graphs piled up: an H200 record ran out of memory
    # halfway through its shapes (139 GiB reserved) and timed the rest eagerly.
    from fp4select.backends import hopper_tactics

    device = torch.device("cuda")
    x = torch.randn(4 << 20, device=device)  # each call allocates 16 MiB inside the capture

    def session() -> None:
        if timer == "selector":
            options = timing.TimingOptions(budget_s=0.0, min_rounds=1, max_rounds=1)
            timing.time_interleaved({"a": [lambda: x * 2], "b": [lambda: x + 1]}, device, options)
        else:
            hopper_tactics._time_us([lambda: x * 2], device, 0.0)
        torch.cuda.synchronize(device)

    session()
    reserved = torch.cuda.memory_reserved(device)
    for _ in range(40):
        session()
    grown_mib = (torch.cuda.memory_reserved(device) - reserved) / 2**20
    assert grown_mib <= 64, f"40 more timing sessions kept {grown_mib:.0f} MiB more"


def test_a_real_cuda_fault_kills_only_the_sandbox_child(tmp_path):
    """The culprit faults in the child; this process then runs a GPU GEMM and is fine."""
    sel = fp4select.configure(
        cache_dir=tmp_path, isolation="subprocess", timing=timing.TimingOptions(budget_s=0.2)
    )
    fp4select.register_backend(
        cuda_fault_backends.illegal_address, name="illegal_address", devices={"cuda"}, preference=0
    )
    fp4select.register_backend(cuda_fault_backends.healthy, name="healthy", devices={"cuda"})
    try:
        problem = Problem(n=1024, k=1024, m_bucket=8)
        inputs = make_inputs(problem, 8, "cuda")
        out = fp4select.best_mm_fp4(**inputs.kwargs(problem))
        assert check(out, inputs, torch.bfloat16).ok  # this process's CUDA context is intact
        record = fp4select.explain(problem=problem, device="cuda")
        culprit = record["verdicts"]["illegal_address"]
        assert culprit["status"] in {"cuda-error", "crash"}, culprit
        assert "illegal memory access" in (culprit["reason"] + json.dumps(culprit["detail"])), (
            culprit
        )
        assert record["winner"] not in {None, "illegal_address"}
        assert "illegal_address" in sel.store.blacklist(record["env"])
        y = torch.randn(2048, 2048, device="cuda") @ torch.randn(2048, 2048, device="cuda")
        torch.cuda.synchronize()
        assert torch.isfinite(y).all()
        pids = [w.pid for w in sel.prober()._pool.workers.values()]
        sel.close()  # the worker exits and, with it, every byte of GPU memory it held
        for pid in pids:
            stat = Path(f"/proc/{pid}/stat")
            assert not stat.exists() or stat.read_text().split()[2] == "Z"
    finally:
        fp4select.unregister_backend("illegal_address")
        fp4select.unregister_backend("healthy")
        fp4select.configure(cache_dir=tmp_path, isolation="inprocess")


def test_doctor_reports_this_gpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fp4select", "doctor", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "FP4SELECT_CACHE_DIR": str(tmp_path)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    props = torch.cuda.get_device_properties(0)
    assert report["machine"]["gpu"] == props.name
    assert report["machine"]["cc"] == props.major * 10 + props.minor
    assert report["machine"]["sm_count"] == props.multi_processor_count


def test_batch_invariant_rows_keep_their_bits_on_the_gpu(cuda_inprocess):
    """cuBLAS picks its algorithm by shape; the invariant path must not let M change a row."""
    from fp4select.validate import prefix_inputs

    problem = Problem(n=2048, k=4096, m_bucket=1, batch_invariant=True)
    big = make_inputs(problem, 300, "cuda")
    full = fp4select.best_mm_fp4(**big.kwargs(problem), batch_invariant=True)
    assert check(full, big, torch.bfloat16).ok
    for m in (1, 7, 16, 17, 129, 255):
        part = prefix_inputs(big, m, problem)
        rows = fp4select.best_mm_fp4(**part.kwargs(problem), batch_invariant=True)
        assert torch.equal(rows, full[:m]), m
    record = fp4select.explain(problem=problem, device="cuda")
    assert record["verdicts"][record["winner"]]["status"] == "passed"
    cc = torch.cuda.get_device_capability()
    if cc[0] * 10 + cc[1] < 100 and "flashinfer-batch-invariant" in record["verdicts"]:
        assert record["verdicts"]["flashinfer-batch-invariant"]["status"] == "unavailable"
    assert fp4select.stats()["tunings"] == 1
