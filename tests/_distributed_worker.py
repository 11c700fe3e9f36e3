"""One rank of a test job for fp4select.distributed (run by tests/test_distributed.py).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch's env:// init), BACKEND (gloo
or nccl), SCENARIO, OUT (a folder; this rank writes OUT/rank<r>.json).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import fp4select
from fp4select import distributed
from fp4select.keys import Problem, environment_for
from fp4select.probe import Verdict
from fp4select.selector import Decision
from fp4select.timing import TimingOptions

sys.path.insert(0, str(Path(__file__).parent))

FAST = TimingOptions(budget_s=0.02, min_rounds=3, max_rounds=20, target_sample_s=1e-4)


def gemm(n: int, m: int, device: torch.device) -> None:
    from fp4select import formats

    x, w = torch.randn(m, 128, device=device), torch.randn(n, 128, device=device)
    a, b = formats.quantize_nvfp4(x), formats.quantize_nvfp4(w)
    alpha = (1.0 / (a.global_scale * b.global_scale)).reshape(1).float()
    fp4select.best_mm_fp4(a.data, b.data.T, a.scales, b.scales.T, alpha, torch.bfloat16)


class Evil:
    """What a hostile rank sends: unpickling it runs a command."""

    def __init__(self, mark: str) -> None:
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


def main() -> None:
    backend = os.environ.get("BACKEND", "gloo")
    scenario = os.environ["SCENARIO"]
    out = Path(os.environ["OUT"])
    rank = int(os.environ["RANK"])
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    from datetime import timedelta

    # PG_TIMEOUT: how long a rank waits in a collective (a test of "every rank learns of a
    # failure within seconds" sets it short, so a hang fails the test instead of stalling it).
    timeout = timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "1800")))
    dist.init_process_group(backend, timeout=timeout)
    sel = fp4select.configure(
        cache_dir=out / f"cache-{rank}",
        isolation=os.environ.get("ISOLATION", "inprocess"),
        timing=FAST,
    )
    env = environment_for(device)
    result: dict = {"rank": rank}
    try:
        if scenario == "sync":
            if rank == 0:  # a key rank 0 already holds
                sel.decide(Problem(n=32, k=128, m_bucket=1), device)
            mine = Problem(n=64 * (rank + 1), k=128, m_bucket=4)
            report = distributed.sync(problems=[mine], device=device)
            result["report"] = report.__dict__
            result["table"] = distributed.decision_table(env)
            result["records"] = {
                d.problem.digest(): {k: v for k, v in d.to_json().items() if k != "source"}
                for d in sel.decisions(env)
            }
            result["sources"] = sorted({d.source for d in sel.decisions(env)})
            gemm(64 * (rank + 1), 3, device)  # the adopted decision serves: no tuning here
            result["tunings_after_call"] = sel.counters.tunings
            result["entries_on_disk"] = len(list(sel.store.iter_entries(None)))
        elif scenario == "disagree":
            problem = Problem(n=64, k=128, m_bucket=4)
            agreed = Problem(n=32, k=128, m_bucket=1)
            distributed.adopt(Decision(agreed, dict(env), "emulation", {}), sel)
            winner = "emulation" if rank == 0 else "other"
            distributed.adopt(Decision(problem, dict(env), winner, {}), sel)
            try:
                distributed.verify(device=device)
                result["error"] = None
            except distributed.RankDisagreementError as exc:
                result["error"] = str(exc)
        elif scenario == "refuse":
            problem = Problem(n=64, k=128, m_bucket=4)
            if rank == 0:
                import fake_backends

                fp4select.register_backend(fake_backends.fast, name="fast", devices={"cpu", "cuda"})
                passed = {"fast": Verdict("fast", "passed")}
                distributed.adopt(
                    Decision(problem, dict(env), "fast", passed, considered=["fast"]), sel
                )
            try:
                distributed.sync(problems=[problem], device=device)
                result["error"] = None
            except distributed.RankDisagreementError as exc:
                result["error"] = str(exc)
        elif scenario in ("hostile", "skew", "unreadable"):
            import pickle
            import time
            import types

            if rank == 1 and scenario == "hostile":  # sends a pickle where JSON belongs
                evil = pickle.dumps(Evil(str(out / "pwned")))
                distributed._encode = lambda obj: evil
                original = dist.all_gather_object

                def all_gather_object(objects, obj, group=None):  # the old wire
                    return original(objects, Evil(str(out / "pwned")), group=group)

                dist.all_gather_object = all_gather_object
            if rank == 1 and scenario == "skew":
                distributed.__version__ = "0.0.1+other"
            if rank == 0 and scenario == "unreadable":  # rank 0 cannot read the others' keys

                def from_json(data):
                    raise ValueError("unknown field 'layout2'")

                distributed.Problem = types.SimpleNamespace(from_json=from_json)
            problem = Problem(n=64 * (rank + 1), k=128, m_bucket=4)
            started = time.monotonic()
            try:
                distributed.sync(problems=[problem], device=device)
                result["error"] = None
            except distributed.RankDisagreementError as exc:
                result["error"] = str(exc)
            result["seconds"] = time.monotonic() - started
        elif scenario == "tactics":  # one winner, two tactics
            from fp4select.records import Status

            problem = Problem(n=64, k=128, m_bucket=4)
            tactic = {"tactic": rank, "default": 0}
            passed = {"emulation": Verdict("emulation", Status.PASSED, detail={"tactic": tactic})}
            distributed.adopt(Decision(problem, dict(env), "emulation", passed), sel)
            try:
                distributed.verify(device=device)
                result["error"] = None
            except distributed.RankDisagreementError as exc:
                result["error"] = str(exc)
        else:
            raise SystemExit(f"unknown SCENARIO {scenario!r}")
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
