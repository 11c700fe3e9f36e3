"""flashinfer tactics: compare backends at their best tactic for the bucket, serve that tactic.

``flashinfer.mm_fp4`` asks ``AutoTuner.get().choose_one("fp4_gemm", runners, tuning_config,
inputs)`` on every call and then runs ``runner(inputs=inputs, tactic=tactic)``. Outside a
``flashinfer.autotune(True)`` context choose_one returns a cached tactic or the default (-1), so
timing a backend through plain mm_fp4 times it untuned.

Design rules (the mechanism, chosen after reading flashinfer 0.6.0, 0.6.18.post1, 0.7.2.post1
and 0.7.4):

* **Tune with flashinfer's own autotuner, one bucket at a time.** In the probe (the sandbox
  child), the backend's runner runs once at M = the bucket's top inside
  ``flashinfer.autotune(True, tuning_buckets=(bucket,))``: flashinfer profiles that one
  profile with the measurement policy mm_fp4 declares (CUDA graphs and cold L2 since 0.7.2),
  and with ``tie_tolerance`` equal to fp4select's noise floor where autotune() takes it (0.7.4),
  so near-tied tactics resolve to the same one in every process. Without ``tuning_buckets``
  (flashinfer 0.6.0 and other early 0.6 releases) it would profile every power of two up to M
  and bucket M downwards, so tuning is reported unavailable there and backends are timed at
  flashinfer's default, as before. The same holds where mm_fp4's tuning configs map M to
  buckets other than fp4select's (checked once): cuDNN builds one graph per mapped M and its
  tactic is a plan index into that graph, so the tactic tuned at the bucket's top means the
  same kernel across the bucket only when both map every M of it to that top.
* **What was chosen is read from choose_one itself**, not from flashinfer's cache: the same
  hook that serves tactics records ``(runner class, tactic)`` of the fp4_gemm choice made
  while tuning. The tactic is then validated (pinned) at every validation M of the bucket, and
  timed (pinned) against the default tactic (-1, pinned too, since the tuned tactic now sits in
  the child's flashinfer cache).
* **The tactic is stored in fp4select's decision** (``verdicts[name].detail["tactic"]``, JSON
  via flashinfer's ``_tactic_to_json``/``_json_to_tactic`` where present: lists <-> tuples), not
  in flashinfer's v1 JSON cache nor its ``autotune_v2`` store. Reasons: a v1 key embeds
  flashinfer's M mapping (floor power of two in 0.6.0, ceil hybrid buckets since 0.6.18), the
  exact shapes of all ten mm_fp4 inputs (padding included) and runner extras;
  ``autotune(cache=...)`` clears loaded configs on entry, so an engine's warmup would drop ours;
  ``autotune_v2`` exists in 0.7.4 only. fp4select's entry is already keyed by everything a
  tactic's meaning depends on (GPU, flashinfer version, N, K, bucket, formats, layouts).
* **Serving pins the tactic per call**, independent of flashinfer's bucket mapping: a bound
  fast runner sets a thread-local pin around its mm_fp4 call, and a hook on the AutoTuner
  singleton's ``choose_one`` answers an fp4_gemm choice with one runner of the recorded class
  by ``(runners[0], tactic)``, with no cache lookup and no tuning. Anything else (other ops,
  other callers, backend="auto", a runner of another class) goes to flashinfer unchanged. No
  re-tuning ever happens in a process that read the decision from disk.
* **Engines defer to fp4select for the calls it decided**: inside an engine's warmup
  ``flashinfer.autotune(True)`` a pinned call returns the stored tactic, so flashinfer tunes
  nothing for it (its tuning would pick a tactic fp4select has neither validated nor timed).
  Calls fp4select did not pin (no decision, no tactic recorded, other ops) are tuned by the
  engine as before. Pinned calls never reach flashinfer's ``set_autotune_process_group``
  collectives; ranks that share the store pin the same calls. fp4select does not set a process
  group itself: it tunes in a child process outside any group.
* Everything is feature-detected; a missing piece is a reason string in the tactic record,
  never an exception. ``FP4SELECT_TACTICS=default`` turns tuning off (backends are then timed
  and served at flashinfer's default, as before), e.g. where JIT-compiling every tactic of a
  backend takes longer than the sandbox's ``FP4SELECT_PROBE_TIMEOUT_S`` allows.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp4select import settings as settings_mod
from fp4select.backends.base import Runner
from fp4select.keys import Problem
from fp4select.store import first_time
from fp4select.timing import MIN_TIE_TOLERANCE

log = logging.getLogger("fp4select")

TACTICS_ENV = "FP4SELECT_TACTICS"  # "tune" (default) or "default": time at flashinfer's default
OP = "fp4_gemm"  # mm_fp4's custom_op name in choose_one, 0.6.0 to 0.7.4
DEFAULT_TACTIC = -1  # flashinfer's fallback tactic: what choose_one returns on a cache miss
TIE_TOLERANCE = MIN_TIE_TOLERANCE
_HOOK_MARK = "__fp4select_hook__"
_MAX_TACTIC_DEPTH = 8

_state = threading.local()  # .pin: (tactic, runner class or None) | None; .capture: list | None
_install_lock = threading.Lock()


@dataclass(frozen=True)
class TunerAPI:
    """The pieces of flashinfer's autotuner fp4select uses, as this flashinfer spells them."""

    autotune: Callable[..., Any]
    tuner_class: Any
    takes_tie_tolerance: bool
    tactic_to_json: Callable[[Any], Any]
    json_to_tactic: Callable[[Any], Any]
    version: str | None


def _tactic_to_json(tactic: Any) -> Any:
    """flashinfer's rule (0.7.2+), for releases without it: iterables become lists."""
    if isinstance(tactic, (str, bytes, dict, bool)) or tactic is None:
        return tactic
    if isinstance(tactic, int):
        return int(tactic)
    if hasattr(tactic, "__iter__"):
        return [_tactic_to_json(v) for v in tactic]
    return tactic


def _json_to_tactic(value: Any) -> Any:
    """flashinfer's rule (0.7.2+): lists become tuples, recursively."""
    if isinstance(value, list):
        return tuple(_json_to_tactic(v) for v in value)
    return value


@functools.lru_cache(maxsize=1)
def tuner_api() -> tuple[TunerAPI | None, str | None]:
    """(the autotuner API, None) or (None, why fp4select cannot tune tactics here)."""
    try:
        autotuner = importlib.import_module("flashinfer.autotuner")
    except Exception as exc:  # not installed, or broken at import
        return None, f"flashinfer's autotuner is not importable ({type(exc).__name__}: {exc})"
    try:
        version: str | None = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(autotuner, "__version__", None)
    autotune = getattr(autotuner, "autotune", None)
    tuner_class = getattr(autotuner, "AutoTuner", None)
    if autotune is None or tuner_class is None:
        return None, f"flashinfer {version}'s autotuner has no autotune() or AutoTuner"
    if not callable(getattr(tuner_class, "get", None)) or not callable(
        getattr(tuner_class, "choose_one", None)
    ):
        return None, f"flashinfer {version}'s AutoTuner has no get() or choose_one()"
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(autotune).parameters
    except (TypeError, ValueError):
        params = {}
    if "tuning_buckets" not in params:
        return None, (
            f"flashinfer {version}'s autotune() takes no tuning_buckets, so it cannot tune one "
            "M bucket alone; backends are timed at flashinfer's default tactic"
        )
    return (
        TunerAPI(
            autotune=autotune,
            tuner_class=tuner_class,
            takes_tie_tolerance="tie_tolerance" in params,
            tactic_to_json=getattr(autotuner, "_tactic_to_json", _tactic_to_json),
            json_to_tactic=getattr(autotuner, "_json_to_tactic", _json_to_tactic),
            version=version,
        ),
        None,
    )


_MM_FP4_CONFIGS = (
    "_MM_FP4_TUNING_CONFIG_128x4",
    "_MM_FP4_TUNING_CONFIG_8x4",
    "_MM_FP4_TUNING_CONFIG_128x4_PER_TOKEN_ALPHA",
)
_MAPPING_PROBES = (*range(1, 4097), 4098, 6000, 8191, 8192, 8193, 12345, 16384, 65537, 1 << 20)


@functools.lru_cache(maxsize=1)
def bucket_mapping_disagreement() -> str | None:
    """Where mm_fp4's tuning configs bucket M unlike fp4select's ``m_bucket``, or None.

    cuDNN builds one graph per ``map_to_tuning_buckets(M)`` and a tactic is a plan index into
    that graph: a tactic tuned at the bucket's top means the same kernel for every M of the
    bucket only if flashinfer maps all of them to that top, as fp4select does. The configs are
    private names, read if present; a flashinfer without them is not second-guessed (pinned
    validation at several M of the bucket still checks the numbers).
    """
    from fp4select.keys import m_bucket

    try:
        gemm_base = importlib.import_module("flashinfer.gemm.gemm_base")
    except Exception:
        return None
    for name in _MM_FP4_CONFIGS:
        config = getattr(gemm_base, name, None)
        specs = getattr(config, "dynamic_tensor_specs", None)
        if not specs:
            continue
        mapper = getattr(specs[0], "map_to_tuning_buckets", None)
        if not callable(mapper):
            continue
        for m in _MAPPING_PROBES:
            try:
                theirs = mapper(m)
            except Exception as exc:
                return f"{name} cannot map M={m} ({type(exc).__name__}: {exc})"
            if theirs != m_bucket(m):
                return f"{name} maps M={m} to {theirs}, fp4select's bucket is {m_bucket(m)}"
    return None


# -- the choose_one hook ---------------------------------------------------------------------
def _hook(original: Callable[..., Any]) -> Callable[..., Any]:
    def choose_one(custom_op, runners, tuning_config, inputs, **kwargs):
        pin = getattr(_state, "pin", None)
        if (
            pin is not None
            and custom_op == OP
            and len(runners) == 1
            and (pin[1] is None or type(runners[0]).__name__ == pin[1])
        ):
            return runners[0], pin[0]
        result = original(custom_op, runners, tuning_config, inputs, **kwargs)
        capture = getattr(_state, "capture", None)
        if capture is not None and custom_op == OP:
            capture.append((type(result[0]).__name__, result[1]))
        return result

    setattr(choose_one, _HOOK_MARK, original)
    return choose_one


def install() -> str | None:
    """Hook the AutoTuner singleton's choose_one (once per singleton); why not, or None.

    The hook is an instance attribute of the singleton, so flashinfer's class is untouched and a
    new singleton (``AutoTuner._instance = None``) is hooked again at the next bind.
    """
    api, why = tuner_api()
    if api is None:
        return why
    try:
        tuner = api.tuner_class.get()
    except Exception as exc:
        return f"flashinfer's AutoTuner.get() raised {type(exc).__name__}: {exc}"
    with _install_lock:
        if not hasattr(tuner.__dict__.get("choose_one"), _HOOK_MARK):
            tuner.choose_one = _hook(tuner.choose_one)
    return None


def installed() -> bool:
    """Whether flashinfer's current AutoTuner singleton carries the hook."""
    api, _ = tuner_api()
    tuner = getattr(api.tuner_class, "_instance", None) if api is not None else None
    return tuner is not None and hasattr(tuner.__dict__.get("choose_one"), _HOOK_MARK)


# -- tactic records --------------------------------------------------------------------------
def _plain(value: Any, depth: int = 0) -> bool:
    """JSON scalars and lists of them only: a record from disk is data, never anything else."""
    if depth > _MAX_TACTIC_DEPTH:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, list) and all(_plain(v, depth + 1) for v in value)


def tactic_of(record: Any) -> tuple[Any, str | None] | None:
    """(tactic, runner class) from a stored record, or None when it holds no usable tactic.

    Records come from disk: anything not shaped as fp4select writes it is ignored (with one
    warning), so a damaged entry serves flashinfer's default instead of a guessed kernel.
    """
    if not isinstance(record, Mapping) or record.get("tactic") is None:
        return None
    value, runner = record.get("tactic"), record.get("runner")
    if record.get("op", OP) != OP or not _plain(value) or not isinstance(runner, (str, type(None))):
        key = repr(record)[:200]
        if first_time(f"flashinfer tactic record: {key}"):
            log.warning("ignoring a malformed flashinfer tactic record: %s", key)
        return None
    api, _ = tuner_api()
    decode = api.json_to_tactic if api is not None else _json_to_tactic
    return decode(value), runner


def pinned(runner: Runner, record: Mapping[str, Any]) -> Runner:
    """``runner`` running at the recorded tactic, whatever flashinfer's cache or context says.

    Returns ``runner`` itself when the record holds no tactic or the hook cannot be installed
    (then flashinfer chooses, as without fp4select).
    """
    decoded = tactic_of(record)
    if decoded is None:
        return runner
    why = install()
    if why is not None:
        if first_time(f"flashinfer tactics: {why}"):
            log.warning("cannot pin flashinfer tactics (%s); flashinfer chooses", why)
        return runner
    pin = decoded
    state = _state

    def run(*args: Any) -> torch.Tensor:
        previous = getattr(state, "pin", None)
        state.pin = pin
        try:
            return runner(*args)
        finally:
            state.pin = previous

    run.fp4select_tactic = pin  # type: ignore[attr-defined]
    return run


# -- tuning ----------------------------------------------------------------------------------
_FATAL_MARKERS = ("CUDA error", "illegal memory access", "device-side assert", "cudaError")


def _fatal(exc: BaseException) -> bool:
    """Failures the probe must see (and classify) rather than note: OOM, a broken context."""
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return any(marker in str(exc) for marker in _FATAL_MARKERS)


def tune(runner: Runner, problem: Problem, args: Sequence[Any]) -> dict[str, Any]:
    """Run ``runner(*args)`` (M = the bucket's top) under flashinfer's autotuner; the record.

    The record is plain JSON: ``tactic`` (None when nothing was tuned, with ``reason``),
    ``runner`` (the TunableRunner class that holds it), ``default`` (flashinfer's fallback
    tactic), the bucket and tuning settings, and flashinfer's version. Out-of-memory and CUDA
    errors propagate (the probe classifies them); other tuning failures become a reason and the
    backend is timed at its default tactic.
    """
    try:
        mode = settings_mod.current().tactics
    except ValueError as exc:  # a bad variable in this process's environment
        # Raised here it would read as "unsupported" for every backend (flashinfer's checks
        # raise ValueError): say it in each record and the log instead, and tune nothing.
        bad = f"{exc}; not tuned"
        if first_time(f"flashinfer tactics: {bad}"):
            log.error(bad)
        return {"op": OP, "tactic": None, "reason": bad}
    if mode == "default":
        return {"op": OP, "tactic": None, "reason": f"{TACTICS_ENV}=default"}
    if getattr(problem, "batch_invariant", False):
        return {"op": OP, "tactic": None, "reason": "batch-invariant problems are not tuned here"}
    api, why = tuner_api()
    if api is None:
        return {"op": OP, "tactic": None, "reason": why}
    why = install() or bucket_mapping_disagreement()
    if why is not None:
        return {"op": OP, "tactic": None, "reason": why}
    settings: dict[str, Any] = {"tuning_buckets": (problem.m_bucket,)}
    if api.takes_tie_tolerance:
        settings["tie_tolerance"] = TIE_TOLERANCE
    record: dict[str, Any] = {
        "op": OP,
        "tactic": None,
        "runner": None,
        "default": DEFAULT_TACTIC,
        "m": problem.m_bucket,
        "tie_tolerance": settings.get("tie_tolerance"),
        "flashinfer": api.version,
    }
    captured: list[tuple[str, Any]] = []
    previous_capture = getattr(_state, "capture", None)
    previous_pin = getattr(_state, "pin", None)
    _state.capture, _state.pin = captured, None
    try:
        with api.autotune(True, **settings):
            runner(*args)
    except Exception as exc:
        if _fatal(exc):
            raise
        record["reason"] = (
            f"flashinfer's autotuner failed ({type(exc).__name__}: {exc}); "
            "timed at the default tactic"
        )[:500]
        return record
    finally:
        _state.capture, _state.pin = previous_capture, previous_pin
    if not captured:
        record["reason"] = "mm_fp4 did not ask flashinfer's autotuner: this backend has no tactics"
        return record
    runner_class, tactic = captured[-1]
    record["runner"] = runner_class
    record["tactic"] = api.tactic_to_json(tactic)
    return record
