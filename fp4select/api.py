"""``best_mm_fp4``: flashinfer.mm_fp4's signature, with the backend chosen per problem.

Design rules:

* The warm path makes one small key, looks it up once and calls a bound runner: no device
  sync, no host-device copy, no logging, so it is safe inside CUDA graph capture
  (benchmarks/bench_warm_path.py measures what it adds).
* Where the C++ key is loaded (fp4select.native_key: built at deploy time, never by a serving
  process), one C++ call turns the exact metadata of every tensor into an int: an exact match
  is the whole check, no guard runs. Otherwise (or ``FP4SELECT_NATIVE=off``) the Python path
  serves, with the same answers: its key separates bound runners (shapes, device index, which
  optional tensors are given, the flags) and a guard made from the binding call
  (fp4select.tensor_guard) verifies the rest of every tensor's metadata. Nothing is taken by
  identity, so engines passing fresh views every call (vLLM's ``b.t()``) are served as fast,
  and metadata changed in place is noticed.
* Arguments are checked in full the first time a call signature (every property the checks
  read that could change with the same shapes) is seen, before any kernel runs, so a call the
  first call would refuse never finds a bound runner: it gets the same error, first or
  thousandth. A call that fails inside the backend is checked in full before its error
  propagates; ``check="always"`` re-checks every call (read into a module global with the
  selector: one global load on the warm path).
* The flags are matched by identity (``True``, ``False``, 16 and 32 are singletons), so a 1 or
  a 16.0 never matches a valid call's key and is checked (and refused) every time.
* A miss during CUDA graph capture never tunes (tuning syncs and allocates): a fallback serves
  the capture, and the key is tuned on the next eager call or by ``tune_pending()``.
"""

import dataclasses
import os
import threading
from typing import Any, Literal

import torch

from fp4select import native_key, tensor_guard
from fp4select import record as _record
from fp4select import settings as settings_mod
from fp4select.arguments import check_arguments
from fp4select.backends import flashinfer_tactics, hopper_launch
from fp4select.keys import Problem, environment_for, resolve_device
from fp4select.records import Decision, TimingOptions
from fp4select.selector import Selector
from fp4select.settings import Settings

# The tables grow with the problems seen, not the calls. _bound: the Python key to (guard,
# runner); _native_bound: the C++ key (exact metadata, no guard) to the runner; _checked: a
# full call signature to the runner (a miss there runs the full checks). An eager prefill
# brings a new M most calls, so past _MAX_SIGNATURES the tables start again: a forgotten call
# is a miss, checked and bound anew, never a wrong runner.
_bound: dict[tuple, Any] = {}
_lookup = _bound.get  # one global load on the warm path instead of two
_native_bound: dict[tuple, Any] = {}
_native_lookup = _native_bound.get
_native_key: native_key.Key | None = None  # set with the settings; None: the Python path
_checked: dict[tuple, Any] = {}
# A key's earlier entries: a caller alternating between two accepted variants (two
# over-allocations of a_descale) finds the other here instead of a new guard every call.
_spares: dict[tuple, tuple] = {}
_SPARES = 3
_MAX_SIGNATURES = 4096
_table_lock = threading.Lock()
_B16 = 16  # small ints are singletons in CPython: `block_size is _B16` refuses 16.0 and True
# What the guard checks in place of alpha=None (a distinct object: PyTorch's guard refuses a
# call that passes one tensor twice).
_NO_ALPHA = torch.empty(0)


_selector: Selector | None = None
# The process-wide selector's ``check == "always"``: set with the selector, read per miss.
_always_check = False


def selector() -> Selector:
    """The process-wide selector, created on first use from the process-wide settings."""
    global _selector, _always_check, _native_key
    if _selector is None:
        with _table_lock:
            if _selector is None:
                made = Selector(settings=settings_mod.current())
                _always_check = made.settings.check == "always"
                _selector = made
                _native_key = native_key.for_settings(made.settings)
                hopper_launch.use_native_key(_native_key)
    return _selector


def _after_fork_in_child() -> None:
    """The child of a fork must not inherit a lock another thread held (a binding)."""
    global _table_lock
    _table_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def configure(
    *, settings: Settings | None = None, timing: TimingOptions | None = None, **changes: Any
) -> Selector:
    """Replace the process-wide settings and selector (and forget bound runners).

    ``settings`` (else the environment's) with each ``Settings`` field given by name and not
    None written over them (``isolation="inprocess"``, ``time_budget_s=0.5``); they become
    ``settings.current()`` and reach the sandbox's children. An unknown name is a
    ``TypeError``, a bad value a ``SettingError``. ``timing`` replaces the ``TimingOptions``.
    """
    global _selector, _always_check, _native_key
    base = settings if settings is not None else Settings.from_env()
    if not isinstance(base, Settings):
        raise TypeError(f"settings must be a fp4select.Settings, got {type(base).__name__}")
    chosen = base.replace(**{k: v for k, v in changes.items() if v is not None})
    if timing is not None and changes.get("time_budget_s") is not None:
        timing = dataclasses.replace(timing, budget_s=chosen.time_budget_s)
    with _table_lock:
        if _selector is not None:
            _selector.close()
        settings_mod.use(chosen)
        _selector = Selector(timing=timing, settings=chosen)
        _always_check = chosen.check == "always"
        _forget_all()
        _native_key = native_key.for_settings(chosen)
        hopper_launch.use_native_key(_native_key)
    return _selector


def reset() -> None:
    """Forget every bound runner in this process (the disk store is untouched)."""
    with _table_lock:
        _forget_all()


def _forget_all() -> None:
    _checked.clear()
    _bound.clear()
    _spares.clear()
    _native_bound.clear()


def clear_blacklist(backend: str | None = None, device: torch.device | str | None = None) -> int:
    """Forget that ``backend`` (or every backend) crashed here; returns how many were removed.

    The blacklist is per environment, so an upgrade clears it by itself; this is for the
    driver update or the fix that fp4select cannot see.
    """
    return selector().store.remove_from_blacklist(environment_for(resolve_device(device)), backend)


def stats() -> dict[str, int]:
    """This process's counters; ``tactic_fallbacks``: calls run at flashinfer's default tactic
    because the stored one cannot serve their M (``explain`` names them and why)."""
    counters = selector().counters.as_dict()
    counters["bound_signatures"] = len(_checked)
    counters["tactic_fallbacks"] = flashinfer_tactics.fallback_calls()
    return counters


def best_mm_fp4(
    a: torch.Tensor,
    b: torch.Tensor,
    a_descale: torch.Tensor,
    b_descale: torch.Tensor,
    alpha: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    block_size: int = 16,
    use_8x4_sf_layout: bool = False,
    backend: Literal[
        "cudnn", "trtllm", "cutlass", "cute-dsl", "cutedsl_low_latency", "b12x", "cake", "auto"
    ] = "auto",
    use_nvfp4: bool = True,
    enable_pdl: bool = True,
    *,
    batch_invariant: bool = False,
    b_layout: Literal["plain", "trtllm"] = "plain",
    allow_blacklisted: bool = False,
) -> torch.Tensor:
    """FP4 GEMM ``out = (a @ b) * alpha`` by the fastest backend proven correct for this problem.

    Drop-in for ``flashinfer.mm_fp4``: ``backend="auto"`` selects (validated, timed, cached
    on disk); a concrete name runs that backend unless it is blacklisted here. ``b_layout``
    says how ``b`` was prepared: ``"plain"`` (128x4 scales, as cudnn/cutlass/b12x take it) or
    ``"trtllm"`` (row-shuffled weight and scales); only backends taking that layout compete.
    ``batch_invariant=True`` promises that row i of the output has the same bits whatever M is:
    one backend serves every M of the shape (flashinfer's batch-invariant class where it runs,
    else emulation's fixed-shape chunked product); it needs ``backend="auto"``.
    """
    try:
        if (
            use_8x4_sf_layout is False
            and use_nvfp4 is True
            and enable_pdl is True
            and batch_invariant is False
            and allow_blacklisted is False
            and block_size is _B16
        ):
            flags: Any = True
        else:
            flags = (
                id(block_size), id(use_8x4_sf_layout), id(use_nvfp4), id(enable_pdl),
                id(batch_invariant), id(allow_blacklisted),
            )  # fmt: skip
        native = _native_key
        exact = None if native is None else native(a, b, a_descale, b_descale, alpha, out)
        if exact is not None:  # the tensors' exact metadata: a match is the whole check
            key: Any = (exact, out_dtype, backend, b_layout, flags)
            runner = _native_lookup(key)
        else:
            key = (
                a.shape, b.shape, a.get_device(), alpha is None, out is None, out_dtype, backend,
                b_layout, flags,
            )  # fmt: skip
            entry = _lookup(key)
            if entry is None:
                runner = None
            elif out is None:  # the common call: five tensors to guard, not six
                runner = (
                    entry[1]
                    if entry[0](a, b, a_descale, b_descale, _NO_ALPHA if alpha is None else alpha)
                    else None
                )
            else:
                alpha_or_not = _NO_ALPHA if alpha is None else alpha
                runner = (
                    entry[1] if entry[0](a, b, a_descale, b_descale, alpha_or_not, out) else None
                )
    except Exception:  # not tensors, unhashable arguments, a guard refusing a non-tensor
        key, runner = None, None
    if runner is None:  # a first call, or tensors the bound entry's guard refused
        args = (a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout)
        flags = (backend, use_nvfp4, enable_pdl, b_layout, allow_blacklisted, batch_invariant)
        runner = _runner_for(key, args, flags)
    try:
        return runner(
            a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout,
            use_nvfp4, enable_pdl,
        )  # fmt: skip
    except Exception:
        # A failing call explains itself as its first call would have: the same argument
        # errors, whatever was bound. Arguments that pass the checks: the backend's own error.
        check_arguments(
            a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout,
            backend, use_nvfp4, enable_pdl, b_layout, batch_invariant, allow_blacklisted,
        )  # fmt: skip
        raise


# Marks the patched-in function so fp4select never mistakes it for flashinfer's own mm_fp4
# (an engine plugin may set flashinfer.mm_fp4 = best_mm_fp4).
best_mm_fp4.__fp4select__ = True  # type: ignore[attr-defined]


def _signature(args: tuple, flags: tuple) -> tuple | None:
    """Every property the checks read that a later call could change with the same shapes."""
    a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4 = args
    backend, use_nvfp4, enable_pdl, b_layout, allow_blacklisted, batch_invariant = flags
    try:
        return (
            a.shape, a.dtype, a.device, a.is_contiguous(),
            b.shape, b.dtype, b.stride(), b.device,
            a_descale.shape, a_descale.dtype, a_descale.device,
            b_descale.shape, b_descale.dtype, b_descale.device,
            None if alpha is None else (alpha.shape, alpha.dtype, alpha.device),
            None if out is None else (out.shape, out.dtype, out.device),
            out_dtype, id(block_size), id(use_8x4), backend, id(use_nvfp4), id(enable_pdl),
            id(batch_invariant), b_layout, id(allow_blacklisted),
        )  # fmt: skip
    except (AttributeError, TypeError):
        return None


def _guarded(args: tuple) -> tuple:
    """The tensors the warm path's guard checks, in its order."""
    a, b, a_descale, b_descale, alpha, _, out = args[:7]
    tensors = (a, b, a_descale, b_descale, _NO_ALPHA if alpha is None else alpha)
    return tensors if out is None else (*tensors, out)


def _runner_for(key: tuple | None, args: tuple, flags: tuple) -> Any:
    """The runner for a call the warm table did not answer; binds it for the next call."""
    if key is not None and type(key[0]) is not int:  # the Python key's spare guards
        tensors = _guarded(args)
        for guard, runner in _spares.get(key, ()):
            try:
                if guard(*tensors):
                    return runner
            except Exception:  # a guard refusing a non-tensor: the checks below explain
                break
    signature = _signature(args, flags)
    runner = None if signature is None else _checked.get(signature)
    if runner is None:
        runner, bindable = _miss(args, *flags)
        if not bindable or signature is None or _always_check:
            return runner
        with _table_lock:
            if len(_checked) >= _MAX_SIGNATURES:
                _forget_all()
            _checked[signature] = runner
    if key is not None and not _always_check and type(key[0]) is int:  # the C++ key's
        with _table_lock:
            _native_bound[key] = runner
    elif key is not None and not _always_check:
        entry = (tensor_guard.guard(*_guarded(args)), runner)
        with _table_lock:
            previous = _bound.get(key)
            if previous is not None:
                _spares[key] = (previous, *_spares.get(key, ()))[:_SPARES]
            _bound[key] = entry
    return runner


# The nine arguments best_mm_fp4 and flashinfer's mm_fp4 take first, in their order:
# a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout.
_CallArgs = tuple[Any, Any, Any, Any, Any, Any, Any, Any, Any]


def _miss(
    args: _CallArgs,
    backend: str,
    use_nvfp4: bool,
    enable_pdl: bool,
    b_layout: str,
    allow_blacklisted: bool,
    batch_invariant: bool,
) -> tuple[Any, bool]:
    """Check the arguments, find or make the decision: (runner, whether it may be bound)."""
    problem = check_arguments(
        *args, backend, use_nvfp4, enable_pdl, b_layout, batch_invariant, allow_blacklisted
    )
    _record.note(problem)  # FP4SELECT_RECORD: the first call of a signature only
    a = args[0]
    sel = selector()
    device = a.device
    env = environment_for(device)  # once per miss, passed down
    if backend != "auto":
        return sel.named_runner(backend, problem, device, allow_blacklisted, env=env), True
    decision = sel.lookup(problem, device, env=env)
    if decision is None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        runner, _ = sel.fallback(problem, device, env=env)
        return runner, False  # not bound: the next eager call tunes this key properly
    if decision is None:
        decision = sel.decide(problem, device, env=env)
    return sel.runner_for(decision, device), True


def explain(
    *args: Any,
    problem: Problem | None = None,
    device: torch.device | str | None = None,
    tune: bool = True,
    vs_bf16: bool = False,
    **kwargs: Any,
) -> dict[str, Any]:
    """The decision record for a call (same arguments as best_mm_fp4) or for a Problem.

    Says which backends were considered, each one's verdict and reason, the timings, the
    winner and its margin, and where the decision came from: ``source`` is how this call was
    served (memory, disk, tuned), ``origin`` how the decision first entered this process.
    ``vs_bf16``: where there is a winner, also ``vs_bf16``, the call as served timed beside the
    same product with a dense weight (``fp4select.versus``; ``fp4select warm --vs-bf16``).
    """
    if problem is None:
        problem = check_arguments(*args, **kwargs)
        device = args[0].device if args else kwargs["a"].device
    device = torch.device(device or "cpu")
    sel = selector()
    env = environment_for(device)
    source = "memory" if sel.in_memory(problem, device, env=env) else "disk"
    decision: Decision | None = sel.lookup(problem, device, env=env)
    if decision is None and tune:
        decision = sel.decide(problem, device, env=env)
        source = decision.source  # "tuned", or "disk" when another process finished first
    fallbacks = flashinfer_tactics.tactic_fallbacks(problem)  # calls served at the default
    if decision is None:
        return {"problem": problem.to_json(), "source": "none", "winner": None} | {
            "tactic_fallbacks": fallbacks
        }
    record = decision.to_json() | {"tactic_fallbacks": fallbacks}
    record["source"] = source  # how this call was served
    record["origin"] = decision.source  # how the decision entered this process
    if vs_bf16 and decision.winner is not None:
        record["vs_bf16"] = _served_vs_dense(problem, device, decision.winner, sel.timing)
    return record


def _served_vs_dense(
    problem: Problem, device: torch.device, winner: str, options: TimingOptions
) -> dict[str, Any]:
    """``explain``'s ``vs_bf16``: a failure to compare (out of memory for the dense weight, say)
    is the comparison's result, not the caller's error: the decision stands."""
    from fp4select import versus

    head = {"problem": problem.describe(), "m": problem.timing_m(), "served": winner}
    try:
        return head | versus.compare(problem, device, best_mm_fp4, options)
    except (RuntimeError, ValueError, MemoryError) as exc:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an out-of-memory error leaves nothing queued
        why = f"not timed: {type(exc).__name__}: {exc}"[:300]
        return head | {"dense_dtype": problem.out_dtype, "why": why}
