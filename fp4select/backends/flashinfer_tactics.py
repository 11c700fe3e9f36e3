"""flashinfer tactics: compare backends at their best tactic for the bucket, serve that tactic.

Why one file of ~700 lines: like Triton's ``autotuner.py``, the whole tactic mechanism (what the
installed flashinfer offers, tuning through its autotuner, the stored record, the per-call hook
that serves and checks it) reads in one place, against flashinfer's source it mirrors.

``flashinfer.mm_fp4`` asks ``AutoTuner.get().choose_one("fp4_gemm", runners, tuning_config,
inputs)`` on every call; outside ``flashinfer.autotune(True)`` that returns a cached tactic or
the default (-1), so timing through plain mm_fp4 times a backend untuned. docs/tactics.md holds
the guarantees, what ``verify`` shows and how to check them on a Blackwell GPU.

Design rules (read against flashinfer 0.6.0, 0.6.18.post1, 0.7.2.post1 and 0.7.4):

* **Tune with flashinfer's own autotuner, one bucket at a time**: in the probe child, at M = the
  bucket's top inside ``autotune(True, tuning_buckets=(bucket,))``, with flashinfer's
  measurement policy and tie rule (the fastest measured: a stored tactic is tuned once for
  all). Where ``tuning_buckets`` is missing (early 0.6) or mm_fp4's configs map M to other
  buckets than fp4select's, tuning is reported unavailable: a tactic (for cuDNN a plan index
  into one graph per mapped M) means the same kernel across a bucket only when both map every
  M of it to its top.
* **What was chosen is read from choose_one itself** (the serving hook records the fp4_gemm
  choice), not from flashinfer's cache; it is then validated pinned at every validation M and
  timed pinned against the default (-1, pinned too: the tuned one sits in the child's cache).
* **The tactic is stored in fp4select's decision** (``verdicts[name].detail["tactic"]``, JSON
  via flashinfer's ``_tactic_to_json``/``_json_to_tactic``), not in flashinfer's caches: a v1
  key embeds flashinfer's M mapping (changed in 0.6.18), all ten input shapes and runner
  extras; ``autotune(cache=...)`` clears loaded configs on entry; ``autotune_v2`` is 0.7.4
  only. fp4select's entry is already keyed by all a tactic's meaning depends on.
* **Serving pins the tactic per call**: a bound runner sets a thread-local pin, and a hook on
  the AutoTuner singleton's ``choose_one`` answers an fp4_gemm choice of the recorded runner
  class with it, no cache lookup, no tuning. Anything else goes to flashinfer unchanged; a
  process that read the decision from disk never re-tunes.
* **A served tactic is checked for the call's own problem, once per M**, as flashinfer checks
  a cached one (``_tactic_still_valid``), or by membership in ``get_valid_tactics`` for a
  runner without a validator (trtllm's cubins and SM12x cute-dsl's tiles depend on M). Where
  it fails the call runs flashinfer's default, logged once, counted and listed by ``explain``.
  A stored record of the wrong type ("abc", 1.5, true) is a miss: one warning, the default.
* **Tuning that cannot finish is not a fault**: past ``FP4SELECT_TUNE_TIMEOUT_S`` (checked
  between tactic profiles, each a sign of life to the sandbox), or when flashinfer gives up
  (-1 after an OOM or every tactic failing), the record holds -1 with ``fallback`` and the
  reason, and the backend competes at the default. ``default_kind`` says what -1 runs
  (CUTLASS: its config 0), so no speed-up is claimed against an arbitrary kernel.
* **Engines defer to fp4select for the calls it decided**: inside an engine's
  ``autotune(True)`` a pinned call returns the stored tactic, which flashinfer would otherwise
  replace with one fp4select neither validated nor timed. fp4select's calls never join an
  engine's ``set_autotune_process_group`` collectives (pinned calls skip them, untuned ones
  answer the default while a group tunes, tuning unsets the group), so ranks that disagree on
  what is decided still meet the same collectives.
* Everything is feature-detected; a missing piece is a reason string in the tactic record,
  never an exception. ``FP4SELECT_TACTICS=default`` (or ``default:NAME,...``) turns tuning off.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp4select import settings as settings_mod
from fp4select.backends.base import Runner, is_cuda_error
from fp4select.keys import Problem, installed_version
from fp4select.store._warn import first_time

log = logging.getLogger("fp4select")

TACTICS_ENV = "FP4SELECT_TACTICS"  # "tune" (default) or "default": time at flashinfer's default
OP = "fp4_gemm"  # mm_fp4's custom_op name in choose_one, 0.6.0 to 0.7.4
DEFAULT_TACTIC = -1  # flashinfer's fallback tactic: what choose_one returns on a cache miss
_HOOK_MARK = "__fp4select_hook__"
_MAX_TACTIC_DEPTH = 8

_state = threading.local()  # .pin: _Pin | None; .capture: list | None
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
    version = installed_version("flashinfer-python") or getattr(autotuner, "__version__", None)
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
    """Where mm_fp4's tuning configs bucket M unlike fp4select's ``m_bucket``, or None (why
    it matters: the module's rules). The configs are private names, read if present; a
    flashinfer without them is not second-guessed (pinned validation at several M of the
    bucket still checks the numbers).
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


# -- what flashinfer runs at its default tactic ------------------------------------------------
# Read from flashinfer 0.7.4's source, per runner class: what ``tactic=-1`` means. Only where
# it is a heuristic for the shape is "tuned vs default" a speed-up worth printing; CUTLASS's -1
# is its config 0 ("No heuristic for now", fp4_gemm_cutlass.cu), an arbitrary kernel.
DEFAULT_KINDS: Mapping[str, str] = {
    "CudnnFp4GemmRunner": "heuristic",  # cuDNN's heuristic plan
    "TrtllmGemmRunner": "heuristic",  # runner.selectHeuristic(m, n, k)
    "CuteDSLFp4GemmRunner": "heuristic",  # untuned_tactic(): the analytical selector
    "Sm12xCuTeFp4GemmRunner": "heuristic",  # policy.default_tactic(m, n, k)
    "B12xFp4GemmRunner": "heuristic",  # _default_dense_plan(m, n, k)
    "CutlassFp4GemmRunner": "config 0",
    "CutedslLowLatencyBlockscaledGemmRunner": "first valid",  # valid_tactics(...)[0]
}


def default_kind(runner_class: Any) -> str:
    """What ``runner_class`` runs at tactic -1: "heuristic", "config 0", ... or "unknown"."""
    return (
        DEFAULT_KINDS.get(runner_class, "unknown") if isinstance(runner_class, str) else "unknown"
    )


# -- served tactics: checked for the actual problem, once per M ------------------------------
_MAX_CHECKED_MS = 4096  # per bound runner; past that a new M is checked on every call
_fallbacks: dict[tuple[Any, ...], dict[str, Any]] = {}  # (runner, tactic, n, k, m) -> entry
_fallbacks_lock = threading.Lock()


def _shaped_like_a_tactic(tactic: Any) -> bool:
    """An int (bool is not one) or a tuple: the only tactic values flashinfer's runners use."""
    return (isinstance(tactic, int) and not isinstance(tactic, bool)) or isinstance(tactic, tuple)


def _profile_of(inputs: Sequence[Any]) -> Any:
    """An OptimizationProfile of the call's own shapes (trtllm reads M, N, K from it)."""
    autotuner = importlib.import_module("flashinfer.autotuner")
    static = autotuner.StaticDim
    shapes = [
        [static(int(d)) for d in t.shape] if isinstance(t, torch.Tensor) else [static(0)]
        for t in inputs
    ]
    return autotuner.OptimizationProfile(shapes=shapes, tensor_initializers=[None] * len(shapes))


def why_not_valid(tuner: Any, runner: Any, inputs: Sequence[Any], tactic: Any) -> str | None:
    """Why ``runner`` cannot run ``tactic`` on these inputs, or None when it can: flashinfer's
    own check where the runner has one, else its valid tactics here (see the module's rules)."""
    cls = type(runner).__name__
    m = inputs[0].shape[0] if inputs and isinstance(inputs[0], torch.Tensor) else "?"
    if not _shaped_like_a_tactic(tactic):
        return f"{tactic!r} is not a tactic value (an int or a tuple)"
    if callable(getattr(runner, "validate_tactic", None)):
        still_valid = getattr(tuner, "_tactic_still_valid", None)
        try:
            if callable(still_valid):
                ok = bool(still_valid(runner, list(inputs), tactic, OP, "fp4select"))
            else:
                ok = bool(runner.validate_tactic(list(inputs), tactic))
        except Exception as exc:
            return f"{cls}.validate_tactic raised at M={m} ({type(exc).__name__}: {exc})"[:300]
        return None if ok else f"{cls}.validate_tactic rejects it at M={m}"
    try:
        valid = runner.get_valid_tactics(list(inputs), _profile_of(inputs))
    except Exception as exc:
        return f"{cls}.get_valid_tactics raised at M={m} ({type(exc).__name__}: {exc})"[:300]
    if tactic in list(valid):
        return None
    return f"not among {cls}'s {len(valid)} valid tactics at M={m}"


def _note_fallback(runner: Any, tactic: Any, inputs: Sequence[Any], why: str) -> dict[str, Any]:
    """Remember (and log, once) that calls at this M run at flashinfer's default instead."""
    a, b = inputs[0], inputs[1]
    cls = type(runner).__name__
    try:
        tactic_json = _tactic_to_json(tactic)
        n, k, m = int(b.shape[1]), int(a.shape[1]) * 2, int(a.shape[0])
    except Exception:
        tactic_json, n, k, m = repr(tactic)[:100], -1, -1, -1
    key = (cls, repr(tactic_json), n, k, m)
    with _fallbacks_lock:
        entry = _fallbacks.get(key)
        if entry is None:
            entry = dict(runner=cls, tactic=tactic_json, n=n, k=k, m=m, reason=why, calls=0)
            _fallbacks[key] = entry
            log.warning(
                "flashinfer tactic %s of %s cannot serve N=%d K=%d M=%d (%s): those calls run at "
                "flashinfer's default tactic",
                json.dumps(tactic_json),
                cls,
                n,
                k,
                m,
                why,
            )
    return entry


def tactic_fallbacks(problem: Problem | None = None) -> list[dict[str, Any]]:
    """Calls served at flashinfer's default because the stored tactic could not serve them.

    One entry per (runner class, tactic, N, K, M) with the reason and how many calls; only
    those of ``problem`` (its N, K and M bucket) when given.
    """
    from fp4select.keys import m_bucket

    with _fallbacks_lock:
        entries = [dict(e) for e in _fallbacks.values()]
    if problem is not None:
        entries = [
            e
            for e in entries
            if e["n"] == problem.n and e["k"] == problem.k and m_bucket(e["m"]) == problem.m_bucket
        ]
    return entries


def fallback_calls() -> int:
    """How many calls in this process ran at flashinfer's default instead of a stored tactic."""
    with _fallbacks_lock:
        return sum(e["calls"] for e in _fallbacks.values())


class _Pin:
    """The tactic a bound runner serves, and what each M it met says of it (checked once)."""

    __slots__ = ("checked", "runner", "tactic")

    def __init__(self, tactic: Any, runner: str | None):
        self.tactic, self.runner = tactic, runner
        self.checked: dict[int, dict[str, Any] | None] = {}  # M -> None (valid) or fallback

    def serve(self, tuner: Any, runner: Any, inputs: Sequence[Any]) -> Any:
        tactic = self.tactic
        if tactic == DEFAULT_TACTIC and isinstance(tactic, int):
            return tactic
        m = inputs[0].shape[0]
        fallback = self.checked.get(m, _UNCHECKED)
        if fallback is _UNCHECKED:
            why = why_not_valid(tuner, runner, inputs, tactic)
            fallback = None if why is None else _note_fallback(runner, tactic, inputs, why)
            if len(self.checked) < _MAX_CHECKED_MS:
                self.checked[m] = fallback
        if fallback is None:
            return tactic
        fallback["calls"] += 1
        return DEFAULT_TACTIC


_UNCHECKED: Any = object()


# -- the choose_one hook ---------------------------------------------------------------------
def _group_tuning(tuner: Any) -> bool:
    """Whether this choose_one would join an engine's ``set_autotune_process_group``."""
    if not getattr(tuner, "is_tuning_mode", False):
        return False
    group = getattr(sys.modules.get("flashinfer.autotuner"), "get_autotune_process_group", None)
    try:
        return callable(group) and group() is not None
    except Exception:
        return False


def _hook(original: Callable[..., Any]) -> Callable[..., Any]:
    tuner = getattr(original, "__self__", None)

    def choose_one(custom_op, runners, tuning_config, inputs, **kwargs):
        pin = getattr(_state, "pin", None)
        if (
            pin is not None
            and custom_op == OP
            and len(runners) == 1
            and (pin.runner is None or type(runners[0]).__name__ == pin.runner)
        ):
            if pin.tactic is not None:
                return runners[0], pin.serve(tuner, runners[0], inputs)
            # A call fp4select serves untuned: flashinfer chooses, except inside an engine's
            # group tuning, which fp4select's calls never join (see the module's rules).
            if _group_tuning(tuner):
                return runners[0], DEFAULT_TACTIC
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


def record_error(record: Any) -> str | None:
    """Why a stored tactic record cannot be served as it is, or None (no tactic is fine).

    A tactic is an int (not a bool) or a list (a tuple in flashinfer) of JSON scalars and
    lists: 99 passes here and is refused per call by the runner's own check; "abc", 1.5 and
    true are refused here.
    """
    if not isinstance(record, Mapping):
        return f"a tactic record must be an object, not {type(record).__name__}"
    value, runner = record.get("tactic"), record.get("runner")
    if record.get("op", OP) != OP:
        return f"the record is for {record.get('op')!r}, not {OP!r}"
    if not isinstance(runner, (str, type(None))):
        return f"runner must be a class name, got {runner!r}"
    if value is None:
        return None
    if not (isinstance(value, list) or (isinstance(value, int) and not isinstance(value, bool))):
        return f"tactic must be an int or a list, got {value!r}"
    if not _plain(value):
        return f"tactic must hold JSON scalars and lists only, got {value!r}"[:200]
    return None


def tactic_of(record: Any) -> tuple[Any, str | None] | None:
    """(tactic, runner class) from a stored record, or None when it holds no usable tactic.

    Records come from disk: anything not shaped as fp4select writes it is ignored (with one
    warning); ``pinned`` then serves flashinfer's default tactic, not a guessed kernel.
    """
    if not isinstance(record, Mapping) or record.get("tactic") is None:
        return None
    why = record_error(record)
    if why is not None:
        key = repr(record)[:200]
        if first_time(f"flashinfer tactic record: {key}"):
            log.warning("ignoring a malformed flashinfer tactic record (%s): %s", why, key)
        return None
    api, _ = tuner_api()
    decode = api.json_to_tactic if api is not None else _json_to_tactic
    return decode(record["tactic"]), record.get("runner")


def served_as(record: Any) -> str:
    """What a tactic record serves: "tuned" (a tactic of its own), "default" (flashinfer's -1,
    pinned: tuning gave up or ran out of time; or a malformed record, which ``pinned`` serves
    so) or "untuned" (no tactic: flashinfer chooses). The one rule ``verify``, ``explain``
    and their JSON count by."""
    tactic = record.get("tactic") if isinstance(record, Mapping) else None
    if tactic is None:
        return "untuned"
    return "default" if record_error(record) or tactic == DEFAULT_TACTIC else "tuned"


def pinned(runner: Runner, record: Mapping[str, Any]) -> Runner:
    """``runner`` running at the recorded tactic (checked per M, see the module's rules),
    whatever flashinfer's cache or context says.

    A record without a tactic serves flashinfer's choice; a malformed one serves flashinfer's
    default (a miss, warned once). Returns ``runner`` itself when the record is empty or the
    hook cannot be installed (then flashinfer chooses, as without fp4select).
    """
    if not isinstance(record, Mapping) or "tactic" not in record:
        return runner
    if record.get("tactic") is None:
        pin = _Pin(None, record.get("runner") if isinstance(record.get("runner"), str) else None)
    else:
        decoded = tactic_of(record)  # None: malformed, a miss (as flashinfer treats one)
        pin = _Pin(DEFAULT_TACTIC, None) if decoded is None else _Pin(*decoded)
    why = install()
    if why is not None:
        if first_time(f"flashinfer tactics: {why}"):
            log.warning("cannot pin flashinfer tactics (%s); flashinfer chooses", why)
        return runner
    state = _state

    def run(*args: Any) -> torch.Tensor:
        previous = getattr(state, "pin", None)
        state.pin = pin
        try:
            return runner(*args)
        finally:
            state.pin = previous

    run.fp4select_tactic = (pin.tactic, pin.runner)  # type: ignore[attr-defined]
    run.fp4select_pin = pin  # type: ignore[attr-defined]
    return run


# -- tuning ----------------------------------------------------------------------------------
class _TuneTimeout(RuntimeError):
    """Raised into flashinfer's profiling loop past the tuning time limit (a failed tactic)."""


class _Watch(logging.Handler):
    """flashinfer's autotuner warnings while one tuning runs (its OOM fallback says so)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.messages.append(record.getMessage()[:300])


class _Tuning:
    """Around one tuning: the time limit, progress per tactic, the group left out, the reasons."""

    def __init__(self, tuner: Any, limit_s: float, progress: Callable[[], None] | None):
        self.tuner, self.limit_s, self.progress = tuner, limit_s, progress
        self.profiled = 0
        self.timed_out = False
        self.oom = ""  # the out-of-memory error a tactic's profiling raised, if any
        self.deadline = 0.0
        self.watch = _Watch()
        self._group: Any = None
        self._set_group: Callable[[Any], None] | None = None
        self._logger: logging.Logger | None = None
        self._had_profile = False
        self._failed_before = 0
        self._successes_before = 0

    def __enter__(self) -> _Tuning:
        tuner = self.tuner
        self.deadline = time.monotonic() + self.limit_s
        autotuner = sys.modules.get("flashinfer.autotuner")
        get_group = getattr(autotuner, "get_autotune_process_group", None)
        set_group = getattr(autotuner, "set_autotune_process_group", None)
        if callable(get_group) and callable(set_group):
            self._group = get_group()
            if self._group is not None:  # an engine's group: fp4select's tuning never joins it
                set_group(None)
                self._set_group = set_group
        logger = getattr(sys.modules.get(type(tuner).__module__), "logger", None)
        if isinstance(logger, logging.Logger):
            self._logger = logger
            logger.addHandler(self.watch)
        stats = getattr(tuner, "stats", None)
        self._failed_before = sum(len(v) for v in getattr(stats, "failed_tactics", {}).values())
        self._successes_before = getattr(stats, "tuned_op_successful_configs", {}).get(OP, 0)
        self._had_profile = "_profile_single_kernel" in tuner.__dict__
        watched = self

        def profile(*args: Any, **kwargs: Any) -> Any:
            watched.profiled += 1
            if watched.progress is not None:
                watched.progress()
            if time.monotonic() > watched.deadline:
                watched.timed_out = True
                raise _TuneTimeout("fp4select's tuning time limit is reached")
            try:
                return type(tuner)._profile_single_kernel(tuner, *args, **kwargs)
            except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
                watched.oom = f"{type(exc).__name__}: {exc}"[:200]
                raise

        if not self._had_profile:
            tuner._profile_single_kernel = profile
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._had_profile:
            self.tuner.__dict__.pop("_profile_single_kernel", None)
        if self._logger is not None:
            self._logger.removeHandler(self.watch)
        if self._set_group is not None:
            self._set_group(self._group)

    def gave_up(self, runner_class: str) -> str:
        """Why flashinfer's autotuner answered its default tactic (-1) after tuning."""
        oom = [m for m in self.watch.messages if "OOM" in m or "out of memory" in m.lower()]
        if oom or self.oom:
            said = "; ".join(x for x in (self.oom, oom[-1] if oom else "") if x)
            return f"flashinfer's autotuner ran out of memory and fell back ({said})"
        stats = getattr(self.tuner, "stats", None)
        failed = (
            sum(len(v) for v in getattr(stats, "failed_tactics", {}).values()) - self._failed_before
        )
        if self.profiled == 0:
            return f"{runner_class} offered no valid tactic for this problem"
        if (
            failed > 0
            or getattr(stats, "tuned_op_successful_configs", {}).get(OP, 0)
            == self._successes_before
        ):
            return f"every one of the {self.profiled} tactics flashinfer profiled failed"
        return "flashinfer's autotuner measured its default tactic fastest"


def tune(
    runner: Runner,
    problem: Problem,
    args: Sequence[Any],
    *,
    name: str | None = None,
    progress: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run ``runner(*args)`` (M = the bucket's top) under flashinfer's autotuner; the record
    (plain JSON; ``tactic`` -1 with ``fallback`` when tuning gave up, None when nothing was
    tuned, each with a ``reason``).

    ``progress`` is the sandbox's sign of life, called before each tactic's profile. OOM and
    CUDA errors propagate (the probe classifies them); any other tuning failure becomes a
    reason and the backend is timed at its default tactic.
    """
    try:
        settings = settings_mod.current()
        mode, limit_s = settings.tactics, settings.tune_timeout_s
    except ValueError as exc:  # a bad variable: raised, it would read as "unsupported"
        # (flashinfer's checks raise ValueError), so say it in the record and log instead
        bad = f"{exc}; not tuned"
        if first_time(f"flashinfer tactics: {bad}"):
            log.error(bad)
        return {"op": OP, "tactic": None, "reason": bad}
    api, why = None, None
    if settings_mod.untuned_by_setting(mode, name):
        why = f"{TACTICS_ENV}={mode}"
    elif getattr(problem, "batch_invariant", False):
        why = "batch-invariant problems are not tuned here"
    else:
        api, why = tuner_api()
        why = why or install() or bucket_mapping_disagreement()
    if api is None or why is not None:
        return {"op": OP, "tactic": None, "reason": why}
    record: dict[str, Any] = {
        "op": OP,
        "tactic": None,
        "runner": None,
        "default": DEFAULT_TACTIC,
        "m": problem.m_bucket,
        "tie_tolerance": 0.0,  # flashinfer's own rule, the fastest measured (the module's rules)
        "flashinfer": api.version,
    }
    captured: list[tuple[str, Any]] = []
    previous_capture = getattr(_state, "capture", None)
    previous_pin = getattr(_state, "pin", None)
    _state.capture, _state.pin = captured, None
    watch = _Tuning(api.tuner_class.get(), limit_s, progress)
    try:
        with watch, api.autotune(True, tuning_buckets=(problem.m_bucket,)):
            runner(*args)
    except Exception as exc:
        if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or is_cuda_error(exc):
            raise  # the probe classifies these: OOM, a broken context
        record["reason"] = (
            f"flashinfer's autotuner failed ({type(exc).__name__}: {exc}); "
            "timed at the default tactic"
        )[:500]
        return record
    finally:
        _state.capture, _state.pin = previous_capture, previous_pin
    record["profiled"] = watch.profiled
    if not captured:
        record["reason"] = "mm_fp4 did not ask flashinfer's autotuner: this backend has no tactics"
        return record
    runner_class, tactic = captured[-1]
    record["runner"] = runner_class
    record["default_kind"] = default_kind(runner_class)
    if watch.timed_out:
        record.update(
            tactic=DEFAULT_TACTIC,
            fallback="timeout",
            reason=(
                f"tuning stopped at the {limit_s:g} s limit (FP4SELECT_TUNE_TIMEOUT_S) after "
                f"{watch.profiled} tactic profiles; served at flashinfer's default tactic"
            ),
        )
        return record
    if isinstance(tactic, int) and not isinstance(tactic, bool) and tactic == DEFAULT_TACTIC:
        record.update(
            tactic=DEFAULT_TACTIC,
            fallback="gave-up",
            reason=watch.gave_up(runner_class) + "; served at flashinfer's default tactic",
        )
        return record
    record["tactic"] = api.tactic_to_json(tactic)
    return record


def untuned_tune(reason: str) -> Callable[..., dict[str, Any]]:
    """A ``tune`` hook that tunes nothing and serves flashinfer's default, saying why (the
    sandbox's answer to tuning that hung a child: slow, so kept, not blamed)."""

    def tune_nothing(runner: Runner, problem: Problem, args: Sequence[Any], **_: Any) -> dict:
        record = {"op": OP, "tactic": DEFAULT_TACTIC, "runner": None, "default": DEFAULT_TACTIC}
        return {**record, "m": problem.m_bucket, "fallback": "timeout", "reason": reason[:500]}

    return tune_nothing
