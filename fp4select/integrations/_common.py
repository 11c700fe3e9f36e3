"""What the SGLang and vLLM plugins share: the switch, the version gate, the record of what was
patched, the call adapter and tuning at model load.

Design rules:

* Opt-in. An engine loads every installed plugin unless its allow-list says otherwise, and this
  plugin tunes at model load (minutes the first time): being installed must not switch it on.
  It patches when the engine's own allow-list names it (``SGLANG_PLUGINS=fp4select``,
  ``VLLM_PLUGINS=fp4select``) or ``FP4SELECT_ENGINE_PLUGIN=1``; ``FP4SELECT_ENGINE_PLUGIN=0``
  turns it off whatever the list says. ``patch()`` from code always patches.
* An engine version that was not tested logs one warning and changes nothing
  (``FP4SELECT_ALLOW_UNTESTED_ENGINE=1`` patches anyway, still with the warning).
* The engine prepared its weights at load for the backend it names in each call: trtllm gets
  row-shuffled weights, the others the plain 128x4 layout. The adapter maps that backend to its
  layout family and lets fp4select choose only inside it. A backend whose layout is not known
  here, or a call fp4select cannot take, goes to flashinfer's own function unchanged.
* flashinfer's original function lives in the adapter's closure and in the patch record, never
  in a module global: SGLang's HookRegistry REPLACE rebinds every module global that ``is`` its
  target, and fp4select's flashinfer backend must keep reaching the real kernel.
* ``unpatch()`` puts back what ``patch()`` changed, and only where the attribute still holds
  what fp4select put there: an object someone bound since is theirs to keep (a warning says so).
* A plugin never raises into the engine (vLLM calls plugins without a try: an exception would
  stop the server). Failures are logged and leave the engine as it was.
* Tuning at load runs in the sandbox and closes the sandbox worker before it returns, so the
  engine sizes its KV cache with nothing of fp4select's on the GPU. A problem that fails to tune
  is logged and left to its first call.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fp4select.settings import engine_setting
from fp4select.store import first_time

log = logging.getLogger("fp4select.integrations")

PLUGIN_NAME = "fp4select"
ENABLE_ENV = "FP4SELECT_ENGINE_PLUGIN"
UNTESTED_ENV = "FP4SELECT_ALLOW_UNTESTED_ENGINE"
WARM_ENV = "FP4SELECT_WARM_AT_LOAD"
WARM_MAX_M_ENV = "FP4SELECT_WARM_MAX_M"

# flashinfer backend name -> the layout family of the weights an engine prepares for it.
# "auto" is what SGLang passes when no FP4 backend was configured; its weights are then plain,
# and flashinfer's own auto never picks the trtllm layout.
LAYOUT_OF_BACKEND: dict[str, Literal["plain", "trtllm"]] = {
    "cutlass": "plain",
    "cudnn": "plain",
    "cute-dsl": "plain",
    "b12x": "plain",
    "auto": "plain",
    "trtllm": "trtllm",
}
# flashinfer's per-call check switch: fp4select runs its own checks, so it is dropped.
_DROPPED_KEYWORDS = frozenset({"skip_check"})


def plugin_enabled(allow_list_env: str) -> bool:
    """Whether an engine's plugin call should patch (see the module rules)."""
    forced = engine_setting(ENABLE_ENV)
    if forced is not None:
        return forced
    return PLUGIN_NAME in {x.strip() for x in os.environ.get(allow_list_env, "").split(",")}


def run_plugin(engine: str, allow_list_env: str, patch: Callable[[], Any]) -> None:
    """An engine's plugin entry point: ``patch()`` when the switch says so; never raises."""
    if not plugin_enabled(allow_list_env):
        log.debug(
            "fp4select: %s plugin installed but off (set %s=fp4select or %s=1)",
            engine,
            allow_list_env,
            ENABLE_ENV,
        )
        return
    try:
        patch()
    except Exception:
        log.exception("fp4select: could not patch %s; it runs unchanged", engine)


def unpatch(patches: PatchSet) -> list[str]:
    """Put back every object ``patches`` replaced; returns their names."""
    restored = patches.restore()
    if restored:
        log.info("fp4select: %s unpatched: %s", patches.engine, ", ".join(restored))
    return restored


_warned_untested: set[str] = set()


def version_allowed(engine: str, version: str | None, tested: Sequence[str]) -> bool:
    """True for a tested engine version; otherwise one warning per engine and process."""
    if version is not None and version in tested:
        return True
    allow = bool(engine_setting(UNTESTED_ENV))
    if first_time(engine, _warned_untested):
        action = (
            f"patching anyway because {UNTESTED_ENV}=1"
            if allow
            else f"leaving {engine} untouched (set {UNTESTED_ENV}=1 to patch anyway)"
        )
        log.warning(
            "fp4select: %s %s is not a version this fp4select was tested with (%s); %s",
            engine,
            version or "(version unknown)",
            ", ".join(tested),
            action,
        )
    return allow


@dataclass
class _Change:
    owner: Any
    name: str
    had: bool  # whether the name was in owner.__dict__ (else it was inherited or absent)
    before: Any
    after: Any


class PatchSet:
    """Every attribute a plugin changed, so that ``restore`` can put each one back."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._changes: list[_Change] = []

    def __bool__(self) -> bool:
        return bool(self._changes)

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """Bind ``owner.name = value`` and remember what was there; returns the old value."""
        had, before = _own(owner, name)
        setattr(owner, name, value)
        self._changes.append(_Change(owner, name, had, before, value))
        return before

    def holds(self, owner: Any, name: str) -> bool:
        """Whether ``owner.name`` is still what this patch set bound there."""
        current = _own(owner, name)[1]
        return any(
            c.owner is owner and c.name == name and c.after is current for c in self._changes
        )

    def original(self, owner: Any, name: str) -> Any:
        """What was bound at ``owner.name`` before the first change this set made to it."""
        for change in self._changes:
            if change.owner is owner and change.name == name:
                return change.before
        raise KeyError(f"{_describe(owner)}.{name} was not patched")

    def restore(self) -> list[str]:
        """Undo every change, newest first; returns the names put back."""
        restored = []
        while self._changes:
            change = self._changes.pop()
            where = f"{_describe(change.owner)}.{change.name}"
            if _own(change.owner, change.name)[1] is not change.after:
                log.warning(
                    "fp4select: %s was rebound by someone else after fp4select patched it; "
                    "leaving their object in place",
                    where,
                )
                continue
            if change.had:
                setattr(change.owner, change.name, change.before)
            else:
                delattr(change.owner, change.name)
            restored.append(where)
        return restored


def _own(owner: Any, name: str) -> tuple[bool, Any]:
    """(whether ``owner`` itself holds ``name``, its value there): a module's or class's own
    namespace; an object with ``__slots__`` (a dataclass ``Field``) holds its slots."""
    try:
        namespace = vars(owner)
    except TypeError:
        return hasattr(owner, name), getattr(owner, name, None)
    return name in namespace, namespace.get(name)


def _describe(owner: Any) -> str:
    """A module's name, or a class's module-qualified name."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    field = getattr(owner, "name", None)  # a dataclass Field
    return getattr(owner, "__name__", None) or (f"field {field}" if field else repr(owner))


def make_mm_fp4(original: Callable[..., torch.Tensor], engine: str) -> Callable[..., torch.Tensor]:
    """An ``mm_fp4`` with flashinfer's signature that selects within the engine's layout family.

    ``original`` is flashinfer's function; calls fp4select cannot serve go to it unchanged.
    """
    import inspect

    from fp4select.api import best_mm_fp4

    accepted = frozenset(inspect.signature(best_mm_fp4).parameters)
    e4m3 = torch.float8_e4m3fn
    layouts = LAYOUT_OF_BACKEND

    def mm_fp4(
        a: torch.Tensor,
        b: torch.Tensor,
        a_descale: torch.Tensor,
        b_descale: torch.Tensor,
        alpha: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        out: torch.Tensor | None = None,
        block_size: int = 16,
        use_8x4_sf_layout: bool = False,
        backend: str = "auto",
        use_nvfp4: bool = True,
        enable_pdl: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        layout = layouts.get(backend)
        if kwargs:
            extra = {k: v for k, v in kwargs.items() if k not in _DROPPED_KEYWORDS}
            unknown = [k for k in extra if k not in accepted]
        else:
            extra, unknown = kwargs, []
        why = None
        if layout is None:
            why = "no known weight layout for this backend"
        elif unknown:
            why = f"fp4select does not take {', '.join(sorted(unknown))}"
        elif layout == "trtllm" and b.shape[-1] % 128:
            why = f"N={b.shape[-1]} is not a multiple of 128 (trtllm row shuffle)"
        if why is not None or layout is None:  # no layout always comes with a why
            if first_time(f"integrations: {engine} mm_fp4(backend={backend!r}): {why}"):
                log.info(
                    "fp4select: %s mm_fp4(backend=%r): passed to flashinfer unchanged: %s",
                    engine,
                    backend,
                    why,
                )
            return original(
                a, b, a_descale, b_descale, alpha, out_dtype, out=out, block_size=block_size,
                use_8x4_sf_layout=use_8x4_sf_layout, backend=backend, use_nvfp4=use_nvfp4,
                enable_pdl=enable_pdl, **kwargs,
            )  # fmt: skip
        if use_nvfp4:
            # Engines hand cutlass/cudnn the same e4m3 bytes as uint8: fp4select proves every
            # candidate with e4m3 scales, so each gets the dtype it was proven with.
            if a_descale.dtype == torch.uint8:
                a_descale = a_descale.view(e4m3)
            if b_descale.dtype == torch.uint8:
                b_descale = b_descale.view(e4m3)
        return best_mm_fp4(
            a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4_sf_layout,
            "auto", use_nvfp4, enable_pdl, b_layout=layout, **extra,
        )  # fmt: skip

    mm_fp4.__name__ = mm_fp4.__qualname__ = "mm_fp4"
    mm_fp4.__module__ = __name__
    mm_fp4.__doc__ = (
        f"fp4select's mm_fp4 for {engine}: the engine's backend names the weight layout; "
        "fp4select selects among the backends that read it."
    )
    # fp4select's flashinfer backend never takes a function with this mark for flashinfer's own.
    mm_fp4.__fp4select__ = True  # type: ignore[attr-defined]
    return mm_fp4


def pin_flashinfer_original() -> None:
    """Make fp4select's flashinfer backend find flashinfer's real mm_fp4 now, before a patch.

    Its lookup is cached per process, so a later rebinding of flashinfer's globals (ours, or a
    HookRegistry REPLACE by another plugin) cannot make it call a wrapper instead of the kernel.
    """
    from fp4select.backends import flashinfer as flashinfer_backend

    flashinfer_backend.load()


# -- GPUs without FP4 tensor cores ----------------------------------------------------------
# Below SM100 neither engine has a W4A4 NVFP4 GEMM (nor an activation quantizer): they serve
# NVFP4 checkpoints as W4A16 (Marlin). fp4select serves them W4A4 on these GPUs when it has a
# candidate kernel there; each candidate is still proven per shape before it serves.
MIN_W4A4_CC = 80
NATIVE_FP4_CC = 100


def gpu_candidates(cc: int) -> list[str]:
    """fp4select's backends that can run an engine's NVFP4 GEMM (plain weights, 128x4 scales)
    on a GPU of compute capability ``cc`` (e.g. 90), leaving out the emulation fallback."""
    from fp4select import keys
    from fp4select.backends import discover

    env = {**keys.environment(None), "device": "cuda", "cc": cc}
    names = []
    for name, backend in discover(include_flashinfer=cc >= NATIVE_FP4_CC).backends.items():
        caps = backend.caps
        if backend.family == "builtin" or "cuda" not in caps.devices:
            continue
        if "nvfp4" not in caps.formats or "plain" not in caps.b_layouts:
            continue
        if "128x4" not in caps.a_sf_layouts or "regular" not in caps.modes:
            continue
        if backend.unavailable_reason(env) is None:
            names.append(name)
    return names


def w4a4_unavailable(cc: int | None) -> str | None:
    """Why fp4select cannot serve NVFP4 W4A4 on a GPU of capability ``cc``, or None."""
    if cc is None:
        return "the GPU's compute capability is unknown"
    if cc < MIN_W4A4_CC:
        return f"needs compute capability >= {MIN_W4A4_CC / 10:.1f}, got {cc / 10:.1f}"
    try:
        names = gpu_candidates(cc)
    except Exception as exc:  # a broken registry must not stop the engine's own choice
        return f"could not list fp4select's backends: {exc}"
    if not names:
        return f"fp4select has no GPU kernel for compute capability {cc / 10:.1f} here"
    return None


# -- tuning at load --------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearShape:
    """One FP4 linear layer's GEMM as the engine calls it: b is (K/2, N)."""

    n: int
    k: int
    out_dtype: str  # "bfloat16" or "float16"
    b_layout: str  # "plain" or "trtllm"
    small_m_8x4: bool = False  # vLLM sends 8x4 activation scales to trtllm at M <= 32


def linear_shapes(
    model: torch.nn.Module,
    layout_of: Callable[[torch.nn.Module], str | None],
    out_dtype: str,
    small_m_8x4: bool = False,
) -> tuple[list[LinearShape], torch.device | None]:
    """(N, K) and layout of every layer of ``model`` that ``layout_of`` gives a layout, as the
    engine's GEMM passes them, and their device. A layer's weight is the packed (N, K/2) uint8;
    an empty one was moved into a fused kernel that does not call mm_fp4."""
    shapes: set[LinearShape] = set()
    device = None
    for module in model.modules():
        layout = layout_of(module)
        weight = getattr(module, "weight", None)
        if layout is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if weight.dtype != torch.uint8 or weight.numel() == 0:
            continue
        n, k = int(weight.shape[0]), 2 * int(weight.shape[1])
        shapes.add(LinearShape(n, k, out_dtype, layout, small_m_8x4 and layout == "trtllm"))
        device = device or weight.device
    return sorted(shapes, key=lambda s: (s.n, s.k, s.b_layout)), device


def then_tune(original: Callable[..., Any], tune: Callable[[Any], Any]) -> Callable[..., Any]:
    """``original`` (an engine's load step), then ``tune(self)``; a failure to tune is logged,
    never raised: the server starts, and the shapes are tuned on first use instead."""

    @functools.wraps(original)
    def run_then_tune(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            tune(self)
        except Exception:
            log.exception("fp4select: tuning at load failed; shapes will be tuned on first use")
        return result

    return run_then_tune


def out_dtype_of(holder: Any) -> str:
    """The GEMM output dtype of an engine object's ``model_config.dtype``: float16 or bfloat16."""
    dtype = getattr(getattr(holder, "model_config", None), "dtype", None)
    return "float16" if dtype == torch.float16 else "bfloat16"


def warm_enabled() -> bool:
    return bool(engine_setting(WARM_ENV))


def warm_max_m(engine_max_m: int) -> int:
    """The largest M to tune for: the engine's own bound unless FP4SELECT_WARM_MAX_M says."""
    value = engine_setting(WARM_MAX_M_ENV)
    return int(value) if value is not None else max(1, int(engine_max_m))


def problems_for(shapes: Iterable[LinearShape], max_m: int) -> list:
    """One Problem per (shape, M bucket up to max_m), in the order a warm-up would meet them."""
    from fp4select.keys import Problem, buckets_up_to

    out = []
    for shape in sorted(set(shapes), key=lambda s: (s.n, s.k, s.out_dtype, s.b_layout)):
        for bucket in buckets_up_to(max_m):
            eight = shape.small_m_8x4 and shape.b_layout == "trtllm" and bucket <= 32
            out.append(
                Problem(
                    n=shape.n,
                    k=shape.k,
                    m_bucket=bucket,
                    out_dtype=shape.out_dtype,
                    a_sf_layout="8x4" if eight else "128x4",
                    b_layout=shape.b_layout,
                    alpha_kind="scalar",
                )
            )
    return out


def tune_at_load(
    engine: str, shapes: Sequence[LinearShape], max_m: int, device: torch.device
) -> dict[str, Any]:
    """Decide every (shape, bucket) now, with progress in the log; then close the sandbox worker.

    Returns a summary (data first: the log lines are made from it). Never raises.
    """
    from fp4select.api import selector

    summary: dict[str, Any] = {"engine": engine, "shapes": len(shapes), "max_m": max_m}
    try:
        problems = problems_for(shapes, max_m)
    except Exception as exc:
        log.warning("fp4select: %s: could not list problems to tune: %s", engine, exc)
        return {**summary, "error": str(exc)}
    summary.update(problems=len(problems), decided=0, failed=0, winners={})
    if not problems:
        log.info("fp4select: %s: no FP4 linear layers served by flashinfer mm_fp4 found", engine)
        return summary
    log.info(
        "fp4select: %s: tuning %d problems (%d layer shapes, M up to %d) on %s before memory "
        "is sized",
        engine,
        len(problems),
        len(set(shapes)),
        max_m,
        device,
    )
    sel = selector()
    started = time.perf_counter()
    try:
        for i, problem in enumerate(problems, 1):
            try:
                decision = sel.decide(problem, device)
            except Exception as exc:  # never stop the engine: the first call tunes or raises
                summary["failed"] += 1
                log.warning("fp4select: [%d/%d] %s: %s", i, len(problems), problem.describe(), exc)
                continue
            winner = decision.winner
            summary["decided" if winner else "failed"] += 1
            summary["winners"][winner or "NONE"] = summary["winners"].get(winner or "NONE", 0) + 1
            log.info(
                "fp4select: [%d/%d] %s -> %s (%s)",
                i,
                len(problems),
                problem.describe(),
                winner or "no correct backend",
                decision.source,
            )
    finally:
        sel.close()  # the sandbox worker exits: nothing of ours holds GPU memory now
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary["seconds"] = round(time.perf_counter() - started, 3)
    log.info(
        "fp4select: %s: tuned %d/%d problems in %.1f s (winners: %s); sandbox worker closed",
        engine,
        summary["decided"],
        len(problems),
        summary["seconds"],
        ", ".join(f"{k}={v}" for k, v in sorted(summary["winners"].items())) or "none",
    )
    return summary
