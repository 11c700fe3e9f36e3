"""Warm-path overhead: best_mm_fp4 against calling the same bound backend directly.

The backend is a registered memoising backend: correct (it computes the reference once per
input set, so it passes validation and wins), and afterwards returns the stored result, so a
call costs only dispatch. What is left is fp4select's own overhead on this machine's CPU.
The two are interleaved batch by batch so that frequency drift hits both alike.

Two ways of passing the weight: the same objects every call (a user holding ``weight.T``), and
fresh views every call, as vLLM passes them (``b.t()``, ``b_descale.t()``); in the second the
direct call makes the same views, so the difference is still fp4select's own.

Two warm paths, side by side in the same batches: the C++ key (fp4select.native_key, built
here first if this torch has no build) and the Python path that serves until it is loaded
(or with FP4SELECT_NATIVE=off). The target, 1 µs added at p50, is the C++ key's.

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
from fp4select import api, native_build, native_key, tensor_guard
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
    parser.add_argument("--native-dir", help="where to build/load the C++ key (default: torch's)")
    args = parser.parse_args()
    device = torch.device(args.device)
    start = time.perf_counter()
    key = native_build.build(args.native_dir)
    print(
        f"C++ key ready in {time.perf_counter() - start:.1f} s: {native_key.library_path(args.native_dir)}"
    )

    with tempfile.TemporaryDirectory() as cache:
        fp4select.configure(
            cache_dir=cache,
            isolation="inprocess",
            timing=TimingOptions(budget_s=0.2),
            native="off",  # this script switches between the two paths itself
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

        def held():
            return fp4select.best_mm_fp4(a, b, ad, bd, al)

        def fresh():
            return fp4select.best_mm_fp4(a, w.t(), ad, ws.t(), al)

        # name -> (the C++ key to serve with, or None for the Python path; the call). The
        # switch is set once per batch, not per call; the direct calls ignore it.
        calls = {
            "direct": (
                None,
                lambda: runner(a, b, ad, bd, al, torch.bfloat16, None, 16, False, True, True),
            ),
            "C++ key": (key, held),
            "Python path": (None, held),
            "direct, fresh views": (
                None,
                lambda: runner(
                    a, w.t(), ad, ws.t(), al, torch.bfloat16, None, 16, False, True, True
                ),
            ),
            "C++ key, fresh views": (key, fresh),
            "Python path, fresh views": (None, fresh),
        }
        expected = calls["direct"][1]()
        for name, (serving, fn) in calls.items():
            api._native_key = serving
            assert torch.equal(fn(), expected), name
            per_call_ns(fn, args.calls)  # warm-up
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.batches):
            for name, (serving, fn) in calls.items():
                api._native_key = serving
                samples[name].append(per_call_ns(fn, args.calls))
        api._native_key = None
        stats = {name: quantiles(values) for name, values in samples.items()}
        for path in ("C++ key", "Python path"):
            for suffix in ("", ", fresh views"):
                overhead = [
                    v - d for v, d in zip(samples[path + suffix], samples["direct" + suffix])
                ]
                stats[f"added: {path}{suffix}"] = quantiles(overhead)
        assert len(api._native_bound) >= 1 and len(api._bound) >= 1, "a path was not bound"
        fp4select.unregister_backend("memo")
        native_guard = tensor_guard.native_available(a, ad)

    rows = [
        [name, f"{s['p50']:.0f}", f"{s['p10']:.0f}", f"{s['p90']:.0f}"] for name, s in stats.items()
    ]
    print(table(rows, ["per call (ns)", "p50", "p10", "p90"]))
    target_ns = 1000
    added = stats["added: C++ key"]["p50"]
    verdict = "meets" if added <= target_ns else "misses"
    print(
        f"added overhead p50, C++ key: {added:.0f} ns {verdict} the {target_ns} ns target"
        f" (fresh views: {stats['added: C++ key, fresh views']['p50']:.0f} ns)."
        f" Python path: {stats['added: Python path']['p50']:.0f} ns"
        f" (fresh views: {stats['added: Python path, fresh views']['p50']:.0f} ns;"
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
            # its file name only: the folder is the machine's own (no local paths in results)
            "native_key": native_key.library_path(args.native_dir).name,
            "target_met_by_native_key": added <= target_ns,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
