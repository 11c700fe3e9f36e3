"""Ranks that agree: every rank of a ``torch.distributed`` job uses rank 0's decisions.

Tensor-parallel ranks that pick different backends for the same GEMM (timing noise makes
near-ties go either way) produce results that differ in the last bits across ranks, and a
rank that tunes while the others wait stalls the collective. So, on every rank, after
``init_process_group`` and before CUDA graphs are captured:
``fp4select.distributed.sync(problems=model_problems)``.

Design rules:

* Rank 0 decides, the others adopt. Every rank's keys (the decisions it holds, plus
  ``problems``) are gathered; rank 0 decides their union (the only rank that may tune) and
  broadcasts the decision records.
* Bytes, never objects. Every message is JSON in a uint8 tensor, its length sent first and
  capped (``MAX_MESSAGE_BYTES``, checked by every rank before any rank allocates), parsed
  strictly (UTF-8, no NaN or Infinity, no repeated keys, the expected shape).
  ``broadcast_object_list``/``all_gather_object`` unpickle what a rank sends, and a pickle
  runs code.
* Nothing received is trusted: each record must parse as a ``Decision``, answer a gathered
  key, come from this rank's environment and name a winner that can run here. A record that
  fails is an error, not a fallback: a rank that quietly chose for itself is exactly the
  disagreement this module exists to prevent.
* Then the ranks prove they agree: each hashes its table (key -> winner and its tactic); if
  any hash differs the tables are gathered and ``RankDisagreementError`` names the first
  differing key and what each rank holds for it.
* Every rank takes part in every collective, whatever happened locally: the sequence is fixed,
  and a failure on one rank travels in the next message and is raised on all of them at the
  end, within seconds, never left as a hang until the process group's timeout.
* Adopted decisions live in memory (as if read from disk); the bound runners of this process
  are dropped so the next call binds the adopted winner.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fp4select._version import __version__
from fp4select.keys import Problem, env_difference, environment_for, resolve_device
from fp4select.records import Decision
from fp4select.selector import Selector
from fp4select.store import MAX_DEPTH, digest, too_deep

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
MAX_MESSAGE_BYTES = 256 << 20  # one rank's message; every rank refuses a larger one


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


def _selector(sel: Selector | None) -> Selector:
    if sel is not None:
        return sel
    from fp4select.api import selector

    return selector()


def adopt(decision: Decision, sel: Selector | None = None) -> None:
    """Install ``decision`` in this process's memory, as a disk read would."""
    _selector(sel).adopt(decision)


def held_problems(env: Mapping[str, Any], sel: Selector | None = None) -> list[Problem]:
    """The problem keys this process holds decisions for in ``env``."""
    return [d.problem for d in _selector(sel).decisions(env)]


def decision_table(env: Mapping[str, Any], sel: Selector | None = None) -> dict[str, Any]:
    """{problem digest: [description, winner, winner's tactic]} of the decisions held in
    ``env`` (the tactic a record or None: the runner serves the winner at it)."""
    return {
        d.problem.digest(): [d.problem.describe(), d.winner, d.tactic(d.winner)]
        for d in _selector(sel).decisions(env)
    }


def table_digest(table: Mapping[str, Any]) -> str:
    """The hash ranks compare: every key's winner and tactic."""
    return digest({k: [v[1], v[2] if len(v) > 2 else None] for k, v in table.items()})


# -- the wire: JSON bytes in tensors, length first ------------------------------------------


def _comm_device(dist: Any, group: Any) -> torch.device:
    """NCCL moves CUDA tensors only; every other backend (gloo, mpi) CPU tensors."""
    if str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.cpu().clone().untyped_storage())


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=False, sort_keys=True, separators=(",", ":")).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("an object repeats a key")
    return result


def _decode(data: bytes, sender: str) -> Any:
    """Strict JSON from ``sender``; ValueError naming the sender and the problem."""
    try:
        obj = json.loads(
            data.decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_unique_keys
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{sender} sent a message that is not strict JSON: {exc}") from None
    if too_deep(obj, MAX_DEPTH + 4):  # a decision record, inside the message's list
        raise ValueError(f"{sender} sent a message that is not strict JSON: nested too deeply")
    return obj


def _too_long(lengths: Sequence[int]) -> str | None:
    for rank, length in enumerate(lengths):
        if not 0 <= length <= MAX_MESSAGE_BYTES:
            return f"rank {rank} sent a message of {length} bytes (at most {MAX_MESSAGE_BYTES})"
    return None


def _all_gather_json(obj: Any, dist: Any, group: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order; a rank whose message cannot be read is an
    ``{"error": ...}`` in its place (so every rank still takes part in what follows)."""
    device = _comm_device(dist, group)
    world = dist.get_world_size(group)
    data = _encode(obj)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths_t = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths_t, length, group=group)
    lengths = [int(t.item()) for t in lengths_t]
    too_long = _too_long(lengths)
    if too_long is not None:  # every rank sees the same lengths: all skip the data together
        return [{"error": too_long}] * world
    size = max(lengths)
    mine = torch.zeros(size, dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = _tensor(data, device)
    parts = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    received = []
    for rank, (part, n) in enumerate(zip(parts, lengths)):
        try:
            received.append(_decode(_bytes(part[:n]), f"rank {rank}"))
        except ValueError as exc:
            received.append({"error": str(exc)})
    return received


def _broadcast_json(obj: Any, src: int, dist: Any, group: Any) -> Any:
    """``obj`` of rank ``src`` on every rank (``obj`` is ignored elsewhere); ValueError when
    it cannot be read (raised on the receiving ranks only, after the collective)."""
    device = _comm_device(dist, group)
    mine = dist.get_rank() == src
    data = _encode(obj) if mine else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    n = int(length.item())
    too_long = _too_long([n])
    if too_long is not None:
        raise ValueError(too_long.replace("rank 0", "rank 0 (broadcast)"))
    buffer = torch.zeros(n, dtype=torch.uint8, device=device)
    if mine and n:
        buffer.copy_(_tensor(data, device))
    dist.broadcast(buffer, src=src, group=group)
    return obj if mine else _decode(_bytes(buffer), "rank 0")


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fp4select.distributed needs torch.distributed initialised "
            "(torch.distributed.init_process_group) before sync/verify"
        )
    return dist


def _receive(
    data: Any, wanted: Iterable[Problem], env: Mapping[str, Any], sel: Selector
) -> list[Decision]:
    """Rank 0's broadcast (parsed JSON), checked record by record; raises ValueError naming
    what is wrong."""
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
            diff = env_difference(decision.env, env, ("on rank 0", "here"))
            raise ValueError(f"rank 0 decided {what} in another environment ({diff})")
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


def _union(gathered: Sequence[Any]) -> dict[Problem, None]:
    """The keys of every rank's message ``{"version", "keys"}`` in rank order; ValueError naming
    the first rank that failed, sent another fp4select version, or a key this rank cannot read."""
    for rank, message in enumerate(gathered):
        if isinstance(message, dict) and isinstance(message.get("error"), str):
            raise ValueError(f"rank {rank}: {message['error']}")
        if not isinstance(message, dict) or not isinstance(message.get("keys"), list):
            raise ValueError(f"rank {rank} sent no list of keys")
        if message.get("version") != __version__:
            raise ValueError(
                f"rank {rank} runs fp4select {message.get('version')!r}, this rank "
                f"{__version__!r}: every rank must run the same version"
            )
    union: dict[Problem, None] = {}
    for rank, message in enumerate(gathered):
        for key in message["keys"]:
            try:
                union.setdefault(Problem.from_json(key), None)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"a key from rank {rank} cannot be read here: {exc}") from None
    return union


def _table_of(message: Any) -> dict[str, list[Any]] | None:
    """A gathered decision table, if it has the shape decision_table() gives."""
    if not isinstance(message, dict):
        return None
    for value in message.values():
        if not (
            isinstance(value, list)
            and len(value) == 3
            and isinstance(value[0], str)
            and (value[1] is None or isinstance(value[1], str))
            and (value[2] is None or isinstance(value[2], dict))
        ):
            return None
    return message


def verify(
    group: Any = None,
    *,
    device: torch.device | str | None = None,
    sel: Selector | None = None,
    error: str | None = None,
) -> str:
    """Check that every rank holds the same decision table (winners and their tactics);
    returns its hash.

    Raises ``RankDisagreementError`` on every rank when the tables differ (naming the first
    differing key) or when any rank passes an ``error`` (used by ``sync``).
    """
    dist = _dist()
    try:
        sel = _selector(sel)
        table = decision_table(environment_for(resolve_device(device)), sel)
        mine: dict[str, Any] = {"digest": table_digest(table), "error": error}
    except Exception as exc:  # still take part: the others must learn it, not wait
        table = {}
        mine = {"digest": "", "error": error or f"{type(exc).__name__}: {exc}"}
    everyone = _all_gather_json(mine, dist, group)
    failures = []
    for rank, message in enumerate(everyone):
        if not isinstance(message, dict) or not (
            message.get("error") is None or isinstance(message.get("error"), str)
        ):
            failures.append((rank, "sent a malformed verdict"))
        elif message.get("error"):
            failures.append((rank, message["error"]))
    if failures:
        raise RankDisagreementError(
            "; ".join(f"rank {r}: {e}" for r, e in failures) + " (no rank may capture graphs)"
        )
    digests = {x.get("digest") for x in everyone}
    if len(digests) == 1:
        return str(digests.pop())
    gathered = _all_gather_json(table, dist, group)
    tables = [_table_of(t) for t in gathered]
    broken = [r for r, t in enumerate(tables) if t is None]
    if broken:
        raise RankDisagreementError(f"rank {broken[0]} sent a malformed decision table")
    full = [t for t in tables if t is not None]
    keys = sorted(set().union(*full), key=lambda k: next(t[k][0] for t in full if k in t))
    for key in keys:
        held = [t.get(key) for t in full]
        chosen = [(h[1], _canonical(h[2])) if h else None for h in held]
        if len(set(chosen)) > 1:
            what = next(h[0] for h in held if h)
            per_rank = ", ".join(
                f"rank {r}: {_served(h) if h else 'no decision'}" for r, h in enumerate(held)
            )
            raise RankDisagreementError(f"ranks disagree on {what}: {per_rank}")
    raise RankDisagreementError("ranks' decision tables hash differently")  # pragma: no cover


def _canonical(tactic: Any) -> str:
    return json.dumps(tactic, sort_keys=True)


def _served(held: Sequence[Any]) -> str:
    """``winner``, with ``at tactic ...`` when it has one."""
    tactic = held[2]
    if not tactic:
        return str(held[1])
    return f"{held[1]} at tactic {_canonical(tactic.get('tactic', tactic))}"


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
    rank, after ``init_process_group`` and before CUDA graphs are captured. A failure on any
    rank raises ``RankDisagreementError`` on every rank, naming it.
    """
    dist = _dist()
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    error: str | None = None
    sel = _selector(sel)
    dev = resolve_device(device)
    tunings_before = sel.counters.tunings
    union: dict[Problem, None] = {}
    env: Mapping[str, Any] = {}
    try:
        env = environment_for(dev)
        keys = list(dict.fromkeys([*held_problems(env, sel), *problems]))
        message: dict[str, Any] = {"version": __version__, "keys": [p.to_json() for p in keys]}
    except Exception as exc:  # told to every rank in the gather below
        message = {"error": f"{type(exc).__name__}: {exc}"}
    gathered = _all_gather_json(message, dist, group)
    try:
        union = _union(gathered)
    except ValueError as exc:
        error = str(exc)
    decided: dict[str, Any] = {"error": "no decisions: a rank failed before rank 0 decided"}
    if rank == 0 and error is None:
        try:
            decisions = [sel.decide(p, dev) for p in union]
            decided = {"decisions": [d.to_json() for d in decisions]}
        except Exception as exc:  # told to every rank, then raised everywhere by verify
            decided = {"error": f"{type(exc).__name__}: {exc}"}
    adopted = 0
    try:
        src = 0 if group is None else dist.get_global_rank(group, 0)  # the group's rank 0
        received = _broadcast_json(decided, src, dist, group)
        if error is None:
            checked = _receive(received, union, env, sel)
            if rank != 0:
                for decision in checked:
                    adopt(decision, sel)
                adopted = len(checked)
                from fp4select.api import reset

                reset()  # runners bound before the sync may be other backends: bind again
    except (ValueError, TypeError) as exc:
        error = error or str(exc)
    agreed = verify(group, device=dev, sel=sel, error=error)
    return SyncReport(
        rank=rank,
        world_size=world,
        keys=len(union),
        adopted=adopted,
        tuned=sel.counters.tunings - tunings_before,
        digest=agreed,
    )
