"""Cold cost: how long tuning takes, for one key and for a model's whole shape set.

Measures, with the backends available on this machine, the wall time of a first call
(discover, validate at several M, time, store) for one key, then `warm` over every dense
linear shape of a model preset and every M bucket up to --max-m, then the same set again
from the disk store in a fresh selector (the cost a restarted server pays).

    python benchmarks/bench_cold.py --device cuda --preset llama3-8b --max-m 8192
    python benchmarks/bench_cold.py --device cpu --preset tiny --max-m 16

``--defaults`` tunes with fp4select's own settings (sandboxed, its timing budget), as
``fp4select warm`` does out of the box. ``--jit-share`` starts from an empty Triton cache and
tunes the whole set twice, the second time into a fresh store with the Triton cache the first
pass filled: the difference bounds what compiling kernels cost (it also holds other one-time
costs, such as the first imports).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from _common import table, write

import fp4select
from fp4select.keys import Problem
from fp4select.keys import buckets_up_to as buckets
from fp4select.timing import TimingOptions

# (N, K) of the dense linear layers per transformer block, unsharded.
PRESETS = {
    "tiny": [(256, 512), (512, 256)],
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "qwen3-32b": [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--max-m", type=int, default=16)
    parser.add_argument("--isolation", choices=("inprocess", "subprocess"), default="inprocess")
    parser.add_argument("--budget-s", type=float, default=0.5, help="timing budget per key")
    parser.add_argument("--defaults", action="store_true", help="fp4select's own settings")
    parser.add_argument("--jit-share", action="store_true", help="tune twice, see the docstring")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.defaults:
        defaults = fp4select.settings.Settings()
        args.isolation, args.budget_s = defaults.isolation, defaults.time_budget_s
    timing = TimingOptions(budget_s=args.budget_s)
    shapes = PRESETS[args.preset]
    problems = [Problem(n=n, k=k, m_bucket=b) for n, k in shapes for b in buckets(args.max_m)]
    triton_cache = tempfile.TemporaryDirectory() if args.jit_share else None
    if triton_cache is not None:
        os.environ["TRITON_CACHE_DIR"] = triton_cache.name  # workers inherit it

    with tempfile.TemporaryDirectory() as cache:
        sel = fp4select.configure(cache_dir=cache, isolation=args.isolation, timing=timing)
        start = time.perf_counter()
        sel.registry()
        discover_s = time.perf_counter() - start
        start = time.perf_counter()
        first = sel.decide(problems[0], device)
        one_key_s = time.perf_counter() - start
        per_key = []
        start = time.perf_counter()
        for i, problem in enumerate(problems[1:], 2):
            t0 = time.perf_counter()
            decision = sel.decide(problem, device)
            per_key.append((problem, decision, time.perf_counter() - t0))
            # as it goes, so that a run cut short by a time limit still says how far it got
            print(f"{i}/{len(problems)} {problem.describe()}: {per_key[-1][2]:.1f} s, "
                  f"{decision.winner}", flush=True)  # fmt: skip
        model_s = time.perf_counter() - start + one_key_s
        print(f"all {len(problems)} keys: {model_s:.1f} s", flush=True)
        sel.close()

        sel = fp4select.configure(cache_dir=cache, isolation=args.isolation, timing=timing)
        sel.registry()
        start = time.perf_counter()
        for problem in problems:
            assert sel.decide(problem, device).source == "disk"
        reload_s = time.perf_counter() - start
        sel.close()

    compiled_s = None
    if triton_cache is not None:  # again, kernels compiled: what is left is not JIT
        with tempfile.TemporaryDirectory() as cache:
            sel = fp4select.configure(cache_dir=cache, isolation=args.isolation, timing=timing)
            sel.registry()
            start = time.perf_counter()
            for problem in problems:
                sel.decide(problem, device)
            compiled_s = time.perf_counter() - start
            sel.close()
        triton_cache.cleanup()

    winners = sorted({d.winner for _, d, _ in per_key} | {first.winner})
    rows = [
        ["discover backends", f"{discover_s:.2f}"],
        [f"tune one key ({problems[0].describe()})", f"{one_key_s:.2f}"],
        [f"tune {len(problems)} keys ({args.preset}, M<={args.max_m})", f"{model_s:.2f}"],
        [f"read {len(problems)} keys back from disk", f"{reload_s:.3f}"],
    ]
    if compiled_s is not None:
        rows.append([f"tune {len(problems)} keys again, kernels compiled", f"{compiled_s:.2f}"])
        rows.append(
            [
                "share of the first not repeated (JIT, at most)",
                f"{max(0.0, 1 - compiled_s / model_s):.0%}",
            ]
        )
    print(table(rows, ["step", "seconds"]))
    print(f"winners: {', '.join(str(w) for w in winners)}; isolation: {args.isolation}")
    path = write(
        f"cold_{args.preset}",
        device,
        {
            "preset": args.preset,
            "shapes": shapes,
            "max_m": args.max_m,
            "keys": len(problems),
            "isolation": args.isolation,
            "timing": timing.to_json(),
            "seconds": {
                "discover": discover_s,
                "one_key": one_key_s,
                "all_keys": model_s,
                "reload_all_keys": reload_s,
                "all_keys_kernels_compiled": compiled_s,
            },
            "jit_share_at_most": None if compiled_s is None else max(0.0, 1 - compiled_s / model_s),
            "per_key": [
                {
                    "problem": p.describe(),
                    "winner": d.winner,
                    "seconds": s,
                    "verdicts": {n: v.status for n, v in d.verdicts.items()},
                }
                for p, d, s in per_key
            ],
            "winners": winners,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
