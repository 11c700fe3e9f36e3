"""The GPU suite: every candidate, the floor, bf16 cuBLAS, fp4select's pick and the oracle.

For shapes of real NVFP4 deployments (Llama-3.1 8B/70B/405B linears at TP 1/4/8, DeepSeek-V3
dense and shared-expert MLPs, Qwen3-235B attention projections) and M from 1 to 8192:

* ``backend_us``: each candidate that passed fp4select's validation, timed independently of the
  selector (CUDA-graph replay, inputs rotated to keep L2 cold, interleaved rounds, median) with
  many more rounds than the selector uses;
* ``floor_us``: bytes of a, b, their scales and the output over the device-to-device copy
  bandwidth measured in the same run;
* ``bf16_us``: cuBLAS bf16 ``a @ w.T`` on already-dequantized operands, timed the same way;
* ``picked``: what fp4select's selector chooses (the real Selector, isolation inprocess, timing
  budget --budget-s per key), ``picked_tactic`` the configuration it tuned the pick to (or
  None); ``oracle``: the fastest in ``backend_us``; ``regret`` = time of the pick / time of the
  oracle, both from ``backend_us``;
* ``quantize_us``: fp4select's NVFP4 activation quantizer (``fp4select.quantize.fp4_quantize``,
  the Triton kernel with its ``QUANT_BY_M`` tiles) on bf16 activations of (M, K), what the
  engines' W4A4 path on Hopper runs before every GEMM; timed the same way in a run of its own
  (activations rotated over their own input sets, so the GEMMs' timing is untouched; at
  M <= 16 the rotation's at most 64 sets leave them mostly in L2, as in serving, where the
  layer before has just written them), its bytes checked against the PyTorch path
  (``quantize_exact``).
  ``quantize_share_of_pick`` = quantize_us / the pick's time (target: at most 0.10 at
  M <= 16); ``layer_us`` = quantize_us + the pick's time, the W4A4 layer an engine runs,
  ``quantize_share_of_layer`` = quantize_us / layer_us and ``layer_over_bf16`` = layer_us /
  bf16_us. At M <= 16 also ``quantize_in_chain_share``: what the quantizer adds to a chain of
  layers (one graph replaying quantize + pick back to back, as a served model does, against the
  pick alone, side by side, both with PDL), over the pick alone; ``..._no_pdl_share`` without
  PDL.

Also: cold and warm tuning wall time for Llama-3.1-8B's shapes (cold first, with an empty
Triton cache if the caller gave one, so JIT compile counts), and the warm-path overhead of
best_mm_fp4 eager and under CUDA-graph replay. Stops adding shapes when --time-limit-s is
spent and records which were left out. Writes benchmarks/results/gpu_h200.json and
gpu_h200.png (or under --out).

    python benchmarks/bench_gpu.py [--out DIR] [--time-limit-s 330] [--ms 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from _common import activations, calibrated_scale, dumps, graph_replay_us, machine, table

import fp4select
from fp4select import formats, quantize, timing, validate
from fp4select._stalls import stalled
from fp4select.keys import Problem, m_bucket
from fp4select.timing import TimingOptions

# (label, N, K), in the order they are measured (most important first).
SHAPES = [
    ("square 8192 (target)", 8192, 8192),
    ("Llama-3.1-8B qkv TP1", 6144, 4096),
    ("Llama-3.1-8B gate_up TP1", 28672, 4096),
    ("Llama-3.1-8B down TP1", 4096, 14336),
    ("Llama-3.1-70B qkv TP4", 2560, 8192),
    ("Llama-3.1-70B gate_up TP4", 14336, 8192),
    ("Llama-3.1-70B down TP4", 8192, 7168),
    ("Llama-3.1-70B o TP4", 8192, 2048),
    ("DeepSeek-V3 shared-expert gate_up", 4096, 7168),
    ("DeepSeek-V3 dense down TP8", 7168, 2304),
    ("Qwen3-235B qkv TP4", 2304, 4096),
    ("Llama-3.1-405B gate_up TP8", 13312, 16384),
    ("Llama-3.1-70B qkv TP8", 1280, 8192),
    ("Llama-3.1-405B down TP8", 16384, 6656),
    ("DeepSeek-V3 dense gate_up TP8", 4608, 7168),
    ("Qwen3-235B o TP4", 4096, 2048),
]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 4096, 8192]
COLD_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3.1-8B
COLD_MS = [1, 16, 256, 2048, 8192]
ORACLE = TimingOptions(budget_s=0.5, min_rounds=15, max_rounds=60)
# The layer chain's three candidates differ by a few percent on purpose: none is dropped early.
LAYER_TIMING = TimingOptions(budget_s=0.5, min_rounds=30, max_rounds=30)
LAYER_MAX_M = 16  # the quantizer's target covers M <= 16


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy (median of 20)."""
    src = torch.randn(1 << 28, device=device)  # 1 GiB of float32
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times[5:])


def bf16_rate(device: torch.device) -> float:
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    timings, _ = timing.time_interleaved(
        {"mm": [lambda: x @ y]}, device, TimingOptions(budget_s=0.5)
    )
    return 2 * 8192**3 / (timings["mm"].median_us * 1e-6)


def fp4_bytes(m: int, n: int, k: int) -> int:
    return m * k // 2 + n * k // 2 + (m + n) * k // 16 + m * n * 2


def dequantized(inputs: validate.ProbeInputs, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a and w as bf16 (M, K), (N, K) with the global scale left out (as the kernels see them)."""
    a = formats.dequantize(inputs.a, inputs.a_descale, k, use_nvfp4=True, sf_layout="128x4")
    w = formats.dequantize(inputs.b.T, inputs.b_descale.T, k, use_nvfp4=True, sf_layout="128x4")
    return a.to(torch.bfloat16), w.to(torch.bfloat16)


def measure_point(
    sel: fp4select.api.Selector, n: int, k: int, m: int, device: torch.device, bw: float
) -> dict:
    problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
    t0 = time.perf_counter()
    decision = sel.decide(problem, device)
    tune_s = time.perf_counter() - t0
    registry = sel.registry()
    passed = [name for name, v in decision.verdicts.items() if v.passed]
    if m * n * k > 2**31:  # emulation takes milliseconds here and never wins: not re-timed
        passed = [p for p in passed if p != "emulation"]
    first = validate.make_inputs(problem, m, device, seed=101, with_reference=False)
    sets_n = timing.input_sets_for_cold_l2(device, first.nbytes() + m * n * 2, True)
    sets = [first] + [
        validate.make_inputs(problem, m, device, seed=101 + i, with_reference=False)
        for i in range(1, sets_n)
    ]
    calls = {}
    for name in passed:  # each at the tactic it was tuned to, as fp4select serves it
        runner = registry.get(name).fast_runner_for(problem, decision.tactic(name))
        calls[name] = [functools.partial(runner, *s.args(problem)) for s in sets]
    dq = [dequantized(s, k) for s in sets[: max(1, min(len(sets), 4))]]
    calls["bf16 cuBLAS"] = [functools.partial(torch.mm, a, w.T) for a, w in dq]
    timings, method = timing.time_interleaved(calls, device, ORACLE)
    backend_us = {name: timings[name].median_us for name in passed}
    oracle = min(backend_us, key=backend_us.get)
    picked = decision.winner
    regret = backend_us[picked] / backend_us[oracle] if picked in backend_us else None
    floor_us = fp4_bytes(m, n, k) / bw * 1e6
    row = {
        "n": n,
        "k": k,
        "m": m,
        "backend_us": backend_us,
        "spread": {name: [timings[name].p10_us, timings[name].p90_us] for name in passed},
        "floor_us": floor_us,
        "bf16_us": timings["bf16 cuBLAS"].median_us,
        "picked": picked,
        # the pick's tactic as tuned (a hopper-* configuration, a flashinfer tactic), or None
        "picked_tactic": (decision.tactic(picked) or {}).get("tactic"),
        "oracle": oracle,
        "regret": regret,
        "selector_us": {name: t.median_us for name, t in decision.timings.items()},
        "selector_margin": (decision.ranking or {}).get("margin"),
        "tie_broken_by_preference": (decision.ranking or {}).get("tie_broken_by_preference"),
        "verdicts": {
            name: v.status + (f": {v.reason}" if v.reason else "")
            for name, v in decision.verdicts.items()
            if not v.passed
        },
        "tune_s": tune_s,
        "method": method,
    }
    for d in dq:
        del d
    try:
        pick = registry.get(picked).fast_runner_for(problem, decision.tactic(picked))
        row.update(quantizer_point(m, k, device, row, problem, pick, sets))
    except Exception:  # the GEMMs' row stands without it
        row["quantize_error"] = traceback.format_exc()
        print(f"quantizer at M={m} K={k} failed:\n{row['quantize_error']}")
    return row


def quantizer_point(
    m: int,
    k: int,
    device: torch.device,
    row: dict,
    problem: Problem,
    pick: Callable[..., torch.Tensor],
    sets: list[validate.ProbeInputs],
) -> dict:
    """The activation quantizer at (M, K), timed as the GEMMs are, and its share of the layer:
    alone, and at M <= LAYER_MAX_M as what it adds to a chain of layers (``layer_chain``)."""
    x0 = activations(m, k, device, seed=m + k)
    gs = calibrated_scale(x0)
    a, sf = quantize.fp4_quantize(x0, gs)
    ref_a, ref_sf = quantize.quantize_torch(x0, gs)
    exact = torch.equal(a, ref_a) and torch.equal(sf.view(torch.uint8), ref_sf.view(torch.uint8))
    rp, cp = quantize.scale_shape(m, k)
    sets_n = timing.input_sets_for_cold_l2(device, m * k * 2 + m * k // 2 + rp * cp, True)
    xs = [x0] + [activations(m, k, device, seed=m + k + i) for i in range(1, sets_n)]
    calls = {"quantize": [functools.partial(quantize.fp4_quantize, x, gs) for x in xs]}
    timings, _ = timing.time_interleaved(calls, device, ORACLE)
    t = timings["quantize"]
    pick_us = row["backend_us"].get(row["picked"])
    out = {
        "quantize_us": t.median_us,
        "quantize_spread": [t.p10_us, t.p90_us],
        "quantize_config": quantize.config_for(m).label,
        "quantize_exact": exact,
        "quantize_share_of_pick": t.median_us / pick_us if pick_us else None,
        "layer_us": t.median_us + pick_us if pick_us else None,
        "quantize_share_of_layer": t.median_us / (t.median_us + pick_us) if pick_us else None,
        "layer_over_bf16": (t.median_us + pick_us) / row["bf16_us"] if pick_us else None,
    }
    if m <= LAYER_MAX_M and pick_us:
        out.update(layer_chain(problem, pick, sets, xs, gs, device))
    del xs, calls
    return out


def layer_chain(
    problem: Problem,
    pick: Callable[..., torch.Tensor],
    sets: list[validate.ProbeInputs],
    xs: list[torch.Tensor],
    gs: torch.Tensor,
    device: torch.device,
) -> dict:
    """What the quantizer adds to a model's layers: a graph replays many calls back to back,
    as a served model's graph does, of the pick alone and of quantize + pick (the pick reading
    what the quantizer wrote), with and without PDL; all three side by side in one run."""

    def layer(s: validate.ProbeInputs, x: torch.Tensor, pdl: bool) -> Callable[[], torch.Tensor]:
        args = list(s.args(problem))

        def call() -> torch.Tensor:
            args[0], args[2] = quantize.fp4_quantize(x, gs, enable_pdl=pdl)
            args[10] = pdl
            return pick(*args)

        return call

    pairs = [(s, xs[i % len(xs)]) for i, s in enumerate(sets)]
    calls = {
        "gemm": [functools.partial(pick, *s.args(problem)) for s in sets],
        "layer": [layer(s, x, True) for s, x in pairs],
        "layer without PDL": [layer(s, x, False) for s, x in pairs],
    }
    timings, _ = timing.time_interleaved(calls, device, LAYER_TIMING)
    # A layer is the GEMM and a kernel of about a microsecond: far slower than the GEMM alone
    # is a stalled graph that its own calibration did not show (chain_sweep_warm.json's first
    # point: 10.3 ms a call), timed again once, beside the GEMM again.
    retake = [
        n for n in calls if n != "gemm" and stalled(timings[n].median_us, timings["gemm"].median_us)
    ]
    if retake:
        again, _ = timing.time_interleaved(
            {n: calls[n] for n in ["gemm", *retake]}, device, LAYER_TIMING
        )
        timings |= again
    gemm, pdl, plain = (timings[n].median_us for n in calls)
    return {
        "chain_gemm_us": gemm,
        "chain_layer_us": pdl,
        "chain_layer_no_pdl_us": plain,
        "quantize_in_chain_us": pdl - gemm,
        "quantize_in_chain_share": (pdl - gemm) / gemm,
        "quantize_in_chain_no_pdl_share": (plain - gemm) / gemm,
        "chain_retaken": retake,
    }


def cold_and_warm(device: torch.device, budget_s: float) -> dict:
    problems = [Problem(n=n, k=k, m_bucket=m_bucket(m)) for n, k in COLD_SHAPES for m in COLD_MS]
    with tempfile.TemporaryDirectory() as cache:
        sel = fp4select.configure(
            cache_dir=cache, isolation="inprocess", timing=TimingOptions(budget_s=budget_s)
        )
        t0 = time.perf_counter()
        first = sel.decide(problems[0], device)
        first_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        winners = {}
        for p in problems[1:]:
            winners[f"{p.n}x{p.k}@{p.m_bucket}"] = sel.decide(p, device).winner
        cold_s = time.perf_counter() - t0
        rest_s = time.perf_counter() - t1
        sel = fp4select.configure(cache_dir=cache, isolation="inprocess")
        t0 = time.perf_counter()
        for p in problems:
            sel.decide(p, device)
        warm_s = time.perf_counter() - t0
    winners[f"{problems[0].n}x{problems[0].k}@{problems[0].m_bucket}"] = first.winner
    return {
        "model": "Llama-3.1-8B (TP1): qkv, o, gate_up, down",
        "keys": len(problems),
        "ms": COLD_MS,
        "isolation": "inprocess",
        "timing_budget_s": budget_s,
        "first_key_s": first_s,
        "cold_s": cold_s,
        "cold_other_keys_s": rest_s,
        "warm_from_disk_s": warm_s,
        "warm_per_key_ms": warm_s / len(problems) * 1e3,
        "winners": winners,
    }


def warm_path(device: torch.device) -> list[dict]:
    """best_mm_fp4 against the bound runner it dispatches to: eager per call, and graph replay."""
    rows = []
    for n, k, m in ((8192, 8192, 16), (1024, 1024, 1)):
        problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
        inputs = validate.make_inputs(problem, m, device, seed=7, with_reference=False)
        kwargs = inputs.kwargs(problem)
        kwargs.pop("b_layout")
        fp4select.best_mm_fp4(**kwargs)  # tunes (if needed) and binds
        sel = fp4select.api.selector()
        decision = sel.lookup(problem, device)
        runner = sel.runner_for(decision, device)
        args = inputs.args(problem)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        direct = functools.partial(runner, *args[:6], out, *args[7:])
        via = functools.partial(fp4select.best_mm_fp4, **{**kwargs, "out": out})

        def eager_us(fn, calls=400):
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / calls * 1e6

        eager = {"direct": [], "best_mm_fp4": []}
        for _ in range(5):  # interleaved, so drift hits both
            eager["direct"].append(eager_us(direct))
            eager["best_mm_fp4"].append(eager_us(via))
        g_direct, g_via = graph_replay_us(direct), graph_replay_us(via)
        host = {}
        for name, fn in (("direct", direct), ("best_mm_fp4", via)):
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            host[name] = (time.perf_counter() - t0) / 200 * 1e6  # launch-side time, no sync
            torch.cuda.synchronize()
        rows.append(
            {
                "n": n,
                "k": k,
                "m": m,
                "winner": decision.winner,
                "eager_us_per_call": {nm: statistics.median(v) for nm, v in eager.items()},
                "host_us_per_call_no_sync": host,
                "graph_replay_us_per_call": {"direct": g_direct, "best_mm_fp4": g_via},
            }
        )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = []
    for r in rows:
        if (r["n"], r["k"]) not in shapes:
            shapes.append((r["n"], r["k"]))
    shapes = shapes[:6]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9), squeeze=False)
    for ax, (n, k) in zip(axes.flat, shapes):
        pts = sorted((r for r in rows if (r["n"], r["k"]) == (n, k)), key=lambda r: r["m"])
        names = sorted({nm for r in pts for nm in r["backend_us"]} | {"bf16 cuBLAS"})
        for nm in names:
            xs, ys = [], []
            for r in pts:
                t = r["bf16_us"] if nm == "bf16 cuBLAS" else r["backend_us"].get(nm)
                if t is not None:
                    xs.append(r["m"])
                    ys.append(t / r["floor_us"])
            style = "--" if nm == "bf16 cuBLAS" else "-"
            ax.plot(xs, ys, style, marker="o", label=nm)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_title(f"N={n} K={k}")
        ax.set_xlabel("M")
        ax.set_ylabel("time / FP4 HBM floor")
        ax.legend(fontsize=7)
    fig.suptitle("fp4select candidates on the H200 (NVFP4, bf16 out): time / floor against M")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(rows: list[dict], bw: float) -> dict:
    regrets = [r["regret"] for r in rows if r["regret"] is not None]
    decode = [r for r in rows if r["m"] <= 16 and r["n"] == 8192 and r["k"] == 8192]
    triton_decode = {}
    for r in decode:
        best = min(
            ((t, nm) for nm, t in r["backend_us"].items() if nm.startswith(("triton", "hopper"))),
            default=(None, None),
        )
        if best[0] is not None:
            triton_decode[r["m"]] = {
                "backend": best[1],
                "us": best[0],
                "floor_us": r["floor_us"],
                "fraction_of_floor": r["floor_us"] / best[0],
                "achieved_TBps": fp4_bytes(r["m"], r["n"], r["k"]) / (best[0] * 1e-6) / 1e12,
            }
    prefill = []
    for r in rows:
        if r["m"] >= 2048 and r["n"] >= 4096 and r["k"] >= 4096:
            best = min(r["backend_us"].values())
            prefill.append(
                {
                    "n": r["n"],
                    "k": r["k"],
                    "m": r["m"],
                    "best": r["oracle"],
                    "bf16_over_best": r["bf16_us"] / best,
                }
            )
    decode_quant = [r for r in rows if r["m"] <= 16 and r.get("quantize_share_of_pick") is not None]
    shares = [r["quantize_share_of_pick"] for r in decode_quant]
    chain = [r["quantize_in_chain_share"] for r in decode_quant if "quantize_in_chain_share" in r]
    plain = [
        r["quantize_in_chain_no_pdl_share"] for r in decode_quant if "quantize_in_chain_share" in r
    ]
    return {
        "quantize_decode": {
            "rows": len(decode_quant),
            "share_of_pick_worst": max(shares, default=None),
            "share_of_pick_median": statistics.median(shares) if shares else None,
            "rows_over_target": sum(s > 0.10 for s in shares),
            "in_chain_rows": len(chain),
            "in_chain_share_median": statistics.median(chain) if chain else None,
            "in_chain_share_worst": max(chain, default=None),
            "in_chain_rows_over_target": sum(s > 0.10 for s in chain),
            "in_chain_no_pdl_share_median": statistics.median(plain) if plain else None,
            "in_chain_no_pdl_rows_over_target": sum(s > 0.10 for s in plain),
            "quantize_us_range": [
                min((r["quantize_us"] for r in decode_quant), default=None),
                max((r["quantize_us"] for r in decode_quant), default=None),
            ],
            "layer_over_bf16_range": [
                min((r["layer_over_bf16"] for r in decode_quant), default=None),
                max((r["layer_over_bf16"] for r in decode_quant), default=None),
            ],
        },
        "quantize_all_exact": all(r.get("quantize_exact", True) for r in rows),
        "points": len(rows),
        "regret_geomean": geomean(regrets),
        "regret_worst": max(regrets) if regrets else None,
        "regret_over_1.10": [
            {k: r[k] for k in ("n", "k", "m", "picked", "oracle", "regret")}
            for r in rows
            if r["regret"] and r["regret"] > 1.10
        ],
        "decode_8192_triton": triton_decode,
        "prefill_vs_bf16": prefill,
        "prefill_min_ratio": min((p["bf16_over_best"] for p in prefill), default=None),
        "targets": {
            "decode_fraction_of_floor": 0.60,
            "prefill_bf16_over_best": 0.85,
            "regret_geomean": 1.02,
            "regret_worst": 1.10,
            "quantize_share_of_pick_at_m16": 0.10,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--time-limit-s", type=float, default=330.0)
    parser.add_argument("--budget-s", type=float, default=0.3, help="selector timing budget/key")
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--max-shapes", type=int, default=len(SHAPES))
    parser.add_argument("--name", default="gpu_h200", help="output file stem")
    parser.add_argument(
        "--ms", type=lambda t: [int(x) for x in t.split(",")], default=MS, help="M values, 1,2,..."
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    record: dict = {
        "benchmark": "gpu",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "triton": _version("triton"),
        "selector_timing_budget_s": args.budget_s,
        "oracle_timing": ORACLE.to_json(),
        "alpha": "scalar",
        "format": "nvfp4, 128x4 scales, plain b, bf16 out",
        "quantize_table": [[lim, cfg.label] for lim, cfg in quantize.QUANT_BY_M],
    }
    if not args.skip_cold:
        try:
            record["tuning_cost"] = cold_and_warm(device, args.budget_s)
            print(
                "tuning cost:", {k: v for k, v in record["tuning_cost"].items() if k != "winners"}
            )
        except Exception:
            record["tuning_cost_error"] = traceback.format_exc()
            print(record["tuning_cost_error"])
    bw = copy_bandwidth(device)
    record["copy_bandwidth_TBps"] = bw / 1e12
    record["bf16_TFLOPs"] = bf16_rate(device) / 1e12
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 {record['bf16_TFLOPs']:.0f} TFLOP/s")

    with tempfile.TemporaryDirectory() as cache:
        sel = fp4select.configure(
            cache_dir=cache, isolation="inprocess", timing=TimingOptions(budget_s=args.budget_s)
        )
        rows, skipped = [], []
        for label, n, k in SHAPES[: args.max_shapes]:
            if time.perf_counter() - started > args.time_limit_s:
                skipped.append(label)
                continue
            for m in args.ms:
                try:
                    row = measure_point(sel, n, k, m, device, bw)
                except Exception:
                    print(f"{label} M={m} failed:\n{traceback.format_exc()}")
                    continue
                row["shape"] = label
                rows.append(row)
                best = ", ".join(
                    f"{nm}={t:.1f}"
                    for nm, t in sorted(row["backend_us"].items(), key=lambda x: x[1])
                )
                print(
                    f"{label:34s} M={m:5d} floor={row['floor_us']:8.1f} bf16={row['bf16_us']:8.1f} "
                    f"picked={row['picked']} regret={row['regret'] or 0:.3f} "
                    f"quant={row.get('quantize_us') or float('nan'):6.2f} "
                    f"({_pct(row.get('quantize_share_of_pick'))} of pick, "
                    f"layer/bf16 {row.get('layer_over_bf16') or float('nan'):.2f}) | {best}",
                    flush=True,
                )
        record["rows"] = rows
        record["skipped_shapes"] = skipped
        try:
            record["warm_path"] = warm_path(device)
            print("warm path:", record["warm_path"])
        except Exception:
            record["warm_path_error"] = traceback.format_exc()
            print(record["warm_path_error"])
    record["summary"] = summarize(rows, bw)
    record["seconds"] = time.perf_counter() - started
    path = out_dir / f"{args.name}.json"
    path.write_text(dumps(record))
    try:
        plot(rows, out_dir / f"{args.name}.png")
    except Exception:
        print("plot failed:", traceback.format_exc())
    print(quantizer_table(rows))
    print(json.dumps(record["summary"], indent=1, default=str))
    print(f"wrote {path} in {record['seconds']:.0f} s")


def quantizer_table(rows: list[dict]) -> str:
    """The quantizer against the GEMM it feeds at M <= 16 (the issue's target's range)."""
    header = ["shape", "M", "quant us", "pick", "pick us", "quant/pick", "layer us", "bf16 us"]
    header += ["layer/bf16", "in chain", "no PDL", "exact"]
    body = [
        [
            r["shape"],
            r["m"],
            f"{r['quantize_us']:.2f}",
            r["picked"],
            f"{r['backend_us'].get(r['picked'], float('nan')):.2f}",
            _pct(r["quantize_share_of_pick"]),
            f"{r['layer_us']:.2f}" if r["layer_us"] else "-",
            f"{r['bf16_us']:.2f}",
            f"{r['layer_over_bf16']:.2f}" if r["layer_over_bf16"] else "-",
            _pct(r.get("quantize_in_chain_share")),
            _pct(r.get("quantize_in_chain_no_pdl_share")),
            "yes" if r["quantize_exact"] else "NO",
        ]
        for r in rows
        if "quantize_us" in r and r["m"] <= 16
    ]
    return table(body, header)


def _pct(share: float | None) -> str:
    return f"{100 * share:.0f}%" if share is not None else "-"


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
