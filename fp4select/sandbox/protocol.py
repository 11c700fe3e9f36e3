"""The sandbox protocol, parent side: what a worker's event stream may say, checked.

The child half is ``worker.py``; the prober that acts on the events is ``prober.py``.

Design rules:

* Only JSON crosses, one object a line: the problem, the options, backend names, and for
  backends registered at runtime their importable ``module:qualname`` spec.
* Nothing the child says is trusted before it is checked. Every request carries a fresh id and
  every event must echo it; every event's shape is checked here (kinds, names from this request,
  statuses the child may give, finite numbers, a ``passed`` verdict only after that backend's
  ``out=`` step ran). A check returns why an event cannot belong to its request, or None; the
  prober decides what that costs (see ``prober.py``).
* A line over ``MAX_LINE_BYTES`` is garbage, not an event: reading it raises ``OutOfStep``.
* Lines that are not JSON objects are not events (``parse`` returns None): a backend's stray
  output, which the prober keeps as detail.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from fp4select.records import Status, Timing, Verdict, is_int, is_number

__all__ = ["CHILD_STATUSES", "MAX_LINE_BYTES", "OutOfStep", "Stream", "parse"]

# A real event is a few KB (tracebacks and stderr tails are cut); a longer line is garbage.
MAX_LINE_BYTES = 8 << 20

# The statuses a child may report; crash and hang are the parent's to give.
CHILD_STATUSES = frozenset(
    {Status.PASSED, Status.WRONG, Status.ERROR, Status.UNSUPPORTED, Status.OOM, Status.CUDA_ERROR}
)
# Exactly what a child's ``Verdict.to_json`` holds: a child never gives a ``cause`` (only the
# parent's candidate filter does), and an empty one is left out.
_VERDICT_KEYS = frozenset(f.name for f in dataclasses.fields(Verdict)) - {"cause"}
_TIMING_KEYS = frozenset(f.name for f in dataclasses.fields(Timing))
_RESULT_KEYS = frozenset({"verdicts", "timings", "method", "seconds", "aborted"})
# The last step of validation: a "passed" verdict for a backend that never reached it is forged.
_LAST_VALIDATION_PHASE = "out="


class OutOfStep(Exception):
    """The worker's stream cannot be trusted any more."""


def _verdict_error(data: Any, names: Iterable[str], finished: set[str]) -> str | None:
    if not isinstance(data, dict):
        return f"a verdict must be an object, got {type(data).__name__}"
    if set(data) != _VERDICT_KEYS:
        return f"a verdict has the fields {sorted(_VERDICT_KEYS)}, got {sorted(data)}"
    name = data["backend"]
    if not isinstance(name, str) or name not in names:
        return f"a verdict for {name!r}, which this request did not name"
    if not isinstance(data["status"], str) or data["status"] not in CHILD_STATUSES:
        return f"status {data['status']!r} is not one a child may give"
    if not isinstance(data["reason"], str):
        return "a verdict's reason must be a string"
    if data["m"] is not None and not is_int(data["m"]):
        return f"a verdict's m must be null or a count, got {data['m']!r}"
    ratio = data["worst_ratio"]
    if ratio is not None and not is_number(ratio):
        return f"a verdict's worst_ratio must be null or a finite number >= 0, got {ratio!r}"
    if data["deterministic"] not in (None, True, False):
        return "a verdict's deterministic must be null or a boolean"
    if not isinstance(data["detail"], dict):
        return "a verdict's detail must be an object"
    if data["status"] == Status.PASSED and name not in finished:
        return f"a passed verdict for {name!r} before its {_LAST_VALIDATION_PHASE} step ran"
    return None


def _timing_error(name: str, data: Any) -> str | None:
    if not isinstance(data, dict) or set(data) != _TIMING_KEYS:
        return f"the timing of {name!r} is not a timing"
    numbers = ("median_us", "p10_us", "p90_us")
    if not all(is_number(data[k]) for k in numbers):
        return f"the timing of {name!r} has a number that is not finite and >= 0"
    if not all(is_int(data[k], 1) for k in ("samples", "calls_per_sample")):
        return f"the timing of {name!r} has a count that is not a positive int"
    if not isinstance(data["method"], str):
        return f"the timing of {name!r} has no method"
    return None


def _result_error(data: Any, names: frozenset[str], finished: set[str]) -> str | None:
    if not isinstance(data, dict) or set(data) != _RESULT_KEYS:
        return f"a result has the fields {sorted(_RESULT_KEYS)}"
    verdicts, timings = data["verdicts"], data["timings"]
    if not isinstance(verdicts, dict) or not isinstance(timings, dict):
        return "a result's verdicts and timings must be objects"
    if not isinstance(data["aborted"], bool) or not isinstance(data["method"], str):
        return "a result's aborted must be a boolean and its method a string"
    if not is_number(data["seconds"]):
        return "a result's seconds must be a finite number >= 0"
    for name, verdict in verdicts.items():
        problem = _verdict_error(verdict, names, finished)
        if problem is not None:
            return problem
        if verdict["backend"] != name:
            return f"the result files {verdict['backend']!r}'s verdict under {name!r}"
    if not data["aborted"] and set(verdicts) != names:
        return f"a result without verdicts for {sorted(names - set(verdicts))}"
    for name, timing in timings.items():
        if name not in verdicts or verdicts[name]["status"] != Status.PASSED:
            return f"a timing for {name!r}, which did not pass"
        problem = _timing_error(name, timing)
        if problem is not None:
            return problem
    return None


class Stream:
    """What one request's events may say, given what its earlier events said."""

    def __init__(self, request_id: str, names: Iterable[str]) -> None:
        self.request_id = request_id
        self.names = frozenset(names)
        self.finished: set[str] = set()  # backends whose last validation step was announced

    def error(self, event: Mapping[str, Any]) -> str | None:
        """Why this event cannot belong to this request; None when it can."""
        kind = event.get("event")
        if event.get("id") != self.request_id:
            return f"a {kind!r} event for request {event.get('id')!r}, not {self.request_id!r}"
        if kind == "run":
            name, phase, m = event.get("backend"), event.get("phase"), event.get("m")
            if name is not None and name not in self.names:
                return f"a run of {name!r}, which this request did not name"
            if not isinstance(phase, str) or len(phase) > 40:
                return f"a run event's phase must be a short string, got {phase!r}"
            if m is not None and not is_int(m):
                return f"a run event's m must be null or a count, got {m!r}"
            if phase == _LAST_VALIDATION_PHASE and name is not None:
                self.finished.add(name)
            return None
        if kind == "verdict":
            return _verdict_error(event.get("verdict"), self.names, self.finished)
        if kind == "result":
            return _result_error(event.get("result"), self.names, self.finished)
        if kind == "error":
            message = event.get("message")
            return None if isinstance(message, str) else "an error event without a message"
        return f"an event of unknown kind {kind!r}"


def parse(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None
