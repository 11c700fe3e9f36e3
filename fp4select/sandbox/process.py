"""Sandbox worker processes, parent side: start them, talk to them, end them, decode deaths.

Design rules:

* One persistent worker per device (a ``WorkerPool`` key), started on first use and reused
  across keys, because starting one costs seconds (torch, flashinfer, JIT caches). It is shut
  down after the pool's idle seconds, at ``close()`` and at exit; shutting it down kills its
  whole process group, so helpers a backend spawned go with it. It exits by itself when its
  stdin closes or its parent goes away, so it never holds GPU memory for a caller that is gone.
* A process forked from the caller starts its own workers: every pool forgets the parent's
  workers (without touching them) and the locks another thread may have held at the fork.
* The child cannot import from the caller's working directory by accident: it is started with
  ``-P`` (Python 3.11+) and a bootstrap that drops a leading ``''`` from ``sys.path``. Its
  environment is the caller's (same ``CUDA_VISIBLE_DEVICES`` mapping) with the caller's real
  ``sys.path`` entries added to ``PYTHONPATH`` (not ``''``), so the plugins the caller imported
  from a named directory, and test modules, are importable in the child too; and with the
  pool's ``Settings`` written over the ``FP4SELECT_*`` variables, so what ``configure()`` set
  (the experimental switch, the tactic mode) holds in the child as well.
* Only JSON crosses, one object a line. A line over ``MAX_LINE_BYTES`` is garbage, not an
  event: reading it raises ``OutOfStep``. A line that is not a JSON object is not an event
  (``parse`` returns None): a backend's stray output, which the prober keeps as detail.
* The child's stderr goes to a file, not a pipe: nobody has to drain it, and a dead child's last
  words stay readable for the verdict's detail.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from fp4select.settings import Settings

__all__ = [
    "MAX_LINE_BYTES",
    "START_TIMEOUT_S",
    "OutOfStep",
    "Worker",
    "WorkerPool",
    "death",
    "parse",
]

# Until the child announces its first run, it is importing torch, flashinfer and plugins:
# slow on a cold disk, and nobody's fault, so it gets at least this long.
START_TIMEOUT_S = 300.0
STDERR_TAIL_CHARS = 4000

_BOOTSTRAP = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"  # -c puts the working directory first, unless -P
    "    del sys.path[0]\n"
    "from fp4select.sandbox.worker import main\n"
    "main()\n"
)


# A real event is a few KB (tracebacks and stderr tails are cut); a longer line is garbage.
MAX_LINE_BYTES = 8 << 20


class OutOfStep(Exception):
    """The worker's stream cannot be trusted any more."""


def parse(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def child_command() -> list[str]:
    """The interpreter, told not to put the working directory on ``sys.path``."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-c", _BOOTSTRAP]


def child_environment(settings: Settings | None = None) -> dict[str, str]:
    """The caller's environment, ``settings`` as variables, and the caller's ``sys.path``."""
    env = dict(os.environ)
    for name, value in (settings.to_env() if settings is not None else {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    # '' means "the working directory, whatever it is": never hand that to the child.
    paths = [os.path.abspath(p) for p in sys.path if isinstance(p, str) and p]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def death(returncode: int) -> tuple[str, dict[str, Any]]:
    """Why the child ended, in words, and as detail fields."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        words = "killed (out of memory?) by SIGKILL" if name == "SIGKILL" else f"killed by {name}"
        return words, {"signal": name}
    return f"exited with code {returncode} without a result", {"exit_code": returncode}


class Worker:
    """One child process and the parent's end of its pipes."""

    def __init__(self, device: str, settings: Settings | None = None) -> None:
        self.device = device
        # A file, not a pipe: nobody has to drain it, and a dead child's last words stay.
        self.stderr = tempfile.TemporaryFile(prefix="fp4select-sandbox-")  # noqa: SIM115
        self.proc = subprocess.Popen(
            child_command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=child_environment(settings),
            start_new_session=True,  # its own process group: ended with every helper in it
            bufsize=0,
        )
        assert self.proc.stdout is not None  # stdout=PIPE above
        self.fd = self.proc.stdout.fileno()
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
                raise OutOfStep(f"a line longer than {MAX_LINE_BYTES} bytes")
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

    def wait(self, timeout: float) -> int:
        """The exit status, killing the process group if the child will not end by itself."""
        self._wait_exit(timeout)
        return self.kill()

    def dump_and_kill(self) -> None:
        """Kill a hung child, first asking faulthandler for every thread's stack (into stderr)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.proc.pid, signal.SIGUSR1)
            self._wait_exit(0.5)
        self.kill()

    def kill(self) -> int:
        """End whatever is left of its process group, then collect the child's exit status."""
        if self.proc.returncode is None:  # unreaped, so its pid still names the group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()

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

    def take_ready(self, event: Mapping[str, Any]) -> bool:
        """Whether this is the worker's one ``ready`` event (true once, then never again)."""
        if self.ready or event.get("event") != "ready" or event.get("pid") != self.pid:
            return False
        self.ready = True
        return True


_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
_abandoned: list[Worker] = []  # a forked child's copies of its parent's workers, never reaped


@atexit.register
def _close_all() -> None:
    for pool in list(_pools):
        pool.close()


def _after_fork_in_child() -> None:
    for pool in list(_pools):
        pool.forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class WorkerPool:
    """The live worker of each device key, one lock per key; see the module docstring."""

    def __init__(self, idle_s: float, settings: Settings | None = None) -> None:
        self.idle_s = idle_s
        self.settings = settings  # written into each worker's environment
        self.workers: dict[str, Worker] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        _pools.add(self)

    def lock(self, key: str) -> threading.Lock:
        """The lock a caller holds while it uses the key's worker."""
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def get(self, key: str) -> Worker:
        """The live worker for a key, started if there is none (caller holds the key's lock)."""
        worker = self.workers.get(key)
        if worker is not None and not worker.alive():
            self.retire(key)
            worker = None
        if worker is None:
            worker = self.workers[key] = Worker(key, self.settings)
        return worker

    def retire(self, key: str) -> None:
        worker = self.workers.pop(key, None)
        if worker is not None:
            worker.close(grace=2.0)

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's workers and lock holders are not ours."""
        self._guard = threading.Lock()
        self._locks = {}
        workers, self.workers = self.workers, {}
        for worker in workers.values():
            worker.abandon()
            _abandoned.append(worker)

    def arm_idle_timer(self, key: str, worker: Worker) -> None:
        worker.last_used = time.monotonic()
        if worker.timer is not None:
            worker.timer.cancel()
        worker.timer = threading.Timer(self.idle_s, self._idle, (key, worker))
        worker.timer.daemon = True
        worker.timer.start()

    def _idle(self, key: str, worker: Worker) -> None:
        lock = self.lock(key)
        if not lock.acquire(blocking=False):
            return  # busy: the user re-arms the timer when it is done
        try:
            idle = time.monotonic() - worker.last_used
            if self.workers.get(key) is worker and idle >= self.idle_s * 0.99:
                self.retire(key)
        finally:
            lock.release()

    def start(self, key: str, timeout_s: float) -> None:
        """Start the key's worker now and wait until it says it is ready."""
        with self.lock(key):
            worker = self.get(key)
            mark = worker.stderr_size()
            deadline = time.monotonic() + max(timeout_s, START_TIMEOUT_S)
            while not worker.ready:
                try:
                    line = worker.read_line(deadline)
                except OutOfStep:
                    line = None
                if not line:  # the deadline passed, or the child is gone
                    tail = worker.stderr_tail(mark)
                    self.retire(key)
                    raise RuntimeError(f"the fp4select sandbox worker did not start:\n{tail}")
                event = parse(line)
                if event is not None:
                    worker.take_ready(event)  # anything else before it is import noise
            self.arm_idle_timer(key, worker)

    def close(self) -> None:
        with self._guard:
            keys = list(self.workers)
        for key in keys:
            lock = self.lock(key)
            if lock.acquire(timeout=1.0):
                try:
                    self.retire(key)
                finally:
                    lock.release()
            elif (worker := self.workers.get(key)) is not None:
                # Another thread is using it (at exit, a daemon thread may be): end the child
                # and let that user fail, rather than blame its backend for our kill.
                worker.closing = True
                worker.kill()
