"""Probing in a child process: a candidate that crashes, hangs or breaks CUDA takes only the child.

This module decides what each candidate's verdict is and whom to blame (the package's
docstring says what its other modules do). Design rules:

* A CUDA fault is sticky: the process that saw it can never use the GPU again. So every
  unproven candidate runs in a worker child; the caller's process runs a backend only after it
  was proven there. One worker per device is reused across keys; it is shut down after
  ``worker_idle_s`` idle seconds, at ``close()`` and at exit.
* Only plain data crosses: backends registered at runtime go as an importable
  ``module:qualname`` spec. A backend whose functions cannot be named that way gets an
  ``error`` verdict here; nothing is spawned for it.
* A stream out of step (a leftover or forged event, a malformed one, an overlong line) costs
  that worker its life: the attempt's events are discarded and the candidates run again in a
  fresh worker. The backend that was running when it happened twice gets an ``error`` verdict
  for the key (never a blacklisting). Lines that are not JSON objects are not events: they are
  kept in the verdict detail of the backend that was running.
* Blame needs a reproduction. The child says what it is about to run before it runs it
  (``run`` events). When it dies (``crash``), stops reporting (``hang``: no event for
  ``probe_timeout_s``, long because a JIT compile can take minutes) or reports a CUDA error,
  the backend of the last ``run`` event is only the first suspect: a fault can be fired late
  by another candidate (a thread, an asynchronous kernel). The suspect, then every other
  candidate that ran in that child, most recent first, is re-run alone in a fresh child
  (validated, timed, then watched for ``ALONE_LINGER_S``) until one fails the same way: only
  that one gets the fatal verdict. When none does, nobody is blamed: the candidates that ran
  there get an ``error`` verdict for this key that says so (the built-in fallback is simply
  probed again once). Each round settles at least one candidate and the rounds are capped.
* After a death, or after a CUDA error (which poisons the child's context, so the child exits
  after reporting it), a fresh worker continues with every candidate that has no verdict yet
  *and* every one that passed: those are validated again and timed together, so the timings of
  a decision always come from one process and one run.
* The child is the process the OOM killer should pick; its ``oom_score_adj`` is raised.
"""

from __future__ import annotations

import itertools
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fp4select import settings as settings_mod
from fp4select.backends.base import Backend, NotImportableError
from fp4select.backends.emulation import NAME as EMULATION
from fp4select.keys import Problem, resolve_device
from fp4select.records import FATAL_STATUSES, ProbeOptions, ProbeResult, Report, Status, Verdict
from fp4select.sandbox.attempt import (
    STRAY_LINES_KEPT,
    Attempt,
    Failure,
    Job,
    run_attempt,
    scaled_timeout_s,
    timing_failure,
)
from fp4select.sandbox.process import WorkerPool
from fp4select.settings import Settings

if TYPE_CHECKING:
    from fp4select.backends import Registry

__all__ = ["SandboxProber", "scaled_timeout_s"]

# How long a candidate re-run alone is watched after its last step, for faults fired late.
ALONE_LINGER_S = 1.0
# Protocol failures while one backend runs before it gets an "error" verdict for the key.
PROTOCOL_STRIKES = 2


class SandboxProber:
    """Runs the probe in a worker child per device; see the module docstring for the rules."""

    isolation = "subprocess"

    def __init__(
        self,
        timeout_s: float | None = None,
        idle_s: float | None = None,
        linger_s: float = ALONE_LINGER_S,
        settings: Settings | None = None,
        *,
        registry: Callable[[], Registry],
    ) -> None:
        # ``settings`` also reach the worker children, as their environment variables.
        self.settings = settings if settings is not None else settings_mod.current()
        # The caller's backends (``backends.discover``, or the selector's cached registry): the
        # child finds by name those it would discover itself; the others go as specs.
        self.registry = registry
        self.timeout_s = timeout_s or self.settings.probe_timeout_s
        self.idle_s = idle_s or self.settings.worker_idle_s
        if not (math.isfinite(linger_s) and linger_s >= 0):
            raise ValueError(f"linger_s must be a finite number >= 0, got {linger_s!r}")
        self.linger_s = linger_s
        self._pool = WorkerPool(self.idle_s, self.settings)
        self._requests = itertools.count(1)

    # -- workers ----------------------------------------------------------------------------
    def start(self, device: torch.device | str) -> float:
        """Start the device's worker now and wait until it is ready; returns the seconds waited.

        Optional: ``probe`` starts the worker when it first needs it. Starting early overlaps
        the child's imports with the caller's own start-up.
        """
        begin = time.monotonic()
        # The child's current device is 0: send the caller's choice explicitly.
        self._pool.start(str(resolve_device(device)), self.timeout_s)
        return time.monotonic() - begin

    def close(self) -> None:
        """End every worker of this prober (a probe running in another thread then fails)."""
        self._pool.close()

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
        that timed; ``seconds`` is the wall time of all attempts and restarts together. Each
        attempt ends one of four ways, each handled by its own method: the stream went out of
        step, a result came back, the child died or hung, or it was lost before anything ran.
        """
        started = time.perf_counter()
        device = resolve_device(device)
        report = report or (lambda event: None)
        verdicts: dict[str, Verdict] = {}
        job = Job(
            problem=problem,
            device=device,
            options=options,
            specs=self._specs(self.registry(), backends, verdicts, report),
            builtin=frozenset(
                b.name for b in backends if b.family == "builtin" or b.name == EMULATION
            ),
            report=report,
            timeout_s=self.timeout_s,
            linger_s=self.linger_s,
        )
        run = _Run(str(device), job, verdicts, [b.name for b in backends if b.name not in verdicts])
        rounds_left = 4 * len(run.pending) + 4  # each round settles one; this is a backstop
        with self._pool.lock(run.key):
            while run.pending:
                rounds_left -= 1
                if rounds_left < 0:
                    run.settle_all("the sandbox gave up after too many restarts")
                    break
                request = self._request(job, run.pending, untuned=run.untuned)
                attempt = run_attempt(self._pool.get(run.key), request, job)
                for name, lines in attempt.stray.items():
                    if name is not None:
                        run.stray.setdefault(name, []).extend(lines)
                if attempt.out_of_step is not None:
                    done = self._out_of_step(run, attempt)
                else:
                    for verdict in attempt.verdicts.values():
                        if verdict.status not in FATAL_STATUSES:
                            verdicts[verdict.backend] = verdict
                    if attempt.result is not None:
                        done = self._returned(run, attempt, attempt.result)
                    elif attempt.failure is not None:
                        self._pool.retire(run.key)
                        if not self._tuning_hung(run, attempt.failure):
                            self._settle(run, attempt.failure, attempt.ran)
                        done = False
                    else:
                        done = self._lost(run, attempt)
                if done:
                    break
                run.pending = [n for n in run.pending if n not in verdicts or verdicts[n].passed]
            if run.key in self._pool.workers:
                self._pool.arm_idle_timer(run.key, self._pool.workers[run.key])

        for name, lines in run.stray.items():
            if name in verdicts:
                verdicts[name].detail["stdout"] = lines[-STRAY_LINES_KEPT:]
        ordered = {b.name: verdicts[b.name] for b in backends if b.name in verdicts}
        passed = {n for n, v in ordered.items() if v.passed}
        return ProbeResult(
            verdicts=ordered,
            timings={n: t for n, t in run.timings.items() if n in passed},
            method=run.method,
            seconds=time.perf_counter() - started,
            aborted=False,
        )

    # -- the four ways an attempt ends (True: the probe is over) ----------------------------
    def _out_of_step(self, run: _Run, attempt: Attempt) -> bool:
        """The stream went out of step: a fresh worker, and a strike against the one running."""
        self._pool.retire(run.key)
        running = (attempt.last_run or {}).get("backend")
        run.strikes[running] = run.strikes.get(running, 0) + 1
        if run.strikes[running] >= PROTOCOL_STRIKES:
            why = f"the sandbox protocol went out of step ({attempt.out_of_step})"
            if running is None:
                run.settle_all(why)
                return True
            run.verdicts[running] = Verdict(
                running,
                Status.ERROR,
                f"{why} twice while it ran"[:2000],
                detail={"phase": "protocol"},
            )
            run.job.report({"event": "verdict", "verdict": run.verdicts[running].to_json()})
        return False

    def _returned(self, run: _Run, attempt: Attempt, result: ProbeResult) -> bool:
        """The child returned a result: done, unless it holds a fatal verdict or was aborted."""
        failure: Failure | None = None
        for name, verdict in result.verdicts.items():
            if verdict.status in FATAL_STATUSES:
                failure = Failure(verdict.status, verdict.reason, name, verdict.m, verdict.detail)
            else:
                run.verdicts[name] = verdict
        if result.timings:
            run.timings, run.method = result.timings, result.method
        elif result.method != "none":
            run.method = result.method
        if not result.aborted and failure is None:
            return True
        self._pool.retire(run.key)  # its CUDA context is gone, and the child with it
        failure = failure or timing_failure(attempt)
        if failure is not None:
            self._settle(run, failure, attempt.ran)
        return False

    def _lost(self, run: _Run, attempt: Attempt) -> bool:
        """The child failed before anything ran: once may be bad luck (it died while idle);
        twice, or an error it reported itself, will not go away."""
        run.unexplained += 1
        if attempt.lost and attempt.lost.startswith("child:"):
            run.unexplained = 2
        else:
            self._pool.retire(run.key)
        if run.unexplained >= 2:
            run.settle_all(f"the sandbox failed: {attempt.lost}")
            return True
        return False

    @staticmethod
    def _tuning_hung(run: _Run, failure: Failure) -> bool:
        """A hang while a backend tuned its tactics: slow JIT, not a fault. That backend runs
        again untuned (at flashinfer's default tactic, the reason recorded), never blacklisted
        for it; a second hang there is blamed as usual."""
        name = failure.suspect
        if (
            failure.status != Status.HANG
            or failure.detail.get("phase") != "tune"
            or name is None
            or name in run.untuned
        ):
            return False
        window = failure.detail.get("timeout_s")
        window = f"{window:g}" if isinstance(window, (int, float)) else "?"
        run.untuned[name] = (
            f"tuning its tactics made no progress for {window} s "
            "in the sandbox (FP4SELECT_PROBE_TIMEOUT_S; a tactic's JIT can take minutes); "
            "served at flashinfer's default tactic"
        )
        return True

    def _request(
        self,
        job: Job,
        names: Sequence[str],
        alone: bool = False,
        untuned: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        request: dict[str, Any] = {
            "op": "probe",
            # A counter makes ids unique here; the token makes a stale or guessed one unlikely.
            "id": f"{next(self._requests)}-{secrets.token_hex(8)}",
            "problem": job.problem.to_json(),
            "device": str(job.device),
            "options": job.options.to_json(),
            "backends": [{"name": n, "spec": job.specs[n]} for n in names],
        }
        for item in request["backends"]:
            if item["name"] in (untuned or {}):
                item["untuned"] = (untuned or {})[item["name"]]
        if alone:
            request["alone"] = True
            request["linger_s"] = self.linger_s
        return request

    @staticmethod
    def _specs(
        registry: Registry,
        backends: Sequence[Backend],
        verdicts: dict[str, Verdict],
        report: Report,
    ) -> dict[str, Any]:
        """Plain-data specs for the backends the child cannot find by itself."""
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
                    backend.name, Status.ERROR, str(exc), detail={"phase": "serialise"}
                )
                report({"event": "verdict", "verdict": verdicts[backend.name].to_json()})
        return specs

    # -- blame ------------------------------------------------------------------------------
    def _settle(self, run: _Run, failure: Failure, ran: Sequence[str]) -> None:
        """Find who reproduces ``failure`` alone; blame only that one, or nobody."""
        key, job, verdicts, spared = run.key, run.job, run.verdicts, run.spared
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
        words = {Status.CRASH: "died", Status.HANG: "hung"}.get(failure.status, "hit a CUDA error")
        reason = (
            f"the sandbox child {words} ({failure.reason}) but no candidate reproduced it alone"
        )
        detail = {
            "phase": "sandbox",
            "unreproduced": {
                **failure.summary(),
                "stderr_tail": failure.detail.get("stderr_tail", ""),
            },
            "rerun_alone": {n: v.status.value for n, v in alone.items()},
        }
        for other in order:
            if other in alone and not alone[other].passed:
                continue
            if other in job.builtin and other not in spared:
                spared.add(other)  # the fallback is probed again rather than excluded
                continue
            m = failure.m if other == failure.suspect else None
            verdicts[other] = Verdict(other, Status.ERROR, reason[:2000], m, detail=dict(detail))
            job.report({"event": "verdict", "verdict": verdicts[other].to_json()})

    def _alone(self, key: str, name: str, job: Job) -> Verdict:
        """``name``'s verdict when it runs by itself in a fresh child."""
        self._pool.retire(key)
        attempt = run_attempt(
            self._pool.get(key), self._request(job, [name], alone=True), job, alone=True
        )
        self._pool.retire(key)  # nothing else runs in a child that ran a suspect
        if attempt.out_of_step is not None:
            reason = (
                f"the sandbox protocol went out of step while it ran alone ({attempt.out_of_step})"
            )
            return Verdict(name, Status.ERROR, reason[:2000], detail={"phase": "protocol"})
        if attempt.result is not None:
            verdict = attempt.result.verdicts.get(name)
            if verdict is not None and verdict.status in FATAL_STATUSES:
                return verdict
            if attempt.result.aborted:  # timing broke the context, and it ran alone
                failure = timing_failure(attempt)
                if failure is not None:
                    return failure.verdict(name)
            if verdict is not None:
                return verdict
            return Verdict(
                name, Status.ERROR, "no verdict when it ran alone", detail={"phase": "sandbox"}
            )
        if attempt.failure is not None:
            return attempt.failure.verdict(name)  # it was alone: whatever ran was its doing
        reason = f"the sandbox failed while it ran alone: {attempt.lost}"
        return Verdict(name, Status.ERROR, reason[:2000], detail={"phase": "sandbox"})


@dataclass
class _Run:
    """What one ``SandboxProber.probe`` call has learnt so far, across its attempts."""

    key: str  # the device, as the worker pool names it
    job: Job
    verdicts: dict[str, Verdict]
    pending: list[str]  # candidates still to run: no verdict yet, or passed (run again)
    timings: dict[str, Any] = field(default_factory=dict)
    method: str = "none"
    stray: dict[str, list[str]] = field(default_factory=dict)
    unexplained: int = 0  # attempts lost before anything ran
    strikes: dict[str | None, int] = field(default_factory=dict)  # out of step, per backend
    spared: set[str] = field(default_factory=set)  # built-ins already given a second chance
    # Backends whose tactic tuning hung the child: run again at flashinfer's default tactic,
    # with this reason, rather than blamed (tuning is slow, not faulty).
    untuned: dict[str, str] = field(default_factory=dict)

    def settle_all(self, reason: str) -> None:
        """An ``error`` verdict for every pending candidate that has none (or passed)."""
        for name in self.pending:
            if name not in self.verdicts or self.verdicts[name].passed:
                self.verdicts[name] = Verdict(
                    name, Status.ERROR, reason[:2000], detail={"phase": "sandbox"}
                )
