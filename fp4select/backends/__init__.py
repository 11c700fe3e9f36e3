"""The backend registry: flashinfer's runtime list, our emulation, entry points, and calls.

Design rules:

* Four sources, in this order: flashinfer's runtime-listed backends, the built-in ones
  (``emulation``, then the GPU kernels ``hopper-*``, ``triton-*``, ``torch-dequant``,
  ``torch-scaled-mm``, each saying itself where it cannot run), the ``fp4select.backends``
  entry-point group, and ``register_backend(...)`` calls. A name may appear once; a later
  source must pass ``replace=True`` to shadow an earlier one.
* A broken source never breaks discovery: an entry point that fails to load, or a flashinfer
  that fails to import, is recorded as a reason and shown by ``doctor`` and ``explain``.
* An entry point's object may be a Backend, an iterable of them, or a zero-argument callable
  returning either; it is loaded once per process.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fp4select.backends import dequant, emulation, torch_scaled_mm, triton_fp4, triton_hopper
from fp4select.backends import flashinfer as flashinfer_backends
from fp4select.backends.base import (
    Backend,
    Capabilities,
    NotImportableError,
    Runner,
    UnsupportedProblem,
)
from fp4select.keys import Problem

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "Capabilities",
    "NotImportableError",
    "Registry",
    "Runner",
    "UnsupportedProblem",
    "discover",
    "register_backend",
    "unregister_backend",
]

ENTRY_POINT_GROUP = "fp4select.backends"

_lock = threading.Lock()
_registered: dict[str, Backend] = {}
_may_shadow: set[str] = set()
_generation = 0  # bumped on every change, so cached registries know they are stale
_entry_points: tuple[list[Backend], dict[str, str]] | None = None


@dataclass
class Registry:
    """A snapshot of every known backend, and why some sources gave none."""

    backends: dict[str, Backend] = field(default_factory=dict)
    source_errors: dict[str, str] = field(default_factory=dict)
    runtime_names: frozenset[str] = frozenset()

    def get(self, name: str) -> Backend | None:
        return self.backends.get(name)


def register_backend(
    backend: Backend | Runner | None = None,
    /,
    *,
    name: str | None = None,
    make_checked_runner: Callable[[Problem], Runner] | None = None,
    why_unavailable: Callable[[Mapping[str, Any]], str | None] | None = None,
    caps: Capabilities | None = None,
    preference: int = 100,
    replace: bool = False,
    description: str = "",
    **capabilities: Any,
) -> Backend:
    """Add a backend for this process.

    Pass a ready ``Backend``, or a runner function plus its declaration, e.g.
    ``register_backend(my_gemm, name="mine", formats={"nvfp4"}, devices={"cuda"})``. For the
    sandbox (the default isolation) the functions must be importable module-level names.
    """
    if isinstance(backend, Backend):
        if name or make_checked_runner or why_unavailable or caps or capabilities:
            raise TypeError("register_backend(Backend) takes no other declaration arguments")
        spec = backend
    else:
        if name is None:
            raise TypeError("register_backend(checked_runner, ...) needs name=")
        if caps is not None and capabilities:
            raise TypeError("give caps= or capability keywords, not both")
        if caps is None:
            fields: dict[str, Any] = {
                k: frozenset(v) if isinstance(v, (set, list, tuple)) else v
                for k, v in capabilities.items()
            }
            caps = Capabilities(**fields)
        spec = Backend(
            name=name,
            checked_runner=backend,
            make_checked_runner=make_checked_runner,
            why_unavailable=why_unavailable,
            caps=caps,
            preference=preference,
            family="plugin",
            description=description,
        )
    with _lock:
        if spec.name in _registered and not replace:
            raise ValueError(f"backend {spec.name!r} is already registered; pass replace=True")
        _registered[spec.name] = spec
        _bump()
        if replace:
            _may_shadow.add(spec.name)
        else:
            _may_shadow.discard(spec.name)
    return spec


def unregister_backend(name: str) -> None:
    with _lock:
        _may_shadow.discard(name)
        if _registered.pop(name, None) is None:
            raise KeyError(f"no backend {name!r} was registered with register_backend")
        _bump()


def _bump() -> None:
    global _generation
    _generation += 1


def generation() -> int:
    """Changes whenever a backend is registered, unregistered or entry points are reloaded."""
    return _generation


def _coerce(obj: Any) -> list[Backend]:
    if isinstance(obj, Backend):
        return [obj]
    if callable(obj):
        return _coerce(obj())
    if isinstance(obj, Iterable):
        items = list(obj)
        if all(isinstance(item, Backend) for item in items):
            return items
    raise TypeError(
        f"expected a Backend, an iterable of Backends or a callable returning them, got {obj!r}"
    )


def _load_entry_points() -> tuple[list[Backend], dict[str, str]]:
    global _entry_points
    with _lock:
        if _entry_points is None:
            found: list[Backend] = []
            errors: dict[str, str] = {}
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                try:
                    found.extend(_coerce(ep.load()))
                except Exception as exc:  # a plugin's bug must not hide every other backend
                    errors[f"entry point {ep.name} ({ep.value})"] = f"{type(exc).__name__}: {exc}"
            _entry_points = (found, errors)
        return _entry_points


def reload_entry_points() -> None:
    """Forget loaded entry points (a package was installed or removed at runtime)."""
    global _entry_points
    with _lock:
        _entry_points = None
        _bump()


def discover(*, include_flashinfer: bool = True) -> Registry:
    registry = Registry()
    if include_flashinfer:
        found, why = flashinfer_backends.backends()
        if why:
            registry.source_errors["flashinfer"] = why
        for b in found:
            registry.backends[b.name] = b
        for b in flashinfer_backends.invariant_backends():
            registry.backends[b.name] = b
    registry.backends[emulation.NAME] = emulation.BACKEND
    gpu_kernels = (
        *triton_hopper.BACKENDS,
        dequant.HOPPER_DEQUANT,
        *triton_fp4.BACKENDS,
        dequant.TORCH_DEQUANT,
    )
    for b in (*gpu_kernels, torch_scaled_mm.BACKEND):
        registry.backends[b.name] = b
    eps, errors = _load_entry_points()
    registry.source_errors.update(errors)
    for b in eps:
        if b.name in registry.backends:
            registry.source_errors[f"entry point backend {b.name}"] = "name already taken; ignored"
            continue
        registry.backends[b.name] = b
    with _lock:
        runtime = dict(_registered)
        may_shadow = set(_may_shadow)
    for b in runtime.values():
        if b.name in registry.backends and b.name not in may_shadow:
            registry.source_errors[f"registered backend {b.name}"] = (
                "name already taken by a built-in or entry-point backend; pass replace=True"
            )
            continue
        registry.backends[b.name] = b
    registry.runtime_names = frozenset(runtime)
    return registry
