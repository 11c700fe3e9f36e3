"""flashinfer's mm_fp4 backends, as the installed flashinfer lists them at runtime.

Design rules:

* The list of backends is read from ``inspect.signature(flashinfer.mm_fp4)`` every process,
  never written down here: a backend that appears in a later flashinfer is a candidate with no
  change to fp4select. Which compute capabilities each supports comes from
  ``mm_fp4.is_backend_supported`` where it exists (else the probe finds out).
* Only what flashinfer cannot tell without a GPU and real tensors is written down here: each
  backend's layout family (trtllm takes row-shuffled weights and 8x4 scales for a), output
  dtypes, alpha kinds and divisibility. A backend missing from that table gets the plain
  defaults, and flashinfer's own per-call checks (on while probing) reject what it cannot do,
  as "unsupported", not failures. After validation mm_fp4 is called with ``skip_check=True``.
* Each backend is tuned under flashinfer's own autotuner before it is validated and timed, and
  is served at the tactic it was timed at (``flashinfer_tactics``).
* flashinfer's batch-invariant class (``mm_fp4(..., batch_invariant=True)``, 0.7.4+, read from
  the signature) is one more backend, ``INVARIANT_NAME``, competing only for batch-invariant
  problems, where invariance, not speed, is the point: the first choice wherever it runs. Its
  declaration mirrors flashinfer's limits for the class (``backend="auto"``, 128x4 scales, a
  plain weight, no per-token alpha); its architectures come from ``MM_FP4_ARCHS``, and where
  that is not exposed it is unavailable (not knowing costs speed, never correctness). A
  problem the class turns down at run time is "unsupported", never a fault.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import typing
from collections.abc import Mapping
from typing import Any

from fp4select import settings
from fp4select.backends import flashinfer_tactics
from fp4select.backends.base import ALL_FORMATS, Backend, Capabilities, Runner
from fp4select.keys import Problem
from fp4select.records import CAUSE_EXPERIMENTAL, Reason

FAMILY = "flashinfer"
# Compute capabilities to ask flashinfer about, to say *where* a backend would run.
KNOWN_CCS = (75, 80, 86, 87, 89, 90, 100, 103, 107, 110, 120, 121)
EXPERIMENTAL_ENV = "FP4SELECT_EXPERIMENTAL"  # named in the reason an experimental one is skipped

_NV = frozenset({"nvfp4"})
_BF16 = frozenset({"bfloat16"})

# name -> (capabilities, preference, python modules it needs). Facts from flashinfer 0.7.2's
# requirement functions and docs; see the module docstring for why they live here.
KNOWN: dict[str, tuple[Capabilities, int, tuple[str, ...]]] = {
    "cutlass": (Capabilities(formats=_NV), 10, ()),
    "cudnn": (Capabilities(), 20, ("cudnn",)),
    "b12x": (Capabilities(k_multiple=32), 30, ("cutlass",)),
    "cute-dsl": (
        Capabilities(n_multiple=8, alpha_kinds=frozenset({"none", "scalar", "per_token"})),
        40,
        ("cutlass",),
    ),
    "cutedsl_low_latency": (Capabilities(max_m=8, k_multiple=64), 50, ("cutlass",)),
    "trtllm": (
        Capabilities(
            formats=_NV,
            a_sf_layouts=frozenset({"128x4", "8x4"}),
            b_layouts=frozenset({"trtllm"}),
            out_dtypes=_BF16,
        ),
        60,
        (),
    ),
    "cake": (
        Capabilities(
            formats=_NV, n_multiple=8, k_multiple=256, alpha_kinds=frozenset({"per_token"})
        ),
        90,
        (),
    ),
}
UNKNOWN_PREFERENCE = 500


@functools.lru_cache(maxsize=1)
def load() -> tuple[Any, str | None]:
    """(flashinfer.mm_fp4 or None, why not). Imported once: it takes seconds."""
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return None, f"flashinfer is not importable ({type(exc).__name__}: {exc})"
    # An engine plugin may have replaced flashinfer.mm_fp4 with best_mm_fp4: look where the
    # original is defined first, and never take our own function for flashinfer's.
    for module_name in ("flashinfer.gemm.gemm_base", "flashinfer.gemm", "flashinfer"):
        try:
            mm_fp4 = getattr(importlib.import_module(module_name), "mm_fp4", None)
        except Exception:
            continue
        if mm_fp4 is not None and not getattr(mm_fp4, "__fp4select__", False):
            return mm_fp4, None
    return None, f"flashinfer {getattr(flashinfer, '__version__', '?')} has no mm_fp4"


def listed_names(mm_fp4: Any) -> list[str]:
    """Backend names from the ``backend`` parameter's Literal annotation, in flashinfer's order."""
    try:
        param = inspect.signature(mm_fp4).parameters["backend"]
    except (KeyError, TypeError, ValueError):
        return []
    annotation = param.annotation
    if isinstance(annotation, str):  # postponed annotations
        try:
            annotation = typing.get_type_hints(inspect.unwrap(mm_fp4))["backend"]
        except Exception:
            return []
    names = [n for n in typing.get_args(annotation) if isinstance(n, str)]
    return [n for n in names if n != "auto"]


def experimental_names(mm_fp4: Any) -> frozenset[str]:
    return frozenset(getattr(mm_fp4, "experimental_backends", frozenset()))


def supported_ccs(mm_fp4: Any, name: str) -> list[int] | None:
    """CCs flashinfer says the backend runs on, or None when this flashinfer cannot say."""
    query = getattr(mm_fp4, "is_backend_supported", None)
    if query is None:
        return None
    out = []
    for cc in KNOWN_CCS:
        try:
            if query(name, cc):
                out.append(cc)
        except Exception:
            return None
    return out


def experimental_allowed() -> bool:
    """The process-wide ``experimental`` setting (``FP4SELECT_EXPERIMENTAL``, ``configure()``)."""
    return settings.current().experimental


def _availability(name: str, modules: tuple[str, ...]):
    def why_unavailable(env: Mapping[str, Any]) -> str | None:
        mm_fp4, why = load()
        if mm_fp4 is None:
            return why
        if env.get("device") != "cuda":
            return "flashinfer's FP4 kernels need a CUDA GPU"
        cc = env.get("cc")
        ccs = supported_ccs(mm_fp4, name)
        if ccs is not None and cc not in ccs:
            where = ", ".join(f"SM{c}" for c in ccs) or "no compute capability"
            return f"flashinfer reports '{name}' unsupported on SM{cc} (supported: {where})"
        if name in experimental_names(mm_fp4) and not experimental_allowed():
            return Reason(
                f"experimental in flashinfer; set {EXPERIMENTAL_ENV}=1 to consider it",
                CAUSE_EXPERIMENTAL,
            )
        for module in modules:
            if importlib.util.find_spec(module) is None:
                return f"needs the Python module '{module}', which is not installed"
        return None

    return why_unavailable


def _runner_maker(name: str, *, skip_check: bool, **extra: Any):
    """A problem -> runner function whose runners call ``mm_fp4`` with ``backend=name`` (and
    ``extra`` keywords, e.g. ``batch_invariant=True``) in mm_fp4's own positional order."""

    def make_runner(problem: Problem) -> Runner:
        mm_fp4, why = load()
        if mm_fp4 is None:
            raise RuntimeError(why)

        def run(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, nvfp4, pdl):
            return mm_fp4(
                a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, name,
                nvfp4, pdl, skip_check=skip_check, **extra,
            )  # fmt: skip

        return run

    return make_runner


def unsupported_errors() -> tuple[type[BaseException], ...]:
    """Exceptions by which flashinfer's checks say "this problem is not mine"."""
    errors: list[type[BaseException]] = [ValueError, NotImplementedError]
    try:
        from flashinfer.utils import BackendSupportedError

        errors.append(BackendSupportedError)
    except Exception:
        pass
    return tuple(errors)


def backends() -> tuple[list[Backend], str | None]:
    """One Backend per runtime-listed name, or ([], why) when flashinfer is unusable."""
    mm_fp4, why = load()
    if mm_fp4 is None:
        return [], why
    names = listed_names(mm_fp4)
    if not names:
        return [], "flashinfer.mm_fp4 lists no backends in its signature"
    experimental = experimental_names(mm_fp4)
    out = []
    for name in names:
        caps, preference, modules = KNOWN.get(name, (Capabilities(), UNKNOWN_PREFERENCE, ()))
        new = "" if name in KNOWN else "new in this flashinfer; checked by its own checks"
        out.append(
            Backend(
                name=name,
                make_checked_runner=_runner_maker(name, skip_check=False),
                make_fast_runner=_runner_maker(name, skip_check=True),
                why_unavailable=_availability(name, modules),
                caps=caps,
                preference=preference,
                family=FAMILY,
                experimental=name in experimental,
                unsupported_errors=unsupported_errors(),
                tune=flashinfer_tactics.tune,
                pin=flashinfer_tactics.pinned,
                description=new,
            )
        )
    return out, None


def auto_runner(env: Mapping[str, Any], problem: Problem) -> Runner | None:
    """flashinfer's own heuristic choice (``backend="auto"``), where it would have one.

    flashinfer's auto never picks a trtllm-layout weight, and needs a supported GPU.
    """
    mm_fp4, _ = load()
    if mm_fp4 is None or env.get("device") != "cuda" or problem.b_layout != "plain":
        return None
    supported = getattr(mm_fp4, "is_compute_capability_supported", None)
    if supported is not None and not supported(env.get("cc")):
        return None
    return _runner_maker("auto", skip_check=False)(problem)


# --------------------------------------------------------------------------- batch-invariant class

INVARIANT_NAME = "flashinfer-batch-invariant"


def takes_batch_invariant(mm_fp4: Any) -> bool:
    try:
        return "batch_invariant" in inspect.signature(mm_fp4).parameters
    except (TypeError, ValueError):
        return False


def invariant_ccs() -> tuple[list[int] | None, str]:
    """Compute capabilities of flashinfer's FP4 batch-invariant class, or (None, why not)."""
    try:
        api = importlib.import_module("flashinfer.gemm.batch_invariant.api")
        return sorted(major * 10 + minor for major, minor in api.MM_FP4_ARCHS), ""
    except Exception as exc:  # moved, renamed, or a partial install
        return None, f"{type(exc).__name__}: {exc}"


def invariant_why_unavailable(env: Mapping[str, Any]) -> str | None:
    mm_fp4, why = load()
    if mm_fp4 is None:
        return why
    if not takes_batch_invariant(mm_fp4):
        return "this flashinfer's mm_fp4 has no batch_invariant mode (added in 0.7.4)"
    if env.get("device") != "cuda":
        return "flashinfer's batch-invariant class needs a CUDA GPU"
    ccs, why = invariant_ccs()
    if ccs is None:
        # Unknown is unavailable: emulation serves batch-invariant problems everywhere, so
        # guessing costs nothing but speed, and a wrong guess would probe a kernel blind.
        return f"cannot tell where flashinfer's batch-invariant class runs ({why})"
    if env.get("cc") not in ccs:
        where = ", ".join(f"SM{c}" for c in ccs)
        return f"flashinfer's FP4 batch-invariant class runs on {where}, not SM{env.get('cc')}"
    return None


# flashinfer's own checks stay on: the class turns down what it cannot do, as "unsupported".
make_invariant_runner = _runner_maker("auto", skip_check=False, batch_invariant=True)


def invariant_backends() -> list[Backend]:
    """The class as a backend, where the installed flashinfer has the mode at all."""
    mm_fp4, _ = load()
    if mm_fp4 is None or not takes_batch_invariant(mm_fp4):
        return []
    return [
        Backend(
            name=INVARIANT_NAME,
            make_checked_runner=make_invariant_runner,
            why_unavailable=invariant_why_unavailable,
            caps=Capabilities(
                formats=ALL_FORMATS,
                alpha_kinds=frozenset({"none", "scalar"}),
                modes=frozenset({"batch_invariant"}),
            ),
            preference=5,
            family=FAMILY,
            unsupported_errors=unsupported_errors(),
            description="flashinfer's batch-invariant NVFP4/MXFP4 class (batch_invariant=True)",
        )
    ]
