"""Miss handling: candidates -> probe -> decide -> store -> the winner's runner.

Why one file of ~620 lines: like Triton's ``autotuner.py``, the whole mechanism (lookup order,
candidates, locking, probing, the decision, the blacklist, binding) reads in one place; the
parts it uses (keys, timing, probe, sandbox, store, backends) are modules of their own.

Design rules:

* Order of lookup: this process's memory, then the disk store, then tuning. Tuning happens
  under the per-key file lock, and the entry is read again once the lock is held: when N
  processes miss together, one tunes and the others read its result.
* A candidate is probed only if it is listed, available here, declares the problem, and is not
  blacklisted for this environment. Every excluded one gets a verdict with the reason, so
  ``explain`` can say why a backend was never tried.
* A fallback (``Backend.fallback_on``: emulation on CUDA; docs/design.md, 'The fallback')
  cannot win where another candidate passes, so it is probed only when none does, in a second
  probe call; otherwise it gets a ``skipped`` verdict saying why (still considered, so the
  entry is not stale for it). A batch-invariant problem, which preference decides, probes it
  with the others.
* Verdicts that mean the process died or its CUDA context broke (crash, hang, cuda-error)
  blacklist the backend for the whole environment (``blacklist_scope="key"`` narrows it to the
  key); wrong numbers, OOM and errors only reject it for this key.
* An entry names the backends that competed for it. One that could compete now but did not
  then (a new plugin, an experimental backend allowed, a blacklisting cleared) makes the entry
  stale; so does a winner that can no longer run here.
* While a CUDA graph is being captured nothing is tuned: a proven backend of the same shape
  (another bucket) or emulation serves, and the key is remembered for ``tune_pending``.
* A disk hit whose winner is not flashinfer's is bound without importing flashinfer (seconds of
  start-up): flashinfer's stored verdicts were judged in this same environment (its fingerprint
  holds flashinfer's version and the GPU), so only what can change inside one environment is
  re-read (the experimental switch, the blacklist); else the full registry is discovered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fp4select import backends as registry_mod
from fp4select import settings as settings_mod
from fp4select.backends import emulation
from fp4select.backends import flashinfer as flashinfer_backends
from fp4select.backends.base import Backend, Runner
from fp4select.keys import Problem, environment_for
from fp4select.probe import InProcessProber, Prober
from fp4select.records import (
    CAUSE_EXPERIMENTAL,
    FATAL_STATUSES,
    Decision,
    MalformedRecord,
    ProbeOptions,
    ProbeResult,
    Status,
    Verdict,
    _now,
)
from fp4select.settings import Isolation, Settings
from fp4select.store import Store, digest, warn_once
from fp4select.timing import TimingOptions, preference_ranking, rank

log = logging.getLogger("fp4select")

# Never blacklisted beyond one key, and never by an imported archive: every supported problem
# must keep a correct answer.
PROTECTED_BACKENDS = frozenset({emulation.NAME})


class BlacklistedBackendError(RuntimeError):
    """An explicitly requested backend is blacklisted in this environment."""


class NoCorrectBackendError(RuntimeError):
    """No candidate passed validation for a problem (not even emulation)."""


@dataclass
class Counters:
    memory_hits: int = 0
    disk_hits: int = 0
    tunings: int = 0
    waited_for_other_process: int = 0
    proofs: int = 0  # imported decisions validated here before they served
    fallbacks: int = 0
    explicit: int = 0
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str) -> None:
        """Count one event; threads share the selector, and ``+=`` on an attribute can lose one."""
        with self._guard:
            setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, int]:
        with self._guard:
            return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class Selector:
    def __init__(
        self,
        store: Store | None = None,
        isolation: str | None = None,
        timing: TimingOptions | None = None,
        lock_timeout: float = 3600.0,
        settings: Settings | None = None,
    ) -> None:
        self.settings = settings if settings is not None else settings_mod.current()
        self.store = store if store is not None else Store(self.settings.cache_dir)
        # A bad ``isolation`` is a SettingError naming it, as a bad setting is.
        self.isolation: Isolation = (
            self.settings.replace(isolation=isolation) if isolation else self.settings
        ).isolation
        self.timing = timing or TimingOptions(budget_s=self.settings.time_budget_s)
        self.lock_timeout = lock_timeout
        self.counters = Counters()
        self.pending: set[tuple[Problem, str]] = set()
        self._memory: dict[Hashable, Decision] = {}
        self._prober: Prober | None = None
        self._lock = threading.RLock()
        # include_flashinfer -> (the registry generation it was discovered in, the registry)
        self._registries: dict[bool, tuple[int, registry_mod.Registry]] = {}

    # -- parts -----------------------------------------------------------------------------
    def registry(
        self, refresh: bool = False, include_flashinfer: bool = True
    ) -> registry_mod.Registry:
        """The registered backends, discovered again when the registry changed since."""
        with self._lock:
            generation = registry_mod.generation()
            held = self._registries.get(include_flashinfer)
            if held is None or refresh or held[0] != generation:
                held = (generation, registry_mod.discover(include_flashinfer=include_flashinfer))
                self._registries[include_flashinfer] = held
            return held[1]

    def light_registry(self) -> registry_mod.Registry:
        """Every backend but flashinfer's: what a disk hit can be checked against cheaply."""
        return self.registry(include_flashinfer=False)

    def _full_registry_current(self) -> bool:
        with self._lock:
            held = self._registries.get(True)
            return held is not None and held[0] == registry_mod.generation()

    def backend(self, name: str) -> Backend | None:
        """The backend called ``name``, importing flashinfer only when it may be flashinfer's.

        A name flashinfer may own (its known backends, its batch-invariant class) is always
        looked up in the full registry: flashinfer's backend shadows a plugin of the same name.
        """
        if not self._full_registry_current() and name not in _FLASHINFER_NAMES:
            backend = self.light_registry().get(name)
            if backend is not None:
                return backend
        return self.registry().get(name)

    def prober(self) -> Prober:
        """The one prober of this selector: two threads must never start two sandbox workers."""
        with self._lock:
            if self._prober is None:
                if self.isolation == "inprocess":
                    self._prober = InProcessProber()
                else:
                    from fp4select.sandbox.prober import SandboxProber

                    self._prober = SandboxProber(settings=self.settings, registry=self.registry)
            return self._prober

    def close(self) -> None:
        with self._lock:
            prober, self._prober = self._prober, None
        if prober is not None:
            prober.close()

    @staticmethod
    def _memory_key(env: Mapping[str, Any], problem: Problem) -> Hashable:
        """The key of this process's memory: the problem and the environment's items as they
        are (a JSON digest of both took about 100 us, paid on every warm-path miss, which an
        eager prefill of a new length pays once per shape); a digest where a value is not
        hashable."""
        try:
            return (problem, tuple(sorted(env.items())))
        except TypeError:
            return digest({"env": env, "problem": problem.to_json()})

    # -- candidates ----------------------------------------------------------------------
    def candidates(
        self, problem: Problem, env: Mapping[str, Any], registry: registry_mod.Registry
    ) -> tuple[list[Backend], dict[str, Verdict]]:
        blacklist = self.store.blacklist(env)
        runnable: list[Backend] = []
        excluded: dict[str, Verdict] = {}
        for name, backend in registry.backends.items():
            entry = blacklist.get(name)
            if entry and _blacklist_applies(entry, problem):
                excluded[name] = Verdict(
                    name,
                    Status.BLACKLISTED,
                    f"{entry.get('kind', '?')} on {entry.get('when', '?')}: "
                    f"{entry.get('reason', '')}",
                    detail={"blacklist": entry},
                )
                continue
            why = backend.unavailable_reason(env)
            if why:
                cause = getattr(why, "cause", "")  # a records.Reason says why as data
                excluded[name] = Verdict(name, Status.UNAVAILABLE, str(why), cause=cause)
                continue
            why = backend.rejects(problem, env)
            if why:
                excluded[name] = Verdict(name, Status.UNSUPPORTED, why)
                continue
            runnable.append(backend)
        return runnable, excluded

    # -- decisions ----------------------------------------------------------------------------
    # Each takes ``env`` when its caller knows it (computed once per miss, passed down).
    def in_memory(
        self, problem: Problem, device: torch.device, *, env: Mapping[str, Any] | None = None
    ) -> bool:
        env = env if env is not None else environment_for(device)
        with self._lock:
            return self._memory_key(env, problem) in self._memory

    def lookup(
        self, problem: Problem, device: torch.device, *, env: Mapping[str, Any] | None = None
    ) -> Decision | None:
        """Memory, then disk; no tuning."""
        env = env if env is not None else environment_for(device)
        mkey = self._memory_key(env, problem)
        with self._lock:
            decision = self._memory.get(mkey)
        if decision is not None:
            self.counters.add("memory_hits")
            return decision
        decision = self._read(env, problem)
        if decision is not None:
            self.counters.add("disk_hits")
            with self._lock:
                self._memory[mkey] = decision
        return decision

    def _read(
        self, env: Mapping[str, Any], problem: Problem, unproven: bool = False
    ) -> Decision | None:
        """The stored decision if it may serve here; an imported one not yet proven here only
        with ``unproven`` (decide() proves it under the key's lock)."""
        record = self.store.read_entry(env, problem.to_json())
        if record is None:
            return None
        try:
            decision = Decision.from_json(record, source="disk")
        except MalformedRecord as exc:
            message = (
                f"fp4select cache: ignoring the stored decision for {problem.describe()}: {exc}. "
                "Treated as a miss; tuning again replaces it."
            )
            warn_once(message, message)
            return None
        if decision.problem != problem or (decision.imported and not unproven):
            return None
        if self._fresh_without_flashinfer(env, problem, decision):
            return decision
        registry = self.registry()
        runnable, _ = self.candidates(problem, env, registry)
        new = {b.name for b in runnable} - set(decision.considered)
        if new:
            log.info(
                "decision for %s did not consider %s, which can run here now; tuning again",
                problem.describe(),
                sorted(new),
            )
            return None
        if decision.winner not in {b.name for b in runnable}:
            log.info(
                "decision for %s names %s, which is gone or blacklisted here; tuning again",
                problem.describe(),
                decision.winner,
            )
            return None
        return decision

    def _fresh_without_flashinfer(
        self, env: Mapping[str, Any], problem: Problem, decision: Decision
    ) -> bool:
        """True when ``decision`` is fresh and its winner runs here, told without flashinfer
        (why that is enough: the module's rules). False means "cannot tell cheaply", never
        "stale": the caller then runs the full check."""
        if self._full_registry_current() or decision.winner in _FLASHINFER_NAMES:
            return False  # flashinfer is loaded already, or it must be loaded to serve
        light = self.light_registry()
        if decision.winner not in light.backends:
            return False
        runnable, _ = self.candidates(problem, env, light)
        names = {b.name for b in runnable}
        if decision.winner not in names or names - set(decision.considered):
            return False
        if env.get("device") != "cuda":
            return True  # flashinfer's kernels need a CUDA GPU: none of them can compete here
        others = {n: v for n, v in decision.verdicts.items() if n not in light.backends}
        if not others and env.get("flashinfer") is not None:
            return False  # installed but listed nothing then (a failed import?): ask it now
        blacklist = self.store.blacklist(env)
        allowed = flashinfer_backends.experimental_allowed()
        for name, verdict in others.items():
            entry = blacklist.get(name)
            if verdict.status == Status.BLACKLISTED and not (
                entry and _blacklist_applies(entry, problem)
            ):
                return False  # its blacklisting was cleared since: it may compete now
            experimental = verdict.cause == CAUSE_EXPERIMENTAL
            if verdict.status == Status.UNAVAILABLE and experimental and allowed:
                return False  # experimental backends were allowed since: it may compete now
        return True

    def decisions(self, env: Mapping[str, Any]) -> list[Decision]:
        """The decisions this process holds for ``env`` (what ranks compare and share)."""
        with self._lock:
            return [d for d in self._memory.values() if d.env == env]

    def adopt(self, decision: Decision) -> None:
        """Hold ``decision`` in memory as if it had been read from disk (rank 0's, say)."""
        with self._lock:
            self._memory[self._memory_key(decision.env, decision.problem)] = decision

    def decide(
        self, problem: Problem, device: torch.device, *, env: Mapping[str, Any] | None = None
    ) -> Decision:
        env = env if env is not None else environment_for(device)
        decision = self.lookup(problem, device, env=env)
        if decision is not None:
            return decision
        with self.store.lock(env, problem.to_json(), timeout=self.lock_timeout):
            decision = self._read(env, problem, unproven=True)
            if decision is not None and decision.imported:  # from another machine: prove it
                decision = self.prove(decision, device, env=env)
                if decision is None:
                    decision = self.tune(problem, device, env=env)
            elif decision is not None:  # another process tuned it while we waited for the lock
                self.counters.add("waited_for_other_process")
            else:
                decision = self.tune(problem, device, env=env)
        if decision.winner is None and device.type not in ("cpu", "cuda"):
            # A meta (or other data-less) call shares the CPU's environment but can run no
            # backend: its failure must not answer the real CPU calls of this problem.
            return decision
        with self._lock:
            self._memory[self._memory_key(env, problem)] = decision
        return decision

    def prove(
        self, decision: Decision, device: torch.device, *, env: Mapping[str, Any] | None = None
    ) -> Decision | None:
        """Validate an imported decision's winner alone, here: the decision proven (stored, with
        the verdict reached here), or None (the caller tunes; a fatal failure blacklists)."""
        env = env if env is not None else environment_for(device)
        problem, winner = decision.problem, decision.winner
        backend = self.backend(winner) if winner is not None else None
        if backend is None:
            return None
        self.counters.add("proofs")
        verdict, why = self._validate_alone(backend, problem, device, env)
        if verdict is None:
            log.warning(
                "imported decision for %s: its winner %s failed here (%s); tuning",
                problem.describe(),
                winner,
                why,
            )
            return None
        decision.verdicts[backend.name] = verdict
        decision.imported = False
        decision.proven_here = _now()
        decision.source = "proven"
        self.store.write_entry(env, problem.to_json(), decision.to_json())
        log.info("imported decision for %s: %s proven here", problem.describe(), winner)
        return decision

    def _validate_alone(
        self, backend: Backend, problem: Problem, device: torch.device, env: Mapping[str, Any]
    ) -> tuple[Verdict | None, str]:
        """(its passed verdict, "") or (None, why not), probing ``backend`` alone, validation
        only; a fatal failure blacklists it as tuning would."""
        options = ProbeOptions(timing=self.timing, validate_only=True)
        result = self.prober().probe(problem, [backend], device, options)
        self._record_fatal(env, problem, result)
        verdict = result.verdicts.get(backend.name)
        if verdict is not None and verdict.passed:
            return verdict, ""
        return None, f"{verdict.status}: {verdict.reason}" if verdict else "not probed"

    def tune(
        self, problem: Problem, device: torch.device, *, env: Mapping[str, Any] | None = None
    ) -> Decision:
        env = env if env is not None else environment_for(device)
        registry = self.registry()
        runnable, excluded = self.candidates(problem, env, registry)
        log.info(
            "tuning %s on %s: %d candidates (%s)",
            problem.describe(),
            env.get("gpu") or "cpu",
            len(runnable),
            ", ".join(b.name for b in runnable),
        )
        self.counters.add("tunings")
        started = time.perf_counter()
        result = self._probe(problem, runnable, device, env) if runnable else ProbeResult()
        verdicts = {**excluded, **result.verdicts}
        self._record_fatal(env, problem, result)
        decision = Decision(
            problem=problem,
            env=dict(env),
            winner=None,
            verdicts=verdicts,
            timings=result.timings,
            method=result.method,
            considered=sorted(b.name for b in runnable),
            tuning_seconds=time.perf_counter() - started,
            isolation=self.prober().isolation,
        )
        passed = {n: registry.backends[n] for n, v in result.verdicts.items() if v.passed}
        preference = {n: b.preference for n, b in registry.backends.items()}
        timed = {n: t for n, t in result.timings.items() if n in passed}
        if timed:
            ranking = rank(timed, preference)
            decision.winner = ranking.winner
            decision.ranking = ranking.to_json()
        elif passed:  # one correct candidate, or timing failed: preference order decides
            record = preference_ranking(passed, preference)
            decision.winner = record["winner"]
            decision.ranking = record
        log.info(
            "decided %s: %s (%s)",
            problem.describe(),
            decision.winner,
            "; ".join(f"{n}={v.status}" for n, v in verdicts.items()),
        )
        if decision.winner is not None:
            self.store.write_entry(env, problem.to_json(), decision.to_json())
        return decision

    def _probe(
        self,
        problem: Problem,
        runnable: list[Backend],
        device: torch.device,
        env: Mapping[str, Any],
    ) -> ProbeResult:
        """Probe ``runnable``; a fallback of this device only when no other candidate passes
        (the module's rules)."""
        # Batch invariance, not speed, decides a batch-invariant problem: validated only, the
        # preference order picks, and a fallback is one more candidate probed with the rest.
        options = ProbeOptions(timing=self.timing, validate_only=problem.batch_invariant)
        kind = env.get("device") or "cpu"
        last = (
            set()
            if problem.batch_invariant
            else {b.name for b in runnable if kind in b.fallback_on}
        )
        first = [b for b in runnable if b.name not in last]
        if not last or not first:
            return self.prober().probe(problem, runnable, device, options)
        result = self.prober().probe(problem, first, device, options)
        passed = [n for n, v in result.verdicts.items() if v.passed]
        if result.aborted and not passed:
            # In-process, a CUDA error ended the probe: nothing more can run in this process
            # (the sandbox restarts its child instead and never returns an aborted probe).
            return result
        if passed:
            shown = ", ".join(passed[:3]) + (f" and {len(passed) - 3} more" if passed[3:] else "")
            reason = (
                f"not tried: on {kind} a fallback, run only when no other candidate passes "
                f"({shown} passed)"
            )
            for name in last:
                result.verdicts[name] = Verdict(name, Status.SKIPPED, reason)
        else:
            rest = self.prober().probe(
                problem, [b for b in runnable if b.name in last], device, options
            )
            result.verdicts.update(rest.verdicts)
            result.timings.update(rest.timings)
            result.method, result.aborted = rest.method, rest.aborted
            result.seconds += rest.seconds
        # In candidate order, as one probe call would have listed them.
        result.verdicts = {
            b.name: result.verdicts[b.name] for b in runnable if b.name in result.verdicts
        }
        return result

    def _record_fatal(self, env: Mapping[str, Any], problem: Problem, result: ProbeResult) -> None:
        scope = self.settings.blacklist_scope
        for name, verdict in result.verdicts.items():
            if verdict.status not in FATAL_STATUSES:
                continue
            # The built-in fallback is every problem's last resort: a fault (a hang on a huge
            # problem, an OOM kill) condemns it for that key only, never for the environment.
            keyed = scope == "key" or name in PROTECTED_BACKENDS
            record = {
                "backend": name,
                "kind": verdict.status.value,
                "reason": verdict.reason,
                "when": _now(),
                "scope": "key" if keyed else "environment",
                "key": problem.to_json(),
                "m": verdict.m,
                "detail": verdict.detail,
            }
            log.warning("blacklisting %s (%s): %s", name, verdict.status, verdict.reason)
            self.store.add_to_blacklist(env, name, record)

    # -- binding ------------------------------------------------------------------------------
    def runner_for(self, decision: Decision, device: torch.device) -> Runner:
        """The winner's fast runner (at its tactic), for the warm path to bind."""
        if decision.winner is None:
            reasons = "; ".join(f"{n}: {v.status} {v.reason}" for n, v in decision.verdicts.items())
            raise NoCorrectBackendError(
                f"no backend is correct for {decision.problem.describe()}: {reasons}"
            )
        backend = self.backend(decision.winner)
        if backend is None:
            raise NoCorrectBackendError(
                f"backend {decision.winner!r} chosen earlier is not registered here"
            )
        return backend.fast_runner_for(decision.problem, decision.tactic(decision.winner))

    def fallback(
        self, problem: Problem, device: torch.device, *, env: Mapping[str, Any] | None = None
    ) -> tuple[Runner, str]:
        """A runner that needs no probing, for a miss while a CUDA graph is being captured.

        In order: a backend proven on the same shape class in another M bucket; with
        ``inprocess`` isolation only, flashinfer's own heuristic choice (``backend="auto"``,
        unproven, which is the risk that setting accepts); else emulation.
        """
        if problem.batch_invariant:
            raise RuntimeError(
                f"batch_invariant=True: no decision yet for {problem.describe()} and a CUDA graph "
                "is being captured; a fallback now could compute these rows with another kernel "
                "than the one chosen later. Call once eagerly (or `fp4select warm`) before capture."
            )
        env = env if env is not None else environment_for(device)
        self.counters.add("fallbacks")
        with self._lock:
            self.pending.add((problem, str(device)))
            proven = [
                d
                for d in self._memory.values()
                if d.env == env and d.winner and _same_shape_class(d.problem, problem)
            ]
        for d in sorted(proven, key=lambda d: abs(d.problem.m_bucket - problem.m_bucket)):
            backend = self.backend(d.winner)  # type: ignore[arg-type]
            if backend is not None:
                return backend.fast_runner_for(problem), d.winner  # type: ignore[return-value]
        if self.isolation == "inprocess":
            runner = flashinfer_backends.auto_runner(env, problem)
            if runner is not None:
                return runner, "flashinfer:auto"
        return emulation.BACKEND.fast_runner_for(problem), emulation.NAME

    def named_runner(
        self,
        name: str,
        problem: Problem,
        device: torch.device,
        allow_blacklisted: bool,
        *,
        env: Mapping[str, Any] | None = None,
    ) -> Runner:
        """A caller-named backend: refused if blacklisted, proven before it runs in this process."""
        env = env if env is not None else environment_for(device)
        backend = self.backend(name)
        if backend is None:
            raise ValueError(
                f"backend must be 'auto' or one of {sorted(self.registry().backends)}, got {name!r}"
            )
        entry = self.store.blacklist(env).get(name)
        if entry and not allow_blacklisted and _blacklist_applies(entry, problem):
            raise BlacklistedBackendError(
                f"backend {name!r} was blacklisted in this environment on {entry.get('when')} "
                f"({entry.get('kind')}: {entry.get('reason')}); pass allow_blacklisted=True to use it anyway"
            )
        self.counters.add("explicit")
        decision = self.lookup(problem, device, env=env)
        if decision and decision.verdicts.get(name) and decision.verdicts[name].passed:
            return backend.fast_runner_for(problem, decision.tactic(name))
        if self.isolation == "inprocess" or backend.family == "builtin":
            # Unproven here: keep the backend's own checks on.
            return backend.checked_runner_for(problem)
        verdict, why = self._validate_alone(backend, problem, device, env)
        if verdict is None:
            raise NoCorrectBackendError(
                f"backend {name!r} failed its check on {problem.describe()} ({why})"
            )
        return backend.fast_runner_for(problem, verdict.detail.get("tactic"))  # as it passed

    def tune_pending(self) -> list[Decision]:
        """Tune every key that was served by a fallback during graph capture."""
        done: list[Decision] = []
        while True:
            with self._lock:
                if not self.pending:
                    return done
                problem, device = self.pending.pop()
            done.append(self.decide(problem, torch.device(device)))


# Looked up with flashinfer loaded: flashinfer's backend shadows a plugin of the same name.
_FLASHINFER_NAMES = frozenset({*flashinfer_backends.KNOWN, flashinfer_backends.INVARIANT_NAME})


def _same_shape_class(a: Problem, b: Problem) -> bool:
    return a.to_json() | {"m_bucket": 0} == b.to_json() | {"m_bucket": 0}


def _blacklist_applies(entry: Mapping[str, Any], problem: Problem) -> bool:
    if entry.get("scope") == "key" or entry.get("backend") in PROTECTED_BACKENDS:
        return entry.get("key") == problem.to_json()
    return True
