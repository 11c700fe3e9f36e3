"""Warm-path overhead: best_mm_fp4 against calling the same bound backend directly.

The backend is a registered memoising backend: correct (it computes the reference once per
input set, so it passes validation and wins), and afterwards returns the stored result, so a
call costs only dispatch. What is left is fp4select's own overhead on this machine's CPU.
The two are interleaved batch by batch so that frequency drift hits both alike.

Two ways of passing the weight: the same objects every call (a user holding ``weight.T``), and
fresh views every call, as vLLM passes them (``b.t()``, ``b_descale.t()``); in the second the
direct call makes the same views, so the difference is still fp4select's own.

    python benchmarks/bench_warm_path.py --device cpu
    python benchmarks/bench_warm_path.py --device cuda
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from _common import quantiles, table, write

import fp4select
from fp4select import tensor_guard
from fp4select.formats import reference_mm_fp4
from fp4select.keys import Problem
from fp4select.timing import TimingOptions
from fp4select.validate import make_inputs

_memo: dict[tuple, torch.Tensor] = {}


def memo(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, use_nvfp4, pdl):
    key = (a.data_ptr(), b.data_ptr(), a.shape, out_dtype)
    result = _memo.get(key)
    if result is None:
        result = _memo[key] = reference_mm_fp4(
            a, b, a_descale, b_descale, alpha, out_dtype, None, block_size, use_8x4, use_nvfp4
        )
    if out is not None:
        out.copy_(result)
        return out
    return result


def per_call_ns(fn, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    device = torch.device(args.device)

    with tempfile.TemporaryDirectory() as cache:
        fp4select.configure(
            cache_dir=cache, isolation="inprocess", timing=TimingOptions(budget_s=0.2)
        )
        fp4select.register_backend(memo, name="memo", devices={"cpu", "cuda"}, preference=0)
        problem = Problem(n=256, k=512, m_bucket=8)
        inputs = make_inputs(problem, 8, device)
        kwargs = inputs.kwargs(problem)
        record = fp4select.explain(problem=problem, device=device)
        assert record["winner"] == "memo", record["winner"]
        a, b, ad, bd, al = (kwargs[k] for k in ("a", "b", "a_descale", "b_descale", "alpha"))
        fp4select.best_mm_fp4(a, b, ad, bd, al)  # bind
        runner = fp4select.api.selector().runner_for(
            fp4select.api.selector().lookup(problem, device), device
        )

        w, ws = b.t(), bd.t()  # the layer's stored weight and scales, (N, K/2) row-major

        calls = {
            "direct": lambda: runner(a, b, ad, bd, al, torch.bfloat16, None, 16, False, True, True),
            "best_mm_fp4": lambda: fp4select.best_mm_fp4(a, b, ad, bd, al),
            "direct, fresh views": lambda: runner(
                a, w.t(), ad, ws.t(), al, torch.bfloat16, None, 16, False, True, True
            ),
            "best_mm_fp4, fresh views": lambda: fp4select.best_mm_fp4(a, w.t(), ad, ws.t(), al),
        }
        for name, fn in calls.items():
            assert torch.equal(fn(), calls["direct"]()), name
            per_call_ns(fn, args.calls)  # warm-up
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.batches):
            for name, fn in calls.items():
                samples[name].append(per_call_ns(fn, args.calls))
        stats = {name: quantiles(values) for name, values in samples.items()}
        for suffix in ("", ", fresh views"):
            overhead = [
                v - d for v, d in zip(samples["best_mm_fp4" + suffix], samples["direct" + suffix])
            ]
            stats["added overhead" + suffix] = quantiles(overhead)
        fp4select.unregister_backend("memo")
        native_guard = tensor_guard.native_available(a, ad)

    rows = [
        [name, f"{s['p50']:.0f}", f"{s['p10']:.0f}", f"{s['p90']:.0f}"] for name, s in stats.items()
    ]
    print(table(rows, ["per call (ns)", "p50", "p10", "p90"]))
    target_ns = 1000
    verdict = "meets" if stats["added overhead"]["p50"] <= target_ns else "misses"
    print(
        f"added overhead p50 {stats['added overhead']['p50']:.0f} ns {verdict} the {target_ns} ns target"
        f" (fresh views: {stats['added overhead, fresh views']['p50']:.0f} ns;"
        f" C++ tensor guard {'used' if native_guard else 'unavailable: Python guard'})"
    )
    path = write(
        "warm_path",
        device,
        {
            "problem": problem.to_json(),
            "batches": args.batches,
            "calls_per_batch": args.calls,
            "ns_per_call": stats,
            "target_added_ns_p50": target_ns,
            "native_guard": native_guard,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
