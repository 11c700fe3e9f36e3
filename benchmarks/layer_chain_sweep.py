"""What the activation quantizer adds to a chain of layers, under launch variants, side by side.

A served model replays quantize + GEMM layer after layer in one CUDA graph. For each shape of
bench_gpu.py and M <= 16, fp4select's pick (tuned as there) is timed in such chains:

* ``gemm``: the pick alone, back to back (PDL);
* ``layer``: quantize + pick, both launched with PDL (the quantizer waits for the kernel before,
  then lets the GEMM launch);
* ``early``: the quantizer lets the GEMM launch before its own wait
  (``_quantize_triton.EARLY_TRIGGER``);
* ``l2``: ``hopper-gemv`` asks L2 for each weight row's first lines before its wait
  (``triton_hopper.GEMV_L2_LINES``);
* ``early+l2``, ``gemm+l2``: both; the GEMM alone with the prefetch.

Each variant's outputs are checked bit for bit against ``layer``'s. Writes
``results/layer_chain_sweep.json``.

    python benchmarks/layer_chain_sweep.py [--ms 1,2,4,8,16] [--max-shapes 16]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import activations, calibrated_scale, dumps, machine, table
from bench_gpu import SHAPES, m_bucket

import fp4select
from fp4select import _quantize_triton, quantize, timing, validate
from fp4select.backends import triton_hopper
from fp4select.keys import Problem
from fp4select.timing import TimingOptions

TIMING = TimingOptions(budget_s=0.5, min_rounds=30, max_rounds=30)
VARIANTS = {  # name: (quantize first, EARLY_TRIGGER, GEMV_L2_LINES)
    "gemm": (False, False, 0),
    "gemm+l2": (False, False, 64),
    "layer": (True, False, 0),
    "early": (True, True, 0),
    "l2": (True, False, 64),
    "early+l2": (True, True, 64),
}


def _variant(pick, args, x, gs, quant: bool, early: bool, lines: int):
    args = list(args)

    def call():
        _quantize_triton.EARLY_TRIGGER, triton_hopper.GEMV_L2_LINES = early, lines
        try:
            if quant:
                args[0], args[2] = quantize.fp4_quantize(x, gs)
            return pick(*args)
        finally:
            _quantize_triton.EARLY_TRIGGER, triton_hopper.GEMV_L2_LINES = False, 0

    return call


def point(sel, n: int, k: int, m: int, device: torch.device) -> dict:
    problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
    decision = sel.decide(problem, device)
    pick = (
        sel.registry()
        .get(decision.winner)
        .fast_runner_for(problem, decision.tactic(decision.winner))
    )
    first = validate.make_inputs(problem, m, device, seed=7, with_reference=False)
    sets_n = timing.input_sets_for_cold_l2(device, first.nbytes() + m * n * 2, True)
    sets = [first] + [
        validate.make_inputs(problem, m, device, seed=7 + i, with_reference=False)
        for i in range(1, sets_n)
    ]
    xs = [activations(m, k, device, seed=m + k + i) for i in range(len(sets))]
    gs = calibrated_scale(xs[0])
    calls = {
        name: [_variant(pick, s.args(problem), x, gs, *spec) for s, x in zip(sets, xs)]
        for name, spec in VARIANTS.items()
    }
    want = {name: calls[name][0]() for name in calls}
    exact = {
        name: bool(torch.equal(want[name], want["layer" if spec[0] else "gemm"]))
        for name, spec in VARIANTS.items()
    }
    timings, _ = timing.time_interleaved(calls, device, TIMING)
    us = {name: timings[name].median_us for name in calls}
    return {"n": n, "k": k, "m": m, "picked": decision.winner, "us": us, "exact": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--ms", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4, 8, 16]
    )
    parser.add_argument("--max-shapes", type=int, default=len(SHAPES))
    parser.add_argument("--time-limit-s", type=float, default=400.0)
    args = parser.parse_args()
    device = torch.device("cuda")
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        sel = fp4select.configure(
            cache_dir=cache, isolation="inprocess", timing=TimingOptions(budget_s=0.3)
        )
        for label, n, k in SHAPES[: args.max_shapes]:
            if time.perf_counter() - started > args.time_limit_s:
                break
            for m in args.ms:
                row = point(sel, n, k, m, device) | {"shape": label}
                rows.append(row)
                g = row["us"]["gemm"]
                print(
                    f"{label:32s} M={m:3d} {row['picked']:12s} gemm={g:7.2f} "
                    + " ".join(
                        f"{v}={(row['us'][v] - g) / g:+.1%}" for v in VARIANTS if v != "gemm"
                    )
                    + ("" if all(row["exact"].values()) else f" NOT EXACT {row['exact']}"),
                    flush=True,
                )
    summary = {}
    for v in VARIANTS:
        if v == "gemm":
            continue
        shares = [(r["us"][v] - r["us"]["gemm"]) / r["us"]["gemm"] for r in rows]
        summary[v] = {
            "median_share_of_gemm": statistics.median(shares),
            "rows_over_0.10": sum(s > 0.10 for s in shares),
            "vs_layer_geomean": statistics.geometric_mean(
                [r["us"][v] / r["us"]["layer" if VARIANTS[v][0] else "gemm"] for r in rows]
            ),
        }
    print(
        table(
            [[v, f"{s['median_share_of_gemm']:.1%}", s["rows_over_0.10"], f"{s['vs_layer_geomean']:.3f}"]
             for v, s in summary.items()],
            ["variant", "median over gemm", "rows over 10%", "vs layer (or gemm)"],
        )
    )  # fmt: skip
    record = {
        "benchmark": "layer_chain_sweep",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "variants": {k: list(v) for k, v in VARIANTS.items()},
        "timing": TIMING.to_json(),
        "all_exact": all(all(r["exact"].values()) for r in rows),
        "summary": summary,
        "rows": rows,
    }
    path = Path(args.out) / "layer_chain_sweep.json"
    path.write_text(dumps(record))
    print(json.dumps({"all_exact": record["all_exact"]}), f"wrote {path}")


if __name__ == "__main__":
    main()
