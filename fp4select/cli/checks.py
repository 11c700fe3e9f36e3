"""The commands that check this machine: ``doctor`` (what can run) and ``verify`` (what holds up).

Design rules: the data comes from ``fp4select.reports`` (``doctor_report``, ``verify_report``);
these functions only print it, as a table or, with ``--json``, as the report's JSON. ``verify``
shows a progress bar on stderr while it tunes (not with ``--json``, nor when stderr is not a
terminal).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fp4select.cli._common import parse_device, print_json, progress_bar, table
from fp4select.reports import (
    DEFAULT_VERIFY_SHAPES,
    VERIFY_BUCKETS,
    doctor_report,
    native_key_report,
    verify_problems,
    verify_report,
)

if TYPE_CHECKING:
    from fp4select.records import Decision

__all__ = ["cmd_doctor", "cmd_native", "cmd_verify", "tactics_cell"]


def cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report(parse_device(args.device), args.cc)
    if args.json:
        print_json(report)
        return 0
    m, env = report["machine"], report["environment"]
    print(f"fp4select {report['fp4select']}")
    if m["gpu"]:
        sms = f"  {m['sm_count']} SMs" if m["sm_count"] else ""
        print(f"machine:  {m['device']}  {m['gpu']}  SM{m['cc']}{sms}")
    else:
        print(f"machine:  cpu (CUDA available: {m.get('cuda_available')})")
    versions = ", ".join(
        f"{k} {env.get(k)}"
        for k in ("torch", "cuda", "cudnn", "flashinfer", "cutlass_dsl", "cudnn_frontend")
    )
    print(f"versions: {versions}")
    fi = report["flashinfer"]
    if fi["problem"]:
        print(f"flashinfer: {fi['problem']}")
    else:
        print(
            f"flashinfer.mm_fp4 lists {len(fi['listed_backends'])} backends: {', '.join(fi['listed_backends'])}"
        )
        sig = fi["signature"]
        if sig["matches"] is False:
            print(
                "warning: best_mm_fp4 does not mirror this flashinfer's mm_fp4: "
                f"parameters only in flashinfer: {sig['only_in_flashinfer'] or 'none'}; "
                f"different defaults: {sig['different_defaults'] or 'none'} "
                "(calls without them work; passing them to best_mm_fp4 raises TypeError)"
            )
    rows = []
    for r in report["backends"]:
        ccs = r.get("flashinfer_supported_ccs")
        where = "-" if ccs is None else (",".join(f"SM{c}" for c in ccs) or "none")
        status = "available" if r["available"] else "unavailable"
        if r["experimental"]:
            status += " (experimental)"
        rows.append([r["backend"], r["family"], status, where, r["reason"]])
    print(table(rows, ["backend", "family", "here", "flashinfer supports", "why not"]))
    for source, err in report["source_errors"].items():
        print(f"warning: {source}: {err}")
    c = report["cache"]
    print(
        f"cache:    {c['root']}{' (memory only)' if c['memory_only'] else ''}; isolation: {c['isolation']}"
    )
    bl = report["blacklist"]
    if bl:
        for name, rec in bl.items():
            print(
                f"blacklisted: {name}: {rec.get('kind')} on {rec.get('when')}: {rec.get('reason')}"
            )
    else:
        print("blacklist: empty")
    print(native_key_line(report["native_key"]))
    print(f"hopper kernels: {report['hopper_launch']}")
    return 0


def native_key_line(state: Mapping[str, Any]) -> str:
    return f"native key: {state['status']} ({state['path']})"


def cmd_native(args: argparse.Namespace) -> int:
    """Show the warm path's C++ key, or build it now (``--build``)."""
    from fp4select import native_build, native_key, settings

    chosen = settings.current()
    failure = None
    if args.build:
        if not args.json:
            print(
                f"building the warm path's C++ key (about 15 s): {native_key.library_path(chosen.native_dir)}"
            )
        try:
            native_build.build(chosen.native_dir)
        except RuntimeError as exc:
            failure = str(exc)
    report = dict(native_key_report(chosen), error=failure)
    if args.json:
        print_json(report)
    else:
        print(native_key_line(report))
        if failure:
            print(f"native: the build failed: {failure}")
        elif args.build and chosen.native == "off":
            print("native: built, but FP4SELECT_NATIVE=off: best_mm_fp4 will not use it")
    return 1 if failure else 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Tune a spread of problems in a scratch cache and say, per backend, what held up."""
    device = parse_device(args.device)
    problems = verify_problems(args.shape or DEFAULT_VERIFY_SHAPES, args.m or VERIFY_BUCKETS)
    bar = progress_bar(len(problems), "fp4select verify", "problem", off=args.json)

    def step(decision: Decision) -> None:
        if bar is not None:
            bar.set_postfix_str(f"{decision.problem.describe()}: {decision.winner or 'NONE'}")
            bar.update(1)

    try:
        report = verify_report(device, problems, cache_dir=args.cache_dir, on_decision=step)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print_json(report.to_json())
        return 0 if report.ok else 1
    rows = [
        [
            name,
            r["wins"],
            ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items())),
            "-" if r["worst_ratio"] is None else f"{r['worst_ratio']:.2f}",
            tactics_cell(r["tactics"]),
            r["first_failure"],
        ]
        for name, r in report.backends.items()
    ]
    header = ["backend", "wins", "verdicts", "worst/bound", "tactics (default/tuned time)"]
    print(table(rows, [*header, "first failure"]))
    for name, r in report.backends.items():  # why a backend runs at flashinfer's default
        for why, count in sorted(r["default_reasons"].items(), key=lambda kv: -kv[1])[:5]:
            print(f"  {name}: {count} x flashinfer's default: {why}"[:200])
    failed = ", ".join(report.failed)
    found = f"backends that failed somewhere: {failed}" if failed else "no backend failed"
    print(f"{report.problems} problems on {report.environment.get('gpu') or 'cpu'}; {found}")
    return 0 if report.ok else 1


def tactics_cell(tactics: Sequence[Mapping[str, Any]]) -> str:
    """How many problems ran at a tuned tactic (of those with tactics), how many at flashinfer's
    default, and the range of default/tuned time ratios where the default is a heuristic (a
    speed-up over CUTLASS's config 0 says nothing)."""
    from fp4select.backends.flashinfer_tactics import served_as

    if not tactics:
        return "-"

    def served(t: Mapping[str, Any]) -> str:
        return str(t["served"]) if "served" in t else served_as(t)

    tuned = [t for t in tactics if served(t) == "tuned"]
    ratios = [
        t["default_us"] / t["tuned_us"]
        for t in tuned
        if t.get("default_us")
        and t.get("tuned_us")
        and t.get("default_kind", "heuristic") == "heuristic"
    ]
    cell = f"{len(tuned)}/{len(tactics)} tuned"
    if ratios:
        cell += f" ({min(ratios):.2f}x-{max(ratios):.2f}x)"
    at_default = sum(served(t) == "default" for t in tactics)
    if at_default:
        cell += f", {at_default} default"
    partly = sum(bool(t.get("default_at")) for t in tuned)
    if partly:
        cell += f", {partly} partly default"
    return cell
