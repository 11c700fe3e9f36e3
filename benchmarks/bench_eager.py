"""Eager launches: the host time of one call of each Hopper kernel path, beside its GPU time.

Engines replay decode from CUDA graphs, where a call costs only its kernels; a prefill (and
any caller without graphs) launches eagerly, where each call also pays the Python side of its
launches: fp4select's argument checks and Triton's launcher, for the two or three kernels a
path runs (a's decode, the main loop, a split's reduction). Per path and point, three numbers:
the host time of one call (rounds of 40 calls issued back to back, no sync: what the CPU
spends; the median of 5 rounds), the eager time per call (the same with the sync: whichever of
host and GPU is slower), and the
graph-replay time per call (the GPU's). Each ``hopper-*`` path twice: its checked runner (what
probing runs: every call checked and planned) and, as "planned", the runner the warm path binds
(``hopper_launch``: planned once per kind of call, launched from the compiled kernels). bf16
``torch.mm`` on the same problem is the baseline, and ``best_mm_fp4`` (tuned first, in a
temporary cache, in process) is what a user's eager call costs, its pick named. Up to M = 128
also the engines' layer op (``torch.ops.fp4select.nvfp4_linear``: the activation quantizer,
then ``best_mm_fp4``) beside bf16 ``F.linear``.

An eager prefill brings a new M most calls: the first call of a new M misses the warm table
(the bucket's decision is in memory; the call is checked, bound and planned), and the same
shape's other layers repeat it. ``new lengths`` times both, host time only, over M = 129-192
at 4096 x 4096 (one bucket, one decision).

    python benchmarks/bench_eager.py   (a CUDA GPU; prints a table, writes eager_cuda.json)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

import torch
from _common import graph_replay_us, table, write

import fp4select
from fp4select import formats, validate
from fp4select.backends import dequant, triton_hopper
from fp4select.integrations import _layer
from fp4select.keys import Problem, m_bucket

POINTS = [(4096, 4096, 1), (4096, 4096, 16), (4096, 4096, 128), (4096, 4096, 2048)]
POINTS += [(8192, 8192, 16), (8192, 8192, 2048), (28672, 4096, 2048)]
CALLS = 200


def paths(m: int) -> dict:
    """The Hopper paths that take M = m (each with its table's tactic for m)."""
    out = {}
    if m <= 8:
        out["hopper-gemv"] = triton_hopper.run_gemv
        out["hopper-gemv planned"] = triton_hopper.fast_gemv
    if m <= 256:
        out["hopper-mma"] = triton_hopper.run_mma
        out["hopper-mma planned"] = triton_hopper.fast_mma
    if 33 <= m <= 2048:
        out["hopper-ws"] = triton_hopper.run_ws
        out["hopper-ws planned"] = triton_hopper.fast_ws
    if m >= 512:
        out["hopper-dequant"] = dequant.run_hopper
        out["hopper-dequant planned"] = dequant.fast_hopper
    return out


ROUNDS = 5  # CALLS split into rounds; the median round is reported (one stalled call, a
# garbage collection or a page fault on the host, moves one round, not the figure)


def host_and_eager_us(fn) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    host, eager = [], []
    per_round = CALLS // ROUNDS
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(per_round):
            fn()
        host.append((time.perf_counter() - start) / per_round * 1e6)
        torch.cuda.synchronize()
        eager.append((time.perf_counter() - start) / per_round * 1e6)
    return statistics.median(host), statistics.median(eager)


def new_lengths(device: torch.device, n: int = 4096, k: int = 4096) -> dict[str, float]:
    """Median host time of best_mm_fp4's first call of each new M, of its repeats, and of
    torch.mm at the same M (see the module docstring)."""
    calls = {}
    for m in range(129, 193):
        problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
        calls[m] = validate.make_inputs(problem, m, device, seed=m, with_reference=False)
    first = calls[129]
    fp4select.best_mm_fp4(**first.kwargs(Problem(n=n, k=k, m_bucket=m_bucket(129))))  # tunes
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    miss, again, mm = [], [], []
    for m, inputs in list(calls.items())[1:]:
        kwargs = inputs.kwargs(Problem(n=n, k=k, m_bucket=m_bucket(m)))
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        for times in (miss, again, again, again):
            start = time.perf_counter()
            fp4select.best_mm_fp4(**kwargs)
            times.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        torch.mm(a, w.T)
        mm.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return {
        "best_mm_fp4, a new M (first call)": statistics.median(miss),
        "best_mm_fp4, the same M again": statistics.median(again),
        "bf16 torch.mm": statistics.median(mm),
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    device = torch.device("cuda")
    rows = []
    cache = tempfile.TemporaryDirectory()
    fp4select.configure(cache_dir=cache.name, isolation="inprocess")
    for n, k, m in POINTS:
        problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
        inputs = validate.make_inputs(problem, m, device, seed=7, with_reference=False)
        args = inputs.args(problem)
        a = formats.dequantize(inputs.a, inputs.a_descale, k, use_nvfp4=True, sf_layout="128x4")
        w = formats.dequantize(inputs.b.T, inputs.b_descale.T, k, use_nvfp4=True, sf_layout="128x4")
        a, w = a.to(torch.bfloat16), w.to(torch.bfloat16)
        calls = {name: functools.partial(run, *args) for name, run in paths(m).items()}
        calls["bf16 torch.mm"] = functools.partial(torch.mm, a, w.T)
        kwargs = inputs.kwargs(problem)
        fp4select.best_mm_fp4(**kwargs)  # tunes this key, then binds its pick
        pick = fp4select.explain(problem=problem, device=device)["winner"]
        calls[f"best_mm_fp4 ({pick})"] = functools.partial(fp4select.best_mm_fp4, **kwargs)
        if m <= 128:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            one = torch.ones(1, device=device)
            calls["layer op (quantize + best_mm_fp4)"] = functools.partial(
                _layer.linear_op(), x, inputs.b.T, inputs.b_descale.T, one, one, torch.bfloat16
            )
            calls["bf16 F.linear"] = functools.partial(torch.nn.functional.linear, x, w)
        for name, fn in calls.items():
            host, eager = host_and_eager_us(fn)
            rows.append(
                {"n": n, "k": k, "m": m, "path": name, "host_us": host, "eager_us": eager,
                 "graph_us": graph_replay_us(fn, 20)}
            )  # fmt: skip
    cells = [
        [f"{r['n']}x{r['k']}", r["m"], r["path"]]
        + [f"{r[f]:.1f}" for f in ("host_us", "eager_us", "graph_us")]
        for r in rows
    ]
    print(table(cells, ["N x K", "M", "path", "host us", "eager us", "graph us"]))
    lengths = new_lengths(device)
    print(table([[k, f"{v:.1f}"] for k, v in lengths.items()], ["new lengths", "host us"]))
    payload = {"calls": CALLS, "rows": rows, "new_lengths": lengths}
    print(f"wrote {write('eager', device, payload)}")
    cache.cleanup()


if __name__ == "__main__":
    main()
