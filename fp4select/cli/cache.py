"""The commands that read or change the store: show, blacklist, export, import, clear."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from fp4select.cli._common import failed, many, os_error, parse_device, print_json, table
from fp4select.keys import environment_for

__all__ = ["cmd_blacklist", "cmd_clear", "cmd_export", "cmd_import", "cmd_show"]


def cmd_show(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    store = selector().store
    env = None if args.all else environment_for(parse_device(args.device))
    items = [{"env": e, "key": k, "record": r} for e, k, r in store.iter_entries(env)]
    if args.json:
        print_json(items)
        return 0
    from fp4select.records import Decision, MalformedRecord

    keyed: list[tuple[tuple[Any, ...], list[Any]]] = []  # (sort key, row): by N, K, M
    for item in items:
        e = item["env"]
        gpu = e.get("gpu") if isinstance(e.get("gpu"), str) else "cpu"
        try:  # a record is data from disk: checked field by field before it is printed
            decision = Decision.from_json(item["record"], source="disk")
        except MalformedRecord as exc:
            keyed.append(((1 << 62,), [gpu, str(item["key"])[:60], "INVALID", "-", f"{exc}"[:60]]))
            continue
        margin = (decision.ranking or {}).get("margin")
        p = decision.problem
        row = [gpu, p.describe(), decision.winner, "-" if margin is None else f"{margin:+.1%}"]
        keyed.append(((p.n, p.k, p.m_bucket, p.describe()), [*row, decision.created]))
    rows = [row for _, row in sorted(keyed, key=lambda r: r[0])]
    print(table(rows, ["gpu", "problem", "winner", "margin", "created"]) if rows else "no entries")
    return 0


def cmd_blacklist(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    store = selector().store
    env = environment_for(parse_device(args.device))
    if args.clear is not None:
        name = args.clear or None
        removed = store.remove_from_blacklist(env, name)
        if name is not None and not removed:
            listed = ", ".join(sorted(store.blacklist(env))) or "none"
            return failed(
                f"fp4select blacklist: {name} is not blacklisted here, nothing cleared "
                f"(blacklisted here: {listed})"
            )
        print(f"removed {many(removed, 'blacklist entry', 'blacklist entries')}")
        return 0
    bl = store.blacklist(env)
    if args.json:
        print_json(bl)
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
        print(table(rows, ["backend", "kind", "when", "scope", "reason"]))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    env = None if args.all else environment_for(parse_device(args.device))
    folder = os.path.dirname(os.path.abspath(args.path))
    if not os.path.isdir(folder):
        return failed(f"export failed: {folder}: no such directory")
    try:
        result = selector().store.export_archive(args.path, env, overwrite=args.overwrite)
    except FileExistsError:
        return failed(f"export failed: {args.path} already exists; add --overwrite to replace it")
    except OSError as exc:  # a directory, a failing disk
        return failed(f"export failed: {os_error(exc)}")
    if args.json:
        print_json({"path": args.path, **result.as_dict()})
    else:
        print(
            f"exported {many(result.entries, 'entry', 'entries')} and "
            f"{many(result.blacklist, 'blacklist record', 'blacklist records')} to {args.path}"
        )
    return 0


def _entry_problem(key: dict[str, Any], record: dict[str, Any]) -> str | None:
    """Why an archived decision must not be imported: it is data from another machine."""
    from fp4select.records import Decision, MalformedRecord

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
        return failed(f"import failed: {os_error(exc)}")
    except ValueError as exc:
        return failed(f"import failed: {exc}")
    from fp4select import bundle

    fit = bundle.applicability(args.path, environment_for(parse_device(args.device)))
    lost = result.entries_in_memory + result.blacklist_in_memory
    if args.json:
        print_json({"path": args.path, **result.as_dict(), "applicability": fit})
    else:
        r = result
        print(f"imported {many(r.entries_written, 'entry', 'entries')} from {args.path}")
        print(f"{fit['apply']} of {many(fit['entries'], 'entry', 'entries')} apply here")
        for why, count in sorted(fit["reasons"].items()):
            print(f"  {count} do not: {why}")
        for why in r.entries_invalid:
            print(f"skipped an invalid entry: {why}")
        if r.entries_present:
            print(
                f"skipped {many(r.entries_present, 'entry', 'entries')} already present "
                "(use --overwrite to replace them)"
            )
        print(f"imported {many(r.blacklist_written, 'blacklist record', 'blacklist records')}")
        if r.blacklist_present:
            print(
                f"skipped {many(r.blacklist_present, 'blacklist record', 'blacklist records')} "
                "already present (use --overwrite to replace them)"
            )
        if r.blacklist_protected:
            print(
                "refused the blacklist records of "
                f"{', '.join(sorted(set(r.blacklist_protected)))}: the built-in fallback "
                "cannot be blacklisted by an archive"
            )
    if lost:
        return failed(
            f"import failed: {many(lost, 'record', 'records')} could not be written to the cache "
            "(see the warning above) and are lost when this command ends"
        )
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    from fp4select.api import selector

    env = None if args.all else environment_for(parse_device(args.device))
    result = selector().store.clear(env)
    if args.json:
        print_json(result.as_dict())
    else:
        print(
            f"removed {many(result.entries, 'entry', 'entries')} and "
            f"{many(result.blacklist, 'blacklist record', 'blacklist records')}"
        )
    for path in result.not_removed:
        print(f"not removed: {path} (see the warning above)", file=sys.stderr)
    return 1 if result.not_removed else 0
