"""What every command shares: argument types, the device, JSON and table output, a progress bar.

Design rules: a mistake in what the user typed raises ``UsageError`` (or argparse's own
``ArgumentTypeError``): one line on stderr, exit status 2. Output goes to stdout (tables or
``--json``); anything else a command says while it works (warnings, progress) goes to stderr,
so that ``--json`` output is clean JSON whatever else happens.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from fp4select.keys import resolve_device

__all__ = [
    "UsageError",
    "compute_capability",
    "failed",
    "many",
    "os_error",
    "parse_device",
    "parse_shape",
    "positive_int",
    "print_json",
    "progress_bar",
    "table",
]


class UsageError(Exception):
    """A mistake in what the user typed: one line on stderr, exit status 2."""


def parse_device(arg: str | None) -> torch.device:
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
    return resolve_device()


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines)


def parse_shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(x) for x in text.lower().replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape must be N,K (two integers), got {text!r}"
        ) from None
    if n < 1 or k < 1:
        raise argparse.ArgumentTypeError(f"shape must be positive, got {text!r}")
    return n, k


def compute_capability(text: str) -> int:
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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def failed(message: str, status: int = 1) -> int:
    """Say ``message`` on stderr (stdout stays clean for ``--json``); returns ``status``."""
    print(message, file=sys.stderr)
    return status


def many(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def os_error(exc: OSError) -> str:
    return f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)


def progress_bar(total: int, desc: str, unit: str, off: bool) -> Any:
    """A tqdm bar on stderr for a long command, or None where there is none to show.

    None when ``off`` (``--json``, ``--quiet``) or when tqdm is missing (it comes with
    flashinfer, it is not one of our dependencies); tqdm itself stays silent when stderr is
    not a terminal (``disable=None``), so a log file or a pipe never collects bar redraws.
    """
    if off:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, disable=None, file=sys.stderr)
