"""Diagnose the warm path on a GPU: does a repeated call take the identity path? What does each
part of the key cost there? (Prints a few lines; used once on the H200.)"""

from __future__ import annotations

import tempfile
import timeit

import torch

import fp4select
from fp4select import api
from fp4select.keys import Problem
from fp4select.timing import TimingOptions
from fp4select.validate import make_inputs

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
with tempfile.TemporaryDirectory() as cache:
    fp4select.configure(cache_dir=cache, isolation="inprocess", timing=TimingOptions(budget_s=0.1))
    p = Problem(n=256, k=512, m_bucket=8)
    kw = make_inputs(p, 8, device).kwargs(p)
    a, b, ad, bd, al = (kw[k] for k in ("a", "b", "a_descale", "b_descale", "alpha"))
    fp4select.best_mm_fp4(a, b, ad, bd, al)
    slow = []
    real = api._runner_for
    api._runner_for = lambda *x: slow.append(x[0]) or real(*x)
    for _ in range(5):
        fp4select.best_mm_fp4(a, b, ad, bd, al)
    print("slow-path calls of 5:", len(slow), "bound entries:", len(api._bound))
    if slow:
        print("a key that missed:", slow[0])
        print("bound keys:", list(api._bound))
    g = {"a": a, "ad": ad, "b": b, "al": al, "id": id}
    for stmt in ("a.shape", "a.dtype", "a.device", "ad.shape", "ad.device", "id(b)", "al.dtype"):
        t = min(timeit.repeat(stmt, globals=g, number=100000, repeat=5)) / 100000 * 1e9
        print(f"{stmt:10s} {t:6.0f} ns")
