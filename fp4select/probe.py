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
* A status is a ``Status`` member, never a bare string: one enum names every outcome, and as a
  ``str`` enum it is written to JSON as the same string it always was, so caches stay readable.
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

import enum
import functools
import math
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from fp4select import timing, validate
from fp4select.backends.base import Backend
from fp4select.keys import Problem

Report = Callable[[Mapping[str, Any]], None]


class Status(str, enum.Enum):
    """What became of one backend on one key: the ``status`` of its verdict.

    A ``str`` enum, so a member *is* its string: it equals and hashes as ``"passed"``, and JSON
    (store entries, archives, the sandbox's pipe) holds the plain string, as it did before
    there was an enum. Reading one back goes through ``Status(text)``, which refuses a string
    that is not a member.
    """

    PASSED = "passed"
    WRONG = "wrong"  # ran, and its numbers are outside the bound (or it ignored ``out=``)
    ERROR = "error"  # raised something that is neither of the two below
    OOM = "oom"
    UNSUPPORTED = "unsupported"  # the backend itself said "not my problem"
    CUDA_ERROR = "cuda-error"  # its CUDA context broke: the process cannot go on
    CRASH = "crash"  # the sandbox child died (given by the parent, never by the child)
    HANG = "hang"  # the sandbox child made no progress in time (given by the parent)
    UNAVAILABLE = "unavailable"  # not a candidate here (no GPU, wrong GPU, not installed)
    BLACKLISTED = "blacklisted"  # not a candidate: condemned in this environment earlier

    # Python 3.12 formats a mixed-in enum as "Status.PASSED"; messages and tables want the text.
    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self.value, spec)


PASSED = Status.PASSED
# Statuses that condemn a backend for the whole environment (the process died or its CUDA
# context broke); the rest are about one key only.
FATAL_STATUSES = frozenset({Status.CRASH, Status.HANG, Status.CUDA_ERROR})
# Timing key of a tuned backend's run at its default tactic (moved into its verdict's detail).
DEFAULT_SUFFIX = "@default"
STATUSES = frozenset(Status)


class MalformedRecord(ValueError):
    """A record read from disk, an archive or a pipe is not what fp4select writes."""


def need(ok: bool, what: str) -> None:
    """Refuse a field read from outside before anything uses it."""
    if not ok:
        raise MalformedRecord(what)


def is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def is_number(value: Any) -> bool:
    """A finite, non-negative JSON number (NaN and infinity never come from fp4select)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


@dataclass
class Verdict:
    backend: str
    status: Status  # a plain string that names a member is turned into it
    reason: str = ""
    m: int | None = None
    worst_ratio: float | None = None
    deterministic: bool | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Code written before the enum (plugins, tests) passes the string: same value, checked.
        self.status = Status(self.status)

    @property
    def passed(self) -> bool:
        return self.status == Status.PASSED

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value}

    @classmethod
    def from_json(cls, data: Any) -> Verdict:
        """Rebuild from JSON read from outside; raises MalformedRecord field by field."""
        need(isinstance(data, Mapping), f"a verdict must be an object, got {type(data).__name__}")
        need(
            set(data) <= _VERDICT_FIELDS and {"backend", "status"} <= set(data),
            f"a verdict has the fields {sorted(_VERDICT_FIELDS)}, got {sorted(map(str, data))}",
        )
        backend, status = data["backend"], data["status"]
        need(isinstance(backend, str) and bool(backend), "verdict.backend must be a name")
        need(
            isinstance(status, str) and status in _STATUS_VALUES,
            f"verdict.status must be one of {sorted(_STATUS_VALUES)}: {status!r}",
        )
        need(isinstance(data.get("reason", ""), str), "verdict.reason must be a string")
        m = data.get("m")
        need(m is None or is_int(m, 1), f"verdict.m must be null or a positive int: {m!r}")
        worst = data.get("worst_ratio")
        need(worst is None or is_number(worst), f"verdict.worst_ratio must be finite: {worst!r}")
        deterministic = data.get("deterministic")
        need(deterministic in (None, True, False), "verdict.deterministic must be a bool or null")
        need(isinstance(data.get("detail", {}), dict), "verdict.detail must be an object")
        return cls(**data)


_VERDICT_FIELDS = frozenset(
    {"backend", "status", "reason", "m", "worst_ratio", "deterministic", "detail"}
)
_STATUS_VALUES = frozenset(s.value for s in Status)


@dataclass(frozen=True)
class ProbeOptions:
    timing: timing.TimingOptions = field(default_factory=timing.TimingOptions)
    seed: int = 0
    validate_only: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "timing": self.timing.to_json(),
            "seed": self.seed,
            "validate_only": self.validate_only,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeOptions:
        return cls(timing.TimingOptions(**data["timing"]), data["seed"], data["validate_only"])


@dataclass
class ProbeResult:
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    timings: dict[str, timing.Timing] = field(default_factory=dict)
    method: str = "none"
    seconds: float = 0.0
    aborted: bool = False  # a CUDA error ended the probe early; remaining candidates unprobed

    def to_json(self) -> dict[str, Any]:
        return {
            "verdicts": {k: v.to_json() for k, v in self.verdicts.items()},
            "timings": {k: v.to_json() for k, v in self.timings.items()},
            "method": self.method,
            "seconds": self.seconds,
            "aborted": self.aborted,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeResult:
        return cls(
            verdicts={k: Verdict.from_json(v) for k, v in data["verdicts"].items()},
            timings={k: timing.Timing.from_json(v) for k, v in data["timings"].items()},
            method=data["method"],
            seconds=data["seconds"],
            aborted=data["aborted"],
        )


def _is_cuda_error(exc: BaseException) -> bool:
    text = str(exc)
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return (accelerator_error and isinstance(exc, accelerator_error)) or any(
        marker in text
        for marker in ("CUDA error", "illegal memory access", "device-side assert", "cudaError")
    )


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
    if _is_cuda_error(exc):
        return Verdict(backend.name, Status.CUDA_ERROR, message, m)
    tail = "".join(traceback.format_exception(exc)[-6:])[-2000:]
    return Verdict(backend.name, Status.ERROR, message, m, detail={"traceback": tail})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
            _sync(device)
            if tactic:
                runner = backend.checked_runner_for(problem, tactic)
        last = None
        for m in ms:
            report({"event": "run", "backend": backend.name, "phase": "validate", "m": m})
            data = inputs[m]
            out = runner(*data.args(problem))
            _sync(device)
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
        _sync(device)
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
        _sync(device)
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
) -> tuple[dict[str, timing.Timing], str]:
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
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
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
            if _is_cuda_error(exc):
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

    def probe(
        self,
        problem: Problem,
        backends: Sequence[Backend],
        device: torch.device | str,
        options: ProbeOptions,
        report: Report | None = None,
    ) -> ProbeResult:
        return probe(problem, backends, device, options, report)

    def close(self) -> None:
        pass
