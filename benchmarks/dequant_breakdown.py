"""Where the decode-then-GEMM candidates spend their time at large M, on a GPU, in one run.

For each shape and M (512, 2048, 4096), timed side by side (CUDA-graph replay, L2 kept cold):
bf16 cuBLAS on decoded operands (``bf16``), ``torch-dequant`` and ``hopper-dequant`` whole,
and their parts: the decode of the weight (``decode_b``) and of a (``decode_a``), cuBLAS into
float32 (``mm_f32``) and the pass that applies alpha to it (``alpha_pass``, torch.mul), and the
TMA GEMM that applies alpha itself (``tma_gemm``, ``_triton_kernels.mm_tma_alpha``). It says
what is left of the gap to bf16: ``hopper-dequant`` = decode_b + decode_a + tma_gemm.

    python benchmarks/dequant_breakdown.py

Writes ``benchmarks/results/dequant_breakdown_cuda.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch
from _common import table, write

from fp4select import timing, validate
from fp4select.backends import dequant, hopper_configs, triton_fp4
from fp4select.keys import Problem, m_bucket
from fp4select.timing import TimingOptions

SHAPES = [(8192, 8192), (28672, 4096), (4096, 14336)]
MS = [512, 2048, 4096]
OPTIONS = TimingOptions(budget_s=0.1, min_rounds=5, max_rounds=12)


def tma_gemm(x: torch.Tensor, w: torch.Tensor, alpha: torch.Tensor, out: torch.Tensor) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, n = out.shape
    sms = triton_fp4._sms(x.device)
    bm, bn, bk, warps, stages = dataclasses.astuple(hopper_configs.dequant_tile(m, n, sms))
    grid = min(sms, -(-m // bm) * -(-n // bn))
    triton_fp4.kernels().mm_tma_alpha[(grid,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w, [bn, bk]),
        alpha, out, m, n, x.shape[1], out.stride(0), out.stride(1), 1.0,
        ALPHA=2, BM=bm, BN=bn, BK=bk, GROUP=8, UPCAST=False,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _weight_scales(s: validate.ProbeInputs) -> torch.Tensor:
    return s.b_descale.T if s.b_descale.dim() == 2 else s.b_descale


def point(n: int, k: int, m: int, device: torch.device) -> dict:
    problem = Problem(n=n, k=k, m_bucket=m_bucket(m))
    sets = [
        validate.make_inputs(problem, m, device, seed=3 + i, with_reference=False) for i in (0, 1)
    ]
    ops = []  # per set: (inputs, decoded a, decoded weight, float32 product, bf16 out)
    for s in sets:
        c = triton_fp4.check_call(*s.args(problem)[:10])
        x = torch.empty((m, k), dtype=torch.bfloat16, device=device)
        w = torch.empty((n, k), dtype=torch.bfloat16, device=device)
        dequant._decode_into(w, s.b.T, _weight_scales(s), True, "128x4")
        dequant._decode_into(x, s.a, c.a_descale, True, "128x4")
        f32 = torch.empty((m, n), dtype=torch.float32, device=device)
        ops.append((s, c, x, w, f32, torch.empty((m, n), dtype=torch.bfloat16, device=device)))
    mm_f32 = torch.ops.aten.mm.dtype_out
    calls = {
        "bf16": [functools.partial(torch.mm, x, w.T, out=o) for _, _, x, w, _, o in ops],
        "torch-dequant": [functools.partial(dequant.run_torch, *s.args(problem)) for s in sets],
        "hopper-dequant": [functools.partial(dequant.run_hopper, *s.args(problem)) for s in sets],
        "decode_b": [
            functools.partial(dequant._decode_into, w, s.b.T, _weight_scales(s), True, "128x4")
            for s, _, _, w, _, _ in ops
        ],
        "decode_a": [
            functools.partial(dequant._decode_into, x, s.a, c.a_descale, True, "128x4")
            for s, c, x, _, _, _ in ops
        ],
        "mm_f32": [
            functools.partial(mm_f32, x, w.T, torch.float32, out=f) for _, _, x, w, f, _ in ops
        ],
        "alpha_pass": [functools.partial(torch.mul, f, s.alpha, out=o) for s, _, _, _, f, o in ops],
        "tma_gemm": [functools.partial(tma_gemm, x, w, s.alpha, o) for s, _, x, w, _, o in ops],
    }
    times, method = timing.time_interleaved(calls, device, OPTIONS)
    return {
        "n": n,
        "k": k,
        "m": m,
        "us": {nm: t.median_us for nm, t in times.items()},
        "method": method,
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    device = torch.device("cuda")
    rows = []
    for n, k in SHAPES:
        for m in MS:
            rows.append(point(n, k, m, device))
            torch.cuda.empty_cache()
    names = list(rows[0]["us"])
    print(
        table(
            [[f"{r['n']}x{r['k']}", r["m"]] + [f"{r['us'][nm]:.1f}" for nm in names] for r in rows],
            ["N x K", "M", *names],
        )
    )
    name = "dequant_breakdown_" + torch.cuda.get_device_name(device).split()[-1].lower()
    print(
        "wrote",
        write(
            name,
            device,
            {"benchmark": "dequant_breakdown", "timing": OPTIONS.to_json(), "rows": rows},
        ),
    )


if __name__ == "__main__":
    main()
