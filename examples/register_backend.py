"""Add your own FP4 GEMM as a candidate: it competes only where it proves correct.

A backend is a function with flashinfer.mm_fp4's positional order (without `backend`) and a
declaration of what it takes. For the sandbox it must be importable by name, so define it at
module level. Packages can publish backends through the `fp4select.backends` entry point:

    [project.entry-points."fp4select.backends"]
    mine = "my_package.fp4:BACKEND"

    python examples/register_backend.py

It uses a temporary cache, removed at the end: a decision won by `mine` must not land in your
own cache, where a later process without this registration would meet it.
"""

from __future__ import annotations

import tempfile

import torch

import fp4select
from fp4select import formats


def decode_then_matmul(
    a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, nvfp4, pdl
):
    return formats.reference_mm_fp4(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, nvfp4
    )


if __name__ == "__main__":
    # Run as a script this file is __main__, which a sandbox child cannot import; register
    # the function through its importable module name instead.
    import register_backend as this

    scratch = tempfile.TemporaryDirectory(prefix="fp4select-example-")
    fp4select.configure(cache_dir=scratch.name)
    fp4select.register_backend(
        this.decode_then_matmul, name="mine", formats={"nvfp4"}, devices={"cpu", "cuda"}
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = formats.quantize_nvfp4(torch.randn(8, 256, device=device))
    b = formats.quantize_nvfp4(torch.randn(128, 256, device=device))
    alpha = (1.0 / (a.global_scale * b.global_scale)).reshape(1).float()
    record = fp4select.explain(a.data, b.data.T, a.scales, b.scales.T, alpha)
    print("mine:", record["verdicts"]["mine"]["status"], "| winner:", record["winner"])
    fp4select.configure()  # closes the sandbox worker before its folder goes
    scratch.cleanup()
