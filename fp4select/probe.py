"""One probe: validate each candidate at several M of the bucket, then time the survivors.

Design rules:

* The probe takes a problem *description* and builds its own inputs, so the very same function
  runs in the caller's process or in the sandbox child with nothing but JSON crossing over.
* Before anything runs, ``report`` hears which backend, phase and M are about to run. If the
  process dies there, the parent (sandbox) knows whom to blame and at which shape.
* Exceptions are classified, never propagated: the backend saying "not my problem" is
  ``unsupported``; out of memory is ``oom``; a CUDA error is ``cuda-error`` and ends the probe,
  because the CUDA context of this process is now unusable (the sandbox restarts the child);
  anything else is ``error``. Wrong numbers are ``wrong``.
* The records it returns (``Verdict``, ``ProbeResult``, ``Status``) live in ``records``.
* The output is checked with ``out=None`` at every validation M, and once more into a
  caller-supplied ``out`` poisoned with NaN, so a backend that ignores ``out=`` or leaves
  elements unwritten fails. A repeat run records whether the backend is bit-for-bit
  deterministic (recorded, not required: split-K kernels may legitimately differ).
* A backend with a ``tune`` hook (flashinfer's, through its autotuner) is tuned first, at the
  bucket's top M; it is then validated and timed at the tactic it chose, which its verdict
  records, so what is served is what was checked. Its default tactic is timed beside it, for
  the record only (``detail["default_timing"]``), never as a candidate.
"""

from __future__ import annotations

import functools
import math
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from fp4select import timing, validate
from fp4select.backends.base import Backend, is_cuda_error
from fp4select.keys import Problem, resolve_device
from fp4select.records import (  # noqa: F401  (re-exported: the names plugins and tests know)
    FATAL_STATUSES,
    STATUSES,
    MalformedRecord,
    ProbeOptions,
    ProbeResult,
    Report,
    Status,
    Timing,
    Verdict,
    is_int,
    is_number,
    need,
)

# Timing key of a tuned backend's run at its default tactic (moved into its verdict's detail).
DEFAULT_SUFFIX = "@default"


def classify(backend: Backend, exc: BaseException, m: int | None) -> Verdict:
    message = f"{type(exc).__name__}: {exc}".strip()[:2000]
    if backend.is_unsupported(exc):
        return Verdict(backend.name, Status.UNSUPPORTED, message, m)
    text = str(exc).lower()
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or any(
        marker in text
        for marker in ("out of memory", "can't allocate memory", "cannot allocate memory")
    ):
        return Verdict(backend.name, Status.OOM, message, m)
    if is_cuda_error(exc):
        return Verdict(backend.name, Status.CUDA_ERROR, message, m)
    tail = "".join(traceback.format_exception(exc)[-6:])[-2000:]
    return Verdict(backend.name, Status.ERROR, message, m, detail={"traceback": tail})


def _finite(value: float) -> float | None:
    """JSON has no infinity: an unmeasurable error is recorded as null."""
    return value if math.isfinite(value) else None


class _Inputs:
    """Validation inputs per M, built once and shared by every candidate."""

    def __init__(self, problem: Problem, device: torch.device, seed: int):
        self.problem, self.device, self.seed = problem, device, seed
        self._cache: dict[int, validate.ProbeInputs] = {}

    def __getitem__(self, m: int) -> validate.ProbeInputs:
        if m not in self._cache:
            self._cache[m] = validate.make_inputs(self.problem, m, self.device, self.seed)
        return self._cache[m]


def validate_backend(
    backend: Backend, problem: Problem, inputs: _Inputs, device: torch.device, report: Report
) -> Verdict:
    """The verdict; with the tactic it was reached at in ``detail`` (wrong ones included)."""
    tactic: dict[str, Any] = {}
    verdict = _validate(backend, problem, inputs, device, report, tactic)
    if tactic:
        verdict.detail["tactic"] = tactic
    return verdict


def _validate(
    backend: Backend,
    problem: Problem,
    inputs: _Inputs,
    device: torch.device,
    report: Report,
    tactic: dict[str, Any],
) -> Verdict:
    out_dtype = problem.torch_out_dtype
    ms = problem.validation_ms()
    worst = 0.0
    m = None
    try:
        report({"event": "run", "backend": backend.name, "phase": "bind", "m": None})
        runner = backend.checked_runner_for(problem)
        if backend.tune is not None:  # tune first: the tactic that is validated is the one timed
            m = problem.timing_m()
            report({"event": "run", "backend": backend.name, "phase": "tune", "m": m})
            tune_m = m

            def progress() -> None:  # per tactic profiled: tuning is alive, however long
                report({"event": "run", "backend": backend.name, "phase": "tune", "m": tune_m})

            record = backend.tune(
                runner, problem, inputs[m].args(problem), name=backend.name, progress=progress
            )
            tactic.update(record or {})
            timing.sync(device)
            if tactic:
                runner = backend.checked_runner_for(problem, tactic)
        last = None
        for m in ms:
            report({"event": "run", "backend": backend.name, "phase": "validate", "m": m})
            data = inputs[m]
            out = runner(*data.args(problem))
            timing.sync(device)
            result = validate.check(out, data, out_dtype)
            if not result.ok:
                return Verdict(
                    backend.name, Status.WRONG, result.reason, m, _finite(result.worst_ratio)
                )
            worst = max(worst, result.worst_ratio)
            last = out
        m = ms[-1]
        data = inputs[m]
        report({"event": "run", "backend": backend.name, "phase": "out=", "m": m})
        poisoned = torch.full((m, problem.n), float("nan"), dtype=out_dtype, device=device)
        returned = runner(*data.args(problem, out=poisoned))
        timing.sync(device)
        result = validate.check(poisoned, data, out_dtype)
        if not result.ok:
            return Verdict(
                backend.name,
                Status.WRONG,
                f"with out=: {result.reason}",
                m,
                _finite(result.worst_ratio),
            )
        if isinstance(returned, torch.Tensor) and returned.data_ptr() != poisoned.data_ptr():
            return Verdict(backend.name, Status.WRONG, "with out=: returned a different tensor", m)
        # Validation Ms where the stored tactic cannot run: served (and so checked) at the default.
        pin = getattr(runner, "fp4select_pin", None)
        if pin is not None and tactic:
            defaults = [{"m": k, "reason": e["reason"]} for k, e in pin.checked.items() if e]
            if defaults:
                tactic["default_at"] = defaults
        deterministic = bool(torch.equal(poisoned, last)) if last is not None else None
        if problem.batch_invariant and last is not None:  # last: the output at M = ms[-1]
            why = _variance(runner, problem, data, last, device, report, backend.name)
            if why:
                return Verdict(backend.name, Status.WRONG, why, m, worst)
    except Exception as exc:
        return classify(backend, exc, m)
    return Verdict(backend.name, Status.PASSED, "", None, worst, deterministic, {"ms": list(ms)})


def _variance(
    runner: Any,
    problem: Problem,
    data: validate.ProbeInputs,
    full: torch.Tensor,
    device: torch.device,
    report: Report,
    name: str,
) -> str:
    """Why the runner is not batch invariant ("" when row bits do not depend on M)."""
    for m in problem.validation_ms()[:-1]:
        report({"event": "run", "backend": name, "phase": "invariance", "m": m})
        part = runner(*validate.prefix_inputs(data, m, problem).args(problem))
        timing.sync(device)
        if not (isinstance(part, torch.Tensor) and torch.equal(part, full[:m])):
            return (
                f"not batch invariant: the first {m} rows differ in their bits when computed "
                f"alone from within a batch of {data.m}"
            )
    return ""


def time_backends(
    backends: Sequence[Backend],
    problem: Problem,
    device: torch.device,
    options: ProbeOptions,
    report: Report,
    tactics: Mapping[str, Mapping[str, Any] | None] | None = None,
) -> tuple[dict[str, Timing], str]:
    """Time at the bucket's largest M (the heaviest the decision must serve).

    A backend with a tuned tactic (``tactics[name]``) is timed at it, and at its ``default``
    tactic too, under the key ``name + DEFAULT_SUFFIX``, so the record shows what tuning bought.
    """
    m = problem.timing_m()
    report({"event": "run", "backend": None, "phase": "inputs", "m": m})
    first = validate.make_inputs(problem, m, device, options.seed + 1, with_reference=False)
    sets = timing.input_sets_for_cold_l2(device, first.nbytes(), options.timing.cold_l2)
    input_sets = [first] + [
        validate.make_inputs(problem, m, device, options.seed + 1 + i, with_reference=False)
        for i in range(1, sets)
    ]
    calls = {}
    owner = {}  # timing key -> backend, so that a death while timing blames the backend
    for backend in backends:
        report({"event": "run", "backend": backend.name, "phase": "bind", "m": m})
        tactic = (tactics or {}).get(backend.name)
        variants = {backend.name: backend.checked_runner_for(problem, tactic)}
        if tactic and tactic.get("tactic") not in (None, tactic.get("default", tactic["tactic"])):
            default = {**tactic, "tactic": tactic["default"]}
            variants[backend.name + DEFAULT_SUFFIX] = backend.checked_runner_for(problem, default)
        for key, runner in variants.items():
            owner[key] = backend.name
            calls[key] = [functools.partial(runner, *s.args(problem)) for s in input_sets]

    def on_start(name: str) -> None:
        report({"event": "run", "backend": owner[name], "phase": "time", "m": m})

    return timing.time_interleaved(calls, device, options.timing, on_start)


def probe(
    problem: Problem,
    backends: Sequence[Backend],
    device: torch.device | str,
    options: ProbeOptions = ProbeOptions(),
    report: Report | None = None,
) -> ProbeResult:
    device = resolve_device(device)
    report = report or (lambda event: None)
    started = time.perf_counter()
    result = ProbeResult()
    inputs = _Inputs(problem, device, options.seed)
    passed: list[Backend] = []
    for backend in backends:
        verdict = validate_backend(backend, problem, inputs, device, report)
        result.verdicts[backend.name] = verdict
        report({"event": "verdict", "verdict": verdict.to_json()})
        if verdict.status == Status.CUDA_ERROR:
            result.aborted = True
            break
        if verdict.passed:
            passed.append(backend)
    if len(passed) == 1 and not options.validate_only:
        result.method = "not timed: one correct candidate"
    elif passed and not options.validate_only and not result.aborted:
        tactics = {b.name: result.verdicts[b.name].detail.get("tactic") for b in passed}
        try:
            result.timings, result.method = time_backends(
                passed, problem, device, options, report, tactics
            )
            for key in [k for k in result.timings if k.endswith(DEFAULT_SUFFIX)]:
                name = key[: -len(DEFAULT_SUFFIX)]
                result.verdicts[name].detail["default_timing"] = result.timings.pop(key).to_json()
        except Exception as exc:
            # Timing broke: we cannot tell which candidate did it from here, so no one wins on
            # speed; the selector falls back to preference order among the validated.
            result.method = f"timing failed: {type(exc).__name__}: {exc}"[:300]
            if is_cuda_error(exc):
                result.aborted = True
    validate.clear_cache()
    result.seconds = time.perf_counter() - started
    return result


class Prober(Protocol):
    """What the selector needs from whatever runs its probes.

    Two implementations: ``InProcessProber`` here, and ``sandbox.SandboxProber``, which keeps
    ``probe``'s contract whatever the candidates do to the child process they run in.
    """

    # "inprocess" or "subprocess": recorded in every decision (``Decision.isolation``)
    isolation: str

    def probe(
        self,
        problem: Problem,
        backends: Sequence[Backend],
        device: torch.device,
        options: ProbeOptions,
        report: Report | None = None,
    ) -> ProbeResult:
        """A verdict for every backend (in order, unless a CUDA error aborted), timings of the
        ones that passed."""
        ...

    def close(self) -> None:
        """Give back what the prober holds (worker processes); it may be used again after."""
        ...


class InProcessProber:
    """Runs the probe in the caller's process: fast, and only as safe as the candidates."""

    isolation = "inprocess"
    probe = staticmethod(probe)

    def close(self) -> None:
        pass
