"""GPU correctness of the built-in GPU backends, and a tile sweep: what the CPU cannot check.

Runs every Triton tile configuration (with and without split-K) and torch-dequant at odd
shapes (M, N, K not multiples of any tile), both formats, both a scale layouts, every alpha
kind and both output dtypes, against the exact float64 reference (fp4select.validate), with
``out=`` poisoned by NaN, under CUDA graph capture, and twice for determinism. Then times a
sweep of tile configurations on the decode and prefill target shapes, to choose the
registered ones. Writes benchmarks/results/gpu_check_h200.json (or --out).

    python benchmarks/gpu_check.py [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
import traceback
from pathlib import Path

import torch
from _common import machine

from fp4select import timing, validate
from fp4select.backends import dequant, torch_scaled_mm, triton_fp4
from fp4select.keys import Problem, environment_for


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


LIMITS: dict[str, int | None] = {}


def runners() -> dict[str, object]:
    out: dict[str, object] = {}
    for cfg in triton_fp4.CONFIGS:
        out[cfg.name] = functools.partial(triton_fp4._run, cfg=cfg)
        LIMITS[cfg.name] = cfg.max_m
        if cfg.split_k:
            for split in (1, 7):
                out[f"{cfg.name}/split{split}"] = functools.partial(
                    triton_fp4._run, cfg=cfg, split=split
                )
    out["torch-dequant"] = dequant.run_torch
    return out


def correctness(device: torch.device) -> list[dict]:
    results = []
    shapes = [
        (1, 72, 160),
        (3, 200, 96),
        (7, 200, 96),
        (33, 136, 4128),
        (130, 264, 544),
        (257, 4104, 1056),
    ]
    # A compiled variant per (format, a layout, alpha kind, out dtype): a few cover them all.
    combos = [
        (True, "128x4", "scalar", "bfloat16"),
        (True, "8x4", "scalar", "bfloat16"),
        (False, "128x4", "scalar", "bfloat16"),
        (False, "8x4", "none", "float16"),
        (True, "128x4", "per_token", "float16"),
        (True, "128x4", "none", "bfloat16"),
        (False, "128x4", "per_token", "bfloat16"),
    ]
    for (m, n, k), (nv, layout, alpha_kind, out_dtype) in itertools.product(shapes, combos):
        bs = 16 if nv else 32
        if k % bs:
            continue
        problem = Problem(
            n=n,
            k=k,
            m_bucket=1,
            use_nvfp4=nv,
            block_size=bs,
            a_sf_layout=layout,
            alpha_kind=alpha_kind,
            out_dtype=out_dtype,
        )
        inputs = validate.make_inputs(problem, m, device, seed=m + n)
        for name, run in runners().items():
            limit = LIMITS.get(name.split("/")[0])
            if limit is not None and m > limit:
                continue
            row = {
                "backend": name,
                "m": m,
                "n": n,
                "k": k,
                "format": problem.format,
                "a_sf": layout,
                "alpha": alpha_kind,
                "out": out_dtype,
            }
            try:
                out = run(*inputs.args(problem))
                _sync()
                r = validate.check(out, inputs, problem.torch_out_dtype)
                poisoned = torch.full_like(out, float("nan"))
                returned = run(*inputs.args(problem, out=poisoned))
                _sync()
                r2 = validate.check(poisoned, inputs, problem.torch_out_dtype)
                row.update(
                    ok=r.ok and r2.ok and returned.data_ptr() == poisoned.data_ptr(),
                    reason=r.reason or r2.reason,
                    worst_ratio=r.worst_ratio,
                    rel_error=r.rel_error,
                    deterministic=bool(torch.equal(out, poisoned)),
                )
            except Exception as exc:
                row.update(ok=False, reason=f"{type(exc).__name__}: {exc}"[:300])
            results.append(row)
    return results


def graph_capture(device: torch.device) -> list[dict]:
    """Each registered runner captured in a CUDA graph and replayed on new inputs."""
    results = []
    problem = Problem(n=1000, k=2080, m_bucket=16, alpha_kind="per_token")
    for name, run in runners().items():
        if "/" in name:
            continue
        m = min(13, LIMITS.get(name) or 13)  # within what the runner declares
        first = validate.make_inputs(problem, m, device, seed=1)
        second = validate.make_inputs(problem, m, device, seed=2)
        names = ("a", "b", "a_descale", "b_descale", "alpha")
        static = [getattr(first, f).clone() for f in names]
        out = torch.empty(m, problem.n, dtype=torch.bfloat16, device=device)
        args = tuple(static)
        rest = (torch.bfloat16, out, 16, False, True, True)
        try:
            run(*args, *rest)  # warm-up outside capture: compiles and makes workspaces
            _sync()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run(*args, *rest)
            for t, f in zip(static, names):
                t.copy_(getattr(second, f))
            out.fill_(float("nan"))
            graph.replay()
            _sync()
            r = validate.check(out, second, torch.bfloat16)
            results.append({"backend": name, "ok": r.ok, "reason": r.reason})
        except Exception as exc:
            results.append({"backend": name, "ok": False, "reason": f"{type(exc).__name__}: {exc}"})
    return results


def sweep(device: torch.device) -> list[dict]:
    """Time tile configurations at the decode and prefill targets (NVFP4, bf16 out)."""
    cases = {(8192, 8192, 1): [], (8192, 8192, 16): []}
    small = []
    for bn, bkh, warps, stages in itertools.product((32, 64, 128), (128, 256), (4,), (3, 5)):
        if bn * bkh > 128 * 128 or (bn == 128 and warps == 2):
            continue
        small.append(
            triton_fp4.TileConfig(
                f"s{bn}x{bkh}w{warps}s{stages}", 16, bn, bkh, warps, stages, True, 64, 0, ""
            )
        )
    gemv = []
    for bn, bkh, warps in (
        (16, 128, 2),
        (32, 128, 4),
        (32, 64, 2),
        (64, 64, 4),
        (32, 256, 4),
        (64, 128, 4),
        (16, 256, 4),
    ):
        gemv.append(
            triton_fp4.TileConfig(
                f"g{bn}x{bkh}w{warps}", 16, bn, bkh, warps, 3, True, 16, 0, "", "gemv"
            )
        )
    large = []
    for (bm, bn), bkh, warps, stages in itertools.product(
        ((64, 128), (128, 128), (128, 256)), (32, 64), (4, 8), (3, 4)
    ):
        if (bm * bn >= 128 * 256 and warps == 4) or (bm == 64 and warps == 8):
            continue
        large.append(
            triton_fp4.TileConfig(
                f"l{bm}x{bn}x{bkh}w{warps}s{stages}", bm, bn, bkh, warps, stages, False, None, 0, ""
            )
        )
    out = []
    for n, k, m in cases:
        problem = Problem(n=n, k=k, m_bucket=max(1, 1 << (m - 1).bit_length()))
        sets = [
            validate.make_inputs(problem, m, device, seed=s, with_reference=False) for s in range(3)
        ]
        cfgs = (gemv + small[:2]) if m <= 16 else (small if m <= 64 else large)
        calls = {}
        for cfg in cfgs:
            run = functools.partial(triton_fp4._run, cfg=cfg)
            try:
                run(*sets[0].args(problem))
                _sync()
            except Exception as exc:
                out.append({"n": n, "k": k, "m": m, "config": cfg.name, "error": str(exc)[:200]})
                continue
            calls[cfg.name] = [functools.partial(run, *s.args(problem)) for s in sets]
        calls["torch-dequant"] = [
            functools.partial(dequant.run_torch, *s.args(problem)) for s in sets
        ]
        timings, method = timing.time_interleaved(
            calls, device, timing.TimingOptions(budget_s=1.0, min_rounds=5, max_rounds=30)
        )
        best = sorted(timings.items(), key=lambda kv: kv[1].median_us)
        for name, t in best:
            out.append(
                {"n": n, "k": k, "m": m, "config": name, "median_us": t.median_us, "method": method}
            )
        print(
            f"sweep n={n} k={k} m={m}: "
            + ", ".join(f"{nm}={t.median_us:.1f}" for nm, t in best[:6])
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated runner names to check")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    device = torch.device("cuda")
    env = environment_for(device)
    started = time.time()
    record: dict = {
        "machine": machine(device),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    record["available"] = {
        "triton": triton_fp4.why_unavailable(env),
        "torch-dequant": dequant.why_torch_unavailable(env),
        "torch-scaled-mm": torch_scaled_mm.why_unavailable(env),
    }
    print("available:", record["available"])
    if args.only:
        keep = set(args.only.split(","))
        global runners
        full = runners
        runners = lambda: {n: r for n, r in full().items() if n.split("/")[0] in keep}  # noqa: E731
    try:
        record["correctness"] = correctness(device)
    except Exception:
        record["correctness_error"] = traceback.format_exc()
        print(record["correctness_error"])
    rows = record.get("correctness", [])
    bad = [r for r in rows if not r["ok"]]
    print(
        f"correctness: {len(rows) - len(bad)}/{len(rows)} passed "
        f"(worst ratio {max((r.get('worst_ratio') or 0) for r in rows) if rows else 0:.3f})"
    )
    for r in bad[:20]:
        print("  FAIL", r)
    record["graph"] = graph_capture(device)
    print("graph capture:", [(r["backend"], r["ok"], r["reason"][:80]) for r in record["graph"]])
    if args.sweep:
        record["sweep"] = sweep(device)
    record["seconds"] = time.time() - started
    path = Path(args.out) / "gpu_check_h200.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {path} in {record['seconds']:.0f} s")


if __name__ == "__main__":
    main()
