"""The command line: doctor, warm, show, explain, verify, blacklist, export/import, clear.

Design rules: every command reads the same store and registry the library uses (nothing is
re-implemented here); every command takes ``--json`` for scripts, and a report is data first
(``fp4select.reports``), printed here; exit status 0 means the command did what it said, 1 that
it could not, 2 a usage error. Every option has help text (a test walks the parser).

This package holds the parser and ``main``; the commands live in ``checks`` (doctor, verify,
native), ``tune`` (warm, explain, with ``plan`` for the keys warm tunes) and ``cache`` (show,
blacklist, export, import, clear); ``_common`` holds what they share.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TextIO

from fp4select._version import __version__
from fp4select.cli._common import UsageError, compute_capability, parse_shape, positive_int
from fp4select.cli.cache import cmd_blacklist, cmd_clear, cmd_export, cmd_import, cmd_show
from fp4select.cli.checks import cmd_doctor, cmd_native, cmd_verify
from fp4select.cli.tune import cmd_explain, cmd_warm
from fp4select.keys import A_SF_LAYOUTS, ALPHA_KINDS, B_LAYOUTS, OUT_DTYPES

__all__ = ["UsageError", "build_parser", "main"]

DESCRIPTION = (
    "Pick the fastest correct FP4 GEMM backend, and inspect its decisions: "
    "doctor, warm, show, explain, verify, blacklist, export/import, native, clear."
)
Command = Callable[[argparse.Namespace], int]


def _shape_option(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--shape", action="append", type=parse_shape, metavar="N,K", help=help_)


def _problem_options(p: argparse.ArgumentParser, format_help: str) -> None:
    """The options that pick the problem's kind beside its shape (they are part of its key)."""
    p.add_argument("--format", choices=("nvfp4", "mxfp4"), default="nvfp4", help=format_help)
    p.add_argument(
        "--out-dtype",
        choices=sorted(OUT_DTYPES),
        default="bfloat16",
        help="output dtype (default bfloat16)",
    )
    p.add_argument(
        "--a-sf-layout",
        choices=A_SF_LAYOUTS,
        default="128x4",
        help="layout of the activations' block scales (default 128x4)",
    )
    p.add_argument(
        "--b-layout",
        choices=B_LAYOUTS,
        default="plain",
        help="layout of the weights: plain, or trtllm-shuffled (default plain)",
    )
    p.add_argument(
        "--alpha",
        choices=ALPHA_KINDS,
        default="scalar",
        help="the global scale: none, one scalar, or one per token (default scalar)",
    )


def _vs_bf16_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--vs-bf16",
        action="store_true",
        help=f"{what} beside the same product with a bfloat16 weight (float16 for float16 "
        "output), side by side in one run, and print the ratio",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4select", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"fp4select {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, fn: Command, help_: str) -> argparse.ArgumentParser:
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
        type=compute_capability,
        help="ask about another compute capability (e.g. 100 for B200, 120 for RTX PRO 6000)",
    )
    p = command("warm", cmd_warm, "tune and store decisions for a model's shapes before serving")
    _shape_option(p, "a weight shape; repeatable")
    p.add_argument(
        "--shapes-file", action="append", metavar="JSON", help='{"shapes": [[N, K], ...]}'
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="a Hugging Face model folder or its config.json: tune its FP4 linear layers",
    )
    p.add_argument(
        "--tp", type=positive_int, default=1, help="tensor-parallel degree for --model (default 1)"
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
        "--compile-jobs",
        type=positive_int,
        metavar="N",
        help="compile the kernels to tune first, in N processes (default: half the CPUs, at "
        "most 4; 1: no compile-ahead, each compiles when first tuned)",
    )
    p.add_argument(
        "--export", metavar="FILE", help="afterwards, write this environment's decisions to FILE"
    )
    p.add_argument("--dry-run", action="store_true", help="print the layers and keys; tune nothing")
    p.add_argument(
        "--max-m",
        type=positive_int,
        default=8192,
        help="largest batch (tokens) to cover (default 8192)",
    )
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar and no line per key; only the table"
    )
    _vs_bf16_option(p, "afterwards, time each key's FP4 GEMM as served")
    _problem_options(p, "FP4 format of --shape keys (default nvfp4; --model brings its own)")
    p.set_defaults(format=None)  # --model brings its own format; nvfp4 otherwise
    p = command("show", cmd_show, "list stored decisions")
    p.add_argument("--all", action="store_true", help="every environment, not just this machine's")
    p = command(
        "explain",
        cmd_explain,
        "show the decision for one problem: verdicts, timings, winner, margin",
    )
    p.add_argument("--n", type=positive_int, required=True, help="output features (N)")
    p.add_argument("--k", type=positive_int, required=True, help="input features (K)")
    p.add_argument("--m", type=positive_int, required=True, help="tokens in the batch (M)")
    p.add_argument("--tune", action="store_true", help="tune now if there is no decision")
    _vs_bf16_option(p, "also time the FP4 GEMM as served")
    _problem_options(p, "FP4 format: nvfp4 (16-value blocks) or mxfp4 (32-value blocks)")
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
    p.add_argument("path", help="the JSON file to write (its folder must exist)")
    p.add_argument("--all", action="store_true", help="every environment")
    p.add_argument(
        "--overwrite",
        "--force",  # the older spelling
        dest="overwrite",
        action="store_true",
        help="replace an existing file at PATH (--force is the older spelling)",
    )
    p = command("import", cmd_import, "read decisions from an exported JSON file")
    p.add_argument("path", help="a JSON file written by fp4select export")
    p.add_argument(
        "--overwrite", action="store_true", help="replace entries and records already present"
    )
    p = command(
        "verify",
        cmd_verify,
        "probe every backend on a spread of problems (formats, layouts, M from 1 to 3072) "
        "in a scratch cache and report what held up; exit 1 if any backend failed",
    )
    _shape_option(p, "a weight shape to verify; repeatable (default 4096,4096)")
    p.add_argument(
        "--m",
        action="append",
        type=positive_int,
        metavar="M",
        help="a batch size (tokens); repeatable (default 1, 16, 256, 3072)",
    )
    p.add_argument("--cache-dir", help="keep the decisions here instead of a scratch directory")
    p = command(
        "native",
        cmd_native,
        "show the warm path's C++ key (built with this machine's compiler) or build it now",
    )
    p.add_argument(
        "--build", action="store_true", help="compile it now if this torch has no build yet"
    )
    p = command("clear", cmd_clear, "delete stored decisions and blacklist of this environment")
    p.add_argument("--all", action="store_true", help="every environment")
    return parser


_LOOKS_NEGATIVE = re.compile(r"-[0-9.]")


def _attach_negative_values(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> list[str]:
    """``--shape -1,1024`` as ``--shape=-1,1024``: argparse takes a value that starts with '-'
    (other than a plain negative number) for an option, and would say "expected one argument"
    instead of what is wrong with the value."""
    args = list(sys.argv[1:] if argv is None else argv)
    takes_value = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                takes_value |= {
                    option
                    for a in sub._actions
                    if a.option_strings and a.nargs is None
                    for option in a.option_strings
                }
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out += args[i:]
            break
        if arg in takes_value and i + 1 < len(args) and _LOOKS_NEGATIVE.match(args[i + 1]):
            out.append(f"{arg}={args[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


@contextmanager
def _plain_warnings() -> Iterator[None]:
    """While a command runs, a warning prints as one plain line on stderr (``warning: ...``),
    not as Python's file path, line number and quoted source line. Only the command line does
    this: the library leaves the warnings module as its host configured it."""
    saved = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        stream = file if file is not None else sys.stderr
        with suppress(OSError, ValueError):  # a closed or gone stderr: say nothing
            stream.write(f"warning: {' '.join(str(message).split())}\n")

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = saved


def _load_settings() -> None:
    """Read the FP4SELECT_* variables now, so that a bad value is one line naming it (exit 2)
    instead of a traceback from wherever a command first needs a setting."""
    from fp4select import settings

    try:
        settings.current()
    except settings.SettingError as exc:  # its message names the variable and what it must be
        raise UsageError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. User mistakes (bad options, a bad FP4SELECT_* variable) print one line
    and exit 2; failures the user can act on (a missing file, a full disk) one line and exit 1;
    a closed pipe (``| head``) ends quietly. Warnings print as one line each. Anything else is
    a bug in fp4select and keeps its traceback."""
    parser = build_parser()
    args = parser.parse_args(_attach_negative_values(parser, argv))
    with _plain_warnings():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        _load_settings()
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
