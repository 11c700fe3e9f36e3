"""Do `hopper-mma` and `hopper-ws` ever give a different bit for the same call?
(the wgmma register hazard of triton-lang/triton#9433: ``tools/wgmma_hazards.py`` found it in
`hopper-mma`'s and the since retired `hopper-prefill`'s SASS under Triton 3.6 until each step
waited for its wgmma, ``_hopper_kernels.retired``; run on both forms of those two, before
``hopper-ws`` existed, this saw no differing bit in either, docs/hopper_kernels.md).

Each tactic runs the same inputs many times, back to back in a CUDA graph, while a second
stream keeps the memory system busy (the hazard depends on timing), and every output is
compared bit for bit with the first, which is also checked against the exact reference. The
kernels sum in a fixed order (where `hopper-mma`'s tiles sum their own K split, an atomic
count decides only which program adds the partial sums, not in which order), so any
differing bit is a race. Prints
one row per tactic and case and writes ``results/hazard_stress_<device>.json``.

Usage (a CUDA GPU): ``python benchmarks/hazard_stress.py [--repeats 400] [--no-load]``
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import time
from pathlib import Path

import torch
from _common import dumps, machine

from fp4select import validate
from fp4select.backends import hopper_configs, triton_hopper
from fp4select.keys import Problem, m_bucket

# (N, K, M): every tactic list of the three backends, narrow and wide shapes.
CASES = [
    (4096, 4096, 16),
    (4096, 4096, 32),
    (8192, 8192, 64),
    (4096, 4096, 128),
    (8192, 8192, 256),
    (6144, 4096, 512),
    (4096, 4096, 1024),
]


def _tactics(m: int):
    """(backend, mm_fp4's call with the tactic, tactic) for every tactic the backends time at M
    (hopper-ws: its buckets, M = 33-``WS_MAX_M``)."""
    kinds = [("mma", triton_hopper.run_mma)]
    kinds += [("ws", triton_hopper.run_ws)] if 33 <= m <= triton_hopper.WS_MAX_M else []
    for kind, run in kinds:
        for cfg in hopper_configs.candidates(kind, m):
            yield f"hopper-{kind}", functools.partial(run, cfg=cfg), cfg


def _stress(run, args, repeats: int, load: bool) -> tuple[int, float]:
    """(outputs differing from the first, seconds): ``repeats`` calls replayed from a graph."""
    first = run(*args).clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    outs = torch.empty((repeats, *first.shape), dtype=first.dtype, device=first.device)
    side = torch.cuda.Stream()
    noise_src = torch.empty(64 << 20, dtype=torch.uint8, device=first.device)
    noise_dst = torch.empty_like(noise_src)
    with torch.cuda.graph(graph):
        for i in range(repeats):
            run(*args[:6], outs[i], *args[7:])
    started = time.perf_counter()
    if load:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(64):
                noise_dst.copy_(noise_src)
    graph.replay()
    torch.cuda.synchronize()
    differing = int((outs.view(repeats, -1) != first.view(1, -1)).any(dim=1).sum())
    return differing, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--no-load", action="store_true", help="no second stream")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for n, k, m in CASES:
        problem = Problem(n=n, k=k, m_bucket=m_bucket(m), alpha_kind="per_token")
        inputs = validate.make_inputs(problem, m, device, seed=m + n)
        call = inputs.args(problem, torch.empty((m, n), dtype=torch.bfloat16, device=device))
        for name, tactic, cfg in _tactics(m):
            exact = validate.check(tactic(*call), inputs, problem.torch_out_dtype)
            differing, seconds = _stress(tactic, call, args.repeats, not args.no_load)
            row = {
                "backend": name, "tactic": list(dataclasses.astuple(cfg)), "n": n, "k": k, "m": m,
                "exact": exact.ok, "repeats": args.repeats, "differing": differing,
                "seconds": round(seconds, 3), "load": not args.no_load,
            }  # fmt: skip
            rows.append(row)
            print(f"{name:15s} {row['tactic']!s:28s} {n:5d}x{k:5d} M={m:4d} exact={exact.ok} "
                  f"differing={differing}/{args.repeats}", flush=True)  # fmt: skip
    record = {
        "benchmark": "hazard_stress",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "rows": rows,
    }
    path = Path(args.out) / "hazard_stress_cuda.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(record))
    bad = sum(r["differing"] > 0 or not r["exact"] for r in rows)
    print(f"wrote {path}: {bad} of {len(rows)} tactic cases differed or failed the exact check")


if __name__ == "__main__":
    main()
