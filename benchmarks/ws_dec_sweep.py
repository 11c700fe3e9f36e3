"""EXPERIMENT: ws_dec (decoder partition) beside hopper-ws's tactics and bf16 cuBLAS."""

import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch
import ws_dec

from fp4select import formats, timing, validate
from fp4select.backends import hopper_configs, triton_hopper
from fp4select.keys import Problem, m_bucket
from fp4select.timing import TimingOptions

OPT = TimingOptions(budget_s=0.12, min_rounds=5, max_rounds=15)
dev = torch.device("cuda")
D2 = dict(decoders=2, launch_regs=96, dec_regs=96, cons_regs=136)
VARIANTS = {
    "dec2 128x128 s3 a3 i1": dict(bn=128, bt=128, stages=3, astages=3, inflight=1, **D2),
    "dec2 128x128 s4 a2 i1": dict(bn=128, bt=128, stages=4, astages=2, inflight=1, **D2),
    "dec1 128x128 s3 a3 i1": dict(bn=128, bt=128, stages=3, astages=3, inflight=1),
    "dec2 128x64 s4 a3 i1": dict(bn=128, bt=64, stages=4, astages=3, inflight=1, **D2),
}
shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[1].split(",")]
ms = [int(x) for x in sys.argv[2].split(",")]
t0 = time.time()
for n, k in shapes:
    for m in ms:
        if time.time() - t0 > float(sys.argv[3]):
            break
        p = Problem(n=n, k=k, m_bucket=m_bucket(m))
        first = validate.make_inputs(p, m, dev, seed=11, with_reference=m * n * k <= 2**34)
        verdict = {}
        calls0 = {}
        for name, kw in VARIANTS.items():
            try:
                out = ws_dec.run_ws_dec(*first.args(p), **kw)
                torch.cuda.synchronize()
                if first.ref.numel():
                    res = validate.check(out, first, p.torch_out_dtype)
                    verdict[name] = "ok" if res.ok else "WRONG " + res.reason[:100]
                    if not res.ok:
                        continue
                else:
                    verdict[name] = "unchecked"
                calls0[name] = kw
            except Exception as exc:
                verdict[name] = f"error {type(exc).__name__}: {str(exc)[:200]}"
        nbytes = first.nbytes() + m * n * 2
        sets = [first] + [
            validate.make_inputs(p, m, dev, seed=11 + i, with_reference=False)
            for i in range(1, timing.input_sets_for_cold_l2(dev, nbytes, True))
        ]
        calls = {}
        for c in hopper_configs.candidates("ws", m):
            calls["ws " + " ".join(map(str, c.__dict__.values()))] = [
                functools.partial(triton_hopper.run_ws, *s.args(p), cfg=c) for s in sets
            ]
        for name, kw in calls0.items():
            calls[name] = [functools.partial(ws_dec.run_ws_dec, *s.args(p), **kw) for s in sets]
        dq = []
        for s in sets[:4]:
            a = formats.dequantize(s.a, s.a_descale, k, use_nvfp4=True, sf_layout="128x4")
            w = formats.dequantize(s.b.T, s.b_descale.T, k, use_nvfp4=True, sf_layout="128x4")
            dq.append((a.to(torch.bfloat16), w.to(torch.bfloat16)))
        calls["bf16"] = [functools.partial(torch.mm, a, w.T) for a, w in dq]
        t, _ = timing.time_interleaved(calls, dev, OPT)
        us = {nm: round(v.median_us, 2) for nm, v in t.items()}
        bws = min(v for kk, v in us.items() if kk.startswith("ws"))
        bdec = min((v for kk, v in us.items() if kk.startswith("dec")), default=float("nan"))
        print(json.dumps({"n": n, "k": k, "m": m, "us": us, "verdicts": verdict}), flush=True)
        print(
            f"# {n}x{k} M={m} bf16={us['bf16']} ws={bws} ({bws / us['bf16']:.3f}) dec={bdec} ({bdec / us['bf16']:.3f}) dec/ws={bdec / bws:.3f} {verdict}",
            flush=True,
        )
