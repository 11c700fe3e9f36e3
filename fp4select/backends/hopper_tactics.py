"""Tactics for the ``hopper-*`` backends: a few configurations timed per shape.

The tables in ``hopper_configs`` hold one configuration per range of M, chosen at three shapes;
the best one differs by shape (docs/hopper_kernels.md, 'The configuration sweeps'). Like
flashinfer's autotuner, probing times the candidates at the bucket's top M (``tune``), and the
winner is stored with the decision.

Design rules:

* The record is data: ``{"op": "hopper", "tactic": [ints], "default": [ints], "timed_us": ...}``.
  ``pin`` serves a record's configuration only if it is one of the runner's own candidates,
  compared as exact ints, so a record read from disk can choose among known kernels and never
  name a new one; anything else runs the table's configuration.
* The weight is rotated through copies while timing, so it comes from HBM as when serving.
* ``FP4SELECT_TACTICS=default`` (or ``default:NAME``) and batch-invariant problems keep the
  table, as for flashinfer's backends; candidates left past ``FP4SELECT_TUNE_TIMEOUT_S`` are
  not timed.
* A candidate far behind the fastest is timed once more from a new capture and kept at that
  time only when it is as far faster (``retime_stalled``): a stalled graph, which its own
  eager calls cannot reveal where launching takes as long (``timing``'s rules).
* A candidate Triton refuses to load on this GPU (``OutOfResources``: the tiles were chosen
  on an H200) is skipped and named in the record; any other error is the backend's.
* The candidates' first calls run together, one thread each (``compile_ahead``): a first call
  is mostly Triton compiling, which holds the GIL for only part of its time, and compiles were
  a large share of a model's warm-up (docs/hopper_kernels.md, 'Where the time goes'). Their
  outputs are discarded (they may share a workspace); what they raise is met again, one at a
  time, in the timed loop.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple
from typing import Any

import torch

from fp4select import settings as settings_mod
from fp4select._stalls import stalled
from fp4select.backends import hopper_configs

OP = "hopper"
_KINDS = {
    "run_gemv": "gemv",
    "run_mma": "mma",
    "run_ws": "ws",
    "fast_gemv": "gemv",
    "fast_mma": "mma",
    "fast_ws": "ws",
}  # the runners of triton_hopper that take cfg= (checked, and the warm path's)
# Seconds per candidate, after its first (compiling) call. compile_ahead's children set 0: they
# only compile, and time nothing they keep (each candidate still runs its few samples).
TUNE_BUDGET_S = 0.05


def _kind(runner: Callable[..., Any]) -> tuple[Callable[..., Any], str]:
    run = getattr(runner, "func", runner)
    name = getattr(run, "__name__", "")
    module = getattr(run, "__module__", "")
    return run, _KINDS.get(name, "") if module == "fp4select.backends.triton_hopper" else ""


def _time_us(calls: Sequence[Callable[[], Any]], device: torch.device, budget_s: float) -> float:
    """Median of a few CUDA-event samples, each call taking the next input set in turn.

    The calls are replayed from a CUDA graph, as serving replays them: timed eagerly, a round
    of small kernels measured the host's launches, so the pick among them was noise
    (docs/hopper_kernels.md, 'Tactics are timed from CUDA graphs').
    """
    for call in calls:  # compiles, first-launch costs and workspaces: out of the samples
        call()
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for call in calls:  # the same calls eagerly, the host waiting: what a replay must not exceed
        call()
    torch.cuda.synchronize(device)
    eager_us = (time.perf_counter() - started) * 1e6 / len(calls)
    for _ in range(2):  # a stalled graph is captured again, once (``_stalls``)
        replay = _graphed(calls, device)
        samples: list[float] = []
        deadline = time.perf_counter() + budget_s
        while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / len(calls))  # ms/round -> us/call
        if not stalled(statistics.median(samples), eager_us):
            break
        del replay  # its graph's memory pool is freed before the next capture
    return statistics.median(samples)


def _graphed(calls: Sequence[Callable[[], Any]], device: torch.device) -> Callable[[], Any]:
    """One replay of all ``calls`` captured in a CUDA graph; the calls themselves, eagerly, if
    the capture fails."""

    def eager() -> None:
        for call in calls:
            call()

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):  # frees the dead graphs' pools first (see timing._Sampler)
            eager()
    except Exception:  # not capturable: eager launches are still right, only less exact
        torch.cuda.synchronize(device)
        return eager
    return graph.replay


def _input_copies(args: Sequence[Any], device: torch.device) -> list[tuple[Any, ...]]:
    """``args`` and copies of its weight, enough that the weight is read from HBM, not L2."""
    b = args[1]
    per_set = b.numel() * b.element_size()
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    copies = max(0, min(3, math.ceil(2 * l2 / max(per_set, 1)) - 1))
    sets = [tuple(args)]
    for _ in range(copies):
        sets.append((args[0], b.clone(), args[2], args[3].clone(), *args[4:]))
    return sets


def tune(
    runner: Callable[..., Any],
    problem: Any,
    args: Sequence[Any],
    *,
    name: str | None = None,
    progress: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Time each candidate configuration at these arguments; the record of the fastest.

    ``FP4SELECT_TACTICS=default`` (or ``default:NAME``) and batch-invariant problems keep the
    table's configuration; so does a CPU tensor (the interpreter's tests). Candidates left past
    ``FP4SELECT_TUNE_TIMEOUT_S`` are not timed.
    """
    a = args[0]
    m = int(a.shape[0])
    run, kind = _kind(runner)
    default = hopper_configs.default(kind, m)
    record: dict[str, Any] = {
        "op": OP,
        "tactic": list(astuple(default)),
        "default": list(astuple(default)),
    }
    try:
        settings = settings_mod.current()
    except ValueError as exc:
        return record | {"reason": f"{exc}; not tuned"}
    if settings_mod.untuned_by_setting(settings.tactics, name):
        return record | {"reason": f"FP4SELECT_TACTICS={settings.tactics}"}
    if getattr(problem, "batch_invariant", False):
        return record | {"reason": "batch-invariant problems keep the table's configuration"}
    if a.device.type != "cuda":
        return record | {"reason": "tuned on CUDA only"}
    if not hopper_configs.candidates(kind, m):
        return record | {"reason": f"no candidates to time at M = {m}"}
    sets = _input_copies(args, a.device)
    started = time.perf_counter()
    compile_ahead(run, sets[0], hopper_configs.candidates(kind, m), a.device)
    times: dict[Any, float] = {}
    skipped: dict[str, str] = {}
    for cfg in hopper_configs.candidates(kind, m):
        if time.perf_counter() - started > settings.tune_timeout_s:
            record["reason"] = (
                f"stopped after {settings.tune_timeout_s:g} s (FP4SELECT_TUNE_TIMEOUT_S)"
            )
            break
        if progress is not None:
            progress()
        calls = [functools.partial(run, *s, cfg=cfg) for s in sets]
        try:
            us = _time_us(calls, a.device, TUNE_BUDGET_S)
        except Exception as exc:
            if not _out_of_resources(exc):
                raise
            # A tile too large for this GPU's shared memory or registers (an H200-sized tile
            # on an A100 or an L40S): refused before launch, so nothing ran; the others compete.
            skipped[" ".join(map(str, astuple(cfg)))] = str(exc).splitlines()[0][:200]
            continue
        times[cfg] = us

    def again(cfg: Any) -> float:
        return _time_us(
            [functools.partial(run, *s, cfg=cfg) for s in sets], a.device, TUNE_BUDGET_S
        )

    times = retime_stalled(times, again)
    best = min(times, key=times.__getitem__) if times else default
    if skipped:
        record["skipped"] = skipped
    timed = {" ".join(map(str, astuple(cfg))): round(us, 2) for cfg, us in times.items()}
    return record | {"tactic": list(astuple(best)), "timed_us": timed}


def retime_stalled(times: Mapping[Any, float], retime: Callable[[Any], float]) -> dict[Any, float]:
    """``times`` with each candidate far behind the fastest (``_stalls``' rule) timed once more
    from a new capture, and kept at that time only when it is as far faster: its own eager
    calls cannot tell a stalled graph where launching takes as long (``timing``'s rules)."""
    fastest = min(times.values(), default=0.0)
    out = dict(times)
    for cfg, us in times.items():
        if stalled(us, fastest):
            fresh = retime(cfg)
            if stalled(us, fresh):
                out[cfg] = fresh
    return out


def compile_ahead(
    run: Callable[..., Any], args: Sequence[Any], cfgs: Sequence[Any], device: torch.device
) -> None:
    """Each configuration's first call, all at once (see the module rules); waits for all."""
    if len(cfgs) < 2:
        return
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def first(cfg: Any) -> None:
        with contextlib.ExitStack() as on:
            if stream is not None:  # a new thread starts on device 0 and its default stream
                on.enter_context(torch.cuda.device(device))
                on.enter_context(torch.cuda.stream(stream))
            run(*args, cfg=cfg)

    with ThreadPoolExecutor(len(cfgs), thread_name_prefix="fp4select-compile") as pool:
        done = [pool.submit(first, cfg) for cfg in cfgs]
    for future in done:
        future.exception()  # left for the timed loop, which runs each again alone
    if stream is not None:
        torch.cuda.synchronize(device)


def _out_of_resources(exc: BaseException) -> bool:
    """Triton's refusal to load a kernel that does not fit the device (no import of triton)."""
    kind = type(exc)
    return kind.__name__ == "OutOfResources" and kind.__module__.startswith("triton")


@functools.cache
def _candidates_by_fields(kind: str) -> dict[tuple[int, ...], Any]:
    """Every candidate of ``kind`` by its fields, as a record stores them: an eager prefill binds
    a runner at each new M, and ``astuple`` over the candidates at each binding took about
    half a launch's host time (a profile of new M's first calls on the H200's host)."""
    return {astuple(cfg): cfg for cfg in hopper_configs.candidates(kind, None)}


def pin(runner: Callable[..., Any], record: Mapping[str, Any]) -> Callable[..., Any]:
    """``runner`` at the record's configuration, if it is one of the candidates; else as is."""
    run, kind = _kind(runner)
    wanted = record.get("tactic") if isinstance(record, Mapping) else None
    if not isinstance(wanted, list) or not all(type(v) is int for v in wanted):
        return runner
    cfg = _candidates_by_fields(kind).get(tuple(wanted))
    return runner if cfg is None else functools.partial(run, cfg=cfg)
