"""One request to one sandbox worker: send it, read its events, and say what it produced.

``prober.py`` decides what to do with an ``Attempt`` (keep its verdicts, start again, look for
whom to blame); this module only reads one, under these rules:

* Nothing the child says is trusted before it is checked (``Stream``, the sandbox protocol's
  parent half). Every request carries a fresh id and every event must echo it; every event's
  shape is checked (kinds, names from this request, statuses the child may give, finite
  numbers, a ``passed`` verdict only after that backend's ``out=`` step ran). One that cannot
  belong to its request puts the stream out of step: the worker is killed and the attempt
  keeps none of its verdicts (``Attempt.out_of_step`` says why).
* Silence is timed per event: after each ``run`` event the child gets that step's window. The
  built-in fallback (``emulation``) and our own steps are never timed out for being slow on a
  large problem: their window is at least ``scaled_timeout_s`` (a floor plus the problem's flops
  at a pessimistic rate), every candidate's validation step gets the reference's share too, and
  a deliberate ``linger`` gets the timeout plus the linger.
* A death or a hang becomes a ``Failure`` naming the backend of the last ``run`` event only as a
  suspect; a death before any ``run`` event is ``Attempt.lost`` (nobody to suspect).
* A fatal verdict is not reported while it runs with others: only once it is confirmed alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fp4select.keys import Problem
from fp4select.records import (
    FATAL_STATUSES,
    MalformedRecord,
    ProbeOptions,
    ProbeResult,
    Report,
    Status,
    Timing,
    Verdict,
    is_int,
    is_number,
)
from fp4select.sandbox.process import START_TIMEOUT_S, OutOfStep, Worker, death, parse

__all__ = [
    "CHILD_STATUSES",
    "Attempt",
    "Failure",
    "Job",
    "Stream",
    "event_window",
    "reference_seconds",
    "run_attempt",
    "scaled_timeout_s",
    "timing_failure",
]

# The statuses a child may report; crash and hang are the parent's to give.
CHILD_STATUSES = frozenset(
    {Status.PASSED, Status.WRONG, Status.ERROR, Status.UNSUPPORTED, Status.OOM, Status.CUDA_ERROR}
)
# Exactly what a child's ``Verdict.to_json`` holds: a child never gives a ``cause`` (only the
# parent's candidate filter does), and an empty one is left out.
_VERDICT_KEYS = frozenset(f.name for f in dataclasses.fields(Verdict)) - {"cause"}
_RESULT_KEYS = frozenset({"verdicts", "timings", "method", "seconds", "aborted"})
# The last step of validation: a "passed" verdict for a backend that never reached it is forged.
_LAST_VALIDATION_PHASE = "out="


def _verdict_error(data: Any, names: Iterable[str], finished: set[str]) -> str | None:
    """The record's own checks (``Verdict.from_json``), then what only a child's verdict for
    this request must hold: exactly the fields it writes, a name the request gave, a status a
    child may give, ``passed`` only after the last validation step."""
    if isinstance(data, dict) and set(data) != _VERDICT_KEYS:
        return f"a verdict has the fields {sorted(_VERDICT_KEYS)}, got {sorted(data)}"
    try:
        verdict = Verdict.from_json(data)
    except MalformedRecord as exc:
        return str(exc)
    if verdict.backend not in names:
        return f"a verdict for {verdict.backend!r}, which this request did not name"
    if verdict.status not in CHILD_STATUSES:
        return f"status {verdict.status.value!r} is not one a child may give"
    if verdict.passed and verdict.backend not in finished:
        return (
            f"a passed verdict for {verdict.backend!r} before its {_LAST_VALIDATION_PHASE} step ran"
        )
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
        try:
            Timing.from_json(timing)
        except MalformedRecord as exc:
            return f"the timing of {name!r} is not a timing ({exc})"
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


STRAY_LINES_KEPT = 20
# The built-in fallback's hang window: at least this, plus its flops at these pessimistic
# rates (a loaded 2-core CPU does ~5e9 float32 FLOP/s through the reference; any CUDA GPU
# several 1e12), times REFERENCE_CALLS (the reference inputs, the run and the out= check).
BUILTIN_FLOOR_S = 60.0
PESSIMISTIC_FLOPS = {"cpu": 2e8, "cuda": 1e11}
DECODE_FLOPS_PER_ELEMENT = 100.0
REFERENCE_CALLS = 3

_PHASE_WORDS = {
    "import": "importing it",
    "bind": "binding it",
    "validate": "validating",
    "out=": "checking out=",
    "time": "timing",
    "inputs": "building inputs",
    "linger": "watching it after its run",
}


def reference_seconds(problem: Problem, m: int, device_type: str) -> float:
    """A pessimistic bound on one reference GEMM (decode to float32, multiply) at this M."""
    rate = PESSIMISTIC_FLOPS.get(device_type, PESSIMISTIC_FLOPS["cpu"])
    flops = 2.0 * m * problem.n * problem.k
    decode = DECODE_FLOPS_PER_ELEMENT * (m + problem.n) * problem.k
    return (flops + decode) / rate


def scaled_timeout_s(
    problem: Problem, device: torch.device | str, configured: float, m: int | None = None
) -> float:
    """The hang window of the built-in fallback: never shorter than its own work can take."""
    device_type = torch.device(device).type
    m = m or problem.m_bucket
    work = REFERENCE_CALLS * reference_seconds(problem, m, device_type)
    return max(configured, BUILTIN_FLOOR_S + work)


def _where(phase: str | None, m: int | None) -> str:
    text = f"while {_PHASE_WORDS.get(phase or '', phase or 'starting')}"
    return text + (f" at M={m}" if m is not None else "")


@dataclass
class Failure:
    """A death, hang or CUDA error seen in a child, before anyone is blamed for it."""

    status: Status  # crash, hang or cuda-error
    reason: str
    suspect: str | None  # the backend of the last run event, if it named one
    m: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def verdict(self, name: str) -> Verdict:
        return Verdict(name, self.status, self.reason, self.m, detail=dict(self.detail))

    def summary(self) -> dict[str, Any]:
        keep = ("phase", "signal", "exit_code", "timeout_s", "ran_in_child")
        return {
            "backend": self.suspect,
            "status": self.status.value,
            "reason": self.reason,
            "m": self.m,
            **{k: self.detail[k] for k in keep if k in self.detail},
        }


@dataclass
class Attempt:
    """What one request to one worker produced."""

    verdicts: dict[str, Verdict] = field(default_factory=dict)
    result: ProbeResult | None = None
    last_run: dict[str, Any] | None = None
    # Backends that ran (not only were imported), the most recently active last.
    ran: list[str] = field(default_factory=list)
    failure: Failure | None = None
    lost: str | None = None  # the child failed with no backend to blame
    out_of_step: str | None = None  # why the stream could not be trusted
    stray: dict[str | None, list[str]] = field(default_factory=dict)

    def announced(self, name: str | None) -> None:
        if name is not None:
            if name in self.ran:
                self.ran.remove(name)
            self.ran.append(name)


@dataclass
class Job:
    """One ``probe`` call: what every attempt of it shares."""

    problem: Problem
    device: torch.device
    options: ProbeOptions
    specs: dict[str, Any]
    builtin: frozenset[str]
    report: Report
    timeout_s: float  # the hang window of a step that is not the built-in fallback's
    linger_s: float  # how long a candidate re-run alone is watched after its last step


def event_window(job: Job, event: Mapping[str, Any]) -> float:
    """Seconds the child may take before its next event, after this one."""
    name, phase, m = event.get("backend"), event.get("phase"), event.get("m")
    if name is None or name in job.builtin:  # our own work: it scales with the problem
        return scaled_timeout_s(job.problem, job.device, job.timeout_s, m)
    if phase == "linger":  # the child waits on purpose, then reports
        return job.timeout_s + job.linger_s
    if phase == "validate":  # the reference for this M is built after this event
        reference = reference_seconds(job.problem, m or job.problem.m_bucket, job.device.type)
        return job.timeout_s + 2 * reference
    return job.timeout_s


def run_attempt(
    worker: Worker, request: Mapping[str, Any], job: Job, alone: bool = False
) -> Attempt:
    """Send one request and read its events until a result, an error, a death or a hang."""
    attempt = Attempt()
    stream = Stream(request["id"], (b["name"] for b in request["backends"]))
    mark = worker.stderr_size()
    window = job.timeout_s
    try:
        with contextlib.suppress(OSError):  # it died while idle: reading says how
            worker.send(request)
        deadline = time.monotonic() + max(job.timeout_s, START_TIMEOUT_S)
        while True:
            try:
                line = worker.read_line(deadline)
            except OutOfStep as exc:
                return _out_of_step(attempt, worker, str(exc))
            if worker.closing:
                raise RuntimeError("the fp4select sandbox was closed while it was probing")
            if line is None:
                worker.dump_and_kill()
                return _blame(attempt, worker, mark, Status.HANG, None, window)
            if line == b"":
                return _blame(attempt, worker, mark, Status.CRASH, worker.wait(5.0), window)
            if not line.strip():
                continue
            event = parse(line)
            if event is None:
                running = (attempt.last_run or {}).get("backend")
                kept = attempt.stray.setdefault(running, [])
                if len(kept) < STRAY_LINES_KEPT:
                    kept.append(line.decode("utf-8", "replace")[:500])
                continue
            if worker.take_ready(event):
                continue
            problem = stream.error(event)
            if problem is not None:
                shown = line[:300].decode("utf-8", "replace")
                return _out_of_step(attempt, worker, f"{problem}: {shown}")
            kind = event["event"]
            if kind == "run":
                attempt.last_run = event
                if event["phase"] != "import":  # imports happen up front, for every spec
                    attempt.announced(event["backend"])
                    if event["backend"] is not None:
                        worker.ran.append(event["backend"])
                window = event_window(job, event)
                deadline = time.monotonic() + window
                job.report({**event, "alone": True} if alone else event)
            elif kind == "verdict":
                verdict = Verdict(**event["verdict"])
                attempt.verdicts[verdict.backend] = verdict
                window = job.timeout_s
                deadline = time.monotonic() + window
                if not alone and verdict.status not in FATAL_STATUSES:
                    job.report(event)  # a fatal one is reported once it is confirmed
            elif kind == "result":
                attempt.result = ProbeResult.from_json(event["result"])
                return attempt
            else:
                attempt.lost = f"child: {event['message']}"
                return attempt
    except BaseException:
        # Interrupted mid-request (or a report callback raised): the worker's state is
        # unknown, so it is not reused.
        worker.kill()
        raise


def _out_of_step(attempt: Attempt, worker: Worker, why: str) -> Attempt:
    worker.kill()
    attempt.out_of_step = why[:1000]
    attempt.verdicts.clear()  # nothing from a stream out of step is kept
    attempt.result = None
    return attempt


def _blame(
    attempt: Attempt,
    worker: Worker,
    mark: int,
    status: Status,
    returncode: int | None,
    window: float,
) -> Attempt:
    run = attempt.last_run or {}
    name, phase, m = run.get("backend"), run.get("phase"), run.get("m")
    tail = worker.stderr_tail(mark)
    if status == Status.HANG:
        words = f"hang: no progress for {window:g} s"
        detail: dict[str, Any] = {"timeout_s": window}
    else:
        assert returncode is not None
        words, detail = death(returncode)
        words = f"crashed: {words}" if returncode < 0 else words
    if attempt.last_run is None:
        attempt.lost = f"the worker failed ({words}) before it started probing:\n{tail}"
        return attempt
    detail = {"phase": phase, **detail, "stderr_tail": tail}
    if name is not None and name in attempt.verdicts:
        detail["after_verdict"] = attempt.verdicts[name].status.value  # e.g. heap damage
    detail["ran_in_child"] = list(dict.fromkeys(worker.ran))
    attempt.failure = Failure(status, f"{words} {_where(phase, m)}", name, m, detail)
    return attempt


def timing_failure(attempt: Attempt) -> Failure | None:
    """A CUDA error while timing names no one in the result; the last run event may."""
    assert attempt.result is not None
    run = attempt.last_run or {}
    if run.get("phase") != "time" and not attempt.ran:
        return None
    name = run.get("backend") if run.get("phase") == "time" else None
    return Failure(
        Status.CUDA_ERROR,
        f"{attempt.result.method} {_where('time', run.get('m'))}"[:2000],
        name,
        run.get("m"),
        {"phase": "time"},
    )
