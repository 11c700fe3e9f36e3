"""FLOOR EXPERIMENT: hopper-ws's tactics timed as they ship and with FP4SELECT_WS_NO_DECODE set
(the weight's words copied into the MMA operand undecoded: wrong outputs), to see how much of
the time the decode costs. Prints one JSON line per point."""

import functools
import json
import os

import torch

from fp4select import timing, validate
from fp4select.backends import hopper_configs, triton_hopper
from fp4select.keys import Problem, m_bucket
from fp4select.timing import TimingOptions

OPT = TimingOptions(budget_s=0.12, min_rounds=5, max_rounds=15)
dev = torch.device("cuda")
for n, k in [(8192, 8192), (28672, 4096), (4096, 14336), (16384, 6656), (4608, 7168)]:
    for m in (128, 256, 512, 2048):
        p = Problem(n=n, k=k, m_bucket=m_bucket(m))
        first = validate.make_inputs(p, m, dev, seed=11, with_reference=False)
        nbytes = first.nbytes() + m * n * 2
        sets = [first] + [
            validate.make_inputs(p, m, dev, seed=11 + i, with_reference=False)
            for i in range(1, timing.input_sets_for_cold_l2(dev, nbytes, True))
        ]
        calls = {}
        for c in hopper_configs.candidates("ws", m):
            name = "ws " + " ".join(map(str, c.__dict__.values()))
            calls[name] = [functools.partial(triton_hopper.run_ws, *s.args(p), cfg=c) for s in sets]
        for fn in calls.values():
            fn[0]()
        torch.cuda.synchronize()
        t, _ = timing.time_interleaved(calls, dev, OPT)
        print(
            json.dumps(
                {
                    "no_decode": os.environ.get("FP4SELECT_WS_NO_DECODE") is not None,
                    "n": n,
                    "k": k,
                    "m": m,
                    "us": {nm: round(v.median_us, 2) for nm, v in t.items()},
                }
            ),
            flush=True,
        )
