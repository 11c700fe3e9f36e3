"""The command line: doctor, warm, show, explain, blacklist, export/import, clear.

Design rules: every command reads the same store and registry the library uses (nothing is
re-implemented here); every command that prints a table also takes ``--json`` for scripts;
exit status 0 means the command did what it said, 1 that it could not, 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
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


def _device(arg: str | None) -> torch.device:
    if arg:
        return torch.device(arg)
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
        "flashinfer": {"listed_backends": listed, "problem": why},
        "backends": rows,
        "source_errors": registry.source_errors,
        "cache": {
            "root": str(sel.store.root),
            "memory_only": sel.store.memory_only,
            "isolation": sel.isolation,
        },
        "blacklist": blacklist,
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


def _buckets(max_m: int) -> list[int]:
    top = m_bucket(max_m)
    return [b for b in M_BUCKETS if b <= top]


def _problems(args: argparse.Namespace) -> list[Problem]:
    shapes = list(args.shape or [])
    for path in args.shapes_file or []:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        for item in data.get("shapes", data) if isinstance(data, dict) else data:
            shapes.append(
                (int(item[0]), int(item[1]))
                if isinstance(item, list)
                else (int(item["n"]), int(item["k"]))
            )
    if not shapes:
        raise SystemExit("warm: give at least one --shape N,K or --shapes-file")
    use_nvfp4 = args.format == "nvfp4"
    problems = []
    for n, k in shapes:
        for bucket in _buckets(args.max_m):
            problems.append(
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
            )
    return problems


def cmd_warm(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    device = _device(args.device)
    problems = _problems(args)
    sel = selector()
    try:
        from tqdm import tqdm

        progress = tqdm(
            problems, desc="fp4select warm", unit="key", disable=args.quiet or args.json
        )
    except ImportError:  # tqdm comes with flashinfer; without it, plain lines
        progress = problems
    results = []
    failures = 0
    for problem in progress:
        decision = sel.decide(problem, device)
        if decision.winner is None:
            failures += 1
        results.append(
            {
                "problem": problem.describe(),
                "winner": decision.winner,
                "source": decision.source,
                "seconds": round(decision.tuning_seconds, 3),
            }
        )
        if not args.json and progress is problems and not args.quiet:
            print(f"{problem.describe()}: {decision.winner} ({decision.source})")
    if args.json:
        _print_json({"results": results, "stats": sel.counters.as_dict()})
    else:
        rows = [[r["problem"], r["winner"] or "NONE", r["source"], r["seconds"]] for r in results]
        print(_table(rows, ["problem", "winner", "source", "tuning s"]))
    return 1 if failures else 0


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
    rows = []
    for item in items:
        rec, e = item["record"], item["env"]
        try:
            desc = Problem.from_json(item["key"]).describe()
        except Exception:
            desc = str(item["key"])
        margin = (rec.get("ranking") or {}).get("margin")
        rows.append(
            [
                e.get("gpu") or "cpu",
                desc,
                rec.get("winner"),
                "-" if margin is None else f"{margin:+.1%}",
                rec.get("created", ""),
            ]
        )
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


def cmd_export(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    env = None if args.all else environment_for(_device(args.device))
    count = selector().store.export_archive(args.path, env)
    print(f"exported {count} entries to {args.path}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    try:
        count = selector().store.import_archive(args.path, overwrite=args.overwrite)
    except (OSError, ValueError) as exc:
        print(f"import failed: {exc}", file=sys.stderr)
        return 1
    print(f"imported {count} entries from {args.path}")
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
    count = selector().store.clear(env)
    print(f"removed {count} files")
    return 0


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
        "--cc", type=int, help="ask about another compute capability (e.g. 100 for B200)"
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
        "--max-m", type=int, default=8192, help="largest batch (tokens) to cover (default 8192)"
    )
    p.add_argument("--quiet", action="store_true")
    _problem_options(p)
    p = command("show", cmd_show, "list stored decisions")
    p.add_argument("--all", action="store_true", help="every environment, not just this machine's")
    p = command(
        "explain",
        cmd_explain,
        "show the decision for one problem: verdicts, timings, winner, margin",
    )
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--m", type=int, required=True)
    p.add_argument("--tune", action="store_true", help="tune now if there is no decision")
    _problem_options(p)
    p = command(
        "blacklist", cmd_blacklist, "list (or clear) backends blacklisted in this environment"
    )
    p.add_argument(
        "--clear", nargs="?", const="", metavar="BACKEND", help="clear one backend, or all"
    )
    p = command("export", cmd_export, "write this environment's decisions to one JSON file")
    p.add_argument("path")
    p.add_argument("--all", action="store_true", help="every environment")
    p = command("import", cmd_import, "read decisions from an exported JSON file")
    p.add_argument("path")
    p.add_argument("--overwrite", action="store_true")
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
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
