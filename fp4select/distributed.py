"""Ranks that agree: every rank of a ``torch.distributed`` job uses rank 0's decisions.

Tensor-parallel ranks that pick different backends for the same GEMM (timing noise makes
near-ties go either way) produce results that differ in the last bits across ranks, and a
rank that tunes while the others wait stalls the collective. So:

    torch.distributed.init_process_group(...)
    torch.cuda.set_device(local_rank)
    fp4select.distributed.sync(problems=model_problems)  # before CUDA graphs are captured

Design rules:

* Rank 0 decides, the others adopt. The keys of every rank (the decisions it holds in memory
  for its environment, plus ``problems``) are gathered; rank 0 decides their union (memory,
  disk, or tuning: the only rank that may tune) and broadcasts the decision records as JSON
  (``broadcast_object_list``). Other ranks tune nothing.
* Nothing received is trusted: each record must parse as a ``Decision``, answer one of the
  gathered keys, come from this rank's environment (same GPU kind, same versions) and name a
  winner that can run here (registered, available, not blacklisted on this host). A record
  that fails is an error, not a fallback: a rank that quietly chose for itself is exactly
  the disagreement this module exists to prevent.
* Then the ranks prove they agree: each hashes its table (key -> winner); the hashes are
  gathered, and if any differs the tables are gathered and ``RankDisagreementError`` names
  the first differing key and what each rank holds for it.
* Every rank takes part in every collective, whatever happened locally: a failure on one
  rank is gathered and raised on all of them, never left as a hang on the others.
* Adopted decisions live in memory (as if read from disk); the bound runners of this process
  are dropped so the next call binds the adopted winner.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp4select.keys import Problem, environment_for
from fp4select.records import Decision
from fp4select.selector import Selector
from fp4select.store import digest

__all__ = [
    "RankDisagreementError",
    "SyncReport",
    "adopt",
    "decision_table",
    "held_problems",
    "sync",
    "table_digest",
    "verify",
]

SOURCE = "rank0"  # Decision.source of an adopted decision


class RankDisagreementError(RuntimeError):
    """The ranks do not hold the same decisions; the message names the first differing key."""


@dataclass
class SyncReport:
    rank: int
    world_size: int
    keys: int  # keys in the agreed table
    adopted: int  # decisions this rank took from rank 0 (0 on rank 0)
    tuned: int  # tunings this call caused on this rank (always 0 except on rank 0)
    digest: str  # the table hash every rank agreed on


def _device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _selector(sel: Selector | None) -> Selector:
    if sel is not None:
        return sel
    from fp4select.api import selector

    return selector()


def _decisions(sel: Selector, env: Mapping[str, Any]) -> list[Decision]:
    return sel.decisions(env)


def adopt(decision: Decision, sel: Selector | None = None) -> None:
    """Install ``decision`` in this process's memory, as a disk read would."""
    _selector(sel).adopt(decision)


def held_problems(env: Mapping[str, Any], sel: Selector | None = None) -> list[Problem]:
    """The problem keys this process holds decisions for in ``env``."""
    return [d.problem for d in _decisions(_selector(sel), env)]


def decision_table(env: Mapping[str, Any], sel: Selector | None = None) -> dict[str, Any]:
    """{problem digest: [description, winner]} of the decisions held in ``env``."""
    return {
        d.problem.digest(): [d.problem.describe(), d.winner]
        for d in _decisions(_selector(sel), env)
    }


def table_digest(table: Mapping[str, Any]) -> str:
    return digest({k: v[1] for k, v in table.items()})


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fp4select.distributed needs torch.distributed initialised "
            "(torch.distributed.init_process_group) before sync/verify"
        )
    return dist


def _src(dist: Any, group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def _env_difference(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> str:
    fields = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    return "; ".join(f"{k}: {theirs.get(k)!r} on rank 0, {mine.get(k)!r} here" for k in fields)


def _receive(
    payload: Any, wanted: Iterable[Problem], env: Mapping[str, Any], sel: Selector
) -> list[Decision]:
    """Rank 0's broadcast, checked record by record; raises ValueError naming what is wrong."""
    if not isinstance(payload, str):
        raise ValueError(f"rank 0 sent {type(payload).__name__}, not a JSON string")
    data = json.loads(payload)
    if not isinstance(data, dict):
        raise ValueError("rank 0 sent JSON that is not an object")
    if "error" in data:
        raise ValueError(f"rank 0 could not decide: {data['error']}")
    records = data.get("decisions")
    if not isinstance(records, list):
        raise ValueError("rank 0's message has no 'decisions' list")
    wanted = set(wanted)
    registry = sel.registry()
    decisions = []
    for record in records:
        try:
            decision = Decision.from_json(record, source=SOURCE)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"a decision from rank 0 is malformed: {exc!r}") from None
        what = decision.problem.describe()
        if decision.problem not in wanted:
            raise ValueError(f"rank 0 sent a decision for {what}, which no rank asked for")
        if digest(decision.env) != digest(env):
            raise ValueError(
                f"rank 0 decided {what} in another environment ({_env_difference(env, decision.env)})"
            )
        if decision.winner is not None:
            runnable, excluded = sel.candidates(decision.problem, env, registry)
            if decision.winner not in {b.name for b in runnable}:
                verdict = excluded.get(decision.winner)
                why = f"{verdict.status}: {verdict.reason}" if verdict else "not registered here"
                raise ValueError(
                    f"rank 0 chose {decision.winner!r} for {what}, which cannot run here ({why})"
                )
        decisions.append(decision)
    missing = wanted - {d.problem for d in decisions}
    if missing:
        raise ValueError(f"rank 0 sent no decision for {min(p.describe() for p in missing)}")
    return decisions


def verify(
    group: Any = None,
    *,
    device: torch.device | str | None = None,
    sel: Selector | None = None,
    error: str | None = None,
) -> str:
    """Check that every rank holds the same decision table; returns its hash.

    Raises ``RankDisagreementError`` on every rank when the tables differ (naming the first
    differing key) or when any rank passes an ``error`` (used by ``sync``).
    """
    dist = _dist()
    sel = _selector(sel)
    env = environment_for(_device(device))
    table = decision_table(env, sel)
    mine = {"digest": table_digest(table), "error": error}
    world = dist.get_world_size(group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    failures = [(r, x["error"]) for r, x in enumerate(everyone) if x["error"]]
    if failures:
        raise RankDisagreementError(
            "; ".join(f"rank {r}: {e}" for r, e in failures) + " (no rank may capture graphs)"
        )
    digests = {x["digest"] for x in everyone}
    if len(digests) == 1:
        return digests.pop()
    tables: list[Any] = [None] * world
    dist.all_gather_object(tables, table, group=group)
    keys = sorted(set().union(*tables), key=lambda k: next(t[k][0] for t in tables if k in t))
    for key in keys:
        held = [t.get(key) for t in tables]
        winners = [h[1] if h else None for h in held]
        present = [h is not None for h in held]
        if len(set(winners)) > 1 or not all(present):
            what = next(h[0] for h in held if h)
            per_rank = ", ".join(
                f"rank {r}: {h[1] if h else 'no decision'}" for r, h in enumerate(held)
            )
            raise RankDisagreementError(f"ranks disagree on {what}: {per_rank}")
    raise RankDisagreementError("ranks' decision tables hash differently")  # pragma: no cover


def sync(
    group: Any = None,
    *,
    problems: Sequence[Problem] = (),
    device: torch.device | str | None = None,
    sel: Selector | None = None,
) -> SyncReport:
    """Make every rank use rank 0's decisions for every key any rank holds, then verify.

    ``problems`` adds keys this rank will need (say, its model's shapes) to those it already
    holds. Rank 0 decides the union (tuning only there); the others adopt. Call it on every
    rank, after ``init_process_group`` and before CUDA graphs are captured.
    """
    dist = _dist()
    sel = _selector(sel)
    dev = _device(device)
    env = environment_for(dev)
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    tunings_before = sel.counters.tunings
    keys = list(dict.fromkeys([*held_problems(env, sel), *problems]))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, [p.to_json() for p in keys], group=group)
    union: dict[Problem, None] = {}
    for rank_keys in gathered:
        for key in rank_keys:
            union.setdefault(Problem.from_json(key), None)
    payload: list[Any] = [None]
    if rank == 0:
        try:
            decisions = [sel.decide(p, dev) for p in union]
            payload[0] = json.dumps({"decisions": [d.to_json() for d in decisions]})
        except Exception as exc:  # told to every rank, then raised everywhere by verify
            payload[0] = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    dist.broadcast_object_list(payload, src=_src(dist, group), group=group)
    error = None
    adopted = 0
    try:
        received = _receive(payload[0], union, env, sel)
        if rank != 0:
            for decision in received:
                adopt(decision, sel)
            adopted = len(received)
            from fp4select.api import reset

            reset()  # runners bound before the sync may be other backends: bind again
    except (ValueError, TypeError) as exc:
        error = str(exc)
    agreed = verify(group, device=dev, sel=sel, error=error)
    return SyncReport(
        rank=rank,
        world_size=world,
        keys=len(union),
        adopted=adopted,
        tuned=sel.counters.tunings - tunings_before,
        digest=agreed,
    )
