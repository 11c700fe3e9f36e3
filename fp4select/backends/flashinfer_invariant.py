"""flashinfer's batch-invariant FP4 class (``mm_fp4(..., batch_invariant=True)``) as a backend.

Design rules:

* It exists only where the installed flashinfer's ``mm_fp4`` takes ``batch_invariant`` (0.7.4
  and later): that is read from the signature at runtime, never from a version number.
* It competes only for batch-invariant problems (``modes={"batch_invariant"}``), where
  invariance, not speed, is the point: it is the first choice wherever it runs, and emulation's
  chunked product serves everywhere else. Its declaration mirrors flashinfer's limits for the
  class: ``backend="auto"``, the 128x4 layout, a plain weight, no per-token alpha, bf16/fp16.
* The architectures come from flashinfer (``MM_FP4_ARCHS``). Where it does not expose them the
  class is unavailable, with the reason: emulation serves batch-invariant problems anywhere,
  so not knowing costs speed, never correctness. A problem the class turns down at run time
  (``BatchInvariantUnsupportedError``, a ValueError) is "unsupported", never a fault.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from fp4select.backends import flashinfer as flashinfer_backends
from fp4select.backends.base import ALL_FORMATS, Backend, Capabilities

NAME = "flashinfer-batch-invariant"


def takes_batch_invariant(mm_fp4: Any) -> bool:
    try:
        return "batch_invariant" in inspect.signature(mm_fp4).parameters
    except (TypeError, ValueError):
        return False


def supported_ccs() -> tuple[list[int] | None, str]:
    """Compute capabilities of flashinfer's FP4 batch-invariant class, or (None, why not)."""
    try:
        api = importlib.import_module("flashinfer.gemm.batch_invariant.api")
        return sorted(major * 10 + minor for major, minor in api.MM_FP4_ARCHS), ""
    except Exception as exc:  # moved, renamed, or a partial install
        return None, f"{type(exc).__name__}: {exc}"


def why_unavailable(env: Mapping[str, Any]) -> str | None:
    mm_fp4, why = flashinfer_backends.load()
    if mm_fp4 is None:
        return why
    if not takes_batch_invariant(mm_fp4):
        return "this flashinfer's mm_fp4 has no batch_invariant mode (added in 0.7.4)"
    if env.get("device") != "cuda":
        return "flashinfer's batch-invariant class needs a CUDA GPU"
    ccs, why = supported_ccs()
    if ccs is None:
        # Unknown is unavailable: emulation serves batch-invariant problems everywhere, so
        # guessing costs nothing but speed, and a wrong guess would probe a kernel blind.
        return f"cannot tell where flashinfer's batch-invariant class runs ({why})"
    if env.get("cc") not in ccs:
        where = ", ".join(f"SM{c}" for c in ccs)
        return f"flashinfer's FP4 batch-invariant class runs on {where}, not SM{env.get('cc')}"
    return None


# flashinfer's own checks stay on: the class turns down what it cannot do, as "unsupported".
make_runner = flashinfer_backends._runner_maker("auto", skip_check=False, batch_invariant=True)


def backends() -> list[Backend]:
    """The class as a backend, where the installed flashinfer has the mode at all."""
    mm_fp4, _ = flashinfer_backends.load()
    if mm_fp4 is None or not takes_batch_invariant(mm_fp4):
        return []
    return [
        Backend(
            name=NAME,
            make_checked_runner=make_runner,
            why_unavailable=why_unavailable,
            caps=Capabilities(
                formats=ALL_FORMATS,
                alpha_kinds=frozenset({"none", "scalar"}),
                modes=frozenset({"batch_invariant"}),
            ),
            preference=5,
            family=flashinfer_backends.FAMILY,
            unsupported_errors=flashinfer_backends.unsupported_errors(),
            description="flashinfer's batch-invariant NVFP4/MXFP4 class (batch_invariant=True)",
        )
    ]
