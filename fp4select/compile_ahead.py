"""``warm``'s compile-ahead: the kernels a deploy will tune, compiled first by parallel processes.

Why: from an empty Triton cache, compiling was up to half of warming a model
(docs/hopper_kernels.md, 'Compile-ahead'), and the threads that compile a key's tactic
candidates together share one interpreter lock. Compiled kernels land in Triton's on-disk
cache, where the tuning that follows (in this process or its sandbox child) finds them.

Design rules:

* Nothing here decides anything. A child only makes the calls of probing's validation that
  compile, for its keys' own kernel candidates (the ``native`` family): each tactic
  candidate's first call and a call at each validation M. Outputs, the tactic chosen and
  anything raised are thrown away: a failure, a hang or a death costs only the time, and the
  tuning after it meets and judges the same in its own sandbox. A child never writes the
  store and computes no reference: GPU contexts of several processes take turns on the GPU,
  so the children give it as little work as compiling allows.
* Only keys the store has no decision for, and only candidates the selector would probe
  (blacklisted, unavailable, rejected and declined ones are left out), are compiled.
* Work is split by kernel, not by key: the keys that share a backend and everything of their
  key but N and K (so the same tactic candidates, mostly the same compiled kernels) go to one
  child, which compiles them once and runs the rest from its in-memory cache.
* Children are spawned (no CUDA state inherited), run this module of the same fp4select, and
  are killed at a deadline; the GPU is otherwise idle meanwhile, and it is idle again when the
  timing starts (the children have exited).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fp4select import validate
from fp4select.keys import Problem, environment_for

if TYPE_CHECKING:
    from fp4select.backends.base import Backend
    from fp4select.selector import Selector
    from fp4select.settings import Settings

__all__ = ["Summary", "compile_ahead", "default_jobs", "plan_groups", "run_children"]

FAMILY = "native"  # fp4select's own kernels: the backends that compile on first use
# A child holds a CUDA context and its inputs: more than 4 children were no faster and only
# cost memory (measured: docs/hopper_kernels.md, 'Compile-ahead').
_MAX_JOBS = 4
DEADLINE_S = 300.0  # past it the children are killed and warm goes on to tune


@dataclass(frozen=True)
class Summary:
    """What compile-ahead did, for warm's report."""

    processes: int
    groups: int
    keys: int
    seconds: float
    killed: int = 0  # children still running at the deadline
    failed: int = 0  # children that exited non-zero (a crash: the tuning meets it again)

    def describe(self) -> str:
        if not self.groups:
            return "compile-ahead: nothing to compile"
        extra = (f", {self.killed} stopped at the deadline" if self.killed else "") + (
            f", {self.failed} exited with an error" if self.failed else ""
        )
        return (
            f"compile-ahead: {self.groups} kernel groups of {self.keys} keys in "
            f"{self.seconds:.1f} s on {self.processes} processes{extra}"
        )

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def default_jobs() -> int:
    """Half the CPUs this process may use (the other half is the children's Triton and ptxas
    work and the C++ key's build), at most ``_MAX_JOBS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_JOBS, cpus // 2))


def _group_key(name: str, problem: Problem) -> str:
    """The backend and the key without N and K (their divisibility by 1024 stays: Triton
    specializes integer arguments on divisibility, so shapes that differ there compile apart)."""
    data = problem.to_json()
    data["n"] = math.gcd(problem.n, 1024)
    data["k"] = math.gcd(problem.k, 1024)
    return name + repr(sorted(data.items()))


def plan_groups(
    sel: Selector, problems: Sequence[Problem], device: torch.device
) -> list[list[tuple[Problem, str]]]:
    """(key, backend name) pairs to compile, grouped by kernel; largest group first."""
    env = environment_for(device)
    registry = sel.light_registry()
    groups: dict[str, list[tuple[Problem, str]]] = {}
    for problem in problems:
        if sel.store.read_entry(env, problem.to_json()) is not None:
            continue  # decided already (read as the store has it, not counted as a hit)
        runnable, _ = sel.candidates(problem, env, registry)
        for backend in runnable:
            if backend.family == FAMILY:
                groups.setdefault(_group_key(backend.name, problem), []).append(
                    (problem, backend.name)
                )
    return sorted(groups.values(), key=len, reverse=True)


def _share(groups: Sequence[Sequence[Any]], processes: int) -> list[list[Any]]:
    """Whole groups to each child, the next group to the child with the fewest keys so far."""
    shares: list[list[Any]] = [[] for _ in range(processes)]
    for group in groups:
        min(shares, key=len).extend(group)
    return [s for s in shares if s]


def _child(
    device: str, jobs: Sequence[tuple[Mapping[str, Any], str]], env_settings: Settings
) -> None:
    """Each (key, backend)'s kernels compiled: its tactic candidates (tuned with no time
    budget), then a call at each M that validation runs. No reference, no check: outputs and
    the tactic chosen are thrown away. The GPU is shared by every child (contexts take turns),
    so they give it as little work as compiling allows."""
    from fp4select import settings
    from fp4select.backends import discover, hopper_tactics
    from fp4select.backends.base import is_cuda_error

    settings.use(env_settings)
    hopper_tactics.TUNE_BUDGET_S = 0.0
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    registry = discover(include_flashinfer=False)
    for key, name in jobs:
        backend = registry.get(name)
        if backend is None:
            continue
        try:
            _compile(backend, Problem.from_json(dict(key)), dev)
        except Exception as exc:  # the tuning meets it again, in its sandbox, and judges it
            if is_cuda_error(exc):  # this context is dead: nothing more compiles here
                os._exit(3)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def _compile(backend: Backend, problem: Problem, dev: torch.device) -> None:
    """The calls of ``probe``'s validation that compile, in its order (see probe._validate)."""
    ms = problem.validation_ms()
    runner = backend.checked_runner_for(problem)
    if backend.tune is not None:
        m = problem.timing_m()
        args = validate.make_inputs(problem, m, dev, with_reference=False).args(problem)
        record = backend.tune(runner, problem, args, name=backend.name)
        runner = backend.checked_runner_for(problem, record or None)
    for m in ms:
        runner(*validate.make_inputs(problem, m, dev, with_reference=False).args(problem))


def compile_ahead(
    sel: Selector,
    problems: Sequence[Problem],
    device: torch.device,
    jobs: int | None = None,
    deadline_s: float = DEADLINE_S,
    announce: Callable[[str], None] | None = None,
) -> Summary:
    """Compile the kernels ``problems`` will tune on ``device`` in up to ``jobs`` children.

    Returns at once (nothing to do) off CUDA, where nothing is compiled, with ``jobs`` < 2, or
    when every key is decided. ``announce`` gets one line before the children start (a long
    silence otherwise: seconds to a minute).
    """
    started = time.perf_counter()
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 2 or device.type != "cuda" or not problems:
        return Summary(0, 0, 0, 0.0)
    if device.index is None:  # a child's set_device needs the index
        device = torch.device("cuda", torch.cuda.current_device())
    groups = plan_groups(sel, problems, device)
    shares = _share(groups, jobs)
    if shares and announce is not None:
        announce(f"compile-ahead: compiling {len(groups)} kernel groups in {len(shares)} processes")
    stopped, failed = run_children(device, shares, sel.settings, deadline_s)
    keys = len({p for share in shares for p, _ in share})
    return Summary(len(shares), len(groups), keys, time.perf_counter() - started, stopped, failed)


def run_children(
    device: torch.device,
    shares: Sequence[Sequence[tuple[Problem, str]]],
    settings: Settings,
    deadline_s: float,
) -> tuple[int, int]:
    """One spawned child a share, all at once; (killed at the deadline, exited non-zero)."""
    ctx = mp.get_context("spawn")
    children = [
        ctx.Process(
            target=_child,
            args=(str(device), [(p.to_json(), name) for p, name in share], settings),
            name=f"fp4select-compile-{i}",
            daemon=True,
        )
        for i, share in enumerate(shares)
    ]
    for child in children:
        child.start()
    end = time.monotonic() + deadline_s
    for child in children:
        child.join(max(0.0, end - time.monotonic()))
    stopped = [c for c in children if c.is_alive()]
    for child in stopped:
        child.kill()
        child.join()
    return len(stopped), sum(1 for c in children if c not in stopped and c.exitcode != 0)
