"""Per-call host cost of serving a flashinfer tactic: fp4select's pin against flashinfer's lookup.

A call shaped like mm_fp4's tactic path (``AutoTuner.get().choose_one("fp4_gemm", [runner],
config, inputs)`` then ``runner(inputs=..., tactic=...)``) with a runner that does nothing, so
what is measured is the choice alone, on this machine's CPU:

* ``flashinfer lookup``: unpinned, flashinfer's real choose_one finding the tuned tactic in its
  in-memory cache (what mm_fp4 pays on every call after ``autotune(True)``);
* ``fp4select pin``: the same call through a pinned runner (thread-local pin, the hook answers
  without a lookup);
* ``no choice``: the runner called with the tactic directly (the floor).

The three are interleaved batch by batch so that frequency drift hits all alike.

    python benchmarks/bench_tactic_pin.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from _common import quantiles, table, write

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import tactic_backends as tb
from flashinfer.autotuner import AutoTuner, autotune

from fp4select.backends import flashinfer_tactics
from fp4select.keys import Problem
from fp4select.validate import make_inputs


class NoopRunner(tb.TwoTacticRunner):
    def forward(self, inputs, tactic=-1, do_preparation=False, **kwargs):
        return None


RUNNER = NoopRunner()


def choose_and_run(
    a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, nvfp4, pdl
):
    inputs = [a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, nvfp4]
    runner, tactic = AutoTuner.get().choose_one("fp4_gemm", [RUNNER], tb._CONFIG, inputs)
    runner(inputs=inputs, tactic=tactic)


def per_call_ns(fn, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    device = torch.device("cpu")
    problem = Problem(n=256, k=512, m_bucket=8)
    call_args = make_inputs(problem, 8, device, with_reference=False).args(problem)
    call_args = (*call_args[:6], torch.empty(8, 256, dtype=torch.bfloat16), *call_args[7:])

    with tb.injected_profiling(), autotune(True, tuning_buckets=(8,)):
        choose_and_run(*call_args)  # flashinfer tunes the bucket: tactic 1 is now cached
    inputs = [*call_args[:8], call_args[9]]
    _, cached = AutoTuner.get().choose_one("fp4_gemm", [RUNNER], tb._CONFIG, inputs)
    assert cached == 1, cached  # the unpinned path measures a cache hit, not a miss
    record = {"op": "fp4_gemm", "tactic": 1, "runner": "NoopRunner"}
    pinned = flashinfer_tactics.pinned(choose_and_run, record)

    def lookup():
        choose_and_run(*call_args)

    def pin():
        pinned(*call_args)

    def floor():
        RUNNER(inputs=inputs, tactic=1)

    cases = {"flashinfer lookup": lookup, "fp4select pin": pin, "no choice": floor}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        per_call_ns(fn, args.calls)  # warm up
    for _ in range(args.batches):
        for name, fn in cases.items():
            samples[name].append(per_call_ns(fn, args.calls))
    stats = {name: quantiles(values) for name, values in samples.items()}
    rows = [
        [name, f"{s['p50'] / 1000:.2f}", f"{s['p10'] / 1000:.2f}", f"{s['p90'] / 1000:.2f}"]
        for name, s in stats.items()
    ]
    print(table(rows, ["path", "p50 us/call", "p10", "p90"]))
    path = write(
        "tactic_pin",
        device,
        {"per_call_ns": stats, "batches": args.batches, "calls_per_batch": args.calls},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
