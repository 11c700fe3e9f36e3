"""Diagnose the warm path on this machine: does a repeated call take the identity path, and what
does each property the warm key reads cost on this device's tensors? (Prints a few lines.)

    python benchmarks/diag_warm_path.py --device cuda
"""

from __future__ import annotations

import argparse
import tempfile
import timeit

import torch

import fp4select
from fp4select import api
from fp4select.keys import Problem
from fp4select.timing import TimingOptions
from fp4select.validate import make_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args().device)
    with tempfile.TemporaryDirectory() as cache:
        fp4select.configure(
            cache_dir=cache, isolation="inprocess", timing=TimingOptions(budget_s=0.1)
        )
        p = Problem(n=256, k=512, m_bucket=8)
        kw = make_inputs(p, 8, device).kwargs(p)
        a, b, ad, bd, al = (kw[k] for k in ("a", "b", "a_descale", "b_descale", "alpha"))
        fp4select.best_mm_fp4(a, b, ad, bd, al)
        slow = []
        real = api._runner_for
        api._runner_for = lambda *x: slow.append(x[0]) or real(*x)
        for _ in range(5):
            fp4select.best_mm_fp4(a, b, ad, bd, al)
        api._runner_for = real
        print(f"slow-path calls of 5: {len(slow)}; identity entries {len(api._bound)}")
        w = b.t()
        g = {"a": a, "ad": ad, "b": b, "w": w, "id": id}
        for stmt in (
            "a.shape",
            "a.size()",
            "a.dtype",
            "a.device",
            "a.is_contiguous()",
            "ad.numel()",
            "id(b)",
            "b._base",
            "b.stride()",
            "w.t()",
            "(a.shape, a.dtype, a.device, a.is_contiguous(), ad.numel(), ad.dtype, ad.device)",
        ):
            t = min(timeit.repeat(stmt, globals=g, number=20000, repeat=7)) / 20000 * 1e9
            print(f"{t:7.0f} ns  {stmt}")


if __name__ == "__main__":
    main()
