"""The commands that tune or read one decision at a time: ``warm`` and ``explain``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

import torch

from fp4select.cli._common import failed, parse_device, print_json, progress_bar, table
from fp4select.cli.plan import WarmUsageError, check_shape, warm_plan
from fp4select.keys import Problem, environment_for, m_bucket
from fp4select.settings import Settings

__all__ = ["cmd_explain", "cmd_warm", "tactic_summary"]


def print_plan(plan: dict[str, Any], as_json: bool) -> None:
    model, record, problems = plan["model"], plan["record"], plan["problems"]
    if as_json:
        print_json(
            {
                "model": model.to_json() if model else None,
                "record": [{"problem": p.to_json(), "count": c} for p, c in record.items()]
                if record is not None
                else None,
                "problems": [p.to_json() for p in problems],
            }
        )
        return
    if model is not None:
        print(f"{model.architecture} at tp={model.tp}: {model.format} layers per rank")
        rows = [[x.name, x.n, x.k, x.count, x.split] for x in model.layers]
        print(table(rows, ["layer", "N", "K", "count", "split"]) if rows else "no FP4 layers")
        for line in model.notes:
            print(f"note: {line}")
    if record is not None:
        rows = [[p.describe(), c] for p, c in record.items()]
        print(table(rows, ["recorded problem", "seen"]) if rows else "the record is empty")
    print(f"{len(problems)} problem keys to tune")


def warm_native_key(settings: Settings, quiet: bool) -> str:
    """Deploy time is when to build the warm path's C++ key: the servers then load it."""
    from fp4select import native_build

    if settings.native == "off":
        return "off"
    try:
        native_build.build(settings.native_dir)
    except RuntimeError as exc:
        if not quiet:
            print(f"warm: the warm path's C++ key was not built ({exc}); the Python path serves")
        return f"failed: {exc}"
    return "built"


def warm_devices(args: argparse.Namespace) -> list[torch.device] | None:
    """The GPUs of --devices (one kind, checked), or None for one device."""
    from fp4select.multi_gpu import check_same_environment, parse_devices

    if not args.devices:
        return None
    if args.device:
        raise WarmUsageError("give --device or --devices, not both")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [torch.device("cuda", i) for i in parse_devices(args.devices, count)]
    check_same_environment(devices)
    return devices


def cmd_warm(args: argparse.Namespace) -> int:
    import time
    from concurrent.futures import ThreadPoolExecutor

    from fp4select.api import selector
    from fp4select.compile_ahead import compile_ahead
    from fp4select.multi_gpu import DeviceError, decision_row, warm_parallel

    plan = warm_plan(args)  # a bad input raises WarmUsageError: one line, exit 2
    try:
        devices = None if args.dry_run else warm_devices(args)
    except DeviceError as exc:
        return failed(f"fp4select warm: {exc}", 2)
    if args.dry_run:
        if args.vs_bf16:
            return failed("fp4select warm: --vs-bf16 times the keys tuned; --dry-run tunes none", 2)
        print_plan(plan, args.json)
        return 0
    problems = plan["problems"]
    if not problems:
        return failed("warm: no FP4 problem keys to tune (see --dry-run for why)")
    sel = selector()
    quiet = args.quiet or args.json
    started = time.perf_counter()
    # The C++ key compiles on one CPU core while the GPU tunes: the two do not wait on each other.
    builder = ThreadPoolExecutor(1, thread_name_prefix="fp4select-native")
    native_built = builder.submit(warm_native_key, sel.settings, quiet)
    device = devices[0] if devices else parse_device(args.device)
    ahead = compile_ahead(
        sel, problems, device, args.compile_jobs, announce=None if quiet else print
    )
    if ahead.groups and not quiet:
        print(ahead.describe())
    if devices is not None:

        def progress(row: dict[str, Any]) -> None:
            if not quiet:
                print(f"{row['problem']}: {row['winner']} ({row['source']}) on {row['device']}")

        results, counters = warm_parallel(
            problems,
            devices,
            store_root=sel.store.root,
            isolation=sel.isolation,
            timing=sel.timing,
            progress=progress,
        )
    else:
        bar = progress_bar(len(problems), "fp4select warm", "key", off=quiet)
        results = []
        try:
            for problem in problems:
                decision = sel.decide(problem, device)
                why = "" if decision.winner else why_none(decision)
                results.append(
                    {"problem": problem.describe(), **decision_row(decision, sel), "why_none": why}
                )
                if bar is not None:
                    bar.update(1)
                elif not quiet:  # no tqdm (it comes with flashinfer): plain lines
                    print(f"{problem.describe()}: {decision.winner} ({decision.source})")
        finally:
            if bar is not None:
                bar.close()
        counters = sel.counters.as_dict()
    native = native_built.result()
    builder.shutdown()
    wall = time.perf_counter() - started
    if args.vs_bf16:
        compare_with_bf16(problems, results, device, quiet)
    failures = sum(1 for r in results if r["winner"] is None)
    # Warming at deploy time is for the processes that come after: a decision kept only in this
    # process's memory (an unwritable cache) is lost when it ends, so that is a failure too.
    lost = sum(1 for r in results if r["winner"] is not None and r.get("stored") is False)
    exported = None
    if args.export:
        try:
            exported = sel.store.export_archive(args.export, environment_for(device)).entries
        except (OSError, ValueError) as exc:
            return failed(f"warm: --export {args.export} failed: {exc}")
    if args.json:
        print_json(
            {
                "results": results,
                "stats": counters,
                "devices": [str(d) for d in devices] if devices else [str(device)],
                "wall_seconds": round(wall, 3),
                "exported": exported,
                "native_key": native,
                "compile_ahead": ahead.to_json(),
            }
        )
    else:
        rows = [
            [r["problem"], r["winner"] or "NONE", r["source"], r.get("seconds", "-")]
            + ([r.get("device") or "-"] if devices else [])
            + (versus_cells(r.get("vs_bf16")) if args.vs_bf16 else [])
            for r in results
        ]
        header = ["problem", "winner", "source", "tuning s"] + (["device"] if devices else [])
        header += VERSUS_HEADER if args.vs_bf16 else []
        print(table(rows, header))
        print(
            f"{len(results)} keys in {wall:.1f} s" + (f" on {len(devices)} GPUs" if devices else "")
        )
        if args.vs_bf16:
            print(VERSUS_NOTE)
            for line in versus_summary(problems, results):
                print(line)
        if exported is not None:
            print(f"exported {exported} entries to {args.export}")
        for r in results:
            if r["winner"] is None and r.get("why_none"):
                print(f"NONE for {r['problem']}: {r['why_none']}")
            elif "why" in r.get("vs_bf16", {}):
                print(f"--vs-bf16 for {r['problem']}: {r['vs_bf16']['why']}")
    if lost:
        print(
            f"warm failed: {lost} of {len(results)} decisions could not be written to the cache "
            f"{sel.store.root} (see the warning above) and are lost when this command ends",
            file=sys.stderr,
        )
    return 1 if failures or lost else 0


VERSUS_HEADER = ["M timed", "FP4 us", "dense us", "FP4/dense"]
VERSUS_NOTE = (
    "dense: the same product with the weight in the output dtype (bfloat16, or float16), "
    "timed beside the FP4 GEMM as served at the bucket's largest M; FP4/dense below 1: FP4 "
    "is faster"
)


def compare_with_bf16(
    problems: list[Problem], results: list[dict[str, Any]], device: torch.device, quiet: bool
) -> None:
    """Each tuned key's served GEMM beside a bfloat16 weight (``explain``'s ``vs_bf16``), into
    its result row as ``vs_bf16``; nothing is tuned here."""
    from fp4select.api import explain

    rows = {r["problem"]: r for r in results}
    bar = progress_bar(len(problems), "fp4select warm --vs-bf16", "key", off=quiet)
    try:
        for problem in problems:
            row = rows.get(problem.describe())
            if row is not None and row["winner"] is not None:
                record = explain(problem=problem, device=device, tune=False, vs_bf16=True)
                row["vs_bf16"] = record.get("vs_bf16", {"why": "no decision stored for this key"})
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def versus_summary(problems: list[Problem], results: list[dict[str, Any]]) -> list[str]:
    """One line per weight shape (and format): up to which M the FP4 GEMM beat the dense one,
    from the smallest M on, and the ratios above it."""
    rows = {r["problem"]: r.get("vs_bf16") or {} for r in results}
    shapes: dict[tuple[Any, ...], list[tuple[int, float]]] = {}
    for p in problems:
        ratio = rows.get(p.describe(), {}).get("ratio")
        if ratio is not None:
            shape = (p.n, p.k, p.format, p.out_dtype, p.a_sf_layout, p.b_layout, p.alpha_kind)
            shapes.setdefault(shape, []).append((p.timing_m(), ratio))
    lines = []
    for (n, k, fmt, *_), points in shapes.items():
        points.sort()
        faster = 0
        while faster < len(points) and points[faster][1] < 1:
            faster += 1
        rest = [r for _, r in points[faster:]]
        line = f"N={n} K={k} {fmt}: FP4 "
        if faster:
            line += f"faster up to M = {points[faster - 1][0]}" + ("; " if rest else "")
        if rest:
            line += f"from M = {points[faster][0]} {min(rest):.2f}-{max(rest):.2f}x the dense time"
        lines.append(line)
    return lines


def versus_cells(comparison: Mapping[str, Any] | None) -> list[str]:
    """The table cells of one ``versus.compare`` result (dashes where nothing was timed)."""
    if not comparison or comparison.get("ratio") is None:
        return ["-"] * len(VERSUS_HEADER)
    return [
        str(comparison["m"]),
        f"{comparison['fp4']['median_us']:.1f}",
        f"{comparison['dense']['median_us']:.1f}",
        f"{comparison['ratio']:.2f}x",
    ]


def why_none(decision: Any) -> str:
    """Why no backend serves a key, in one line: each candidate's verdict, shortest first."""
    reasons = sorted(
        (f"{name} {v.status}: {v.reason}" for name, v in decision.verdicts.items()), key=len
    )
    return "; ".join(r[:120] for r in reasons[:4]) or "no backend is registered"


def cmd_explain(args: argparse.Namespace) -> int:
    from fp4select.api import explain

    check_shape(args.n, args.k, args.format)  # what warm refuses, explain refuses alike
    problem = Problem(
        n=args.n,
        k=args.k,
        m_bucket=m_bucket(args.m),
        out_dtype=args.out_dtype,
        block_size=16 if args.format == "nvfp4" else 32,
        use_nvfp4=args.format == "nvfp4",
        a_sf_layout=args.a_sf_layout,
        b_layout=args.b_layout,
        alpha_kind=args.alpha,
    )
    record = explain(
        problem=problem, device=parse_device(args.device), tune=args.tune, vs_bf16=args.vs_bf16
    )
    if args.json:
        print_json(record)
        return 0 if record.get("winner") else 1
    print(f"problem: {problem.describe()}")
    print(f"source:  {record['source']}")
    if record.get("winner") is None and record["source"] == "none":
        print("no decision yet (run with --tune, or `fp4select warm`)")
        return 1
    ranking = record.get("ranking") or {}
    margin = ranking.get("margin")
    print(
        f"winner:  {record['winner']}"
        + ("" if margin is None else f"  (runner-up {margin:+.1%} slower)")
        + ("  [near-tie: preference order]" if ranking.get("tie_broken_by_preference") else "")
    )
    rows = []
    resampled = False
    for name, v in record["verdicts"].items():
        t = record["timings"].get(name)
        time_s = f"{t['median_us']:.2f} [{t['p10_us']:.2f}-{t['p90_us']:.2f}]" if t else "-"
        if t and str(t.get("method", "")).endswith("+resampled"):
            time_s, resampled = time_s + " *", True
        tactic, why_untuned = tactic_summary(v)
        reason = v.get("reason") or why_untuned
        rows.append([name, v["status"], time_s, tactic, reason[:100]])
    print(table(rows, ["backend", "verdict", "median us [p10-p90]", "tactic", "reason"]))
    if resampled:
        print("* sampled again: its first samples ran far slower than its own calls (a stall)")
    if record.get("method"):
        print(f"timing:  {record['method']}")
    if "vs_bf16" in record:
        print(versus_line(record["vs_bf16"]))
    return 0 if record.get("winner") else 1


def versus_line(comparison: Mapping[str, Any]) -> str:
    if comparison.get("ratio") is None:
        return f"vs {comparison['dense_dtype']}: not timed ({comparison.get('why', '?')})"
    cells = dict(zip(VERSUS_HEADER, versus_cells(comparison)))
    return (
        f"vs {comparison['dense_dtype']}: at M={cells['M timed']} the FP4 GEMM as served "
        f"({comparison['served']}) took {cells['FP4 us']} us, the same product with a "
        f"{comparison['dense_dtype']} weight {cells['dense us']} us: {cells['FP4/dense']} "
        f"({comparison['method']}, side by side)"
    )


def tactic_summary(verdict: Mapping[str, Any]) -> tuple[str, str]:
    """(the tactic cell, why it is not tuned) for a verdict's JSON: the tactic the backend was
    validated, timed and is served at, with its time at flashinfer's default tactic and what
    that default is (a heuristic, or CUTLASS's config 0)."""
    from fp4select.backends.flashinfer_tactics import served_as

    detail = verdict.get("detail") or {}
    record = detail.get("tactic")
    if not isinstance(record, Mapping):
        return "-", ""
    served = served_as(record)
    if served == "untuned":
        return "default", f"untuned: {record.get('reason') or '?'}"
    if served == "default":
        return (
            "default (-1)",
            f"{record.get('fallback') or 'default'}: {record.get('reason') or '?'}",
        )
    cell = json.dumps(record["tactic"])
    default = detail.get("default_timing")
    if isinstance(default, Mapping) and default.get("median_us") is not None:
        kind = record.get("default_kind") or "unknown"
        cell += f" (default, {kind}: {default['median_us']:.2f} us)"
    at = [d.get("m") for d in record.get("default_at") or [] if isinstance(d, Mapping)]
    return cell, (f"served at the default at M={at}" if at else "")
