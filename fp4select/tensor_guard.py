"""A check, in one call, that tensors still have the metadata they had when the guard was made.

Design rules:

* This serves best_mm_fp4's Python path, until the C++ key (fp4select.native_key, exact, no
  guard needed) is loaded and wherever it cannot be built. The warm path must see the dtype,
  device, sizes and strides of the tensors new every call, so that a bad call is refused as
  its first call was; read one Python attribute at a time that is seven reads, where
  PyTorch's guard for compiled code, ``torch._C._dynamo.guards.TensorGuards``, checks it all
  (and the dispatch keys) in one C++ call.
* That class is private to PyTorch, so it is trusted only where it constructs with the
  signature used here *and* passes a self-test on the very tensors it will guard: they pass,
  and a view of the first one with another dtype, or the same shape on another device, fails.
  Otherwise a Python guard that compares the same properties serves: slower, same answers.
* A guard may be stricter than the argument checks (exact strides, dispatch keys such as
  requires_grad; a call it refuses takes the slow path, which checks in full), never laxer.
* PyTorch's guard refuses one tensor object passed twice: callers pass distinct objects, and
  the self-test sends a guard that fails this way to the fallback.
* Making a guard allocates nothing on a device (views and the meta device), so it is safe
  while a CUDA graph is being captured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# torch's ``TensorGuards`` class, or None. A private API (see the design rules), typed Any: its
# stub's signature changes between torch releases.
_TensorGuards: Any
try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - every torch fp4select supports has it today
    _TensorGuards = None

Guard = Callable[..., bool]

# Another dtype of the same size, for the self-test's view.
_OTHER_DTYPE = {
    1: (torch.uint8, torch.int8),
    2: (torch.float16, torch.bfloat16),
    4: (torch.float32, torch.int32),
}


def _metadata(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device)


def python_guard(tensors: tuple[torch.Tensor, ...]) -> Guard:
    """The fallback: the same properties, read attribute by attribute."""
    expected = tuple(_metadata(t) for t in tensors)

    def check(*now: torch.Tensor) -> bool:
        return tuple(_metadata(t) for t in now) == expected

    return check


def _other_dtype_view(t: torch.Tensor) -> torch.Tensor | None:
    choices = _OTHER_DTYPE.get(t.element_size())
    if choices is None:
        return None
    other = choices[1] if t.dtype == choices[0] else choices[0]
    try:
        return t.view(other)
    except RuntimeError:
        return None


def _native_guard(tensors: tuple[torch.Tensor, ...]) -> Guard | None:
    if _TensorGuards is None:
        return None
    try:
        guard = _TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
        check: Guard = guard.check
        if not check(*tensors):
            return None
        first, rest = tensors[0], tensors[1:]
        retyped = _other_dtype_view(first)
        if retyped is None or check(retyped, *rest):
            return None
        elsewhere = torch.empty_strided(
            first.shape, first.stride(), dtype=first.dtype, device="meta"
        )
        if check(elsewhere, *rest):
            return None
        return check
    except Exception:  # another signature in this torch, or a tensor it cannot guard
        return None


def guard(*tensors: torch.Tensor) -> Guard:
    """A function that tells, in one call, whether tensors have these tensors' metadata."""
    return _native_guard(tensors) or python_guard(tensors)


def native_available(*tensors: torch.Tensor) -> bool:
    """Whether the C++ guard serves these tensors here (doctor and the benchmarks report it)."""
    return _native_guard(tensors) is not None
