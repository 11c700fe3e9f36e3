"""``fp4select warm --vs-bf16`` of a model's shapes as a user runs it: each key's FP4 GEMM as
served beside the same product with a bfloat16 weight, side by side.

The user's view of issue 19's question (is FP4 faster than bf16 here?), from a fresh cache and
Triton cache. Where the record (``results/gpu_h200.json``, ``benchmarks/bench_gpu.py``) has the
same shape and M, its ratio (the pick over bf16 cuBLAS, timed by the benchmark's own harness)
is listed beside this one: two measurements of one question by two code paths.

    python benchmarks/bench_vs_bf16.py [--preset llama3-8b] [--max-m 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from _common import RESULTS, table, write
from bench_cold import PRESETS
from bench_deploy import run_warm


def record_ratios(path: Path) -> dict[tuple[int, int, int], float]:
    """(N, K, M) -> the record's best candidate over bf16 cuBLAS, where the record exists."""
    if not path.exists():
        return {}
    rows = json.loads(path.read_text()).get("rows", [])
    return {
        (r["n"], r["k"], r["m"]): min(r["backend_us"].values()) / r["bf16_us"]
        for r in rows
        if r.get("backend_us") and r.get("bf16_us")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--max-m", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        env = {
            **os.environ,
            "FP4SELECT_CACHE_DIR": str(Path(scratch) / "decisions"),
            "TRITON_CACHE_DIR": str(Path(scratch) / "triton"),
        }
        report, wall = run_warm(PRESETS[args.preset], args.max_m, env, ("--vs-bf16",))
    record = record_ratios(RESULTS / "gpu_h200.json")
    rows, points = [], []
    for row in report["results"]:
        vs = row.get("vs_bf16") or {}
        if vs.get("ratio") is None:
            continue
        problem = row["problem"]
        n, k = (int(problem.split()[i].split("=")[1]) for i in (0, 1))
        theirs = record.get((n, k, vs["m"]))
        points.append(
            {
                "n": n,
                "k": k,
                "m": vs["m"],
                "served": vs["served"],
                "fp4_us": vs["fp4"]["median_us"],
                "dense_us": vs["dense"]["median_us"],
                "ratio": vs["ratio"],
                "record_ratio": theirs,
                "method": vs["method"],
            }
        )
        rows.append(
            [f"{n}x{k}", vs["m"], vs["served"], f"{vs['fp4']['median_us']:.1f}",
             f"{vs['dense']['median_us']:.1f}", f"{vs['ratio']:.2f}",
             "-" if theirs is None else f"{theirs:.2f}"]
        )  # fmt: skip
    print(table(rows, ["N x K", "M", "served", "FP4 us", "bf16 us", "FP4/bf16", "record"]))
    print(f"{len(points)} keys compared; warm --vs-bf16 took {wall:.1f} s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    payload = {"preset": args.preset, "max_m": args.max_m, "process_s": wall, "points": points}
    print(f"wrote {write(f'vs_bf16_{args.preset}', device, payload, args.out)}")


if __name__ == "__main__":
    main()
