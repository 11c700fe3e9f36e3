"""The sandbox child: reads probe requests, runs them, and reports on a private channel.

The parent half (``prober.py``) starts this module in a fresh interpreter and trusts nothing
it says until it has checked it; this half only has to be honest and unambiguous.

Design rules:

* The protocol channel is private: before anything is imported, stdout moves onto stderr and
  stdin onto /dev/null, so a backend that prints (or reads) cannot corrupt it. Its file
  descriptor is in ``FP4SELECT_SANDBOX_FD`` (tests use it to corrupt the channel on purpose).
* Every event of a request carries that request's ``id``, so the parent can tell a current
  event from a leftover or a forgery; each line starts with a newline, so a backend's partial
  line on the channel cannot swallow the next event.
* Before it runs anything the child says what it is about to run (``run`` events: backend,
  phase, M), flushed, so that if it dies the parent knows where.
* An ``alone`` request re-runs one candidate by itself to confirm a death the parent saw: it is
  validated, timed even though it has no rival (a crash under repetition must show again), and
  the child then waits ``linger_s`` seconds under a ``linger`` event, so that a fault a
  background thread fires a little later still lands on the backend that started it.
* The child is the process the OOM killer should pick (``oom_score_adj`` 1000): it is
  expendable, the caller is not. It exits when its stdin closes or its parent goes away, and
  after a CUDA error (its context is dead), skipping interpreter teardown, which can hang on a
  broken context.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fp4select import probe as probe_mod
from fp4select.backends import Registry, discover
from fp4select.backends.base import Backend
from fp4select.backends.flashinfer_tactics import untuned_tune
from fp4select.keys import Problem
from fp4select.records import ProbeOptions, ProbeResult, Status, Verdict

# Set in the child: the file descriptor of the protocol channel (for tests that corrupt it).
PROTOCOL_FD_ENV = "FP4SELECT_SANDBOX_FD"
OOM_SCORE_ADJ = 1000  # the most expendable process on the machine


def _channel(fd: int) -> Callable[[Mapping[str, Any]], None]:
    """The child's private protocol pipe: one JSON object a line, written through at once."""

    def send(event: Mapping[str, Any]) -> None:
        # The leading newline ends whatever partial line a backend may have left on the pipe.
        data = memoryview(("\n" + json.dumps(event, default=str) + "\n").encode())
        while data:
            data = data[os.write(fd, data) :]

    return send


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


def _probe_alone(
    problem: Problem,
    backend: Backend,
    device: str,
    options: ProbeOptions,
    linger_s: float,
    send: Callable[[Mapping[str, Any]], None],
) -> ProbeResult:
    """One candidate by itself, through every phase a probe can put it through, then a wait."""
    result = probe_mod.probe(problem, [backend], device, options, send)
    verdict = result.verdicts.get(backend.name)
    if verdict is not None and verdict.passed and not options.validate_only:
        try:  # the full probe does not time a lone candidate; a confirmation must
            result.timings, result.method = probe_mod.time_backends(
                [backend], problem, torch.device(device), options, send
            )
        except Exception as exc:
            cuda = probe_mod.classify(backend, exc, problem.m_bucket)
            if cuda.status == Status.CUDA_ERROR:
                cuda.detail["phase"] = "time"
                result.verdicts[backend.name], result.aborted = cuda, True
                send({"event": "verdict", "verdict": cuda.to_json()})
                return result
            result.method = f"timing failed: {type(exc).__name__}: {exc}"[:300]
    if not result.aborted and linger_s > 0:
        send({"event": "run", "backend": backend.name, "phase": "linger", "m": None})
        deadline = time.monotonic() + linger_s
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
    return result


def _serve_one(
    request: Mapping[str, Any], send: Callable[[Mapping[str, Any]], None], known: _ChildRegistry
) -> ProbeResult:
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
                    Status.ERROR,
                    f"could not be rebuilt in the sandbox: {type(exc).__name__}: {exc}"[:2000],
                    detail={"phase": "import", "traceback": traceback.format_exc()[-2000:]},
                )
        elif registry.get(name) is not None:
            chosen.append(registry.backends[name])
        else:
            errors = "; ".join(f"{k}: {v}" for k, v in registry.source_errors.items())
            early[name] = Verdict(
                name,
                Status.ERROR,
                f"not known in the sandbox child ({errors or 'no source errors'})",
            )
        if name in early:
            send({"event": "verdict", "verdict": early[name].to_json()})
        elif isinstance(item.get("untuned"), str) and chosen[-1].tune is not None:
            # its tuning hung an earlier child: flashinfer's default tactic, with the reason
            why = item["untuned"]
            chosen[-1] = dataclasses.replace(chosen[-1], tune=untuned_tune(why))
    if request.get("alone") and len(chosen) == 1:
        linger_s = float(request.get("linger_s") or 0.0)
        result = _probe_alone(problem, chosen[0], request["device"], options, linger_s, send)
    else:
        result = probe_mod.probe(problem, chosen, request["device"], options, send)
    result.verdicts = {**early, **result.verdicts}
    return result


def _watch_parent(parent: int) -> None:
    # A busy child does not read stdin, so it would not notice its parent dying; this does.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def _volunteer_for_the_oom_killer() -> None:
    # Raising one's own score needs no privilege; where there is no such file, nothing to do.
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as fh:
        fh.write(str(OOM_SCORE_ADJ))


def main() -> None:
    """The worker loop: one probe request a line on stdin, events and a result on the channel."""
    channel = os.dup(1)
    os.dup2(2, 1)  # a backend's prints land in stderr, not in the protocol
    requests = os.fdopen(os.dup(0), "rb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ[PROTOCOL_FD_ENV] = str(channel)
    _volunteer_for_the_oom_killer()
    # The Python stack of a fatal signal, or of a hang (the parent sends SIGUSR1 before it
    # kills), goes to stderr, where the verdict's tail picks it up.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    channel_send = _channel(channel)
    known = _ChildRegistry()
    channel_send({"event": "ready", "pid": os.getpid()})
    for line in requests:
        request_id = None
        try:
            request = json.loads(line)
            request_id = request.get("id")
            if request.get("op") != "probe" or not isinstance(request_id, str):
                raise ValueError(f"unknown request {request.get('op')!r}")

            def send(event: Mapping[str, Any], _id: str = request_id) -> None:
                channel_send({**event, "id": _id})

            result = _serve_one(request, send, known)
        except Exception:
            message = traceback.format_exc()[-4000:]
            channel_send({"event": "error", "id": request_id, "message": message})
            continue
        send({"event": "result", "result": result.to_json()})
        if result.aborted:
            break  # a CUDA error poisoned this process: the parent starts a fresh one
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: it can hang on a broken CUDA context
