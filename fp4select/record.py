"""Recorded shapes: the problem keys a real run met, so a later ``warm`` tunes exactly those.

``FP4SELECT_RECORD=FILE`` makes every process append one line per problem key it meets for the
first time; ``fp4select warm --from-record FILE`` reads the file back.

Design rules:

* Never on the warm path. ``note`` is called from the miss path only (the first call of a
  call signature, which already checks arguments and looks the decision up); inside it a key
  this process has recorded costs one set lookup. A fork child starts its own set.
* Safe from many processes without a lock: each line is written with one ``write()`` on a
  descriptor opened with ``O_APPEND``, so the kernel places every line whole at the end of
  the file (local file systems; over NFS use one file per host). A line is small (~300 bytes).
* Reading holds at most one line of ``_MAX_LINE`` bytes: a longer line is skipped (as
  damaged) while it is read past in bounded pieces, so a 3 GB line costs no memory. Its key
  must be one a call could have made (``Problem`` refuses the rest: N = 10**30, block size 7).
* A line is one JSON object ``{"fp4select_record": 1, "key": {...}, "pid": ..., "host": ...,
  "time": ...}``. The count of a key is the number of lines naming it: how many processes met
  it. Reading skips a damaged line (a torn tail after a crash, a foreign line) with one warning
  that says how many were skipped and the first line number; it never fails the warm.
* Never write into a file fp4select did not make: a non-empty file whose first line is not a
  record line disables recording with one warning, and so does a symbolic link at the path
  (``O_NOFOLLOW``: a dangling one would otherwise create its target wherever it points). Any
  error while recording (permissions, a full disk) disables it with one warning: recording
  must never break a GEMM call.
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import socket
import stat
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fp4select import settings
from fp4select.keys import Problem
from fp4select.store import SCHEMA_VERSION

__all__ = ["RECORD_ENV", "RecordWarning", "note", "read_record", "record_line"]

RECORD_ENV = "FP4SELECT_RECORD"  # read by fp4select.settings; named in warnings
FORMAT_VERSION = 1
_TAG = "fp4select_record"
_MAX_LINE = 64 << 10


class RecordWarning(UserWarning):
    """The record file could not be written or read in part; fp4select carries on."""


_lock = threading.Lock()
_state: dict[str, Any] = {"pid": None, "seen": set(), "disabled": None}


def record_line(problem: Problem) -> bytes:
    """The bytes appended for one first sighting of ``problem`` (one JSON line)."""
    line = {
        _TAG: FORMAT_VERSION,
        "key": problem.to_json(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return (json.dumps(line, sort_keys=True, separators=(",", ":")) + "\n").encode("ascii")


def _open_regular(path: str | os.PathLike[str], flags: int, follow: bool = True) -> int:
    """A descriptor for ``path`` only if it is a regular file: a FIFO would block the caller's
    first GEMM (or the CLI) forever, and a device would be read or written without end.
    ``follow=False``: a symbolic link at ``path`` is refused (``O_NOFOLLOW``), dangling or not."""
    flags |= os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if not follow and exc.errno == errno.ELOOP:
            why = "is a symbolic link (not followed)"
            raise OSError(errno.ELOOP, why, os.fsdecode(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", os.fsdecode(path))
    return fd


def _foreign(path: str) -> str | None:
    """Why ``path`` must not be appended to, or None when it is empty or a record file."""
    try:
        with os.fdopen(_open_regular(path, os.O_RDONLY, follow=False), "rb") as fh:
            first = fh.readline(_MAX_LINE)
    except FileNotFoundError:
        return None
    if not first:
        return None
    try:
        obj = json.loads(first)
    except ValueError:
        obj = None
    if not isinstance(obj, dict) or _TAG not in obj:
        return f"{path} exists and is not an fp4select record file; not writing into it"
    return None


def _disable(why: str) -> None:
    _state["disabled"] = why
    warnings.warn(f"{RECORD_ENV}: recording is off for this process: {why}", RecordWarning, 2)


def note(problem: Problem) -> None:
    """Append ``problem`` to ``$FP4SELECT_RECORD`` the first time this process meets it.

    Called by the miss path of ``best_mm_fp4``; does nothing when the ``record`` setting
    (``FP4SELECT_RECORD``, or ``configure(record=...)``) is unset.
    """
    path = settings.current().record
    if not path:
        return
    with _lock:
        pid = os.getpid()
        if _state["pid"] != pid:  # first call, or a fork child: its own sightings
            _state.update(pid=pid, seen=set(), disabled=None)
            try:
                why = _foreign(path)
            except OSError as exc:
                why = f"cannot read {path}: {exc}"
            if why:
                _disable(why)
        if _state["disabled"] or problem in _state["seen"]:
            return
        _state["seen"].add(problem)
        try:
            fd = _open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, follow=False)
            try:
                data = record_line(problem)
                if os.write(fd, data) != len(data):  # a short write to a regular file: disk full
                    raise OSError(f"short write to {path}")
            finally:
                os.close(fd)
        except OSError as exc:
            _disable(f"cannot append to {path}: {exc}")


def _parse(line: bytes) -> Problem:
    obj = json.loads(line)
    if not isinstance(obj, dict) or obj.get(_TAG) != FORMAT_VERSION:
        raise ValueError("not a version-1 record line")
    key = obj.get("key")
    if not isinstance(key, Mapping) or key.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"key is not a schema-{SCHEMA_VERSION} problem key")
    if not isinstance(key.get("use_nvfp4"), bool):
        raise ValueError("use_nvfp4 must be true or false")
    return Problem.from_json(dict(key))


def _bounded_lines(fh: Any) -> Any:
    """Each line of ``fh`` (bytes), or None for one longer than ``_MAX_LINE`` (read past in
    pieces of that size, never held whole)."""
    while True:
        line = fh.readline(_MAX_LINE + 1)
        if not line:
            return
        if len(line) <= _MAX_LINE or line.endswith(b"\n"):
            yield line if len(line) <= _MAX_LINE else None
            continue
        while line and not line.endswith(b"\n"):  # the rest of an overlong line
            line = fh.readline(_MAX_LINE)
        yield None


def read_record(path: str | os.PathLike[str]) -> dict[Problem, int]:
    """Every problem key in a record file with how many lines (process sightings) name it.

    Order is first appearance. A damaged line is skipped; all skipped lines share one
    ``RecordWarning``. A missing or unreadable file raises ``OSError`` (the user named it).
    """
    counts: dict[Problem, int] = {}
    skipped: list[int] = []
    with os.fdopen(_open_regular(Path(os.fsdecode(path)), os.O_RDONLY), "rb") as fh:
        for number, line in enumerate(_bounded_lines(fh), start=1):
            if line is not None and not line.strip():
                continue
            try:
                if line is None:
                    raise ValueError(f"longer than {_MAX_LINE} bytes")
                if not line.endswith(b"\n"):
                    raise ValueError("no line end (torn write)")
                problem = _parse(line)
            except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
                skipped.append(number)
                continue
            counts[problem] = counts.get(problem, 0) + 1
    if skipped:
        warnings.warn(
            f"{os.fsdecode(path)}: skipped {len(skipped)} damaged line(s), first at line "
            f"{skipped[0]}",
            RecordWarning,
            2,
        )
    return counts
