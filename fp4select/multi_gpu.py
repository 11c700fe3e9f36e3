"""``warm --devices``: tune a list of problem keys on several GPUs of one kind at once.

Design rules:

* One worker process per GPU (spawned, so no CUDA state is inherited). Workers take keys
  from one shared queue, largest GEMM first, so a slow key never leaves the other GPUs idle
  and no cost model is needed.
* GPUs of one kind share one environment (the fingerprint holds the GPU name, CC, SM count
  and versions, not the device index), so a key tuned on any of them is stored once, in the
  shared store, under the per-key file lock, and serves all of them. GPUs whose environments
  differ are refused before anything runs, naming the fields that differ: their decisions
  would not be interchangeable, so splitting keys across them would be wrong.
* A worker that dies takes only its current key with it: that key is reported as failed with
  the worker's exit code, the other workers carry on with the rest.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fp4select import settings
from fp4select.keys import Problem, env_difference, environment_for
from fp4select.selector import Selector
from fp4select.settings import Settings
from fp4select.store import digest

if TYPE_CHECKING:
    from fp4select.records import Decision
    from fp4select.settings import Isolation

__all__ = [
    "DeviceError",
    "check_same_environment",
    "decision_row",
    "parse_devices",
    "tuning_order",
    "warm_parallel",
]


class DeviceError(ValueError):
    """A --devices list that cannot be used; the message says why."""


def parse_devices(spec: str, count: int) -> list[int]:
    """GPU indices from ``all`` or ``0,1,...`` given ``count`` visible GPUs."""
    text = spec.strip().lower()
    if count < 1:
        raise DeviceError(f"--devices {spec!r}: no CUDA GPU is visible here")
    if text == "all":
        return list(range(count))
    try:
        indices = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        indices = []
    if not indices:
        raise DeviceError(f"--devices must be 'all' or GPU indices like 0,1; got {spec!r}")
    for i in indices:
        if not 0 <= i < count:
            raise DeviceError(f"--devices names GPU {i}, but GPUs 0..{count - 1} are visible")
    if len(set(indices)) != len(indices):
        raise DeviceError(f"--devices names a GPU twice: {spec!r}")
    return indices


def check_same_environment(
    devices: Sequence[torch.device],
    env_of: Callable[[torch.device], Mapping[str, Any]] = environment_for,
) -> dict[str, Any]:
    """The one environment all ``devices`` share; raises ``DeviceError`` naming the difference."""
    envs = [dict(env_of(d)) for d in devices]
    first = envs[0]
    for device, env in zip(devices[1:], envs[1:]):
        if digest(env) != digest(first):
            diff = env_difference(first, env, (f"on {devices[0]}", f"on {device}"))
            raise DeviceError(
                f"--devices mixes GPU kinds ({diff}); their decisions differ, so run warm "
                "once per kind with --devices naming GPUs of one kind"
            )
    return first


def tuning_order(problems: Sequence[Problem]) -> list[Problem]:
    """Largest M*N*K first (the slowest keys), so the last keys to finish are short ones."""
    return sorted(problems, key=lambda p: (-(p.m_bucket * p.n * p.k), p.n, p.k, p.m_bucket))


def decision_row(decision: Decision, sel: Selector) -> dict[str, Any]:
    """What warm reports of one decided key, tuned on one GPU or on several."""
    return {
        "winner": decision.winner,
        "source": decision.source,
        "seconds": round(decision.tuning_seconds, 3),
        "stored": not sel.store.memory_only,
    }


def _worker(
    device: str, tasks: Any, results: Any, store_root: str, isolation: Isolation, timing: Any
) -> None:
    """Body of one worker process: take keys until the sentinel, decide each, report it.

    Its settings are the environment's with the caller's cache and isolation over them, made
    the process-wide ones (as ``configure()`` would) so that its sandbox children get them.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    chosen = Settings.from_env().replace(cache_dir=store_root, isolation=isolation)
    settings.use(chosen)
    sel = Selector(timing=timing, settings=chosen)
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            index, key = item
            results.put(("start", device, index, None))
            problem = Problem.from_json(key)
            started = time.perf_counter()
            try:
                row = decision_row(sel.decide(problem, dev), sel)
            except Exception as exc:  # reported per key; the worker goes on with the next
                row = {"winner": None, "source": "error", "error": f"{type(exc).__name__}: {exc}"}
            row["wall_seconds"] = round(time.perf_counter() - started, 3)
            results.put(("done", device, index, row))
        results.put(("counters", device, None, sel.counters.as_dict()))
    finally:
        sel.close()


def warm_parallel(
    problems: Sequence[Problem],
    devices: Sequence[torch.device],
    *,
    store_root: str | os.PathLike[str],
    isolation: Isolation,
    timing: Any,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Decide every key on one of ``devices``; returns (one row per key in input order, counters).

    Rows: problem, winner, source, seconds, device (the worker that decided it). Counters are
    summed over workers.
    """
    if not devices:
        raise DeviceError("warm_parallel needs at least one device")
    ctx = mp.get_context("spawn")
    tasks = ctx.Queue()
    results = ctx.Queue()
    order = tuning_order(problems)
    index_of = {p: i for i, p in enumerate(problems)}
    for p in order:
        tasks.put((index_of[p], p.to_json()))
    for _ in devices:
        tasks.put(None)
    workers = {
        str(d): ctx.Process(
            target=_worker,
            args=(str(d), tasks, results, os.fspath(store_root), isolation, timing),
            name=f"fp4select-warm-{d}",
        )
        for d in devices
    }
    for w in workers.values():
        w.start()
    rows: dict[int, dict[str, Any]] = {}
    in_flight: dict[str, int | None] = {d: None for d in workers}
    counters: dict[str, int] = {}
    reported: set[str] = set()
    try:
        while len(reported) < len(workers):
            try:
                kind, device, index, payload = results.get(timeout=0.5)
            except queue.Empty:
                for name, w in workers.items():
                    if name in reported or w.is_alive():
                        continue
                    # Messages it sent before dying may still be in the pipe: drain first.
                    time.sleep(0.2)
                    if not results.empty():
                        break
                    lost = in_flight[name]
                    if lost is not None and lost not in rows:
                        rows[lost] = _failed(
                            f"worker on {name} died (exit code {w.exitcode})", name
                        )
                    reported.add(name)
                continue
            if kind == "start":
                in_flight[device] = index
            elif kind == "done":
                payload["device"] = device
                rows[index] = payload
                in_flight[device] = None
                if progress is not None:
                    progress({"problem": problems[index].describe(), **payload})
            elif kind == "counters":
                for k, v in payload.items():
                    counters[k] = counters.get(k, 0) + int(v)
                reported.add(device)
    finally:
        for w in workers.values():
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
                w.join()
    out = [
        {"problem": p.describe(), **(rows.get(i) or _failed("not tuned: every worker died", None))}
        for i, p in enumerate(problems)
    ]
    return out, counters


def _failed(error: str, device: str | None) -> dict[str, Any]:
    """The row of a key no worker reported a decision for."""
    return {"winner": None, "source": "error", "error": error, "device": device}
