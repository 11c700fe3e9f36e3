"""Probing in a child process: a candidate that crashes, hangs or breaks CUDA takes only the child.

Design rules:

* A CUDA fault is sticky: the process that saw it can never use the GPU again. So every
  unproven candidate runs in a worker child (``python -m fp4select.sandbox``); the caller's
  process runs a backend only after it was proven there.
* One persistent worker per device, started on first use and reused across keys, because
  starting one costs seconds (torch, flashinfer, JIT caches). It is shut down after
  ``FP4SELECT_WORKER_IDLE_S`` idle seconds (default 120), at ``close()`` and at exit. It exits
  by itself when its stdin closes or its parent goes away, so it never holds GPU memory for a
  caller that is gone. Its environment is the caller's (same ``CUDA_VISIBLE_DEVICES`` mapping)
  with the caller's ``sys.path`` added to ``PYTHONPATH``, so whatever the caller imports (a
  plugin in the working tree, a test module) the child imports too.
* Only JSON crosses, one object a line: the problem, the options, backend names, and for
  backends registered at runtime their importable ``module:qualname`` spec. A backend whose
  functions cannot be named that way gets an ``error`` verdict here; nothing is spawned for it.
* The child says what it is about to run before it runs it (the probe's ``report`` events,
  one flushed line each, plus an ``import`` event before rebuilding each spec). When the child
  dies, the backend, phase and M of the last ``run`` event take the blame: killed by a signal
  or exiting without a result is ``crash``; no event for ``FP4SELECT_PROBE_TIMEOUT_S`` seconds
  (default 600: a JIT compile can take minutes) is ``hang``, and the child's process group is
  killed. The verdict carries the phase, the signal or exit code, and the tail of the child's
  stderr (where ``faulthandler`` has written the Python stack of the fatal signal).
* After a death, or after a ``cuda-error`` verdict (which poisons the child's CUDA context, so
  the child exits after reporting it), a fresh worker continues with every candidate that has
  no verdict yet *and* every one that passed: those are validated again and timed together,
  so the timings of a decision always come from one process and one run. Each restart settles
  at least one candidate, so the loop ends.
* The protocol channel is private: the child moves its stdout onto stderr and its stdin onto
  /dev/null before anything is imported, so a backend that prints (or reads) cannot corrupt
  it. Lines that reach the channel anyway and are not JSON objects are not parsed but kept
  in the verdict detail of the backend that was running.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fp4select import probe as probe_mod
from fp4select.backends import Registry, discover
from fp4select.backends.base import Backend, NotImportableError
from fp4select.keys import Problem
from fp4select.probe import ProbeOptions, ProbeResult, Report, Verdict

PROBE_TIMEOUT_ENV = "FP4SELECT_PROBE_TIMEOUT_S"
IDLE_ENV = "FP4SELECT_WORKER_IDLE_S"
# Set in the child: the file descriptor of the protocol channel (for tests that corrupt it).
PROTOCOL_FD_ENV = "FP4SELECT_SANDBOX_FD"
DEFAULT_PROBE_TIMEOUT_S = 600.0
DEFAULT_IDLE_S = 120.0
# Until the child announces its first run, it is importing torch, flashinfer and plugins:
# slow on a cold disk, and nobody's fault, so it gets at least this long.
START_TIMEOUT_S = 300.0
STDERR_TAIL_CHARS = 4000
STRAY_LINES_KEPT = 20

_PHASE_WORDS = {
    "import": "importing it",
    "bind": "binding it",
    "validate": "validating",
    "out=": "checking out=",
    "time": "timing",
}


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not seconds > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return seconds


def _child_environment() -> dict[str, str]:
    env = dict(os.environ)
    paths = [p or os.getcwd() for p in sys.path if isinstance(p, str)]
    paths += env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return env


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


# ---------------------------------------------------------------------------------- parent


class _Worker:
    """One child process and the parent's end of its pipes."""

    def __init__(self, device: str) -> None:
        self.device = device
        # A file, not a pipe: nobody has to drain it, and a dead child's last words stay.
        self.stderr = tempfile.TemporaryFile(prefix="fp4select-sandbox-")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fp4select.sandbox"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=_child_environment(),
            start_new_session=True,  # its own process group: a hang is killed with its helpers
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

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

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
            elif self.proc.poll() is not None:
                # Dead, but a grandchild may hold the pipe open: treat it as the end.
                self._eof = True

    def stderr_size(self) -> int:
        return os.fstat(self.stderr.fileno()).st_size

    def stderr_tail(self, since: int) -> str:
        size = self.stderr_size()
        start = max(since, size - STDERR_TAIL_CHARS)
        data = os.pread(self.stderr.fileno(), max(0, size - start), start)
        return data.decode("utf-8", "replace")

    def wait(self, timeout: float) -> int:
        """The exit status, killing the process group if it will not end by itself."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait()

    def dump_and_kill(self) -> None:
        """Kill a hung child, first asking faulthandler for every thread's stack (into stderr)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.proc.pid, signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.5)
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self, grace: float = 5.0) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the child's loop ends at EOF
        self.wait(grace)
        self._poll.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stderr.close()


@dataclass
class _Attempt:
    """What one request to one worker produced."""

    verdicts: dict[str, Verdict] = field(default_factory=dict)
    result: ProbeResult | None = None
    last_run: dict[str, Any] | None = None
    death: Verdict | None = None  # the crash/hang verdict for the backend that was running
    lost: str | None = None  # the child failed with no backend to blame
    stray: dict[str | None, list[str]] = field(default_factory=dict)


_live: weakref.WeakSet[SandboxProber] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for prober in list(_live):
        prober.close()


class SandboxProber:
    """Runs the probe in a worker child per device; see the module docstring for the rules."""

    isolation = "subprocess"

    def __init__(self, timeout_s: float | None = None, idle_s: float | None = None) -> None:
        self.timeout_s = timeout_s or _env_seconds(PROBE_TIMEOUT_ENV, DEFAULT_PROBE_TIMEOUT_S)
        self.idle_s = idle_s or _env_seconds(IDLE_ENV, DEFAULT_IDLE_S)
        self._workers: dict[str, _Worker] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
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
            while True:
                line = worker.read_line(deadline)
                if line is None or line == b"":
                    tail = worker.stderr_tail(mark)
                    self._retire(key)
                    raise RuntimeError(f"the fp4select sandbox worker did not start:\n{tail}")
                event = _parse(line)
                if event is not None and event.get("event") == "ready":
                    break
            self._arm_idle_timer(key, worker)
        return time.monotonic() - begin

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
        specs = self._specs(backends, verdicts, report)
        pending = [b.name for b in backends if b.name not in verdicts]
        timings: dict[str, Any] = {}
        method = "none"
        aborted = False
        stray: dict[str, list[str]] = {}
        unexplained = 0
        with self._device_lock(key):
            while pending:
                request = {
                    "op": "probe",
                    "problem": problem.to_json(),
                    "device": key,
                    "options": options.to_json(),
                    "backends": [{"name": n, "spec": specs[n]} for n in pending],
                }
                attempt = self._attempt(key, request, report)
                for name, lines in attempt.stray.items():
                    if name is not None:
                        stray.setdefault(name, []).extend(lines)
                verdicts.update(attempt.verdicts)
                if attempt.result is not None:
                    verdicts.update(attempt.result.verdicts)
                    if attempt.result.timings:
                        timings, method = attempt.result.timings, attempt.result.method
                    elif attempt.result.method != "none":
                        method = attempt.result.method
                    if not attempt.result.aborted:
                        break
                    self._retire(key)  # its CUDA context is gone, and the child with it
                    if not any(v.status == "cuda-error" for v in attempt.result.verdicts.values()):
                        culprit = _timing_culprit(attempt)
                        if culprit is None:
                            aborted = True  # nobody to blame: a retry would change nothing
                            break
                        verdicts[culprit.backend] = culprit
                        report({"event": "verdict", "verdict": culprit.to_json()})
                elif attempt.death is not None:
                    self._retire(key)
                    verdicts[attempt.death.backend] = attempt.death
                    report({"event": "verdict", "verdict": attempt.death.to_json()})
                else:
                    # The child failed before blaming anyone: once may be bad luck (it died
                    # while idle); twice, or an error it reported itself, will not go away.
                    unexplained += 1
                    if attempt.lost and attempt.lost.startswith("child:"):
                        unexplained = 2
                    else:
                        self._retire(key)
                    if unexplained >= 2:
                        for name in pending:
                            if name not in verdicts:
                                verdicts[name] = Verdict(
                                    name, "error", f"the sandbox failed: {attempt.lost}"[:2000]
                                )
                        break
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
            aborted=aborted,
        )

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

    def _attempt(self, key: str, request: Mapping[str, Any], report: Report) -> _Attempt:
        attempt = _Attempt()
        worker = self._worker(key)
        mark = worker.stderr_size()
        try:
            with contextlib.suppress(OSError):  # it died while idle: reading says how
                worker.send(request)
            deadline = time.monotonic() + max(self.timeout_s, START_TIMEOUT_S)
            while True:
                line = worker.read_line(deadline)
                if worker.closing:
                    raise RuntimeError("the fp4select sandbox was closed while it was probing")
                if line is None:
                    worker.dump_and_kill()
                    return self._blame(attempt, worker, mark, "hang", None)
                if line == b"":
                    return self._blame(attempt, worker, mark, "crash", worker.wait(5.0))
                event = _parse(line)
                if event is None:
                    running = (attempt.last_run or {}).get("backend")
                    kept = attempt.stray.setdefault(running, [])
                    if len(kept) < STRAY_LINES_KEPT:
                        kept.append(line.decode("utf-8", "replace")[:500])
                    continue
                kind = event.get("event")
                if kind == "run":
                    attempt.last_run = event
                    deadline = time.monotonic() + self.timeout_s
                    report(event)
                elif kind == "verdict":
                    verdict = Verdict.from_json(event["verdict"])
                    attempt.verdicts[verdict.backend] = verdict
                    deadline = time.monotonic() + self.timeout_s
                    report(event)
                elif kind == "result":
                    attempt.result = ProbeResult.from_json(event["result"])
                    return attempt
                elif kind == "error":
                    attempt.lost = f"child: {event.get('message', '')}"
                    return attempt
        except BaseException:
            # Interrupted mid-request (or a report callback raised): the worker's state is
            # unknown, so it is not reused.
            worker.kill()
            raise

    def _blame(
        self, attempt: _Attempt, worker: _Worker, mark: int, status: str, returncode: int | None
    ) -> _Attempt:
        run = attempt.last_run or {}
        name, phase, m = run.get("backend"), run.get("phase"), run.get("m")
        tail = worker.stderr_tail(mark)
        if status == "hang":
            words = f"hang: no progress for {self.timeout_s:g} s"
            detail: dict[str, Any] = {"timeout_s": self.timeout_s}
        else:
            assert returncode is not None
            words, detail = _death(returncode)
            words = f"crashed: {words}" if returncode < 0 else words
        if name is None:
            attempt.lost = f"the worker failed ({words}) before it started probing:\n{tail}"
            return attempt
        earlier = attempt.verdicts.get(name)
        detail = {"phase": phase, **detail, "stderr_tail": tail}
        if earlier is not None:
            detail["after_verdict"] = earlier.status  # e.g. heap damage noticed later
        reason = f"{words} {_where(phase, m)}"
        attempt.death = Verdict(name, status, reason, m, detail=detail)
        return attempt


def _timing_culprit(attempt: _Attempt) -> Verdict | None:
    """A CUDA error while timing names no one in the result; the last run event does."""
    assert attempt.result is not None
    run = attempt.last_run or {}
    if run.get("phase") != "time" or run.get("backend") is None:
        return None
    return Verdict(
        run["backend"],
        "cuda-error",
        f"{attempt.result.method} {_where('time', run.get('m'))}"[:2000],
        run.get("m"),
        detail={"phase": "time"},
    )


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def _normalise(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # The child's current device is 0: send the caller's choice explicitly.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# ----------------------------------------------------------------------------------- child


class _Channel:
    """The child's private protocol pipe: one JSON object a line, written through at once."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, event: Mapping[str, Any]) -> None:
        data = memoryview((json.dumps(event, default=str) + "\n").encode())
        while data:
            data = data[os.write(self.fd, data) :]


class _ChildRegistry:
    """Discovery without flashinfer first: importing it costs seconds the CPU never needs."""

    def __init__(self) -> None:
        self.registry: Registry | None = None
        self.full = False

    def get(self, names: set[str]) -> Registry:
        if self.registry is None:
            self.registry = discover(include_flashinfer=False)
        if not self.full and not names <= set(self.registry.backends):
            self.registry, self.full = discover(), True
        return self.registry


def _serve_one(request: Mapping[str, Any], send: _Channel, known: _ChildRegistry) -> ProbeResult:
    problem = Problem.from_json(request["problem"])
    options = ProbeOptions.from_json(request["options"])
    items = request["backends"]
    registry = known.get({item["name"] for item in items if item["spec"] is None})
    early: dict[str, Verdict] = {}
    chosen: list[Backend] = []
    for item in items:
        name, spec = item["name"], item["spec"]
        if spec is not None:
            send({"event": "run", "backend": name, "phase": "import", "m": None})
            try:
                chosen.append(Backend.from_json(spec))
            except Exception as exc:  # an import error is this backend's problem only
                early[name] = Verdict(
                    name,
                    "error",
                    f"could not be rebuilt in the sandbox: {type(exc).__name__}: {exc}"[:2000],
                    detail={"phase": "import", "traceback": traceback.format_exc()[-2000:]},
                )
        elif registry.get(name) is not None:
            chosen.append(registry.backends[name])
        else:
            errors = "; ".join(f"{k}: {v}" for k, v in registry.source_errors.items())
            early[name] = Verdict(
                name, "error", f"not known in the sandbox child ({errors or 'no source errors'})"
            )
        if name in early:
            send({"event": "verdict", "verdict": early[name].to_json()})
    result = probe_mod.probe(problem, chosen, request["device"], options, send)
    result.verdicts = {**early, **result.verdicts}
    return result


def _watch_parent(parent: int) -> None:
    # A busy child does not read stdin, so it would not notice its parent dying; this does.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def main() -> None:
    """The worker loop: one probe request a line on stdin, events and a result on the channel."""
    channel = os.dup(1)
    os.dup2(2, 1)  # a backend's prints land in stderr, not in the protocol
    requests = os.fdopen(os.dup(0), "rb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ[PROTOCOL_FD_ENV] = str(channel)
    # The Python stack of a fatal signal, or of a hang (the parent sends SIGUSR1 before it
    # kills), goes to stderr, where the verdict's tail picks it up.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    send = _Channel(channel)
    known = _ChildRegistry()
    send({"event": "ready", "pid": os.getpid()})
    for line in requests:
        try:
            request = json.loads(line)
            if request.get("op") != "probe":
                raise ValueError(f"unknown request {request.get('op')!r}")
            result = _serve_one(request, send, known)
        except Exception:
            send({"event": "error", "message": traceback.format_exc()[-4000:]})
            continue
        send({"event": "result", "result": result.to_json()})
        if result.aborted:
            break  # a CUDA error poisoned this process: the parent starts a fresh one
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: it can hang on a broken CUDA context


if __name__ == "__main__":
    main()
