"""The warp-specialized Gluon kernel (benchmarks/hopper_ws.py) against the exact reference, on a
CUDA GPU: small and odd shapes, both a-scale layouts, three alpha kinds; an experiment.

Usage: python benchmarks/hopper_ws_check.py [--pingpong]   (--pingpong: mma_pp too)"""

import sys

import torch

sys.path.insert(0, "benchmarks")
import hopper_sweep as hs

from fp4select import validate
from fp4select.keys import Problem, m_bucket

for n, k, m, bn, bt, st, alpha, layout in [
    (256, 256, 64, 128, 64, 4, "none", "128x4"),
    (4096, 4096, 256, 128, 128, 4, "per_token", "128x4"),
    (520, 2080, 130, 128, 128, 3, "scalar", "8x4"),
    (4096, 4096, 200, 64, 128, 4, "per_token", "8x4"),
    (4096, 4096, 64, 64, 64, 4, "none", "128x4"),
]:
    p = Problem(n=n, k=k, m_bucket=m_bucket(m), alpha_kind=alpha, a_sf_layout=layout)
    inp = validate.make_inputs(p, m, "cuda", seed=m)
    forms = ("ws", "smem", "pp") if "--pingpong" in sys.argv else ("ws", "smem")
    for form in forms:  # pp: see hopper_ws.mma_pp
        pp = form == "pp"
        try:
            out = hs.run_ws(
                *inp.args(p), bn=128 if pp else bn, bt=bt, stages=min(st, 3), pingpong=pp,
                smem=form == "smem",
            )  # fmt: skip
        except Exception as exc:  # print the compiler's own words, then go on
            print("".join(line for line in str(exc).splitlines(True) if "error" in line)[-1500:])
            continue
        torch.cuda.synchronize()
        r = validate.check(out, inp, p.torch_out_dtype)
        verdict = "ok" if r.ok else f"BAD {r.reason}"
        print(n, k, m, bn, bt, st, alpha, layout, form, verdict, flush=True)
