"""The command line: doctor, warm, show, explain, blacklist, export/import, clear.

Design rules: every command reads the same store and registry the library uses (nothing is
re-implemented here); every command that prints a table also takes ``--json`` for scripts;
exit status 0 means the command did what it said, 1 that it could not, 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fp4select._version import __version__
from fp4select.keys import (
    A_SF_LAYOUTS,
    ALPHA_KINDS,
    B_LAYOUTS,
    M_BUCKETS,
    OUT_DTYPES,
    Problem,
    environment_for,
    m_bucket,
)


class UsageError(Exception):
    """A mistake in what the user typed: one line on stderr, exit status 2."""


def _device(arg: str | None) -> torch.device:
    if arg:
        try:
            device = torch.device(arg)
        except RuntimeError:
            raise UsageError(
                f"--device {arg!r} is not a torch device (cpu, cuda, cuda:1, ...)"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {arg}: this torch sees no CUDA device")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise UsageError(f"--device {arg}: there are {torch.cuda.device_count()} CUDA devices")
        if device.type not in ("cpu", "cuda"):
            raise UsageError(f"--device {arg}: fp4select runs on cpu or cuda devices")
        return device
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def _table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


# -- doctor -------------------------------------------------------------------------------------
def doctor_report(device: torch.device, what_if_cc: int | None = None) -> dict[str, Any]:
    """Everything doctor prints, as data (tests and --json read this).

    ``what_if_cc`` asks the installed flashinfer about another GPU generation (say 100 for
    B200) from any machine, the CPU included: the answers are flashinfer's own.
    """
    from fp4select.api import selector
    from fp4select.backends import discover
    from fp4select.backends import flashinfer as fi

    env = environment_for(device)
    if what_if_cc is not None:
        env = dict(env, device="cuda", cc=what_if_cc, gpu=f"what-if SM{what_if_cc}", sm_count=None)
    sel = selector()
    registry = discover()
    mm_fp4, why = fi.load()
    listed = fi.listed_names(mm_fp4) if mm_fp4 is not None else []
    rows = []
    for name, backend in registry.backends.items():
        reason = backend.unavailable_reason(env)
        row = {
            "backend": name,
            "family": backend.family,
            "available": reason is None,
            "reason": reason or "",
            "experimental": backend.experimental,
        }
        if backend.family == fi.FAMILY and mm_fp4 is not None:
            ccs = fi.supported_ccs(mm_fp4, name)
            row["flashinfer_supported_ccs"] = ccs
        rows.append(row)
    blacklist = sel.store.blacklist(env)
    machine = {
        "device": str(device),
        "gpu": env.get("gpu"),
        "cc": env.get("cc"),
        "sm_count": env.get("sm_count"),
    }
    if device.type == "cpu":
        machine["cuda_available"] = torch.cuda.is_available()
    return {
        "fp4select": __version__,
        "machine": machine,
        "environment": env,
        "flashinfer": {
            "listed_backends": listed,
            "problem": why,
            "signature": signature_report(mm_fp4),
        },
        "backends": rows,
        "source_errors": registry.source_errors,
        "cache": {
            "root": str(sel.store.root),
            "memory_only": sel.store.memory_only,
            "isolation": sel.isolation,
        },
        "blacklist": blacklist,
    }


def signature_report(mm_fp4: Any) -> dict[str, Any]:
    """How ``best_mm_fp4``'s parameters line up with the installed ``flashinfer.mm_fp4``'s.

    A newer flashinfer may add a parameter: fp4select keeps working (it calls flashinfer
    with the parameters both know), but a caller passing the new one gets a TypeError from
    ``best_mm_fp4``, and this says so before it happens.
    """
    import inspect

    from fp4select.api import best_mm_fp4

    if mm_fp4 is None:
        return {"matches": None, "only_in_flashinfer": [], "different_defaults": []}
    try:
        theirs = inspect.signature(mm_fp4).parameters
    except (TypeError, ValueError):
        return {"matches": None, "only_in_flashinfer": [], "different_defaults": []}
    ours = inspect.signature(best_mm_fp4).parameters
    missing = [name for name in theirs if name not in ours]
    defaults = [
        name
        for name, param in theirs.items()
        if name in ours and param.default is not inspect.Parameter.empty
        and ours[name].default != param.default
    ]  # fmt: skip
    return {
        "matches": not missing and not defaults,
        "only_in_flashinfer": missing,
        "different_defaults": defaults,
    }


def cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report(_device(args.device), args.cc)
    if args.json:
        _print_json(report)
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
    print(_table(rows, ["backend", "family", "here", "flashinfer supports", "why not"]))
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
    return 0


# -- warm ---------------------------------------------------------------------------------------
def _parse_shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(x) for x in text.lower().replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape must be N,K (two integers), got {text!r}"
        ) from None
    if n < 1 or k < 1:
        raise argparse.ArgumentTypeError(f"shape must be positive, got {text!r}")
    return n, k


def _compute_capability(text: str) -> int:
    from fp4select.backends.flashinfer import KNOWN_CCS

    try:
        value = int(text)
    except ValueError:
        value = -1
    if value not in KNOWN_CCS:
        raise argparse.ArgumentTypeError(
            f"must be a compute capability flashinfer knows ({', '.join(map(str, KNOWN_CCS))}), "
            f"got {text!r}"
        )
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _buckets(max_m: int) -> list[int]:
    top = m_bucket(max_m)
    return [b for b in M_BUCKETS if b <= top]


def _problems_for(
    shapes: Sequence[tuple[int, int]], args: argparse.Namespace, fmt: str
) -> list[Problem]:
    use_nvfp4 = fmt == "nvfp4"
    return [
        Problem(
            n=n,
            k=k,
            m_bucket=bucket,
            out_dtype=args.out_dtype,
            block_size=16 if use_nvfp4 else 32,
            use_nvfp4=use_nvfp4,
            a_sf_layout=args.a_sf_layout,
            b_layout=args.b_layout,
            alpha_kind=args.alpha,
        )
        for n, k in shapes
        for bucket in _buckets(args.max_m)
    ]


class _WarmUsageError(Exception):
    """Bad warm input: printed as ``warm: <message>``, exit status 2."""


def _shapes_file(path: str) -> list[tuple[int, int]]:
    """``{"shapes": [[N, K], ...]}``, a bare list, or objects with n and k; checked."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise _WarmUsageError(f"--shapes-file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise _WarmUsageError(f"--shapes-file {path}: not JSON ({exc})") from None
    items = data.get("shapes") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise _WarmUsageError(f'--shapes-file {path}: expected {{"shapes": [[N, K], ...]}}')
    shapes = []
    for i, item in enumerate(items):
        pair = (item.get("n"), item.get("k")) if isinstance(item, dict) else item
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair)
        ):
            raise _WarmUsageError(
                f"--shapes-file {path}: shapes[{i}] must be [N, K] with positive integers, "
                f"got {item!r}"
            )
        shapes.append((pair[0], pair[1]))
    return shapes


def _warm_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Every key warm will tune, from --shape, --shapes-file, --model and --from-record.

    Returns the problems (deduplicated, first appearance first) and, as data for --dry-run,
    the model table and the record counts.
    """
    from fp4select.model_shapes import ModelConfigError, shapes_from_path
    from fp4select.record import read_record

    plan: dict[str, Any] = {"model": None, "record": None}
    shapes = list(args.shape or [])
    for path in args.shapes_file or []:
        shapes += _shapes_file(path)
    fmt = args.format or "nvfp4"
    block = 16 if fmt == "nvfp4" else 32
    for n, k in shapes:
        if k % block:
            raise _WarmUsageError(
                f"shape {n},{k}: K must be a multiple of {block} for {fmt} (one block scale "
                f"per {block} values of K)"
            )
    problems: list[Problem] = []
    if args.model:
        try:
            model = shapes_from_path(args.model, tp=args.tp)
        except ModelConfigError as exc:
            raise _WarmUsageError(f"--model {args.model}: {exc}") from None
        if args.format and args.format != model.format:
            raise _WarmUsageError(
                f"--format {args.format} contradicts the model's FP4 layers ({model.format})"
            )
        plan["model"] = model
        problems += model.problems(
            args.max_m,
            out_dtype=args.out_dtype,
            a_sf_layout=args.a_sf_layout,
            b_layout=args.b_layout,
            alpha_kind=args.alpha,
        )
    problems += _problems_for(shapes, args, fmt)
    if args.from_record:
        try:
            counts = read_record(args.from_record)
        except OSError as exc:
            raise _WarmUsageError(f"--from-record: {exc}") from None
        plan["record"] = counts
        problems += list(counts)
    if not (args.shape or args.shapes_file or args.model or args.from_record):
        raise _WarmUsageError("give --shape N,K, --shapes-file, --model PATH or --from-record FILE")
    plan["problems"] = list(dict.fromkeys(problems))
    return plan


def _print_plan(plan: dict[str, Any], as_json: bool) -> None:
    model, record, problems = plan["model"], plan["record"], plan["problems"]
    if as_json:
        _print_json(
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
        print(_table(rows, ["layer", "N", "K", "count", "split"]) if rows else "no FP4 layers")
        for line in model.notes:
            print(f"note: {line}")
    if record is not None:
        rows = [[p.describe(), c] for p, c in record.items()]
        print(_table(rows, ["recorded problem", "seen"]) if rows else "the record is empty")
    print(f"{len(problems)} problem keys to tune")


def _warm_devices(args: argparse.Namespace) -> list[torch.device] | None:
    from fp4select.multi_gpu import check_same_environment, parse_devices

    if not args.devices:
        return None
    if args.device:
        raise _WarmUsageError("give --device or --devices, not both")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [torch.device("cuda", i) for i in parse_devices(args.devices, count)]
    check_same_environment(devices)
    return devices


def cmd_warm(args: argparse.Namespace) -> int:
    import time

    from fp4select.api import selector
    from fp4select.multi_gpu import DeviceError, warm_parallel

    try:
        plan = _warm_plan(args)
        devices = None if args.dry_run else _warm_devices(args)
    except (_WarmUsageError, DeviceError) as exc:
        print(f"warm: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        _print_plan(plan, args.json)
        return 0
    problems = plan["problems"]
    if not problems:
        print("warm: no FP4 problem keys to tune (see --dry-run for why)", file=sys.stderr)
        return 1
    sel = selector()
    started = time.perf_counter()
    if devices is not None:
        show = not (args.quiet or args.json)

        def progress(row: dict[str, Any]) -> None:
            if show:
                print(f"{row['problem']}: {row['winner']} ({row['source']}) on {row['device']}")

        results, counters = warm_parallel(
            problems,
            devices,
            store_root=sel.store.root,
            isolation=sel.isolation,
            timing=sel.timing,
            progress=progress,
        )
        device = devices[0]
    else:
        device = _device(args.device)
        try:
            from tqdm import tqdm

            progress = tqdm(
                problems, desc="fp4select warm", unit="key", disable=args.quiet or args.json
            )
        except ImportError:  # tqdm comes with flashinfer; without it, plain lines
            progress = problems
        results = []
        for problem in progress:
            decision = sel.decide(problem, device)
            results.append(
                {
                    "problem": problem.describe(),
                    "winner": decision.winner,
                    "source": decision.source,
                    "seconds": round(decision.tuning_seconds, 3),
                    "why_none": "" if decision.winner else _why_none(decision),
                }
            )
            if not args.json and progress is problems and not args.quiet:
                print(f"{problem.describe()}: {decision.winner} ({decision.source})")
        counters = sel.counters.as_dict()
    wall = time.perf_counter() - started
    failures = sum(1 for r in results if r["winner"] is None)
    exported = None
    if args.export:
        try:
            exported = sel.store.export_archive(args.export, environment_for(device)).entries
        except (OSError, ValueError) as exc:
            print(f"warm: --export {args.export} failed: {exc}", file=sys.stderr)
            return 1
    if args.json:
        _print_json(
            {
                "results": results,
                "stats": counters,
                "devices": [str(d) for d in devices] if devices else [str(device)],
                "wall_seconds": round(wall, 3),
                "exported": exported,
            }
        )
    else:
        rows = [
            [r["problem"], r["winner"] or "NONE", r["source"], r.get("seconds", "-")]
            + ([r.get("device") or "-"] if devices else [])
            for r in results
        ]
        header = ["problem", "winner", "source", "tuning s"] + (["device"] if devices else [])
        print(_table(rows, header))
        print(
            f"{len(results)} keys in {wall:.1f} s" + (f" on {len(devices)} GPUs" if devices else "")
        )
        if exported is not None:
            print(f"exported {exported} entries to {args.export}")
        for r in results:
            if r["winner"] is None and r.get("why_none"):
                print(f"NONE for {r['problem']}: {r['why_none']}")
    return 1 if failures else 0


def _why_none(decision: Any) -> str:
    """Why no backend serves a key, in one line: each candidate's verdict, shortest first."""
    reasons = sorted(
        (f"{name} {v.status}: {v.reason}" for name, v in decision.verdicts.items()), key=len
    )
    return "; ".join(r[:120] for r in reasons[:4]) or "no backend is registered"


# -- show / explain -------------------------------------------------------------------------------
def cmd_show(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    store = selector().store
    env = None if args.all else environment_for(_device(args.device))
    items = []
    for env_, key, record in store.iter_entries(env):
        items.append({"env": env_, "key": key, "record": record})
    if args.json:
        _print_json(items)
        return 0
    from fp4select.probe import MalformedRecord
    from fp4select.selector import Decision

    rows = []
    for item in items:
        e = item["env"]
        gpu = e.get("gpu") if isinstance(e.get("gpu"), str) else "cpu"
        try:  # a record is data from disk: checked field by field before it is printed
            decision = Decision.from_json(item["record"], source="disk")
        except MalformedRecord as exc:
            rows.append(((1 << 62,), [gpu, str(item["key"])[:60], "INVALID", "-", f"{exc}"[:60]]))
            continue
        margin = (decision.ranking or {}).get("margin")
        p = decision.problem
        row = [gpu, p.describe(), decision.winner, "-" if margin is None else f"{margin:+.1%}"]
        rows.append(((p.n, p.k, p.m_bucket, p.describe()), [*row, decision.created]))
    rows = [row for _, row in sorted(rows, key=lambda r: r[0])]
    print(_table(rows, ["gpu", "problem", "winner", "margin", "created"]) if rows else "no entries")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from fp4select.api import explain

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
    record = explain(problem=problem, device=_device(args.device), tune=args.tune)
    if args.json:
        _print_json(record)
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
    for name, v in record["verdicts"].items():
        t = record["timings"].get(name)
        time_s = f"{t['median_us']:.2f} [{t['p10_us']:.2f}-{t['p90_us']:.2f}]" if t else "-"
        tactic, why_untuned = tactic_summary(v)
        reason = v.get("reason") or why_untuned
        rows.append([name, v["status"], time_s, tactic, reason[:100]])
    print(_table(rows, ["backend", "verdict", "median us [p10-p90]", "tactic", "reason"]))
    if record.get("method"):
        print(f"timing:  {record['method']}")
    return 0 if record.get("winner") else 1


def tactic_summary(verdict: Mapping[str, Any]) -> tuple[str, str]:
    """(the tactic cell, why it is untuned) for a verdict's JSON: the tactic the backend was
    validated, timed and is served at, with its time at flashinfer's default tactic."""
    detail = verdict.get("detail") or {}
    record = detail.get("tactic")
    if not isinstance(record, Mapping):
        return "-", ""
    if record.get("tactic") is None:
        return "default", f"untuned: {record.get('reason') or '?'}"
    cell = json.dumps(record["tactic"])
    default = detail.get("default_timing")
    if isinstance(default, Mapping) and default.get("median_us") is not None:
        cell += f" (default {default['median_us']:.2f} us)"
    return cell, ""


# -- blacklist / archive / clear ---------------------------------------------------------------
def cmd_blacklist(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    store = selector().store
    env = environment_for(_device(args.device))
    if args.clear is not None:
        removed = store.remove_from_blacklist(env, args.clear or None)
        print(f"removed {removed} blacklist entr{'y' if removed == 1 else 'ies'}")
        return 0
    bl = store.blacklist(env)
    if args.json:
        _print_json(bl)
    elif not bl:
        print("blacklist: empty")
    else:
        rows = [
            [
                n,
                r.get("kind"),
                r.get("when"),
                r.get("scope", "environment"),
                (r.get("reason") or "")[:80],
            ]
            for n, r in bl.items()
        ]
        print(_table(rows, ["backend", "kind", "when", "scope", "reason"]))
    return 0


def _many(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _os_error(exc: OSError) -> str:
    return f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)


def cmd_export(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    env = None if args.all else environment_for(_device(args.device))
    folder = os.path.dirname(os.path.abspath(args.path))
    if not os.path.isdir(folder):
        print(f"export failed: {folder}: no such directory", file=sys.stderr)
        return 1
    try:
        result = selector().store.export_archive(args.path, env, overwrite=args.force)
    except OSError as exc:  # a directory, an existing file without --force, a failing disk
        print(f"export failed: {_os_error(exc)}", file=sys.stderr)
        return 1
    if args.json:
        _print_json({"path": args.path, **result.as_dict()})
    else:
        print(
            f"exported {_many(result.entries, 'entry', 'entries')} and "
            f"{_many(result.blacklist, 'blacklist record', 'blacklist records')} to {args.path}"
        )
    return 0


def _entry_problem(key: dict[str, Any], record: dict[str, Any]) -> str | None:
    """Why an archived decision must not be imported: it is data from another machine."""
    from fp4select.probe import MalformedRecord
    from fp4select.selector import Decision

    try:
        decision = Decision.from_json(record, source="import")
    except MalformedRecord as exc:
        return str(exc)
    if decision.problem.to_json() != key:
        return "its record answers another problem than its key"
    return None


def cmd_import(args: argparse.Namespace) -> int:
    from fp4select.api import selector
    from fp4select.selector import PROTECTED_BACKENDS

    try:
        # The built-in fallback must stay usable: an archive cannot blacklist it.
        result = selector().store.import_archive(
            args.path,
            overwrite=args.overwrite,
            protected_backends=PROTECTED_BACKENDS,
            check_entry=_entry_problem,
        )
    except OSError as exc:
        print(f"import failed: {_os_error(exc)}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"import failed: {exc}", file=sys.stderr)
        return 1
    from fp4select import bundle

    fit = bundle.applicability(args.path, environment_for(_device(args.device)))
    lost = result.entries_in_memory + result.blacklist_in_memory
    if args.json:
        _print_json({"path": args.path, **result.as_dict(), "applicability": fit})
    else:
        r = result
        print(f"imported {_many(r.entries_written, 'entry', 'entries')} from {args.path}")
        print(f"{fit['apply']} of {_many(fit['entries'], 'entry', 'entries')} apply here")
        for why, count in sorted(fit["reasons"].items()):
            print(f"  {count} do not: {why}")
        for why in r.entries_invalid:
            print(f"skipped an invalid entry: {why}")
        if r.entries_present:
            print(
                f"skipped {_many(r.entries_present, 'entry', 'entries')} already present "
                "(use --overwrite to replace them)"
            )
        print(f"imported {_many(r.blacklist_written, 'blacklist record', 'blacklist records')}")
        if r.blacklist_present:
            print(
                f"skipped {_many(r.blacklist_present, 'blacklist record', 'blacklist records')} "
                "already present (use --overwrite to replace them)"
            )
        if r.blacklist_protected:
            print(
                "refused the blacklist records of "
                f"{', '.join(sorted(set(r.blacklist_protected)))}: the built-in fallback "
                "cannot be blacklisted by an archive"
            )
    if lost:
        print(
            f"import failed: {_many(lost, 'record', 'records')} could not be written to the cache "
            "(see the warning above) and are lost when this command ends",
            file=sys.stderr,
        )
        return 1
    return 0


# -- verify -----------------------------------------------------------------------------------
# The problem kinds a deployment meets: plain NVFP4, trtllm-shuffled weights, MXFP4, fp16
# output, per-token alpha. M buckets span decode to prefill, and include 3072, where one
# release's backends returned zeros on one GPU.
VERIFY_KINDS = (
    {},
    {"b_layout": "trtllm"},
    {"use_nvfp4": False, "block_size": 32, "alpha_kind": "none"},
    {"out_dtype": "float16"},
    {"alpha_kind": "per_token"},
)
VERIFY_BUCKETS = (1, 16, 256, 3072)


def verify_problems(shapes: Sequence[tuple[int, int]], buckets: Sequence[int]) -> list[Problem]:
    return [
        Problem(n=n, k=k, m_bucket=m_bucket(m), **kind)
        for n, k in shapes
        for kind in VERIFY_KINDS
        for m in buckets
    ]


def cmd_verify(args: argparse.Namespace) -> int:
    """Tune a spread of problems in a scratch cache and say, per backend, what held up."""
    import tempfile

    from fp4select.api import configure, selector

    device = _device(args.device)
    problems = verify_problems(args.shape or [(4096, 4096)], args.m or VERIFY_BUCKETS)
    with tempfile.TemporaryDirectory() as scratch:
        configure(cache_dir=args.cache_dir or scratch)
        sel = selector()
        decisions = [sel.decide(problem, device) for problem in problems]
        sel.close()
    summary: dict[str, dict[str, Any]] = {}
    for decision in decisions:
        for name, verdict in decision.verdicts.items():
            row = summary.setdefault(
                name,
                {"statuses": {}, "worst_ratio": 0.0, "wins": 0, "first_failure": "", "tactics": []},
            )
            record = verdict.detail.get("tactic")
            if verdict.passed and isinstance(record, Mapping):  # tuned vs default, per problem
                tuned = decision.timings.get(name)
                default = verdict.detail.get("default_timing") or {}
                row["tactics"].append(
                    {
                        "problem": decision.problem.describe(),
                        "tactic": record.get("tactic"),
                        "untuned_reason": record.get("reason"),
                        "tuned_us": tuned.median_us if tuned else None,
                        "default_us": default.get("median_us"),
                    }
                )
            row["statuses"][verdict.status] = row["statuses"].get(verdict.status, 0) + 1
            if verdict.worst_ratio is not None:
                row["worst_ratio"] = max(row["worst_ratio"], verdict.worst_ratio)
            if (
                verdict.status in ("wrong", "error", "crash", "hang", "cuda-error", "oom")
                and not row["first_failure"]
            ):
                row["first_failure"] = (
                    f"{decision.problem.describe()}: {verdict.status} {verdict.reason}"[:160]
                )
        if decision.winner:
            summary[decision.winner]["wins"] += 1
    failed = [n for n, r in summary.items() if r["first_failure"]]
    report = {
        "environment": environment_for(device),
        "problems": len(problems),
        "undecided": [d.problem.describe() for d in decisions if d.winner is None],
        "backends": summary,
        "failed": failed,
    }
    if args.json:
        _print_json(report)
    else:
        rows = [
            [
                name,
                r["wins"],
                ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items())),
                f"{r['worst_ratio']:.2f}",
                _tactics_cell(r["tactics"]),
                r["first_failure"],
            ]
            for name, r in summary.items()
        ]
        print(
            _table(
                rows,
                [
                    "backend",
                    "wins",
                    "verdicts",
                    "worst/bound",
                    "tuned (default/tuned)",
                    "first failure",
                ],
            )
        )
        print(
            f"{len(problems)} problems on {environment_for(device).get('gpu') or 'cpu'}; "
            + (
                f"backends that failed somewhere: {', '.join(failed)}"
                if failed
                else "no backend failed"
            )
        )
    return 1 if failed or report["undecided"] else 0


def _tactics_cell(tactics: Sequence[Mapping[str, Any]]) -> str:
    """How many problems ran at a tuned tactic, and the range of default/tuned time ratios."""
    if not tactics:
        return "-"
    tuned = [t for t in tactics if t["tactic"] is not None]
    ratios = [t["default_us"] / t["tuned_us"] for t in tuned if t["default_us"] and t["tuned_us"]]
    cell = f"{len(tuned)}/{len(tactics)}"
    if ratios:
        cell += f" ({min(ratios):.2f}x-{max(ratios):.2f}x)"
    return cell


def cmd_clear(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    env = None if args.all else environment_for(_device(args.device))
    result = selector().store.clear(env)
    if args.json:
        _print_json(result.as_dict())
    else:
        print(
            f"removed {_many(result.entries, 'entry', 'entries')} and "
            f"{_many(result.blacklist, 'blacklist record', 'blacklist records')}"
        )
    for path in result.not_removed:
        print(f"not removed: {path} (see the warning above)", file=sys.stderr)
    return 1 if result.not_removed else 0


def _problem_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("nvfp4", "mxfp4"), default="nvfp4")
    p.add_argument("--out-dtype", choices=sorted(OUT_DTYPES), default="bfloat16")
    p.add_argument("--a-sf-layout", choices=A_SF_LAYOUTS, default="128x4")
    p.add_argument("--b-layout", choices=B_LAYOUTS, default="plain")
    p.add_argument("--alpha", choices=ALPHA_KINDS, default="scalar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4select", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"fp4select {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, fn, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(fn=fn)
        return p

    p = command(
        "doctor",
        cmd_doctor,
        "print the machine, versions and every backend with why it can or cannot run",
    )
    p.add_argument(
        "--cc",
        type=_compute_capability,
        help="ask about another compute capability (e.g. 100 for B200, 120 for RTX PRO 6000)",
    )
    p = command("warm", cmd_warm, "tune and store decisions for a model's shapes before serving")
    p.add_argument(
        "--shape",
        action="append",
        type=_parse_shape,
        metavar="N,K",
        help="a weight shape; repeatable",
    )
    p.add_argument(
        "--shapes-file", action="append", metavar="JSON", help='{"shapes": [[N, K], ...]}'
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="a Hugging Face model folder or its config.json: tune its FP4 linear layers",
    )
    p.add_argument(
        "--tp", type=_positive_int, default=1, help="tensor-parallel degree for --model (default 1)"
    )
    p.add_argument(
        "--from-record",
        metavar="FILE",
        help="tune exactly the problem keys a run recorded with FP4SELECT_RECORD=FILE",
    )
    p.add_argument(
        "--devices",
        metavar="all|0,1,...",
        help="tune on these GPUs (of one kind) in parallel, one worker each",
    )
    p.add_argument(
        "--export", metavar="FILE", help="afterwards, write this environment's decisions to FILE"
    )
    p.add_argument("--dry-run", action="store_true", help="print the layers and keys; tune nothing")
    p.add_argument(
        "--max-m",
        type=_positive_int,
        default=8192,
        help="largest batch (tokens) to cover (default 8192)",
    )
    p.add_argument("--quiet", action="store_true")
    _problem_options(p)
    p.set_defaults(format=None)  # --model brings its own format; nvfp4 otherwise
    p = command("show", cmd_show, "list stored decisions")
    p.add_argument("--all", action="store_true", help="every environment, not just this machine's")
    p = command(
        "explain",
        cmd_explain,
        "show the decision for one problem: verdicts, timings, winner, margin",
    )
    p.add_argument("--n", type=_positive_int, required=True, help="output features (N)")
    p.add_argument("--k", type=_positive_int, required=True, help="input features (K)")
    p.add_argument("--m", type=_positive_int, required=True, help="tokens in the batch (M)")
    p.add_argument("--tune", action="store_true", help="tune now if there is no decision")
    _problem_options(p)
    p = command(
        "blacklist", cmd_blacklist, "list (or clear) backends blacklisted in this environment"
    )
    p.add_argument(
        "--clear", nargs="?", const="", metavar="BACKEND", help="clear one backend, or all"
    )
    p = command(
        "export",
        cmd_export,
        "write this environment's decisions to one new JSON file (never onto a directory)",
    )
    p.add_argument("path")
    p.add_argument("--all", action="store_true", help="every environment")
    p.add_argument("--force", action="store_true", help="replace an existing file at PATH")
    p = command("import", cmd_import, "read decisions from an exported JSON file")
    p.add_argument("path")
    p.add_argument(
        "--overwrite", action="store_true", help="replace entries and records already present"
    )
    p = command(
        "verify",
        cmd_verify,
        "probe every backend on a spread of problems (formats, layouts, M from 1 to 3072) "
        "in a scratch cache and report what held up; exit 1 if any backend failed",
    )
    p.add_argument(
        "--shape", action="append", type=_parse_shape, metavar="N,K", help="default 4096,4096"
    )
    p.add_argument(
        "--m", action="append", type=int, metavar="M", help="batch sizes (default 1, 16, 256, 3072)"
    )
    p.add_argument("--cache-dir", help="keep the decisions here instead of a scratch directory")
    p = command("clear", cmd_clear, "delete stored decisions and blacklist of this environment")
    p.add_argument("--all", action="store_true", help="every environment")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. User mistakes print one line and exit 2; failures the user can act on
    (a missing file, a full disk) one line and exit 1; a closed pipe (``| head``) ends quietly.
    Anything else is a bug in fp4select and keeps its traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except UsageError as exc:
        print(f"fp4select {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader is gone: stop writing, and keep Python from complaining at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"fp4select {args.command}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
