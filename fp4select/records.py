"""The records a decision is made of: what a probe returns, what the store keeps, what crosses
the sandbox's pipe, and the strict readers that check them when they come back from outside.

Design rules:

* A leaf: it imports nothing of fp4select but other leaves (``keys`` for ``Problem``, the
  version). Probing, timing, the sandbox, the selector and the store's users all import these
  types from here, so none of them needs another's logic to name a verdict (before, ``probe``
  and ``timing`` imported each other, and the sandbox's protocol pulled in validation).
* A status is a ``Status`` member, never a bare string: one enum names every outcome, and as a
  ``str`` enum it is written to JSON as the same string it always was, so caches stay readable.
* A record read from disk, an archive or a pipe is checked field by field before anything uses
  it (``from_json``); what is not what fp4select writes raises ``MalformedRecord`` naming the
  field, and is never served.
* Why a backend could not compete is data (``Verdict.cause``), not a phrase code searches for.
"""

from __future__ import annotations

import datetime as _dt
import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from fp4select._version import __version__
from fp4select.keys import Problem

Report = Callable[[Mapping[str, Any]], None]


def _now() -> str:
    """The time a record is made, as it is written: UTC, ISO 8601, seconds."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


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
    # A candidate, not run: a fallback of this device (``Backend.fallback_on``), left out
    # because another candidate passed. Given by the selector, never by a probe.
    SKIPPED = "skipped"

    # Python 3.12 formats a mixed-in enum as "Status.PASSED"; messages and tables want the text.
    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self.value, spec)


# Statuses that condemn a backend for the whole environment (the process died or its CUDA
# context broke); the rest are about one key only.
FATAL_STATUSES = frozenset({Status.CRASH, Status.HANG, Status.CUDA_ERROR})
STATUSES = frozenset(Status)
# ``Verdict.cause`` of an experimental backend left out because experimental backends are not
# allowed (it may compete once they are: a stored decision is then stale).
CAUSE_EXPERIMENTAL = "experimental"


class Reason(str):
    """Why a backend cannot compete: the text it always was, with its ``cause`` as data.

    A ``str``, so whatever shows or stores a reason is unchanged; ``candidates`` copies the
    cause into ``Verdict.cause``, where code reads it instead of searching the text.
    """

    cause: str

    def __new__(cls, text: str, cause: str = "") -> Reason:
        made = super().__new__(cls, text)
        made.cause = cause
        return made


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


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Verdict:
    backend: str
    status: Status  # a plain string that names a member is turned into it
    reason: str = ""
    m: int | None = None
    worst_ratio: float | None = None
    deterministic: bool | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    # Why it could not compete, as data ("" = nothing to say): ``CAUSE_EXPERIMENTAL``.
    cause: str = ""

    def __post_init__(self) -> None:
        # Code written before the enum (plugins, tests) passes the string: same value, checked.
        self.status = Status(self.status)

    @property
    def passed(self) -> bool:
        return self.status == Status.PASSED

    def to_json(self) -> dict[str, Any]:
        data = {**asdict(self), "status": self.status.value}
        if not self.cause:  # records written before the field read the same as they did
            del data["cause"]
        return data

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
        need(isinstance(data.get("cause", ""), str), "verdict.cause must be a string")
        return cls(**data)


_VERDICT_FIELDS = frozenset(f.name for f in fields(Verdict))
_STATUS_VALUES = frozenset(s.value for s in Status)


@dataclass(frozen=True)
class TimingOptions:
    use_cuda_graph: bool = True
    cold_l2: bool = True
    budget_s: float = 3.0
    min_rounds: int = 5
    max_rounds: int = 100
    target_sample_s: float = 2e-4  # choose R so one sample lasts about this long

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    samples: int
    calls_per_sample: int
    method: str

    @property
    def half_spread(self) -> float:
        return (self.p90_us - self.p10_us) / (2 * self.median_us) if self.median_us > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Timing:
        """Rebuild from JSON read from outside: finite non-negative times, positive counts."""
        need(isinstance(data, Mapping), f"a timing must be an object, got {type(data).__name__}")
        names = {"median_us", "p10_us", "p90_us", "samples", "calls_per_sample", "method"}
        need(set(data) == names, f"a timing has the fields {sorted(names)}")
        for name in ("median_us", "p10_us", "p90_us"):
            need(is_number(data[name]), f"timing.{name} must be a finite number: {data[name]!r}")
        for name in ("samples", "calls_per_sample"):
            need(is_int(data[name], 1), f"timing.{name} must be a positive int: {data[name]!r}")
        need(isinstance(data["method"], str), "timing.method must be a string")
        return cls(**data)


@dataclass(frozen=True)
class ProbeOptions:
    timing: TimingOptions = field(default_factory=TimingOptions)
    seed: int = 0
    validate_only: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeOptions:
        return cls(TimingOptions(**data["timing"]), data["seed"], data["validate_only"])


@dataclass
class ProbeResult:
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    timings: dict[str, Timing] = field(default_factory=dict)
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
            timings={k: Timing.from_json(v) for k, v in data["timings"].items()},
            method=data["method"],
            seconds=data["seconds"],
            aborted=data["aborted"],
        )


@dataclass
class Decision:
    """The record of one choice; ``to_json`` is what the store keeps and ``explain`` returns."""

    problem: Problem
    env: dict[str, Any]
    winner: str | None
    verdicts: dict[str, Verdict]
    timings: dict[str, Timing] = field(default_factory=dict)
    ranking: Mapping[str, Any] | None = None  # a timing.RankingRecord, or as read from disk
    method: str = ""
    considered: list[str] = field(default_factory=list)
    created: str = field(default_factory=_now)
    tuning_seconds: float = 0.0
    isolation: str = ""
    source: str = "tuned"  # memory | disk | tuned | fallback | explicit | proven
    # Came from an archive (another machine) and not yet proven here: never served as it is
    # (see Selector.decide). The archive importer sets it whatever the archive says.
    imported: bool = False
    # When an imported decision's winner passed validation on this machine (None otherwise).
    proven_here: str | None = None

    def to_json(self) -> dict[str, Any]:
        # ``imported`` and ``proven_here`` only when set: a record tuned here is written as
        # before they existed.
        marks: dict[str, Any] = {"imported": True} if self.imported else {}
        if self.proven_here is not None:
            marks["proven_here"] = self.proven_here
        return {
            "problem": self.problem.to_json(),
            "env": self.env,
            "winner": self.winner,
            "verdicts": {k: v.to_json() for k, v in self.verdicts.items()},
            "timings": {k: v.to_json() for k, v in self.timings.items()},
            "ranking": self.ranking,
            "method": self.method,
            "considered": self.considered,
            "created": self.created,
            "tuning_seconds": self.tuning_seconds,
            "isolation": self.isolation,
            "fp4select": __version__,
            "source": self.source,
            **marks,
        }

    def tactic(self, name: str | None) -> dict[str, Any] | None:
        """The tactic record ``name`` was validated and timed at (served with it), if any."""
        verdict = self.verdicts.get(name) if name else None
        record = verdict.detail.get("tactic") if verdict is not None else None
        return record if isinstance(record, dict) else None

    @classmethod
    def from_json(cls, data: Any, source: str) -> Decision:
        """Rebuild from a store record or an import, checking every field before it is used.

        Raises ``MalformedRecord`` (a ValueError) naming the field: a record that is not what
        fp4select writes (NaN, wrong types, a winner that never passed) is never served.
        """
        need(isinstance(data, Mapping), f"a decision must be an object, not {type(data).__name__}")
        for name, kind in (("problem", dict), ("env", dict), ("verdicts", dict), ("timings", dict)):
            need(isinstance(data.get(name), kind), f"decision.{name} must be an object")
        try:
            problem = Problem.from_json(data["problem"])
        except (TypeError, ValueError) as exc:
            raise MalformedRecord(f"decision.problem: {exc}") from None
        verdicts = {k: Verdict.from_json(v) for k, v in data["verdicts"].items()}
        for name, verdict in verdicts.items():
            need(verdict.backend == name, f"verdicts[{name!r}] is about {verdict.backend!r}")
        timings = {k: Timing.from_json(v) for k, v in data["timings"].items()}
        winner = data.get("winner")
        need(winner is None or isinstance(winner, str), "decision.winner must be a name or null")
        if winner is not None:
            chosen = verdicts.get(winner)
            need(chosen is not None and chosen.passed, f"winner {winner!r} never passed")
        ranking = data.get("ranking")
        need(ranking is None or isinstance(ranking, dict), "decision.ranking must be an object")
        if ranking is not None:
            need(ranking.get("winner") == winner, "decision.ranking names another winner")
            margin = ranking.get("margin")
            need(margin is None or _finite(margin), f"ranking.margin must be finite: {margin!r}")
        considered = data.get("considered", [])
        need(
            isinstance(considered, list) and all(isinstance(n, str) for n in considered),
            "decision.considered must be a list of names",
        )
        seconds = data.get("tuning_seconds", 0.0)
        need(is_number(seconds), f"decision.tuning_seconds must be finite: {seconds!r}")
        for name in ("method", "created", "isolation"):
            need(isinstance(data.get(name, ""), str), f"decision.{name} must be a string")
        imported = data.get("imported", False)
        need(type(imported) is bool, f"decision.imported must be true or false: {imported!r}")
        proven = data.get("proven_here")
        need(proven is None or isinstance(proven, str), "decision.proven_here must be a string")
        return cls(
            problem=problem,
            env=dict(data["env"]),
            winner=winner,
            verdicts=verdicts,
            timings=timings,
            ranking=ranking,
            method=data.get("method", ""),
            considered=list(considered),
            created=data.get("created", ""),
            tuning_seconds=float(seconds),
            isolation=data.get("isolation", ""),
            source=source,
            imported=imported,
            proven_here=proven,
        )
