"""What a backend is, to the selector: a runner plus the promises it makes about its inputs.

Design rules:

* A backend declares what it accepts (formats, scale layouts, b layout, output dtypes, alpha
  kinds, divisibility, M limit, devices). The selector never runs a candidate on a problem its
  declaration excludes: an impossible candidate is a recorded reason, not a failed probe.
* Availability problems (a package missing, a compute capability unsupported, a JIT toolchain
  missing) are returned as reason strings, never raised: one broken backend must not hide the
  others.
* A runner has exactly ``flashinfer.mm_fp4``'s positional order without ``backend``:
  ``(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout,
  use_nvfp4, enable_pdl)``, called positionally so the warm path pays no keyword binding.
* A backend that must run in the sandbox child is rebuilt there from importable references
  (``module:qualname``) and plain data; nothing but JSON crosses the process boundary.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from fp4select.formats import ALPHA_KINDS, OUT_DTYPES

if TYPE_CHECKING:
    from fp4select.keys import Problem

Runner = Callable[..., torch.Tensor]
ALL_FORMATS = frozenset({"nvfp4", "mxfp4"})
# "regular": the rows of the output may depend on M (per-bucket kernels, split-K by M).
# "batch_invariant": row i of the output is the same bits whatever M and the other rows are.
MODES = ("regular", "batch_invariant")


@dataclass(frozen=True)
class Capabilities:
    """The problems a backend claims to handle; the default is flashinfer's plain-layout family."""

    formats: frozenset[str] = ALL_FORMATS
    a_sf_layouts: frozenset[str] = frozenset({"128x4"})
    b_layouts: frozenset[str] = frozenset({"plain"})
    out_dtypes: frozenset[str] = frozenset(OUT_DTYPES)
    alpha_kinds: frozenset[str] = frozenset({"none", "scalar"})
    n_multiple: int = 1
    k_multiple: int = 1
    max_m: int | None = None
    # Declines buckets that end below it: a fixed cost per call (a decode pass over the whole
    # weight) that no small M can win back, so validating and timing it there only slows warm.
    min_m: int | None = None
    devices: frozenset[str] = frozenset({"cuda"})
    modes: frozenset[str] = frozenset({"regular"})

    def rejects(self, problem: Problem, device_type: str) -> str | None:
        """Why this problem is outside the declaration, or None when it is inside."""
        mode = "batch_invariant" if problem.batch_invariant else "regular"
        if mode not in self.modes:
            return (
                "is not batch invariant (its rows may depend on M)"
                if problem.batch_invariant
                else "runs only in batch-invariant mode"
            )
        if device_type not in self.devices:
            return f"runs on {sorted(self.devices)} only, not {device_type}"
        if problem.format not in self.formats:
            return f"does not take {problem.format} (takes {sorted(self.formats)})"
        if problem.a_sf_layout not in self.a_sf_layouts:
            return f"does not take a {problem.a_sf_layout} scale layout for a"
        if problem.b_layout not in self.b_layouts:
            return f"does not take b in the {problem.b_layout!r} layout"
        if problem.out_dtype not in self.out_dtypes:
            return f"does not produce {problem.out_dtype}"
        if problem.alpha_kind not in self.alpha_kinds:
            return f"does not take alpha of kind {problem.alpha_kind!r}"
        if problem.n % self.n_multiple:
            return f"needs N % {self.n_multiple} == 0, got N={problem.n}"
        if problem.k % self.k_multiple:
            return f"needs K % {self.k_multiple} == 0, got K={problem.k}"
        if self.max_m is not None and problem.batch_invariant:
            return f"needs M <= {self.max_m}; a batch-invariant decision serves every M"
        if self.max_m is not None and problem.m_range[0] > self.max_m:
            return f"needs M <= {self.max_m}, bucket starts at {problem.m_range[0]}"
        if self.min_m is not None and problem.m_range[1] < self.min_m:
            return f"is built for M >= {self.min_m}, bucket ends at {problem.m_range[1]}"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            name: sorted(value) if isinstance(value, frozenset) else value
            for name, value in self.__dict__.items()
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Capabilities:
        fields: dict[str, Any] = {
            k: frozenset(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)

    def __post_init__(self) -> None:
        unknown = set(self.alpha_kinds) - set(ALPHA_KINDS)
        if unknown:
            raise ValueError(f"alpha_kinds must be drawn from {ALPHA_KINDS}, got {sorted(unknown)}")
        unknown = set(self.modes) - set(MODES)
        if unknown or not self.modes:
            raise ValueError(
                f"modes must be a non-empty subset of {MODES}, got {sorted(self.modes)}"
            )


@dataclass(frozen=True)
class Backend:
    """A candidate for one matrix product.

    Two runners. The *checked* runner is what probing runs (with whatever argument checks the
    backend has): ``checked_runner`` is that runner itself for simple backends, or
    ``make_checked_runner`` (problem -> runner) builds it for those that need the problem (the
    b layout, a pre-compiled kernel). The *fast* runner is what the warm path binds once the
    backend is proven on the problem: ``make_fast_runner`` (problem -> runner, its checks
    skipped) where the backend has one, else the checked runner. ``why_unavailable`` (env ->
    reason or None) says why the backend cannot run in this environment at all; call it
    through ``unavailable_reason``, which turns its exceptions into reasons. ``preference``
    breaks near-ties: lower wins, so ranks and restarts agree when timings are inside noise.
    """

    name: str
    checked_runner: Runner | None = None
    make_checked_runner: Callable[[Problem], Runner] | None = None
    why_unavailable: Callable[[Mapping[str, Any]], str | None] | None = None
    caps: Capabilities = field(default_factory=Capabilities)
    preference: int = 100
    family: str = "plugin"
    experimental: bool = False
    description: str = ""
    make_fast_runner: Callable[[Problem], Runner] | None = None
    unsupported_errors: tuple[type[BaseException], ...] = ()
    # Optional tactic hooks (flashinfer's autotuner, see flashinfer_tactics): ``tune(runner,
    # problem, args, *, name, progress)`` returns a JSON record of the tactic chosen at M = the
    # bucket's top (``progress()`` is called as it goes); ``pin(runner, record)`` returns a
    # runner that runs at the recorded tactic.
    tune: Callable[..., Mapping[str, Any]] | None = None
    pin: Callable[[Runner, Mapping[str, Any]], Runner] | None = None
    # ``declines(problem, env)``: why this backend, though it could run the problem, is not
    # tried here (measured never to win there, e.g. superseded on a GPU generation), or None.
    # A declined problem is neither validated nor timed, which keeps warm-up short.
    declines: Callable[[Problem, Mapping[str, Any]], str | None] | None = None
    # Device types (``env["device"]``) where this backend cannot win while any other candidate
    # passes (emulation on CUDA): a fallback there, probed only when no other candidate passes
    # (the selector's rules).
    fallback_on: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name == "auto":
            raise ValueError(
                f"backend name must be a non-empty string other than 'auto', got {self.name!r}"
            )
        if (self.checked_runner is None) == (self.make_checked_runner is None):
            raise ValueError(
                f"backend {self.name!r}: give exactly one of checked_runner= or "
                "make_checked_runner="
            )
        # A set or list is taken too (the docs write ``fallback_on={"cuda"}``); held frozen.
        object.__setattr__(self, "fallback_on", frozenset(self.fallback_on))

    def checked_runner_for(
        self, problem: Problem, tactic: Mapping[str, Any] | None = None
    ) -> Runner:
        """The runner used while probing (with whatever checks the backend has).

        ``tactic`` (a record from ``tune``) pins the runner to that tactic.
        """
        if self.make_checked_runner is not None:
            return self._pinned(self.make_checked_runner(problem), tactic)
        assert self.checked_runner is not None  # __post_init__: exactly one of the two is given
        return self._pinned(self.checked_runner, tactic)

    def fast_runner_for(self, problem: Problem, tactic: Mapping[str, Any] | None = None) -> Runner:
        """The runner bound for the warm path, once this backend is proven on the problem."""
        if self.make_fast_runner is not None:
            return self._pinned(self.make_fast_runner(problem), tactic)
        return self.checked_runner_for(problem, tactic)

    def _pinned(self, runner: Runner, tactic: Mapping[str, Any] | None) -> Runner:
        if tactic is None or self.pin is None:
            return runner
        return self.pin(runner, tactic)

    def is_unsupported(self, exc: BaseException) -> bool:
        """Whether an exception from the runner means "not my problem" rather than a fault."""
        return isinstance(exc, (UnsupportedProblem, *self.unsupported_errors))

    def unavailable_reason(self, env: Mapping[str, Any]) -> str | None:
        """Why this backend cannot run in ``env``, or None: ``why_unavailable``, never raising."""
        if self.why_unavailable is None:
            return None
        try:
            return self.why_unavailable(env)
        except Exception as exc:  # a broken availability check is itself a reason
            return f"availability check raised {type(exc).__name__}: {exc}"

    def rejects(self, problem: Problem, env: Mapping[str, Any]) -> str | None:
        why = self.caps.rejects(problem, env.get("device") or "cpu")
        if why is None and self.declines is not None:
            try:
                why = self.declines(problem, env)
            except Exception as exc:  # a plugin's broken hook is a reason, not a crash
                why = f"declines raised {type(exc).__name__}: {exc}"
        return why

    # -- crossing into the sandbox -------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """Plain-data form for the sandbox child; raises if a function cannot be re-imported.

        Never stored: it crosses a pipe to a child of the same fp4select, so its keys are the
        field names of this version.
        """
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update({name: _reference(data[name]) for name in _FUNCTIONS})
        data["caps"] = self.caps.to_json()
        data["fallback_on"] = sorted(self.fallback_on)
        data["unsupported_errors"] = [_reference(e) for e in self.unsupported_errors]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Backend:
        values = {**data, **{name: _resolve(data.get(name)) for name in _FUNCTIONS}}
        values["caps"] = Capabilities.from_json(data["caps"])
        values["unsupported_errors"] = tuple(_resolve(e) for e in data["unsupported_errors"])
        return cls(**values)


# The fields of a Backend that hold functions: they cross as ``module:qualname`` references.
_FUNCTIONS = (
    "checked_runner",
    "make_checked_runner",
    "why_unavailable",
    "make_fast_runner",
    "tune",
    "pin",
    "declines",
)


def cuda_from(env: Mapping[str, Any], min_cc: int) -> bool:
    """Whether ``env`` is a CUDA GPU of compute capability ``min_cc`` or newer: ``declines``
    hooks narrow the field only on GPUs where it was measured, and leave the rest alone."""
    cc = env.get("cc")
    return env.get("device") == "cuda" and isinstance(cc, int) and cc >= min_cc


def is_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the CUDA context broke: that process cannot use the GPU again."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    markers = ("CUDA error", "illegal memory access", "device-side assert", "cudaError")
    return any(marker in str(exc) for marker in markers)


class UnsupportedProblem(Exception):
    """Raised by a runner to say it cannot take this problem: recorded, never blacklisted."""


class NotImportableError(ValueError):
    """A backend function that a child process could not import by name."""


def _reference(fn: Callable[..., Any] | None) -> str | None:
    if fn is None:
        return None
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        raise NotImportableError(
            f"{fn!r} cannot be imported by the sandbox child: define it at module level in an "
            "importable module (not __main__, not a lambda or closure), or use isolation='inprocess'"
        )
    if _resolve(f"{module}:{qualname}") is not fn:
        raise NotImportableError(f"{module}:{qualname} does not name {fn!r}")
    return f"{module}:{qualname}"


def _resolve(ref: str | None) -> Any:
    if ref is None:
        return None
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
