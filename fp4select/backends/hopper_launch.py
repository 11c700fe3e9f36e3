"""Eager calls of the ``hopper-*`` paths planned once per kind of call, then launched from the
kernels Triton compiled.

Called eagerly (a prefill; any caller without CUDA graphs), a call of these paths costs its
host time, which below about M = 2048 is longer than its kernels: fp4select's argument checks and
decisions (split, grid, tile, PDL) and Triton's JIT binding every argument of every launch to
find the compiled kernel again (docs/hopper.md, 'Eager launches'). A *plan* holds what a call's
metadata decides; a ``Launch`` holds one kernel at one grid and one set of compile-time
arguments, launched through the JIT the first time and then straight through the compiled
kernel's own launcher (``CompiledKernel[grid](*args)``), as Triton's ahead-of-time users do,
or with Triton 3.6's launcher, by calling it as that does.

Design rules:

* A plan depends only on what ``call_key`` reads: every tensor's shape, strides, dtype and
  device, its data pointer's remainder mod 16, the flags and alpha's kind, the current device
  (the tensors' metadata in one call of the warm path's C++ key where it is loaded).
  Those fix every integer a kernel receives and every property Triton specializes a kernel on
  (pointers' and integers' divisibility by 16, integers equal to 1, dtypes), so the compiled
  kernel of the first launch is the kernel the JIT would pick again. Data pointers and a Python
  alpha's value change freely: they are passed on every call.
* A plan never holds a caller's tensor (only workspaces and tables the kernels' modules keep
  anyway), so caching plans keeps no activation or weight alive.
* A plan made while a CUDA graph is being captured is used once and not kept: during capture
  the workspaces and tables that cannot be allocated are replaced by slower choices (no K
  split, the byte-wise kernel), which an eager call made later should not inherit.
* The checked runners (what probing runs) plan every call anew, so they check every call; the
  warm path's fast runners (``planned``) plan once per key. Both run the same plan code.
* Where a launch does not return a compiled kernel (Triton's interpreter), or Triton calls
  hooks before its launches, every launch goes through the JIT as before; so does a launch
  whose direct forms each raised an argument error on their first call (``TypeError``,
  ``IndexError``, ``AttributeError``: a Triton whose launcher takes its arguments otherwise),
  which Python raises before the kernel is enqueued.
* The raw form (``_raw_form``) steps aside for Triton's own path while a profiler's launch
  hook is set, read at every launch.
* The raw form of a kernel taking host TMA descriptors (``hopper-ws``, ``hopper-dequant``)
  encodes each descriptor once per distinct base pointer, shape, strides and padding and
  reuses the encoding (``_described``): it is a function of those and the kernel's fixed
  metadata, and holds no tensor.
* Once every launch of a plan is direct, the plan passes the call's own tensors where the
  kernels were compiled for word views of them: a compiled launcher reads a tensor's data
  pointer only, and the key fixes its alignment, shape and strides (``all_direct``). The
  first calls, through the JIT, pass the views Triton specializes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

Plan = Callable[[tuple[Any, ...]], torch.Tensor]
PlanFor = Callable[[tuple[Any, ...], Any], Plan]

# Plans kept per process; past this many distinct calls the table starts again (a model has a
# few dozen shapes, each at a few M).
MAX_PLANS = 512

_plans: dict[Hashable, Plan] = {}
_plans_lock = threading.Lock()


class Launch:
    """One kernel at one grid with fixed compile-time arguments (``options``); called with the
    kernel's leading run-time arguments, the same ones every call up to their values."""

    __slots__ = ("_fn", "_forms", "_grid", "_kernel", "_options", "direct")

    def __init__(self, fn: Any, grid: tuple[int, ...], **options: Any) -> None:
        self._fn, self._grid, self._options = fn, grid, options
        self._kernel: Any = None  # what the JIT's first launch returned, until a second call
        # The direct forms not yet refused, fastest first; None until a second call (a checked
        # runner's launches run once: they never pay for making them).
        self._forms: list[Callable[..., Any]] | None = None
        # A direct form has gone through: every later call takes it, and the kernels read only
        # the pointers of tensor arguments, so a plan may pass its call's tensors unviewed.
        self.direct = False

    def __call__(self, *args: Any) -> None:
        if self.direct:
            self._forms[0](*args)  # type: ignore[index]
            return
        if self._forms is None and self._kernel is not None:
            self._forms = _direct_forms(
                self._kernel, self._fn, self._grid, len(args), self._options
            )
            self._kernel = None
        while self._forms:  # a first direct launch: an argument error is another Triton's
            try:  # launcher, raised before anything was enqueued; the next form is tried
                self._forms[0](*args)
            except (TypeError, IndexError, AttributeError):
                del self._forms[0]
            else:
                self.direct = True
                return
        kernel = self._fn[self._grid](*args, **self._options)
        if self._forms is None:
            self._kernel = kernel


def all_direct(launches: tuple[Launch | None, ...]) -> bool:
    """Whether every launch of a plan takes its direct form (None: a launch the plan skips)."""
    return all(launch is None or launch.direct for launch in launches)


# Triton 3.6's compiled launcher (``CudaLauncher.launch``) parses these leading arguments:
# grid x, y, z, stream, function, cooperative, PDL, two scratch buffers, the kernel's packed
# metadata, launch metadata and the two launch hooks; then every parameter of the kernel.
_RAW_LAUNCH_FORMAT = "iiiKKppOOOOOO"


def _direct_forms(
    kernel: Any, fn: Any, grid: tuple[int, ...], leading: int, options: dict[str, Any]
) -> list[Callable[..., Any]]:
    """The compiled kernel's launch forms taking the leading arguments, fastest first; none to
    stay on the JIT.

    Both take every parameter in order, compile-time ones included (the launcher skips them),
    so the rest are appended from ``options`` or the parameter's default. The first, where
    there is one, is ``_raw_form``."""
    if type(kernel).__name__ != "CompiledKernel" or getattr(fn, "pre_run_hooks", None):
        return []
    try:
        names = list(fn.arg_names)
        defaults = {p.name: p.default for p in fn.params}
        tail = tuple(options[n] if n in options else defaults[n] for n in names[leading:])
        dims = (*grid, 1, 1)[:3]
        run = kernel[dims]  # its launcher reads all three dimensions
    except Exception:  # another Triton's internals: the JIT path is always right
        return []

    def launch(*args: Any) -> None:
        run(*args, *tail)

    raw = _raw_form(kernel, dims, tail, run)
    return [launch] if raw is None else [raw, launch]


def _raw_form(
    kernel: Any, dims: tuple[int, ...], tail: tuple[Any, ...], run: Callable[..., Any]
) -> Callable[..., Any] | None:
    """The compiled launcher called as ``CompiledKernel.run`` calls it, without the Python
    around it (the device and stream lookups, the hooks' metadata, the scratch buffers, none
    of which these kernels use), which took about as much host time as the launch itself on the
    H200's host (docs/hopper.md, 'Eager launches'); None where the launcher is not the one
    whose arguments it was written against (Triton 3.6's), or needs scratch."""
    try:
        from triton import knobs
        from triton.backends.nvidia import driver as nvidia

        launcher = kernel.run
        if (
            getattr(nvidia, "_BASE_ARGS_FORMAT", None) != _RAW_LAUNCH_FORMAT
            or type(launcher).__name__ != "CudaLauncher"
            or launcher.global_scratch_size
            or launcher.profile_scratch_size
        ):
            return None
        enqueue, hooks = _described(launcher.launch, nvidia), knobs.runtime
        fixed = (
            kernel.function, bool(launcher.launch_cooperative_grid), bool(launcher.launch_pdl),
            None, None, kernel.packed_metadata, None, None, None,
        )  # fmt: skip
        stream_of, device = torch._C._cuda_getCurrentRawStream, torch.cuda.current_device()
    except Exception:
        return None
    x, y, z = dims

    def raw(*args: Any) -> None:
        if _silent(hooks.launch_enter_hook) and _silent(hooks.launch_exit_hook):
            enqueue(x, y, z, stream_of(device), *fixed, *args, *tail)
        else:  # a profiler's hooks: Triton's own path calls them
            run(*args, *tail)

    return raw


# TMA descriptors kept per launch (``_described``); past this many the table starts again (one
# per weight a plan serves, one or two per workspace: a model's layers of one shape).
MAX_DESCRIPTORS = 1024


def _described(launch: Callable[..., Any], nvidia: Any) -> Callable[..., Any]:
    """``launch`` (Triton 3.6's compiled launcher) with the kernel's TMA descriptors encoded once
    per distinct (base pointer, shape, strides, padding) instead of at every launch.

    For a kernel taking host tensor descriptors, Triton 3.6 wraps the launcher in ``inner``,
    which encodes each descriptor (``make_tensordesc_arg``: a ``cuTensorMapEncodeTiled``) on
    every call. The encoding is a function of those fields and the kernel's fixed metadata
    only, and the launcher copies it into the kernel's parameters at launch, so one encoding
    serves every call with the same fields, whichever tensor object carries them. Descriptors
    without metadata hold the tensor itself: those launchers stay as they are, as does any
    ``launch`` that is not that wrapper.
    """
    code, cells = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if code is None or cells is None or code.co_name != "inner":
        return launch
    try:
        env = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells)))
        compiled, indices, metas = (
            env["launcher"], sorted(env["tensordesc_indices"]), list(env["tensordesc_meta"])
        )  # fmt: skip
        encode, base = nvidia.make_tensordesc_arg, nvidia._BASE_ARGS_FORMAT_LEN
    except (KeyError, TypeError, AttributeError):
        return launch
    if not callable(compiled) or len(metas) != len(indices) or any(m is None for m in metas):
        return launch
    encoded: dict[tuple[Any, ...], list[Any]] = {}

    def expand(j: int, desc: Any) -> list[Any]:
        key = (j, desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
        parts = encoded.get(key)
        if parts is None:
            if len(encoded) >= MAX_DESCRIPTORS:
                encoded.clear()
            parts = encoded[key] = encode(desc, metas[j])
        return parts

    def cached(*args: Any) -> Any:
        final = list(args[:base])
        at = base
        for j, index in enumerate(indices):
            final += args[at : base + index]
            final += expand(j, args[base + index])
            at = base + index + 1
        final += args[at:]
        return compiled(*final)

    return cached


def _silent(hook: Any) -> bool:
    """No launch hook: None, or Triton's chain of hooks (``knobs.HookChain``) holding none."""
    return hook is None or not getattr(hook, "calls", True)


# The warm path's C++ key (``fp4select.native_key``) where the settings load one (``api`` sets
# it with them): it reads every tensor's metadata in one call, a few times faster than Python.
_native: Callable[..., int | None] | None = None


def use_native_key(key: Callable[..., int | None] | None) -> None:
    """Key plans with ``key`` (the loaded C++ key), or in Python (None)."""
    global _native
    _native = key


def metadata_key(*tensors: torch.Tensor | None) -> Hashable:
    """What a plan reads of ``tensors`` (each a tensor or None): every one's shape, strides,
    dtype and device (the C++ key reads its type, dispatch keys and requires_grad too), and
    its data pointer's remainder mod 16. Raises what reading a non-tensor raises."""
    exact = None if _native is None else _native(*tensors)
    aligned = tuple([-1 if t is None else t.data_ptr() & 15 for t in tensors])
    if exact is not None:
        return exact, aligned
    meta = tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors])
    return meta, aligned


def call_key(args: tuple[Any, ...]) -> Hashable | None:
    """What a plan for mm_fp4's positional ``args`` depends on (the module rules), or None for
    a call that is not all tensors where tensors are expected (planned every time)."""
    a, b, a_descale, b_descale, alpha, out_dtype, out = args[:7]
    try:
        held = alpha if isinstance(alpha, torch.Tensor) else None
        meta = metadata_key(a, b, a_descale, b_descale, held, out)
        device = torch.cuda.current_device() if a.is_cuda else -1
    except (AttributeError, TypeError, RuntimeError):
        return None
    kind = alpha if alpha is None else type(alpha)
    return (meta, kind, out_dtype, *args[7:11], device)


def planned(kind: str, plan_for: PlanFor, args: tuple[Any, ...], cfg: Any) -> torch.Tensor:
    """Run ``args`` by the plan kept for their key (``plan_for(args, cfg)`` on the first call)."""
    key = call_key(args)
    whole = None if key is None else (kind, cfg, key)
    plan = None if whole is None else _plans.get(whole)
    if plan is None:
        plan = plan_for(args, cfg)
        if whole is not None and not _capturing(args[0]):
            with _plans_lock:
                if len(_plans) >= MAX_PLANS:
                    _plans.clear()
                _plans[whole] = plan
    return plan(args)


def _capturing(a: torch.Tensor) -> bool:
    return a.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def clear_plans() -> None:
    """Forget every plan (tests; after ``triton_fp4.clear_workspaces``)."""
    with _plans_lock:
        _plans.clear()
