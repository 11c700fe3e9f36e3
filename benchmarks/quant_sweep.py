"""Sweep the NVFP4 activation quantizer's tilings in one GPU run: bytes checked, then timed.

For M in 1, 2, 4, 8, 16, 64, 256 and K in 4096, 8192, 14336, every configuration in
``DECODE`` (M <= 16) or ``PREFILL`` (M > 16), the one ``fp4select.quantize.QUANT_BY_M`` names
now (``table``) and the kernel as it was before that table (``before``: tiles over the scale
grid's padding rows, even and odd elements loaded apart) is first checked byte for byte
against the PyTorch path (``quantize_torch``, on the GPU), then all that passed are timed side
by side as ``bench_gpu.py`` times the GEMMs (``timing.time_interleaved``: CUDA-graph replay,
inputs rotated over as many sets as cold L2 asks, interleaved rounds, median). At M <= 16 the
activations (at most 460 KB a set) stay mostly in L2 over the rotation's at most 64 sets, as
they do in serving, where the layer before has just written them.

Also the host time of one eager call (``eager_host_us``: the public ``fp4_quantize`` and the
bare launch, M = 1). Prints one line per point (``table``, ``before``, the best) and, at the
end, the ``QUANT_BY_M`` that the fastest configurations make (per M, the lowest geometric
mean over the Ks), to paste into ``fp4select/quantize.py``. Writes ``quant_sweep.json`` (machine,
versions, date, every time) under ``--out``. Needs torch and triton on a CUDA GPU; about 30 s
there, most of it Triton compiling the ~40 tilings (``--time-limit-s`` stops adding points).
Used to choose ``QUANT_BY_M``; ``bench_gpu.py`` is the benchmark of record for the quantizer
against the GEMM it feeds.

    python benchmarks/quant_sweep.py [--ms 1,16] [--ks 4096] [--out DIR] [--time-limit-s 50]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import math
import time
import traceback
from pathlib import Path

import torch
from _common import activations, calibrated_scale, dumps, machine, table

from fp4select import quantize, timing
from fp4select.quantize import QuantConfig
from fp4select.timing import TimingOptions

MS = [1, 2, 4, 8, 16, 64, 256]
KS = [4096, 8192, 14336]
OPTIONS = TimingOptions(budget_s=0.1, min_rounds=10, max_rounds=30)

# Decode: one row per program or all of M in one; programs from 4 to 32 scale columns wide
# (64-512 values of a row); 1-4 warps. block_m is capped at M rounded up to a power of two.
DECODE = [
    QuantConfig(bm, bc, w)
    for bm, bc, w in [
        (1, 8, 1),
        (1, 16, 1),
        (1, 32, 1),
        (1, 32, 2),
        (4, 4, 1),
        (4, 8, 1),
        (4, 8, 2),
        (4, 16, 2),
        (4, 16, 4),
        (16, 4, 2),
        (16, 8, 2),
        (16, 8, 4),
        (16, 16, 4),
    ]
]
PREFILL = [
    QuantConfig(bm, bc, w)
    for bm, bc, w in [(8, 16, 2), (16, 8, 4), (16, 16, 4), (32, 8, 4), (32, 16, 4), (32, 32, 8)]
]


def variants(m: int) -> dict[str, QuantConfig]:
    """What runs at M: the table's choice, the kernel before the table, each change of the
    kernel on its own at the table's tiles (paired loads; padding by tiles), the candidates."""
    table_cfg = quantize.config_for(m)
    out = {
        "table": table_cfg,
        "before": quantize.config_for(m, quantize.QUANT_BEFORE),
        "table pairs": QuantConfig(
            table_cfg.block_m, table_cfg.block_c, table_cfg.num_warps, False
        ),
        "table tiles-pad": QuantConfig(
            table_cfg.block_m, table_cfg.block_c, table_cfg.num_warps, True, False
        ),
    }
    cap = 1 << (m - 1).bit_length()
    seen = {(min(table_cfg.block_m, cap), table_cfg.block_c, table_cfg.num_warps)}
    for cfg in DECODE if m <= 16 else PREFILL:
        key = (min(cfg.block_m, cap), cfg.block_c, cfg.num_warps)
        if key not in seen:  # the same kernel and grid as one already listed
            seen.add(key)
            out[cfg.label] = cfg
    return out


def point(m: int, k: int, device: torch.device) -> dict:
    kernel = quantize._triton()
    runs = variants(m)
    x0 = activations(m, k, device, seed=m + k)
    gs = calibrated_scale(x0)
    ref_a, ref_sf = quantize.quantize_torch(x0, gs)
    exact, passed = {}, {}
    for name, cfg in runs.items():
        try:
            a, sf = kernel.quantize(x0, gs, cfg)
            exact[name] = torch.equal(a, ref_a) and torch.equal(
                sf.view(torch.uint8), ref_sf.view(torch.uint8)
            )
        except Exception as exc:
            exact[name] = f"error {type(exc).__name__}: {str(exc)[:200]}"
        if exact[name] is True:
            passed[name] = cfg
    rp, cp = quantize.scale_shape(m, k)
    nbytes = m * k * 2 + m * k // 2 + rp * cp  # x, codes, scales
    xs = [x0] + [
        activations(m, k, device, seed=m + k + i)
        for i in range(1, timing.input_sets_for_cold_l2(device, nbytes, True))
    ]
    calls = {
        name: [functools.partial(kernel.quantize, x, gs, cfg) for x in xs]
        for name, cfg in passed.items()
    }
    times, method = timing.time_interleaved(calls, device, OPTIONS)
    us = {name: t.median_us for name, t in times.items()}
    best = min(us, key=us.get)
    return {
        "m": m,
        "k": k,
        "us": us,
        "spread": {name: [t.p10_us, t.p90_us] for name, t in times.items()},
        "configs": {name: cfg.label for name, cfg in runs.items()},
        "exact": exact,
        "best": best,
        "best_config": runs[best].label,
        "input_sets": len(xs),
        "method": method,
    }


def eager_host_us(device: torch.device, m: int = 1, k: int = 4096, calls: int = 500) -> dict:
    """Host time per call without a graph (what an eager engine pays before the GPU starts):
    the public ``fp4_quantize`` (argument checks, configuration, launch) and the launch alone."""
    x = activations(m, k, device, seed=1)
    gs = calibrated_scale(x)
    cfg = quantize.config_for(m)
    launch = functools.partial(quantize._triton().quantize, x, gs, cfg)
    public = functools.partial(quantize.fp4_quantize, x, gs)
    out = {"m": m, "k": k}
    for name, fn in (("fp4_quantize", public), ("launch only", launch)):
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
            if device.type == "cuda":
                torch.cuda.synchronize()
        out[name] = best
    return out


def suggest(rows: list[dict]) -> dict[int, dict]:
    """Per M: the configuration with the lowest geometric mean time over every K it ran at."""
    out = {}
    for m in sorted({r["m"] for r in rows}):
        at_m = [r for r in rows if r["m"] == m]
        times: dict[str, list[float]] = {}
        for r in at_m:
            for name, t in r["us"].items():
                times.setdefault(name, []).append(t)
        geo = {
            name: math.exp(sum(map(math.log, ts)) / len(ts))
            for name, ts in times.items()
            if len(ts) == len(at_m)
        }
        if not geo:
            continue
        best = min(geo, key=geo.get)
        out[m] = {
            "config": variants(m)[best],
            "geomean_us": geo[best],
            "table_geomean_us": geo.get("table"),
            "before_geomean_us": geo.get("before"),
        }
    return out


def as_python(suggested: dict[int, dict]) -> str:
    """The suggestion as a QUANT_BY_M literal (consecutive Ms with one configuration merged)."""
    entries: list[list] = []
    ms = sorted(suggested)
    for i, m in enumerate(ms):
        cfg = suggested[m]["config"]
        limit = None if i == len(ms) - 1 else m
        if entries and entries[-1][1] == cfg:
            entries[-1][0] = limit
        else:
            entries.append([limit, cfg])
    return "QUANT_BY_M = (\n" + "".join(f"    ({lim}, {cfg!r}),\n" for lim, cfg in entries) + ")"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--ks", default=",".join(map(str, KS)))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--time-limit-s", type=float, default=50.0)
    parser.add_argument(
        "--device", default="cuda", help="cpu: under TRITON_INTERPRET=1 (the CPU test's run)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("quant_sweep needs a CUDA GPU")
    started = time.perf_counter()
    rows, skipped = [], []
    for m in map(int, args.ms.split(",")):
        for k in map(int, args.ks.split(",")):
            if time.perf_counter() - started > args.time_limit_s:
                skipped.append([m, k])
                continue
            try:
                row = point(m, k, device)
            except Exception:
                print(f"M={m} K={k} failed:\n{traceback.format_exc()}")
                continue
            rows.append(row)
            us = row["us"]
            wrong = [n for n, ok in row["exact"].items() if ok is not True]
            print(
                f"M={m:4d} K={k:5d} table={us.get('table', float('nan')):6.2f} "
                f"before={us.get('before', float('nan')):6.2f} "
                f"pairs={us.get('table pairs', float('nan')):6.2f} "
                f"tiles-pad={us.get('table tiles-pad', float('nan')):6.2f} "
                f"best={us[row['best']]:6.2f} [{row['best_config']}]"
                + (f" | NOT EXACT: {wrong}" if wrong else ""),
                flush=True,
            )
    host = eager_host_us(device, calls=500 if device.type == "cuda" else 2)
    print(f"eager host us per call at M=1 K=4096: {host}")
    suggested = suggest(rows)
    print(
        table(
            [
                [
                    m,
                    s["config"].label,
                    f"{s['geomean_us']:.2f}",
                    f"{s['table_geomean_us']:.2f}" if s["table_geomean_us"] else "-",
                    f"{s['before_geomean_us']:.2f}" if s["before_geomean_us"] else "-",
                ]
                for m, s in suggested.items()
            ],
            ["M", "fastest (geomean over K)", "us", "table us", "before us"],
        )
    )
    literal = as_python(suggested) if suggested else ""
    print(literal)
    record = {
        "benchmark": "quant_sweep",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "timing": OPTIONS.to_json(),
        "table": [[lim, cfg.label] for lim, cfg in quantize.QUANT_BY_M],
        "rows": rows,
        "skipped": skipped,
        "eager_host_us": host,
        "suggested": {m: {**s, "config": s["config"].label} for m, s in suggested.items()},
        "suggested_python": literal,
        "all_exact": all(ok is True for r in rows for ok in r["exact"].values()),
        "seconds": time.perf_counter() - started,
    }
    path = Path(args.out) / "quant_sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(record))
    print(f"wrote {path} in {record['seconds']:.0f} s")
    if not record["all_exact"]:
        raise SystemExit("a configuration's bytes differ from the PyTorch path")


if __name__ == "__main__":
    main()
