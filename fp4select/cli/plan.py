"""Which keys ``warm`` tunes: from ``--shape``, ``--shapes-file``, ``--model``, ``--from-record``.

Design rules: a plan is data (the problems, deduplicated in first-seen order, plus the model
table and record counts for ``--dry-run``); everything read from a file is checked before it
is used, and a bad input raises ``WarmUsageError`` naming the argument (``warm`` prints it as
one line and exits 2). Nothing is tuned here.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fp4select.cli._common import UsageError
from fp4select.keys import Problem, shape_problems

__all__ = ["WarmUsageError", "check_shape", "shapes_file", "warm_plan"]


class WarmUsageError(UsageError):
    """Bad warm input: printed as ``fp4select warm: <message>``, exit status 2."""


def check_shape(n: int, k: int, fmt: str) -> None:
    """Refuse a shape no FP4 GEMM of ``fmt`` can have (``warm`` and ``explain`` alike)."""
    block = 16 if fmt == "nvfp4" else 32
    if k % block:
        raise WarmUsageError(
            f"shape {n},{k}: K must be a multiple of {block} for {fmt} (one block scale "
            f"per {block} values of K)"
        )


def shapes_file(path: str) -> list[tuple[int, int]]:
    """``{"shapes": [[N, K], ...]}``, a bare list, or objects with n and k; checked."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise WarmUsageError(f"--shapes-file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise WarmUsageError(f"--shapes-file {path}: not JSON ({exc})") from None
    items = data.get("shapes") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise WarmUsageError(f'--shapes-file {path}: expected {{"shapes": [[N, K], ...]}}')
    shapes = []
    for i, item in enumerate(items):
        pair = (item.get("n"), item.get("k")) if isinstance(item, dict) else item
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair)
        ):
            raise WarmUsageError(
                f"--shapes-file {path}: shapes[{i}] must be [N, K] with positive integers, "
                f"got {item!r}"
            )
        shapes.append((pair[0], pair[1]))
    return shapes


def warm_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The plan of every key warm will tune (its fields are in the module's rules)."""
    from fp4select.model_shapes import ModelConfigError, shapes_from_path
    from fp4select.record import read_record

    plan: dict[str, Any] = {"model": None, "record": None}
    shapes = list(args.shape or [])
    for path in args.shapes_file or []:
        shapes += shapes_file(path)
    fmt = args.format or "nvfp4"
    for n, k in shapes:
        check_shape(n, k, fmt)
    problems: list[Problem] = []
    fields = {
        "out_dtype": args.out_dtype,
        "a_sf_layout": args.a_sf_layout,
        "b_layout": args.b_layout,
        "alpha_kind": args.alpha,
    }
    if args.model:
        try:
            model = shapes_from_path(args.model, tp=args.tp)
        except ModelConfigError as exc:
            raise WarmUsageError(f"--model {args.model}: {exc}") from None
        if args.format and args.format != model.format:
            raise WarmUsageError(
                f"--format {args.format} contradicts the model's FP4 layers ({model.format})"
            )
        plan["model"] = model
        problems += model.problems(args.max_m, **fields)
    problems += shape_problems(shapes, args.max_m, fmt, **fields)
    if args.from_record:
        try:
            counts = read_record(args.from_record)
        except OSError as exc:
            raise WarmUsageError(f"--from-record: {exc}") from None
        plan["record"] = counts
        problems += list(counts)
    if not (args.shape or args.shapes_file or args.model or args.from_record):
        raise WarmUsageError("give --shape N,K, --shapes-file, --model PATH or --from-record FILE")
    plan["problems"] = list(dict.fromkeys(problems))
    return plan
