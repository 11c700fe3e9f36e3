"""A separate process that registers test backends, makes one call, and reports as JSON.

Usage: python _selector_worker.py CACHE_DIR M BACKEND[,BACKEND...]
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fake_backends
import injected_timing

import fp4select
from fp4select.keys import Problem
from fp4select.timing import TimingOptions
from fp4select.validate import check, make_inputs

injected_timing.install_from_environment()
cache, m, names = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
fp4select.configure(
    cache_dir=cache, isolation="inprocess", timing=TimingOptions(budget_s=0.05, min_rounds=3)
)
for name in names:
    if name:
        fp4select.register_backend(getattr(fake_backends, name), name=name, devices={"cpu"})
problem = Problem(n=64, k=128, m_bucket=fp4select.m_bucket(m))
inputs = make_inputs(problem, m, "cpu")
out = fp4select.best_mm_fp4(**inputs.kwargs(problem))
record = fp4select.explain(problem=problem, device="cpu", tune=False)
print(
    json.dumps(
        {
            "ok": check(out, inputs, problem.torch_out_dtype).ok,
            "winner": record["winner"],
            "stats": fp4select.stats(),
            "pid": os.getpid(),
        }
    )
)
