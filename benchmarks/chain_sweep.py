"""Each small-M tactic in a chain of layers: what the activation quantizer adds before it.

    python benchmarks/chain_sweep.py [--shapes 16384x6656,...] [--ms 1,2,4,16] [--both-triggers]
        [--time-limit-s 300]

``bench_gpu.py`` times the chain (a graph of quantize + GEMM, back to back, with PDL and
without) for its pick only. Under PDL a kernel lets the next launch in early, so how two
kernels overlap depends on both; a chain that is slow for one tactic is invisible there when
another is picked. This times every ``hopper-gemv`` and ``hopper-mma`` tactic of each M in
the same three ways side by side (``bench_gpu.layer_chain``) and prints one line per tactic:
the GEMM alone, the chain with PDL and without, in microseconds (GPU only).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
from pathlib import Path

import torch
from _common import activations, calibrated_scale, dumps, machine, sweep_points
from bench_gpu import layer_chain

from fp4select import timing, validate
from fp4select.backends import hopper_configs, triton_hopper
from fp4select.keys import Problem, m_bucket


def point(n: int, k: int, m: int, device: torch.device, both_triggers: bool) -> list[dict]:
    problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
    first = validate.make_inputs(problem, m, device, seed=11, with_reference=False)
    nbytes = first.nbytes() + m * n * 2
    count = timing.input_sets_for_cold_l2(device, nbytes, True)
    sets = [first] + [
        validate.make_inputs(problem, m, device, seed=11 + i, with_reference=False)
        for i in range(1, count)
    ]
    xs = [activations(m, k, device, seed=m + k + i) for i in range(count)]
    gs = calibrated_scale(xs[0])
    kinds = [("gemv", triton_hopper.run_gemv)] if m <= 8 else []
    kinds += [("mma", triton_hopper.run_mma)]
    rows = []
    for kind, run in kinds:
        cfgs = list(hopper_configs.candidates(kind, m))
        if kind == "gemv" and both_triggers:  # each also with PDL's trigger in the other place
            cfgs += [dataclasses.replace(c, late=1 - c.late) for c in cfgs]
        for cfg in cfgs:
            pick = functools.partial(run, cfg=cfg)
            got = layer_chain(problem, pick, sets, xs, gs, device)
            tactic = f"{kind} " + " ".join(map(str, dataclasses.astuple(cfg)))
            rows.append({"n": n, "k": k, "m": m, "tactic": tactic} | got)
            print(
                f"{n:5d}x{k:5d} M={m:3d} {tactic:34s} gemm={got['chain_gemm_us']:7.1f} "
                f"pdl={got['chain_layer_us']:7.1f} plain={got['chain_layer_no_pdl_us']:7.1f}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16384x6656,8192x8192,4096x14336,28672x4096")
    parser.add_argument("--ms", default="1,2,4,16")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--name", default="chain_sweep")
    parser.add_argument(
        "--both-triggers", action="store_true", help="each GEMV tactic also with the other `late`"
    )
    parser.add_argument("--time-limit-s", type=float, default=1e9)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for n, k, m in sweep_points(args.shapes, args.ms, args.time_limit_s):
        rows += point(n, k, m, device, args.both_triggers)
        record = {
            "benchmark": "chain_sweep",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(device),
            "rows": rows,
        }
        path = Path(args.out) / f"{args.name}.json"
        path.write_text(dumps(record))  # after each point: a time-out keeps what ran
    print(f"wrote {Path(args.out) / args.name}.json")


if __name__ == "__main__":
    main()
