"""Probing in a child process: a candidate that crashes, hangs or breaks CUDA takes only the child.

This is the parent half; the child half is ``sandbox_worker.py``.

Design rules:

* A CUDA fault is sticky: the process that saw it can never use the GPU again. So every
  unproven candidate runs in a worker child; the caller's process runs a backend only after it
  was proven there.
* One persistent worker per device, started on first use and reused across keys, because
  starting one costs seconds (torch, flashinfer, JIT caches). It is shut down after
  ``FP4SELECT_WORKER_IDLE_S`` idle seconds (default 120), at ``close()`` and at exit; shutting
  it down kills its whole process group, so helpers a backend spawned go with it. It exits by
  itself when its stdin closes or its parent goes away, so it never holds GPU memory for a
  caller that is gone. A process forked from the caller starts its own workers: it forgets the
  parent's (without touching them) and the locks another thread may have held at the fork.
* The child cannot import from the caller's working directory by accident: it is started with
  ``-P`` (Python 3.11+) and a bootstrap that drops a leading ``''`` from ``sys.path``. Its
  environment is the caller's (same ``CUDA_VISIBLE_DEVICES`` mapping) with the caller's real
  ``sys.path`` entries added to ``PYTHONPATH`` (not ``''``), so the plugins the caller imported
  from a named directory, and test modules, are importable in the child too.
* Only JSON crosses, one object a line: the problem, the options, backend names, and for
  backends registered at runtime their importable ``module:qualname`` spec. A backend whose
  functions cannot be named that way gets an ``error`` verdict here; nothing is spawned for it.
* Nothing the child says is trusted before it is checked. Every request carries a fresh id and
  every event must echo it; every event's shape is checked (kinds, names from this request,
  statuses the child may give, finite numbers, a ``passed`` verdict only after that backend's
  ``out=`` step ran). A stream out of step (a leftover or forged event, a malformed one, a line
  over ``MAX_LINE_BYTES``) costs that worker its life: the attempt's events are discarded and
  the candidates run again in a fresh worker. The backend that was running when it happened
  twice gets an ``error`` verdict for the key (never a blacklisting). Lines that are not JSON
  objects are not events: they are kept in the verdict detail of the backend that was running.
* Blame needs a reproduction. The child says what it is about to run before it runs it
  (``run`` events). When it dies (``crash``), stops reporting (``hang``: no event for
  ``FP4SELECT_PROBE_TIMEOUT_S`` seconds, default 600, since a JIT compile can take minutes) or
  reports a CUDA error, the backend of the last ``run`` event is only the first suspect: a fault
  can be fired late by another candidate (a thread, an asynchronous kernel). The suspect, then
  every other candidate that ran in that child, most recent first, is re-run alone in a fresh
  child (validated, timed, then watched for ``ALONE_LINGER_S``) until one fails the same way:
  only that one gets the fatal verdict (which the selector blacklists). When none does, nobody
  is blamed: the candidates that ran there get an ``error`` verdict for this key that says so,
  except the built-in fallback, which is simply probed again once. Each round settles at least
  one candidate, and the rounds are capped, so the loop ends.
* The built-in fallback (``emulation``) is never timed out on a large problem for being slow:
  its hang window is at least ``scaled_timeout_s`` (a floor plus the problem's flops at a
  pessimistic rate), and every candidate's validation step gets the reference's share too.
* After a death, or after a CUDA error (which poisons the child's context, so the child exits
  after reporting it), a fresh worker continues with every candidate that has no verdict yet
  *and* every one that passed: those are validated again and timed together, so the timings of
  a decision always come from one process and one run.
* The child is the process the OOM killer should pick; its ``oom_score_adj`` is raised.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import math
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fp4select.backends import discover
from fp4select.backends.base import Backend, NotImportableError
from fp4select.backends.emulation import NAME as EMULATION
from fp4select.keys import Problem
from fp4select.probe import FATAL_STATUSES, ProbeOptions, ProbeResult, Report, Verdict
from fp4select.sandbox_worker import PROTOCOL_FD_ENV
from fp4select.timing import Timing

__all__ = [
    "IDLE_ENV",
    "PROBE_TIMEOUT_ENV",
    "PROTOCOL_FD_ENV",
    "SandboxProber",
    "scaled_timeout_s",
]

PROBE_TIMEOUT_ENV = "FP4SELECT_PROBE_TIMEOUT_S"
IDLE_ENV = "FP4SELECT_WORKER_IDLE_S"
DEFAULT_PROBE_TIMEOUT_S = 600.0
DEFAULT_IDLE_S = 120.0
# Until the child announces its first run, it is importing torch, flashinfer and plugins:
# slow on a cold disk, and nobody's fault, so it gets at least this long.
START_TIMEOUT_S = 300.0
STDERR_TAIL_CHARS = 4000
STRAY_LINES_KEPT = 20
# A real event is a few KB (tracebacks and stderr tails are cut); a longer line is garbage.
MAX_LINE_BYTES = 8 << 20
# How long a candidate re-run alone is watched after its last step, for faults fired late.
ALONE_LINGER_S = 1.0
# Protocol failures while one backend runs before it gets an "error" verdict for the key.
PROTOCOL_STRIKES = 2
# The built-in fallback's hang window: at least this, plus its flops at these pessimistic
# rates (a loaded 2-core CPU does ~5e9 float32 FLOP/s through the reference; any CUDA GPU
# several 1e12), times REFERENCE_CALLS (the reference inputs, the run and the out= check).
BUILTIN_FLOOR_S = 60.0
PESSIMISTIC_FLOPS = {"cpu": 2e8, "cuda": 1e11}
DECODE_FLOPS_PER_ELEMENT = 100.0
REFERENCE_CALLS = 3

# The statuses a child may report; "crash" and "hang" are the parent's to give.
CHILD_STATUSES = frozenset({"passed", "wrong", "error", "unsupported", "oom", "cuda-error"})
_VERDICT_KEYS = frozenset(f.name for f in dataclasses.fields(Verdict))
_TIMING_KEYS = frozenset(f.name for f in dataclasses.fields(Timing))
_RESULT_KEYS = frozenset({"verdicts", "timings", "method", "seconds", "aborted"})
# The last step of validation: a "passed" verdict for a backend that never reached it is forged.
_LAST_VALIDATION_PHASE = "out="

_PHASE_WORDS = {
    "import": "importing it",
    "bind": "binding it",
    "validate": "validating",
    "out=": "checking out=",
    "time": "timing",
    "inputs": "building inputs",
    "linger": "watching it after its run",
}

_BOOTSTRAP = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"  # -c puts the working directory first, unless -P
    "    del sys.path[0]\n"
    "from fp4select.sandbox_worker import main\n"
    "main()\n"
)


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


def _child_command() -> list[str]:
    """The interpreter, told not to put the working directory on ``sys.path``."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-c", _BOOTSTRAP]


def _child_environment() -> dict[str, str]:
    env = dict(os.environ)
    # '' means "the working directory, whatever it is": never hand that to the child.
    paths = [os.path.abspath(p) for p in sys.path if isinstance(p, str) and p]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


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


def _is_builtin(backend: Backend) -> bool:
    return backend.family == "builtin" or backend.name == EMULATION


def _where(phase: str | None, m: int | None) -> str:
    text = f"while {_PHASE_WORDS.get(phase or '', phase or 'starting')}"
    return text + (f" at M={m}" if m is not None else "")


def _death(returncode: int) -> tuple[str, dict[str, Any]]:
    """Why the child ended, in words, and as detail fields."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        words = "killed (out of memory?) by SIGKILL" if name == "SIGKILL" else f"killed by {name}"
        return words, {"signal": name}
    return f"exited with code {returncode} without a result", {"exit_code": returncode}


# ------------------------------------------------------------------------- protocol checks


class _OutOfStep(Exception):
    """The worker's stream cannot be trusted any more."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(
        value
    )


def _verdict_error(data: Any, names: Iterable[str], finished: set[str]) -> str | None:
    if not isinstance(data, dict):
        return f"a verdict must be an object, got {type(data).__name__}"
    if set(data) != _VERDICT_KEYS:
        return f"a verdict has the fields {sorted(_VERDICT_KEYS)}, got {sorted(data)}"
    name = data["backend"]
    if not isinstance(name, str) or name not in names:
        return f"a verdict for {name!r}, which this request did not name"
    if data["status"] not in CHILD_STATUSES:
        return f"status {data['status']!r} is not one a child may give"
    if not isinstance(data["reason"], str):
        return "a verdict's reason must be a string"
    if data["m"] is not None and not (_is_int(data["m"]) and data["m"] >= 0):
        return f"a verdict's m must be null or a count, got {data['m']!r}"
    ratio = data["worst_ratio"]
    if ratio is not None and not (_is_number(ratio) and ratio >= 0):
        return f"a verdict's worst_ratio must be null or a finite number >= 0, got {ratio!r}"
    if data["deterministic"] not in (None, True, False):
        return "a verdict's deterministic must be null or a boolean"
    if not isinstance(data["detail"], dict):
        return "a verdict's detail must be an object"
    if data["status"] == "passed" and name not in finished:
        return f"a passed verdict for {name!r} before its {_LAST_VALIDATION_PHASE} step ran"
    return None


def _timing_error(name: str, data: Any) -> str | None:
    if not isinstance(data, dict) or set(data) != _TIMING_KEYS:
        return f"the timing of {name!r} is not a timing"
    numbers = ("median_us", "p10_us", "p90_us")
    if not all(_is_number(data[k]) and data[k] >= 0 for k in numbers):
        return f"the timing of {name!r} has a number that is not finite and >= 0"
    if not all(_is_int(data[k]) and data[k] >= 1 for k in ("samples", "calls_per_sample")):
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
    if not (_is_number(data["seconds"]) and data["seconds"] >= 0):
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
        if name not in verdicts or verdicts[name]["status"] != "passed":
            return f"a timing for {name!r}, which did not pass"
        problem = _timing_error(name, timing)
        if problem is not None:
            return problem
    return None


class _Stream:
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
            if m is not None and not (_is_int(m) and m >= 0):
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


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


# ---------------------------------------------------------------------------------- parent


class _Worker:
    """One child process and the parent's end of its pipes."""

    def __init__(self, device: str) -> None:
        self.device = device
        # A file, not a pipe: nobody has to drain it, and a dead child's last words stay.
        self.stderr = tempfile.TemporaryFile(prefix="fp4select-sandbox-")  # noqa: SIM115
        self.proc = subprocess.Popen(
            _child_command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=_child_environment(),
            start_new_session=True,  # its own process group: ended with every helper in it
            bufsize=0,
        )
        self.fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        self._poll = selectors.DefaultSelector()
        self._poll.register(self.fd, selectors.EVENT_READ)
        self._buffer = bytearray()
        self._eof = False
        self.spawned = time.monotonic()
        self.last_used = self.spawned
        self.timer: threading.Timer | None = None
        self.closing = False  # set when the parent ends it: its death then blames no one
        self.ready = False
        self.ran: list[str] = []  # every backend this child announced, over all its requests

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> bool:
        """Whether the child ended, without reaping it: its pid must keep naming its group."""
        if self.proc.returncode is not None:
            return True
        if not hasattr(os, "waitid"):
            return self.proc.poll() is not None
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
            return os.waitid(os.P_PID, self.proc.pid, flags) is not None
        except ChildProcessError:
            return True

    def alive(self) -> bool:
        return not self.exited()

    def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.exited():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def send(self, message: Mapping[str, Any]) -> None:
        data = memoryview((json.dumps(message) + "\n").encode())
        pipe = self.proc.stdin
        assert pipe is not None
        while data:
            written = pipe.write(data)
            data = data[written or 0 :]

    def read_line(self, deadline: float) -> bytes | None:
        """The next line; ``b""`` once the child is gone; None when the deadline passes first."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line or b" "  # an empty line is not the end of the stream
            if len(self._buffer) > MAX_LINE_BYTES:
                raise _OutOfStep(f"a line longer than {MAX_LINE_BYTES} bytes")
            if self._eof:
                line, self._buffer = bytes(self._buffer), bytearray()
                return line
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self._poll.select(min(left, 0.5)):
                chunk = os.read(self.fd, 1 << 16)
                if chunk:
                    self._buffer += chunk
                else:
                    self._eof = True
            elif self.exited():
                # Dead, but a grandchild may hold the pipe open: treat it as the end.
                self._eof = True

    def stderr_size(self) -> int:
        return os.fstat(self.stderr.fileno()).st_size

    def stderr_tail(self, since: int) -> str:
        size = self.stderr_size()
        start = max(since, size - STDERR_TAIL_CHARS)
        data = os.pread(self.stderr.fileno(), max(0, size - start), start)
        return data.decode("utf-8", "replace")

    def _reap(self) -> int:
        """End whatever is left of its process group, then collect the child's exit status."""
        if self.proc.returncode is None:  # unreaped, so its pid still names the group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()

    def wait(self, timeout: float) -> int:
        """The exit status, killing the process group if the child will not end by itself."""
        if not self._wait_exit(timeout):
            return self.kill()
        return self._reap()

    def dump_and_kill(self) -> None:
        """Kill a hung child, first asking faulthandler for every thread's stack (into stderr)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.proc.pid, signal.SIGUSR1)
            self._wait_exit(0.5)
        self.kill()

    def kill(self) -> int:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self._reap()

    def close(self, grace: float = 5.0) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the child's loop ends at EOF
        self.wait(grace)
        self._release_files()

    def _release_files(self) -> None:
        with contextlib.suppress(OSError):
            self._poll.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        with contextlib.suppress(OSError):
            self.stderr.close()

    def abandon(self) -> None:
        """In a forked child: drop our copies of the pipes; the worker is the parent's."""
        if self.timer is not None:
            self.timer.cancel()
        self._release_files()


@dataclass
class _Failure:
    """A death, hang or CUDA error seen in a child, before anyone is blamed for it."""

    status: str  # crash, hang or cuda-error
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
            "status": self.status,
            "reason": self.reason,
            "m": self.m,
            **{k: self.detail[k] for k in keep if k in self.detail},
        }


@dataclass
class _Attempt:
    """What one request to one worker produced."""

    verdicts: dict[str, Verdict] = field(default_factory=dict)
    result: ProbeResult | None = None
    last_run: dict[str, Any] | None = None
    # Backends that ran (not only were imported), the most recently active last.
    ran: list[str] = field(default_factory=list)
    failure: _Failure | None = None
    lost: str | None = None  # the child failed with no backend to blame
    out_of_step: str | None = None  # why the stream could not be trusted
    stray: dict[str | None, list[str]] = field(default_factory=dict)

    def announced(self, name: str | None) -> None:
        if name is not None:
            if name in self.ran:
                self.ran.remove(name)
            self.ran.append(name)


@dataclass
class _Job:
    """One ``probe`` call: what every attempt of it shares."""

    problem: Problem
    device: torch.device
    options: ProbeOptions
    specs: dict[str, Any]
    builtin: frozenset[str]
    report: Report


_live: weakref.WeakSet[SandboxProber] = weakref.WeakSet()
_abandoned: list[_Worker] = []  # a forked child's copies of its parent's workers, never reaped


@atexit.register
def _close_all() -> None:
    for prober in list(_live):
        prober.close()


def _after_fork_in_child() -> None:
    for prober in list(_live):
        prober._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class SandboxProber:
    """Runs the probe in a worker child per device; see the module docstring for the rules."""

    isolation = "subprocess"

    def __init__(
        self,
        timeout_s: float | None = None,
        idle_s: float | None = None,
        linger_s: float = ALONE_LINGER_S,
    ) -> None:
        self.timeout_s = timeout_s or _env_seconds(PROBE_TIMEOUT_ENV, DEFAULT_PROBE_TIMEOUT_S)
        self.idle_s = idle_s or _env_seconds(IDLE_ENV, DEFAULT_IDLE_S)
        if not (math.isfinite(linger_s) and linger_s >= 0):
            raise ValueError(f"linger_s must be a finite number >= 0, got {linger_s!r}")
        self.linger_s = linger_s
        self._workers: dict[str, _Worker] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._requests = itertools.count(1)
        _live.add(self)

    # -- workers ----------------------------------------------------------------------------
    def _device_lock(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def _worker(self, key: str) -> _Worker:
        """The live worker for a device (caller holds the device lock)."""
        worker = self._workers.get(key)
        if worker is not None and not worker.alive():
            self._retire(key)
            worker = None
        if worker is None:
            worker = self._workers[key] = _Worker(key)
        return worker

    def _retire(self, key: str) -> None:
        worker = self._workers.pop(key, None)
        if worker is not None:
            worker.close(grace=2.0)

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's workers and lock holders are not ours."""
        self._guard = threading.Lock()
        self._locks = {}
        workers, self._workers = self._workers, {}
        for worker in workers.values():
            worker.abandon()
            _abandoned.append(worker)

    def _arm_idle_timer(self, key: str, worker: _Worker) -> None:
        worker.last_used = time.monotonic()
        if worker.timer is not None:
            worker.timer.cancel()
        worker.timer = threading.Timer(self.idle_s, self._idle, (key, worker))
        worker.timer.daemon = True
        worker.timer.start()

    def _idle(self, key: str, worker: _Worker) -> None:
        lock = self._device_lock(key)
        if not lock.acquire(blocking=False):
            return  # busy: the probe re-arms the timer when it ends
        try:
            idle = time.monotonic() - worker.last_used
            if self._workers.get(key) is worker and idle >= self.idle_s * 0.99:
                self._retire(key)
        finally:
            lock.release()

    def start(self, device: torch.device | str) -> float:
        """Start the device's worker now and wait until it is ready; returns the seconds waited.

        Optional: ``probe`` starts the worker when it first needs it. Starting early overlaps
        the child's imports with the caller's own start-up.
        """
        key = str(_normalise(device))
        begin = time.monotonic()
        with self._device_lock(key):
            worker = self._worker(key)
            mark = worker.stderr_size()
            deadline = begin + max(self.timeout_s, START_TIMEOUT_S)
            while not worker.ready:
                try:
                    line = worker.read_line(deadline)
                except _OutOfStep:
                    line = None
                if not line:  # the deadline passed, or the child is gone
                    tail = worker.stderr_tail(mark)
                    self._retire(key)
                    raise RuntimeError(f"the fp4select sandbox worker did not start:\n{tail}")
                event = _parse(line)
                if event is not None:
                    self._is_ready(worker, event)  # anything else before it is import noise
            self._arm_idle_timer(key, worker)
        return time.monotonic() - begin

    @staticmethod
    def _is_ready(worker: _Worker, event: Mapping[str, Any]) -> bool:
        """Whether this is the worker's one ``ready`` event (true once, then never again)."""
        if worker.ready or event.get("event") != "ready" or event.get("pid") != worker.pid:
            return False
        worker.ready = True
        return True

    def close(self) -> None:
        with self._guard:
            keys = list(self._workers)
        for key in keys:
            lock = self._device_lock(key)
            if lock.acquire(timeout=1.0):
                try:
                    self._retire(key)
                finally:
                    lock.release()
            elif (worker := self._workers.get(key)) is not None:
                # Another thread is probing (at exit, a daemon thread may be): end the child
                # and let that probe fail, rather than blame its backend for our kill.
                worker.closing = True
                worker.kill()

    # -- probing ----------------------------------------------------------------------------
    def probe(
        self,
        problem: Problem,
        backends: Sequence[Backend],
        device: torch.device | str,
        options: ProbeOptions,
        report: Report | None = None,
    ) -> ProbeResult:
        """``probe.probe``'s contract, whatever the candidates do to the child.

        Verdicts come from every attempt, in candidate order; timings from the last attempt
        that timed; ``seconds`` is the wall time of all attempts and restarts together.
        """
        started = time.perf_counter()
        device = _normalise(device)
        key = str(device)
        report = report or (lambda event: None)
        verdicts: dict[str, Verdict] = {}
        job = _Job(
            problem=problem,
            device=device,
            options=options,
            specs=self._specs(backends, verdicts, report),
            builtin=frozenset(b.name for b in backends if _is_builtin(b)),
            report=report,
        )
        pending = [b.name for b in backends if b.name not in verdicts]
        timings: dict[str, Any] = {}
        method = "none"
        stray: dict[str, list[str]] = {}
        unexplained = 0
        strikes: dict[str | None, int] = {}
        spared: set[str] = set()  # built-in candidates already given a second chance
        rounds_left = 4 * len(pending) + 4  # each round settles one; this is a backstop
        with self._device_lock(key):
            while pending:
                rounds_left -= 1
                if rounds_left < 0:
                    self._settle_all(
                        verdicts, pending, "the sandbox gave up after too many restarts"
                    )
                    break
                attempt = self._attempt(key, self._request(job, pending), job)
                for name, lines in attempt.stray.items():
                    if name is not None:
                        stray.setdefault(name, []).extend(lines)
                if attempt.out_of_step is not None:
                    self._retire(key)
                    running = (attempt.last_run or {}).get("backend")
                    strikes[running] = strikes.get(running, 0) + 1
                    if strikes[running] >= PROTOCOL_STRIKES:
                        why = f"the sandbox protocol went out of step ({attempt.out_of_step})"
                        if running is None:
                            self._settle_all(verdicts, pending, why)
                            break
                        verdicts[running] = Verdict(
                            running,
                            "error",
                            f"{why} twice while it ran"[:2000],
                            detail={"phase": "protocol"},
                        )
                        report({"event": "verdict", "verdict": verdicts[running].to_json()})
                    pending = [n for n in pending if n not in verdicts or verdicts[n].passed]
                    continue
                failure: _Failure | None = None
                for verdict in attempt.verdicts.values():
                    if verdict.status not in FATAL_STATUSES:
                        verdicts[verdict.backend] = verdict
                if attempt.result is not None:
                    result = attempt.result
                    for name, verdict in result.verdicts.items():
                        if verdict.status in FATAL_STATUSES:
                            failure = _Failure(
                                verdict.status, verdict.reason, name, verdict.m, verdict.detail
                            )
                        else:
                            verdicts[name] = verdict
                    if result.timings:
                        timings, method = result.timings, result.method
                    elif result.method != "none":
                        method = result.method
                    if not result.aborted and failure is None:
                        break
                    self._retire(key)  # its CUDA context is gone, and the child with it
                    failure = failure or _timing_failure(attempt)
                elif attempt.failure is not None:
                    self._retire(key)
                    failure = attempt.failure
                else:
                    # The child failed before anything ran: once may be bad luck (it died
                    # while idle); twice, or an error it reported itself, will not go away.
                    unexplained += 1
                    if attempt.lost and attempt.lost.startswith("child:"):
                        unexplained = 2
                    else:
                        self._retire(key)
                    if unexplained >= 2:
                        self._settle_all(verdicts, pending, f"the sandbox failed: {attempt.lost}")
                        break
                if failure is not None:
                    self._settle(key, failure, attempt.ran, job, verdicts, spared)
                pending = [n for n in pending if n not in verdicts or verdicts[n].passed]
            if key in self._workers:
                self._arm_idle_timer(key, self._workers[key])

        for name, lines in stray.items():
            if name in verdicts:
                verdicts[name].detail["stdout"] = lines[-STRAY_LINES_KEPT:]
        ordered = {b.name: verdicts[b.name] for b in backends if b.name in verdicts}
        passed = {n for n, v in ordered.items() if v.passed}
        return ProbeResult(
            verdicts=ordered,
            timings={n: t for n, t in timings.items() if n in passed},
            method=method,
            seconds=time.perf_counter() - started,
            aborted=False,
        )

    @staticmethod
    def _settle_all(verdicts: dict[str, Verdict], pending: Sequence[str], reason: str) -> None:
        for name in pending:
            if name not in verdicts or verdicts[name].passed:
                verdicts[name] = Verdict(name, "error", reason[:2000], detail={"phase": "sandbox"})

    def _request(self, job: _Job, names: Sequence[str], alone: bool = False) -> dict[str, Any]:
        request: dict[str, Any] = {
            "op": "probe",
            # A counter makes ids unique here; the token makes a stale or guessed one unlikely.
            "id": f"{next(self._requests)}-{secrets.token_hex(8)}",
            "problem": job.problem.to_json(),
            "device": str(job.device),
            "options": job.options.to_json(),
            "backends": [{"name": n, "spec": job.specs[n]} for n in names],
        }
        if alone:
            request["alone"] = True
            request["linger_s"] = self.linger_s
        return request

    @staticmethod
    def _specs(
        backends: Sequence[Backend], verdicts: dict[str, Verdict], report: Report
    ) -> dict[str, Any]:
        """Plain-data specs for the backends the child cannot find by itself."""
        registry = discover()
        specs: dict[str, Any] = {}
        for backend in backends:
            known = registry.get(backend.name)
            runtime = backend.name in registry.runtime_names and known is backend
            if known is not None and not runtime:
                specs[backend.name] = None  # built-in or entry point: the child discovers it
                continue
            try:
                specs[backend.name] = backend.to_json()
            except NotImportableError as exc:
                verdicts[backend.name] = Verdict(
                    backend.name, "error", str(exc), detail={"phase": "serialise"}
                )
                report({"event": "verdict", "verdict": verdicts[backend.name].to_json()})
        return specs

    # -- blame ------------------------------------------------------------------------------
    def _settle(
        self,
        key: str,
        failure: _Failure,
        ran: Sequence[str],
        job: _Job,
        verdicts: dict[str, Verdict],
        spared: set[str],
    ) -> None:
        """Find who reproduces ``failure`` alone; blame only that one, or nobody."""
        suspects = [failure.suspect] if failure.suspect is not None else []
        order = [n for n in dict.fromkeys([*suspects, *reversed(ran)]) if n in job.specs]
        alone: dict[str, Verdict] = {}
        for name in order:
            verdict = self._alone(key, name, job)
            if verdict.status in FATAL_STATUSES:
                verdict.detail["reproduced_alone"] = True
                verdict.detail["first_failure"] = failure.summary()
                verdicts[name] = verdict
                job.report({"event": "verdict", "verdict": verdict.to_json()})
                break
            alone[name] = verdict
        else:
            name = None
        for other, verdict in alone.items():
            if not verdict.passed:  # a real verdict, from a clean child
                verdicts[other] = verdict
                job.report({"event": "verdict", "verdict": verdict.to_json()})
        if name is not None:
            return
        words = {"crash": "died", "hang": "hung"}.get(failure.status, "hit a CUDA error")
        reason = (
            f"the sandbox child {words} ({failure.reason}) but no candidate reproduced it alone"
        )
        detail = {
            "phase": "sandbox",
            "unreproduced": {
                **failure.summary(),
                "stderr_tail": failure.detail.get("stderr_tail", ""),
            },
            "rerun_alone": {n: v.status for n, v in alone.items()},
        }
        for other in order:
            if other in alone and not alone[other].passed:
                continue
            if other in job.builtin and other not in spared:
                spared.add(other)  # the fallback is probed again rather than excluded
                continue
            m = failure.m if other == failure.suspect else None
            verdicts[other] = Verdict(other, "error", reason[:2000], m, detail=dict(detail))
            job.report({"event": "verdict", "verdict": verdicts[other].to_json()})

    def _alone(self, key: str, name: str, job: _Job) -> Verdict:
        """``name``'s verdict when it runs by itself in a fresh child."""
        self._retire(key)
        attempt = self._attempt(key, self._request(job, [name], alone=True), job, alone=True)
        self._retire(key)  # nothing else runs in a child that ran a suspect
        if attempt.out_of_step is not None:
            reason = (
                f"the sandbox protocol went out of step while it ran alone ({attempt.out_of_step})"
            )
            return Verdict(name, "error", reason[:2000], detail={"phase": "protocol"})
        if attempt.result is not None:
            verdict = attempt.result.verdicts.get(name)
            if verdict is not None and verdict.status in FATAL_STATUSES:
                return verdict
            if attempt.result.aborted:  # timing broke the context, and it ran alone
                failure = _timing_failure(attempt)
                if failure is not None:
                    return failure.verdict(name)
            if verdict is not None:
                return verdict
            return Verdict(
                name, "error", "no verdict when it ran alone", detail={"phase": "sandbox"}
            )
        if attempt.failure is not None:
            return attempt.failure.verdict(name)  # it was alone: whatever ran was its doing
        reason = f"the sandbox failed while it ran alone: {attempt.lost}"
        return Verdict(name, "error", reason[:2000], detail={"phase": "sandbox"})

    # -- one request ------------------------------------------------------------------------
    def _window(self, job: _Job, event: Mapping[str, Any]) -> float:
        """Seconds the child may take before its next event, after this one."""
        name, phase, m = event.get("backend"), event.get("phase"), event.get("m")
        if name is None or name in job.builtin:  # our own work: it scales with the problem
            return scaled_timeout_s(job.problem, job.device, self.timeout_s, m)
        if phase == "linger":  # the child waits on purpose, then reports
            return self.timeout_s + self.linger_s
        if phase == "validate":  # the reference for this M is built after this event
            reference = reference_seconds(job.problem, m or job.problem.m_bucket, job.device.type)
            return self.timeout_s + 2 * reference
        return self.timeout_s

    def _attempt(
        self, key: str, request: Mapping[str, Any], job: _Job, alone: bool = False
    ) -> _Attempt:
        attempt = _Attempt()
        worker = self._worker(key)
        stream = _Stream(request["id"], (b["name"] for b in request["backends"]))
        mark = worker.stderr_size()
        window = self.timeout_s
        try:
            with contextlib.suppress(OSError):  # it died while idle: reading says how
                worker.send(request)
            deadline = time.monotonic() + max(self.timeout_s, START_TIMEOUT_S)
            while True:
                try:
                    line = worker.read_line(deadline)
                except _OutOfStep as exc:
                    return self._out_of_step(attempt, worker, str(exc))
                if worker.closing:
                    raise RuntimeError("the fp4select sandbox was closed while it was probing")
                if line is None:
                    worker.dump_and_kill()
                    return self._blame(attempt, worker, mark, "hang", None, window)
                if line == b"":
                    return self._blame(attempt, worker, mark, "crash", worker.wait(5.0), window)
                if not line.strip():
                    continue
                event = _parse(line)
                if event is None:
                    running = (attempt.last_run or {}).get("backend")
                    kept = attempt.stray.setdefault(running, [])
                    if len(kept) < STRAY_LINES_KEPT:
                        kept.append(line.decode("utf-8", "replace")[:500])
                    continue
                if self._is_ready(worker, event):
                    continue
                problem = stream.error(event)
                if problem is not None:
                    shown = line[:300].decode("utf-8", "replace")
                    return self._out_of_step(attempt, worker, f"{problem}: {shown}")
                kind = event["event"]
                if kind == "run":
                    attempt.last_run = event
                    if event["phase"] != "import":  # imports happen up front, for every spec
                        attempt.announced(event["backend"])
                        if event["backend"] is not None:
                            worker.ran.append(event["backend"])
                    window = self._window(job, event)
                    deadline = time.monotonic() + window
                    job.report({**event, "alone": True} if alone else event)
                elif kind == "verdict":
                    verdict = Verdict(**event["verdict"])
                    attempt.verdicts[verdict.backend] = verdict
                    window = self.timeout_s
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

    @staticmethod
    def _out_of_step(attempt: _Attempt, worker: _Worker, why: str) -> _Attempt:
        worker.kill()
        attempt.out_of_step = why[:1000]
        attempt.verdicts.clear()  # nothing from a stream out of step is kept
        attempt.result = None
        return attempt

    @staticmethod
    def _blame(
        attempt: _Attempt,
        worker: _Worker,
        mark: int,
        status: str,
        returncode: int | None,
        window: float,
    ) -> _Attempt:
        run = attempt.last_run or {}
        name, phase, m = run.get("backend"), run.get("phase"), run.get("m")
        tail = worker.stderr_tail(mark)
        if status == "hang":
            words = f"hang: no progress for {window:g} s"
            detail: dict[str, Any] = {"timeout_s": window}
        else:
            assert returncode is not None
            words, detail = _death(returncode)
            words = f"crashed: {words}" if returncode < 0 else words
        if attempt.last_run is None:
            attempt.lost = f"the worker failed ({words}) before it started probing:\n{tail}"
            return attempt
        detail = {"phase": phase, **detail, "stderr_tail": tail}
        if name is not None and name in attempt.verdicts:
            detail["after_verdict"] = attempt.verdicts[name].status  # e.g. heap damage
        detail["ran_in_child"] = list(dict.fromkeys(worker.ran))
        attempt.failure = _Failure(status, f"{words} {_where(phase, m)}", name, m, detail)
        return attempt


def _timing_failure(attempt: _Attempt) -> _Failure | None:
    """A CUDA error while timing names no one in the result; the last run event may."""
    assert attempt.result is not None
    run = attempt.last_run or {}
    if run.get("phase") != "time" and not attempt.ran:
        return None
    name = run.get("backend") if run.get("phase") == "time" else None
    return _Failure(
        "cuda-error",
        f"{attempt.result.method} {_where('time', run.get('m'))}"[:2000],
        name,
        run.get("m"),
        {"phase": "time"},
    )


def _normalise(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # The child's current device is 0: send the caller's choice explicitly.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


if __name__ == "__main__":  # ``python -m fp4select.sandbox`` still starts a worker by hand
    from fp4select.sandbox_worker import main

    main()
