"""Start-up: fresh processes of an older fp4select ("before") against this checkout ("after").

Measures, each in a fresh interpreter: ``fp4select --version``, ``fp4select show``,
``fp4select explain`` of a stored key, and ``import fp4select`` plus the first ``best_mm_fp4``
served from a warm disk cache (emulation wins on a CPU). The two trees run alternately, case by
case and repetition by repetition (the order flips every repetition), so that load on a shared
machine hits both alike. Both read one cache, warmed once with the "before" tree: the store
format and the environment fingerprint are the same in both, and each child says whether it
was served from disk (``disk_hits``) without tuning.

    python benchmarks/bench_startup.py                 # before = git ref main
    python benchmarks/bench_startup.py --before-ref v0.1.0 --reps 7

Absolute times depend on the machine (most of a fresh process is importing torch); the ratio
before/after is the result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import table, write

REPO = Path(__file__).resolve().parents[1]

FIRST_CALL = """
import json, sys, time
t0 = time.perf_counter()
import fp4select
t1 = time.perf_counter()
from fp4select.keys import Problem
from fp4select.validate import make_inputs
problem = Problem(n=128, k=256, m_bucket=16)
kwargs = make_inputs(problem, 13, "cpu").kwargs(problem)
t2 = time.perf_counter()
fp4select.best_mm_fp4(**kwargs)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_call_s": t3 - t2, "stats": fp4select.stats(),
                  "flashinfer": "flashinfer" in sys.modules, "file": fp4select.__file__}))
"""

WARM = """
import fp4select
from fp4select.keys import Problem
from fp4select.validate import make_inputs
problem = Problem(n=128, k=256, m_bucket=16)
fp4select.best_mm_fp4(**make_inputs(problem, 13, "cpu").kwargs(problem))
winner = fp4select.explain(problem=problem, device="cpu", tune=False)["winner"]
print("winner", winner, "by", fp4select.__file__)
"""

# What each case runs after the interpreter; argv for ``python``.
CASES: dict[str, list[str]] = {
    "fp4select --version": ["-m", "fp4select", "--version"],
    "fp4select show": ["-m", "fp4select", "show"],
    "fp4select explain (stored)": [
        *("-m", "fp4select", "explain"),
        *("--n", "128", "--k", "256", "--m", "13"),
    ],
    "import + first call (warm disk)": ["-c", FIRST_CALL],
}


def export_tree(ref: str, into: Path) -> Path:
    """The fp4select of git ref ``ref`` as plain files (no worktree, no checkout)."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def child_env(tree: Path, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP4SELECT_")}
    env.update(
        PYTHONPATH=str(tree),
        FP4SELECT_CACHE_DIR=str(cache),
        FP4SELECT_ISOLATION="inprocess",
        FP4SELECT_TIME_BUDGET_S="0.2",
    )
    return env


def run_case(tree: Path, cache: Path, argv: list[str]) -> dict[str, Any]:
    """One fresh process: its wall time, and the child's own report where it prints one.

    It runs in the cache's parent folder: ``python -c`` and ``-m`` put the working directory
    first on the path, and this checkout's fp4select must not shadow the tree under test.
    """
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *argv],
        cwd=cache.parent,
        env=child_env(tree, cache),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{argv} under {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = {"wall_s": wall}
    if argv[0] == "-c":
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        if not report["file"].startswith(str(tree)):
            raise SystemExit(f"the child imported {report['file']}, not the tree {tree}")
        if report["stats"]["disk_hits"] != 1 or report["stats"]["tunings"] != 0:
            raise SystemExit(f"the first call was not a warm disk hit: {report['stats']}")
        result.update(report)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-ref", default="main", help="git ref of the code to compare to")
    parser.add_argument("--reps", type=int, default=5, help="fresh processes per case and tree")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")

    with tempfile.TemporaryDirectory(prefix="fp4select-startup-") as scratch:
        scratch_dir = Path(scratch)
        before = export_tree(args.before_ref, scratch_dir / "before")
        trees = {"before": before, "after": REPO}
        cache = scratch_dir / "cache"
        warm = subprocess.run(
            [sys.executable, "-c", WARM],
            cwd=scratch_dir,
            env=child_env(before, cache),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if warm.returncode != 0:
            raise SystemExit(f"warming the cache failed:\n{warm.stderr[-3000:]}")
        print(f"cache warmed by {args.before_ref}: {warm.stdout.strip()}", file=sys.stderr)
        samples: dict[str, dict[str, list[dict[str, Any]]]] = {
            case: {"before": [], "after": []} for case in CASES
        }
        for rep in range(args.reps):
            order = ("before", "after") if rep % 2 == 0 else ("after", "before")
            for case, argv in CASES.items():
                for name in order:
                    samples[case][name].append(run_case(trees[name], cache, argv))
            print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr)

    rows, results = [], {}
    for case, by_tree in samples.items():
        med = {name: statistics.median(s["wall_s"] for s in runs) for name, runs in by_tree.items()}
        entry: dict[str, Any] = {
            "wall_s": {name: [s["wall_s"] for s in runs] for name, runs in by_tree.items()},
            "median_wall_s": med,
            "ratio_before_over_after": med["before"] / med["after"],
        }
        extra = ""
        if "first_call_s" in by_tree["after"][0]:
            first = {
                name: statistics.median(s["first_call_s"] for s in runs)
                for name, runs in by_tree.items()
            }
            imported = {name: runs[0]["flashinfer"] for name, runs in by_tree.items()}
            entry.update(median_first_call_s=first, flashinfer_imported=imported)
            extra = (
                f"first call {first['before']:.3f} s -> {first['after']:.3f} s; flashinfer "
                f"imported: {imported['before']} -> {imported['after']}"
            )
        results[case] = entry
        rows.append(
            [
                case,
                f"{med['before']:.2f}",
                f"{med['after']:.2f}",
                f"{med['before'] / med['after']:.2f}x",
                extra,
            ]
        )
    print(table(rows, ["fresh process", "before s (median)", "after s (median)", "ratio", "note"]))
    path = write(
        "startup",
        torch.device("cpu"),
        {
            "before_ref": args.before_ref,
            "before_commit": subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", args.before_ref],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip(),
            "after_commit": subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip(),
            "after_fp4select_has_uncommitted_changes": bool(
                subprocess.run(
                    ["git", "-C", str(REPO), "status", "--porcelain", "--", "fp4select"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.strip()
            ),
            "reps": args.reps,
            "note": "wall time of fresh processes on a shared CPU machine; compare the ratio",
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
