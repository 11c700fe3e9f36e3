"""What the sandbox costs: worker start-up, and probing one key in a child versus in-process.

Measures (1) spawn to ready of the worker child (torch and fp4select imports), (2) a first key
on a fresh prober (spawn, discovery in the child, the probe), and (3) for a set of keys, the
probe of the same candidates in this process and in a warm worker, alternating per key so
drift hits both alike. The difference in (3) is the price of isolation per key once the
worker is up: JSON over a pipe, one line per event.

    python benchmarks/bench_sandbox.py --device cpu
    python benchmarks/bench_sandbox.py --device cuda --backends all
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import table, write

from fp4select.backends import discover
from fp4select.keys import Problem, environment_for
from fp4select.probe import InProcessProber, ProbeOptions
from fp4select.sandbox import SandboxProber
from fp4select.timing import TimingOptions

SHAPES = [(256, 512), (512, 256)]
BUCKETS = [1, 2, 4, 8, 16]


def candidates(names: str, problem: Problem, device: torch.device) -> list:
    registry = discover()
    env = environment_for(device)
    if names != "all":
        return [registry.backends[n] for n in names.split(",")]
    return [
        b
        for b in registry.backends.values()
        if not b.unavailable_reason(env) and not b.rejects(problem, env)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backends", default="emulation", help="comma list, or 'all' runnable")
    parser.add_argument("--starts", type=int, default=3, help="worker start-ups to measure")
    parser.add_argument("--repeats", type=int, default=3, help="probes per key and isolation")
    parser.add_argument("--budget-s", type=float, default=0.05, help="timing budget per key")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    options = ProbeOptions(timing=TimingOptions(budget_s=args.budget_s))
    problems = [Problem(n=n, k=k, m_bucket=b) for n, k in SHAPES for b in BUCKETS]

    startups = []
    for _ in range(args.starts):
        prober = SandboxProber(registry=discover)
        startups.append(prober.start(device))
        prober.close()

    prober = SandboxProber(registry=discover)
    first = problems[0]
    started = time.perf_counter()
    result = prober.probe(first, candidates(args.backends, first, device), device, options)
    first_key_s = time.perf_counter() - started
    statuses = {n: v.status for n, v in result.verdicts.items()}

    inprocess = InProcessProber()
    per_key = []
    for problem in problems:
        backends = candidates(args.backends, problem, device)
        local, child = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            inprocess.probe(problem, backends, device, options)
            local.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            prober.probe(problem, backends, device, options)
            child.append(time.perf_counter() - t0)
        per_key.append(
            {
                "problem": problem.describe(),
                "backends": [b.name for b in backends],
                "inprocess_s": statistics.median(local),
                "sandbox_s": statistics.median(child),
            }
        )
    prober.close()

    overhead = [k["sandbox_s"] - k["inprocess_s"] for k in per_key]
    summary = {
        "startup_s": statistics.median(startups),
        "first_key_cold_s": first_key_s,
        "per_key_inprocess_s": statistics.median(k["inprocess_s"] for k in per_key),
        "per_key_sandbox_s": statistics.median(k["sandbox_s"] for k in per_key),
        "per_key_overhead_s": statistics.median(overhead),
    }
    rows = [
        [
            f"worker start-up, spawn to ready (median of {args.starts})",
            f"{summary['startup_s']:.3f}",
        ],
        ["first key on a fresh prober (spawn + probe)", f"{first_key_s:.3f}"],
        [
            f"per key in-process (median of {len(per_key)} keys)",
            f"{summary['per_key_inprocess_s']:.4f}",
        ],
        ["per key in the warm sandbox", f"{summary['per_key_sandbox_s']:.4f}"],
        ["per key overhead of the sandbox", f"{summary['per_key_overhead_s']:.4f}"],
    ]
    print(table(rows, ["step", "seconds"]))
    print(f"device {device}; candidates {args.backends}; first key verdicts {statuses}")
    path = write(
        "sandbox",
        device,
        {
            "backends": args.backends,
            "timing": options.timing.to_json(),
            "summary": summary,
            "startups_s": startups,
            "first_key_verdicts": statuses,
            "per_key": per_key,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
