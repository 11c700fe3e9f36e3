"""Reports as data: what ``doctor`` and ``verify`` find, for the CLI to print and scripts to read.

Design rules: a report function returns data (a ``TypedDict``, or a dataclass whose ``to_json()``
is the ``--json`` output), typed so the command line and scripts know every field, and prints
nothing; the command line only formats it. A report reads the same store, registry and selector
the library uses: nothing is re-implemented here. ``verify`` tunes in its own selector over a
scratch cache, so it never changes the caller's decisions or the process-wide selector.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from fp4select._version import __version__
from fp4select.keys import Problem, environment_for, m_bucket
from fp4select.records import Status

if TYPE_CHECKING:  # the selector imports the registry: a report imports it only when it runs
    from fp4select.records import Decision
    from fp4select.selector import Selector
    from fp4select.settings import Settings

__all__ = [
    "DEFAULT_VERIFY_SHAPES",
    "VERIFY_BUCKETS",
    "VERIFY_KINDS",
    "BackendSummary",
    "DoctorBackend",
    "DoctorReport",
    "SignatureReport",
    "TacticRow",
    "VerifyReport",
    "doctor_report",
    "native_key_report",
    "signature_report",
    "verify_problems",
    "verify_report",
]


# -- doctor ------------------------------------------------------------------------------------
class SignatureReport(TypedDict):
    """How ``best_mm_fp4``'s parameters line up with the installed ``flashinfer.mm_fp4``'s."""

    matches: bool | None  # None: no flashinfer, or its signature cannot be read
    only_in_flashinfer: list[str]  # parameters a caller cannot pass to best_mm_fp4
    different_defaults: list[str]


class _DoctorBackendCore(TypedDict):
    backend: str
    family: str
    available: bool
    reason: str  # why it cannot run here; "" when it can
    experimental: bool


class DoctorBackend(_DoctorBackendCore, total=False):
    """One registered backend: can it run here, and where flashinfer says it runs."""

    flashinfer_supported_ccs: list[int] | None  # only for flashinfer's, when flashinfer loads


class _MachineCore(TypedDict):
    device: str
    gpu: str | None
    cc: int | None
    sm_count: int | None


class DoctorMachine(_MachineCore, total=False):
    cuda_available: bool  # only when the device is the CPU


class DoctorFlashinfer(TypedDict):
    listed_backends: list[str]  # what ``mm_fp4``'s ``backend`` parameter lists
    problem: str | None  # why flashinfer could not be loaded
    signature: SignatureReport


class DoctorCache(TypedDict):
    root: str
    memory_only: bool
    isolation: str


class DoctorNativeKey(TypedDict):
    """The warm path's C++ key (fp4select.native_key): its mode, library and state."""

    mode: str  # FP4SELECT_NATIVE: auto or off
    path: str
    built: bool
    loaded: bool
    status: str


class DoctorReport(TypedDict):
    """What ``doctor`` prints; ``--json`` prints exactly this."""

    fp4select: str
    machine: DoctorMachine
    environment: dict[str, Any]  # the environment fingerprint decisions are stored under
    flashinfer: DoctorFlashinfer
    backends: list[DoctorBackend]
    source_errors: dict[str, str]  # backend source (plugin, flashinfer) -> why it failed
    cache: DoctorCache
    blacklist: dict[str, dict[str, Any]]  # backend -> the record of its blacklisting
    native_key: DoctorNativeKey
    hopper_launch: str  # how the hopper-* kernels launch here: with PDL or without, and why


def doctor_report(
    device: torch.device, what_if_cc: int | None = None, *, selector: Selector | None = None
) -> DoctorReport:
    """Everything doctor prints, as data (tests and --json read this).

    ``what_if_cc`` asks the installed flashinfer about another GPU generation (say 100 for
    B200) from any machine, the CPU included: the answers are flashinfer's own. ``selector``
    is whose cache and isolation are reported; by default one made from the process-wide
    settings, which has the process-wide selector's (``configure()`` sets both).
    """
    from fp4select.backends import discover, triton_hopper
    from fp4select.backends import flashinfer as fi
    from fp4select.selector import Selector

    env = environment_for(device)
    if what_if_cc is not None:
        env = dict(env, device="cuda", cc=what_if_cc, gpu=f"what-if SM{what_if_cc}", sm_count=None)
    sel = selector if selector is not None else Selector()
    registry = discover()
    mm_fp4, why = fi.load()
    listed = fi.listed_names(mm_fp4) if mm_fp4 is not None else []
    rows: list[DoctorBackend] = []
    for name, backend in registry.backends.items():
        reason = backend.unavailable_reason(env)
        row = DoctorBackend(
            backend=name,
            family=backend.family,
            available=reason is None,
            reason=reason or "",
            experimental=backend.experimental,
        )
        if backend.family == fi.FAMILY and mm_fp4 is not None:
            row["flashinfer_supported_ccs"] = fi.supported_ccs(mm_fp4, name)
        rows.append(row)
    machine = DoctorMachine(
        device=str(device), gpu=env.get("gpu"), cc=env.get("cc"), sm_count=env.get("sm_count")
    )
    if device.type == "cpu":
        machine["cuda_available"] = torch.cuda.is_available()
    return DoctorReport(
        fp4select=__version__,
        machine=machine,
        environment=env,
        flashinfer=DoctorFlashinfer(
            listed_backends=listed, problem=why, signature=signature_report(mm_fp4)
        ),
        backends=rows,
        source_errors=registry.source_errors,
        cache=DoctorCache(
            root=str(sel.store.root), memory_only=sel.store.memory_only, isolation=sel.isolation
        ),
        blacklist=sel.store.blacklist(env),
        native_key=native_key_report(sel.settings),
        hopper_launch=triton_hopper.launch_path(env),
    )


def native_key_report(settings: Settings) -> DoctorNativeKey:
    """Where the warm path's C++ key is, and whether this process could load it."""
    from fp4select import native_key

    if settings.native != "off":
        native_key.load(settings.native_dir)  # a refusal shows in the status
    state = native_key.status(settings.native_dir)
    return DoctorNativeKey(
        mode=settings.native,
        path=state["path"],
        built=state["built"],
        loaded=state["loaded"],
        status=state["status"] if settings.native != "off" else "off (FP4SELECT_NATIVE=off)",
    )


def signature_report(mm_fp4: Any) -> SignatureReport:
    """How ``best_mm_fp4``'s parameters line up with the installed ``flashinfer.mm_fp4``'s.

    A newer flashinfer may add a parameter: fp4select keeps working (it calls flashinfer
    with the parameters both know), but a caller passing the new one gets a TypeError from
    ``best_mm_fp4``, and this says so before it happens. ``best_mm_fp4``'s parameters are read
    off ``check_arguments``, which takes each of them with its default (a test holds the two
    equal), so that a report needs no import of the API it reports on.
    """
    import inspect

    from fp4select.arguments import check_arguments

    try:
        theirs = inspect.signature(mm_fp4).parameters  # None (no flashinfer): a TypeError too
    except (TypeError, ValueError):
        return SignatureReport(matches=None, only_in_flashinfer=[], different_defaults=[])
    ours = inspect.signature(check_arguments).parameters
    missing = [name for name in theirs if name not in ours]
    defaults = [
        name
        for name, param in theirs.items()
        if name in ours and param.default is not inspect.Parameter.empty
        and ours[name].default != param.default
    ]  # fmt: skip
    return SignatureReport(
        matches=not missing and not defaults,
        only_in_flashinfer=missing,
        different_defaults=defaults,
    )


# -- verify ------------------------------------------------------------------------------------
# The problem kinds a deployment meets: plain NVFP4, trtllm-shuffled weights, MXFP4, fp16
# output, per-token alpha. M buckets span decode to prefill, and include 3072, where one
# release's backends returned zeros on one GPU.
VERIFY_KINDS: tuple[dict[str, Any], ...] = (
    {},
    {"b_layout": "trtllm"},
    {"use_nvfp4": False, "block_size": 32, "alpha_kind": "none"},
    {"out_dtype": "float16"},
    {"alpha_kind": "per_token"},
)
VERIFY_BUCKETS = (1, 16, 256, 3072)
DEFAULT_VERIFY_SHAPES = ((4096, 4096),)
# The statuses that count as a backend failing somewhere (unsupported is not a failure).
_FAILURES = frozenset(
    {Status.WRONG, Status.ERROR, Status.CRASH, Status.HANG, Status.CUDA_ERROR, Status.OOM}
)


def verify_problems(
    shapes: Sequence[tuple[int, int]] = DEFAULT_VERIFY_SHAPES,
    buckets: Sequence[int] = VERIFY_BUCKETS,
) -> list[Problem]:
    """Every problem ``verify`` tunes: each shape in each kind at each M."""
    return [
        Problem(n=n, k=k, m_bucket=m_bucket(m), **kind)
        for n, k in shapes
        for kind in VERIFY_KINDS
        for m in buckets
    ]


class TacticRow(TypedDict):
    """One passed problem of a backend that has tactics: the tactic served, tuned vs default."""

    problem: str
    tactic: Any  # the backend's own tactic value (JSON); -1 its default; None untuned
    # "tuned"; "default" (tuning gave up or ran out of time: flashinfer's -1 is pinned);
    # "untuned" (tuning off or unavailable: flashinfer chooses, its default unless an engine
    # tunes it)
    served: str
    untuned_reason: str | None  # why it is not tuned ("default" and "untuned" rows)
    default_kind: str  # what flashinfer's -1 runs: "heuristic", "config 0", ... "unknown"
    default_at: list[int]  # validation Ms where the tuned tactic cannot run: served at -1
    tuned_us: float | None
    default_us: float | None


class BackendSummary(TypedDict):
    """One backend over every problem verify tuned."""

    statuses: dict[str, int]  # verdict status -> how many problems
    worst_ratio: float | None  # its worst error over the bound, over every problem; None: none ran
    wins: int  # problems it was chosen for
    first_failure: str  # "" when it never failed
    tactics: list[TacticRow]
    # Over its passed problems with tactics: how many serve a tuned tactic, flashinfer's
    # default ("default") or flashinfer's choice ("untuned"); and each reason, counted.
    tactic_counts: dict[str, int]
    default_reasons: dict[str, int]


@dataclass
class VerifyReport:
    """What ``verify`` found: per backend, what held up; ``to_json()`` is the ``--json`` output."""

    environment: dict[str, Any]
    problems: int
    undecided: list[str] = field(default_factory=list)  # problems no backend could serve
    backends: dict[str, BackendSummary] = field(default_factory=dict)

    @property
    def failed(self) -> list[str]:
        """The backends that failed on at least one problem, in the order they were first seen."""
        return [name for name, row in self.backends.items() if row["first_failure"]]

    @property
    def ok(self) -> bool:
        """No backend failed anywhere and every problem has a winner (``verify`` exits 0)."""
        return not self.failed and not self.undecided

    def to_json(self) -> dict[str, Any]:
        return {
            "environment": self.environment,
            "problems": self.problems,
            "undecided": list(self.undecided),
            "backends": {name: dict(row) for name, row in self.backends.items()},
            "failed": self.failed,
        }

    @staticmethod
    def _add_tactic(
        row: BackendSummary,
        decision: Decision,
        name: str,
        detail: Mapping[str, Any],
        record: Mapping[str, Any],
    ) -> None:
        from fp4select.backends import flashinfer_tactics

        tactic = record.get("tactic")
        served = flashinfer_tactics.served_as(record)
        reason = None if served == "tuned" else str(record.get("reason") or "?")
        defaults = record.get("default_at") or []
        default_at = [d.get("m") for d in defaults if isinstance(d, Mapping)]
        tuned = decision.timings.get(name)
        default = detail.get("default_timing") or {}
        row["tactics"].append(
            TacticRow(
                problem=decision.problem.describe(),
                tactic=tactic,
                served=served,
                untuned_reason=reason,
                default_kind=flashinfer_tactics.default_kind(record.get("runner")),
                default_at=[m for m in default_at if isinstance(m, int)],
                tuned_us=tuned.median_us if tuned else None,
                default_us=default.get("median_us"),
            )
        )
        row["tactic_counts"][served] = row["tactic_counts"].get(served, 0) + 1
        if reason is not None:
            row["default_reasons"][reason] = row["default_reasons"].get(reason, 0) + 1
        for entry in defaults:  # a tuned tactic that cannot run at some M of its bucket
            if isinstance(entry, Mapping):
                why = f"at M={entry.get('m')}: {entry.get('reason')}"
                row["default_reasons"][why] = row["default_reasons"].get(why, 0) + 1

    def add(self, decision: Decision) -> None:
        """Count one decision into the per-backend summary."""
        for name, verdict in decision.verdicts.items():
            row = self.backends.setdefault(
                name,
                BackendSummary(
                    statuses={},
                    worst_ratio=None,
                    wins=0,
                    first_failure="",
                    tactics=[],
                    tactic_counts={},
                    default_reasons={},
                ),
            )
            record = verdict.detail.get("tactic")
            if verdict.passed and isinstance(record, Mapping):  # tuned vs default, per problem
                self._add_tactic(row, decision, name, verdict.detail, record)
            row["statuses"][verdict.status] = row["statuses"].get(verdict.status, 0) + 1
            if verdict.worst_ratio is not None:
                worst = row["worst_ratio"]
                row["worst_ratio"] = (
                    verdict.worst_ratio if worst is None else max(worst, verdict.worst_ratio)
                )
            if verdict.status in _FAILURES and not row["first_failure"]:
                row["first_failure"] = (
                    f"{decision.problem.describe()}: {verdict.status} {verdict.reason}"[:160]
                )
        if decision.winner is None:
            self.undecided.append(decision.problem.describe())
        else:
            self.backends[decision.winner]["wins"] += 1


def verify_report(
    device: torch.device,
    problems: Sequence[Problem] | None = None,
    *,
    cache_dir: str | None = None,
    on_decision: Callable[[Decision], None] | None = None,
) -> VerifyReport:
    """Tune a spread of problems (``verify_problems()`` unless given) and say, per backend,
    what held up.

    Decisions go to ``cache_dir`` when given, else to a scratch folder removed afterwards,
    through a selector of its own (the process-wide one is not touched). ``on_decision`` hears
    each ``Decision`` as it is made: the command line moves its progress bar with it.
    """
    from fp4select.selector import Selector
    from fp4select.store import Store

    problems = list(problems) if problems is not None else verify_problems()
    report = VerifyReport(environment=environment_for(device), problems=len(problems))
    with tempfile.TemporaryDirectory(prefix="fp4select-verify-") as scratch:
        sel = Selector(Store(cache_dir or scratch))
        try:
            for problem in problems:
                decision = sel.decide(problem, device)
                report.add(decision)
                if on_decision is not None:
                    on_decision(decision)
        finally:
            sel.close()
    return report
