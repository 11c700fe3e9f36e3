"""Quantise two matrices to NVFP4 and multiply them with the backend fp4select picks.

Runs anywhere: on a CPU or a GPU without FP4 tensor cores the winner is `emulation`; on
Blackwell it is whichever flashinfer backend proved fastest *and* correct there.

    python examples/quickstart.py

A try-out leaves no trace: its decisions go to a temporary folder, removed at the end. In
your own code leave the `configure` line out and they persist in the user cache.
"""

from __future__ import annotations

import tempfile

import torch

import fp4select
from fp4select import formats

scratch = tempfile.TemporaryDirectory(prefix="fp4select-example-")
fp4select.configure(cache_dir=scratch.name)

device = "cuda" if torch.cuda.is_available() else "cpu"
m, n, k = 37, 512, 1024
x = torch.randn(m, k, device=device)
w = torch.randn(n, k, device=device)

a = formats.quantize_nvfp4(x)  # activations: 128x4 scales
b = formats.quantize_nvfp4(w)  # weight (N, K): passed transposed, as flashinfer takes it
alpha = (1.0 / (a.global_scale * b.global_scale)).reshape(1).float()

out = fp4select.best_mm_fp4(a.data, b.data.T, a.scales, b.scales.T, alpha, torch.bfloat16)

exact = x @ w.T
print(
    f"relative error vs. the unquantised product: {float((out.float() - exact).norm() / exact.norm()):.3f}"
)
record = fp4select.explain(a.data, b.data.T, a.scales, b.scales.T, alpha, torch.bfloat16)
print(f"chosen backend: {record['winner']} (decision {record['origin']} in this process)")
for name, verdict in sorted(record["verdicts"].items()):
    print(f"  {name:20s} {verdict['status']:12s} {verdict['reason'][:70]}")
fp4select.configure()  # closes the sandbox worker before the folder goes
scratch.cleanup()
