"""Deploy cost: ``fp4select warm`` of a model's shapes, as a user runs it, from nothing.

Runs the command line twice in fresh processes at fp4select's default settings (sandboxed):

1. cold: an empty Triton cache, an empty decision cache, no C++ key built (a fresh
   ``TORCH_EXTENSIONS_DIR``): what a new machine pays;
2. compiled: the Triton cache and the C++ key the first run left, an empty decision cache:
   what is left when nothing needs compiling. ``1 - compiled / cold`` bounds the JIT share.
3. with ``--serial``: cold again, from its own empty Triton cache, with ``--compile-jobs 1``
   (no compile-ahead: each kernel compiles when it is first tuned), for compile-ahead's gain.

Each run's wall time is the whole process (start-up and imports included), beside the
``wall_seconds`` warm reports itself. Issue 19's target: the cold run of Llama-3.1-8B's shapes
within 60 s on the H200.

    python benchmarks/bench_deploy.py [--preset llama3-8b] [--max-m 8192] [--serial] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import RESULTS, table, write
from bench_cold import PRESETS, compiled_kernels, kernel_signatures


def run_warm(
    shapes: list[tuple[int, int]], max_m: int, env: dict[str, str], extra: tuple[str, ...] = ()
) -> tuple[dict, float]:
    """One ``fp4select warm --json`` in a fresh process: its report and the process's wall."""
    command = [sys.executable, "-m", "fp4select", "warm", "--json", "--quiet", "--max-m"]
    command += [str(max_m), *extra]
    for n, k in shapes:
        command += ["--shape", f"{n},{k}"]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"warm {' '.join(extra)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout), wall


def warm(
    shapes: list[tuple[int, int]], max_m: int, env: dict[str, str], extra: tuple[str, ...] = ()
) -> dict:
    """``run_warm``'s report summed up: its walls, keys, C++ key, compile-ahead, winners."""
    report, wall = run_warm(shapes, max_m, env, extra)
    winners: dict[str, int] = {}
    for row in report["results"]:
        winners[row["winner"]] = winners.get(row["winner"], 0) + 1
    return {
        "process_s": wall,
        "warm_wall_s": report["wall_seconds"],
        "keys": len(report["results"]),
        "native_key": report["native_key"],
        "compile_ahead": report.get("compile_ahead"),
        "winners": winners,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--max-m", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--serial",
        action="store_true",
        help="also a third run: cold again (its own empty Triton cache) with --compile-jobs 1, "
        "each kernel compiled when first tuned, for compile-ahead's gain side by side",
    )
    args = parser.parse_args()
    shapes = PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        env = {
            **os.environ,
            "TRITON_CACHE_DIR": str(root / "triton"),
            "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions"),
        }
        for name in ("FP4SELECT_ISOLATION", "FP4SELECT_TIME_BUDGET_S", "FP4SELECT_TACTICS"):
            env.pop(name, None)  # fp4select's defaults
        runs = {}
        for run in ("cold", "compiled") + (("cold serial",) if args.serial else ()):
            env["FP4SELECT_CACHE_DIR"] = str(root / f"decisions_{run}")  # empty each time
            if run == "cold serial":
                env["TRITON_CACHE_DIR"] = str(root / "triton_serial")
            extra = ("--compile-jobs", "1") if run == "cold serial" else ()
            runs[run] = warm(shapes, args.max_m, env, extra)
            print(f"{run}: {runs[run]['process_s']:.1f} s", flush=True)
            if run == "cold":  # what it compiled, and what told the hopper-ws variants apart
                triton_cache = str(root / "triton")
                runs[run]["kernels_compiled"] = compiled_kernels(triton_cache)
                runs[run]["mma_ws_signatures"] = kernel_signatures(triton_cache, "mma_ws")
                print(f"kernels compiled: {json.dumps(runs[run]['kernels_compiled'])}")
    jit_share = max(0.0, 1 - runs["compiled"]["process_s"] / runs["cold"]["process_s"])
    rows = [
        [run, r["keys"], f"{r['process_s']:.1f}", f"{r['warm_wall_s']:.1f}", r["native_key"]]
        for run, r in runs.items()
    ]
    print(table(rows, ["run", "keys", "process s", "warm's own wall s", "C++ key"]))
    print(f"JIT share of the cold run, at most: {jit_share:.0%}")
    print(f"winners: {json.dumps(runs['cold']['winners'], sort_keys=True)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    payload = {"preset": args.preset, "shapes": shapes, "max_m": args.max_m, "runs": runs}
    payload["jit_share_at_most"] = jit_share
    print(f"wrote {write(f'deploy_{args.preset}', device, payload, args.out)}")


if __name__ == "__main__":
    main()
