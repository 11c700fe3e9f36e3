"""One rank of an engine that autotunes under ``set_autotune_process_group`` (two gloo ranks).

``python _tactics_group_worker.py RANK WORLD PORT SCENARIO``; prints one JSON line.

* ``pinned``: rank 0 serves a stored tactic, rank 1 the same backend untuned; then both run
  an op of the engine's own that flashinfer tunes across the group. fp4select's calls must
  join no collective, so that both ranks meet the engine's op's collectives in step.
* ``tune``: rank 0 tunes a key in its own process (in-process isolation) while rank 1 goes
  straight on; fp4select's tuning must not join the group.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tactic_backends as tb
import torch.distributed as dist
from flashinfer import autotuner

from fp4select.backends import flashinfer_tactics as tactics
from fp4select.keys import Problem
from fp4select.validate import make_inputs

PROBLEM = Problem(n=64, k=128, m_bucket=16)


def main() -> None:
    rank, world, port, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    args = make_inputs(PROBLEM, 16, "cpu").args(PROBLEM)
    autotuner.set_autotune_process_group(dist.group.WORLD)
    try:
        if scenario == "pinned":
            tactic = 0 if rank == 0 else None
            record = {"op": "fp4_gemm", "tactic": tactic, "runner": "TwoTacticRunner"}
            served = tb.BACKEND.checked_runner_for(PROBLEM, record)
            with autotuner.autotune(True):  # the engine's warmup
                served(*args)
                tb.fake_mm_fp4(*args)  # the engine's own op: tuned across the group
        else:
            if rank == 0:
                runner = tb.BACKEND.checked_runner_for(PROBLEM)
                record = tactics.tune(runner, PROBLEM, args)
                assert record["tactic"] == 1, record
            assert autotuner.get_autotune_process_group() is dist.group.WORLD
            with autotuner.autotune(True):
                tb.fake_mm_fp4(*args)
        dist.barrier()
    finally:
        autotuner.set_autotune_process_group(None)
    print(json.dumps({"rank": rank, "ran": tb.ran, "profiled": tb.profiled}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
