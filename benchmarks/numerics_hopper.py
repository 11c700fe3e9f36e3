"""W4A4 (fp4select on Hopper, Blackwell's numbers) against W4A16 (the engines' Marlin fallback).

For real layer shapes (Llama-3.1-8B's four linears, and two of Llama-3.1-70B at TP 8) with
realistic activations, compares each path's output with the product of the bf16 activations
and the dequantized NVFP4 weight, computed in float64. Runs on the CPU with fp4select's
emulation (the numbers do not depend on the kernel: every fp4select backend is proven against
the same exact product):

* W4A16: bf16 activations x dequantized weight, float32 accumulation, bf16 output (Marlin).
* W4A4: activations quantized to NVFP4 with a static input scale calibrated on another batch
  (as ModelOpt calibrates ``input_scale``), by fp4select's quantizer (flashinfer's recipe),
  then the exact FP4 product, bf16 output (fp4select on Hopper; flashinfer on Blackwell).

Activations: the residual stream's shape of outliers (a few channels 20-100x the rest) for the
qkv/gate_up inputs, a SwiGLU product (heavy tails) for down_proj, attention outputs (Gaussian)
for o_proj. Weights: Gaussian with per-row spread, quantized with ModelOpt's recipe. Output
rows are subsampled to ``--rows`` per layer (the error is a per-element statistic).

    python benchmarks/numerics_hopper.py            # table + benchmarks/results/numerics_hopper_cpu.json
"""

from __future__ import annotations

import argparse

import _common
import torch

from fp4select import formats
from fp4select.quantize import quantize_torch

# (model, layer, N, K, activation kind)
LAYERS = [
    ("Llama-3.1-8B", "qkv_proj", 6144, 4096, "residual"),
    ("Llama-3.1-8B", "o_proj", 4096, 4096, "attention"),
    ("Llama-3.1-8B", "gate_up_proj", 28672, 4096, "residual"),
    ("Llama-3.1-8B", "down_proj", 4096, 14336, "swiglu"),
    ("Llama-3.1-70B TP8", "qkv_proj", 1280, 8192, "residual"),
    ("Llama-3.1-70B TP8", "down_proj", 8192, 3584, "swiglu"),
]


def activations(kind: str, m: int, k: int, g: torch.Generator) -> torch.Tensor:
    if kind == "swiglu":
        gate = torch.randn(m, k, generator=g) * 1.5
        up = torch.randn(m, k, generator=g)
        x = torch.nn.functional.silu(gate) * up
    elif kind == "attention":
        x = torch.randn(m, k, generator=g) * 0.5
    else:
        channel = torch.exp(torch.randn(k, generator=g) * 0.5)
        outliers = torch.randperm(k, generator=g)[: max(1, k // 256)]
        channel[outliers] *= 20 + 80 * torch.rand(outliers.numel(), generator=g)
        x = torch.randn(m, k, generator=g) * channel
    return x.to(torch.bfloat16)


def weight(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    rows = torch.exp(torch.randn(n, 1, generator=g) * 0.3)
    return (torch.randn(n, k, generator=g) * 0.02 * rows).to(torch.bfloat16)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def measure(layer: tuple, m: int, rows: int, seed: int) -> dict:
    model, name, n, k, kind = layer
    g = torch.Generator().manual_seed(seed)
    w = weight(min(n, rows), k, g)
    qw = formats.quantize_nvfp4(w, None, "linear")
    sf = qw.scales.float().repeat_interleave(16, dim=1)
    w_deq = formats.e2m1_decode(formats.unpack_nibbles(qw.data)).double() * sf / qw.global_scale
    calibration = activations(kind, 4 * m, k, g)  # ModelOpt's static input_scale
    x = activations(kind, m, k, g)
    gs_x = (448.0 * 6.0 / calibration.abs().max().float()).reshape(1)
    ref = x.double() @ w_deq.T  # bf16 activations x dequantized weight
    ref_bf16_weight = x.double() @ w.double().T
    w4a16 = (x.float() @ w_deq.float().T).to(torch.bfloat16)
    a, a_sf = quantize_torch(x, gs_x)
    alpha = (1.0 / (gs_x * qw.global_scale)).float()
    w4a4 = formats.reference_mm_fp4(
        a, qw.data.T, a_sf, formats.swizzle_sf(qw.scales, "128x4").T, alpha, torch.bfloat16
    )
    clipped = float((x.abs().float() > calibration.abs().max().float()).float().mean())
    return {
        "model": model,
        "layer": name,
        "n": n,
        "k": k,
        "rows_measured": w.shape[0],
        "m": m,
        "activations": kind,
        "w4a16_vs_dequantized": rel(w4a16, ref),
        "w4a4_vs_dequantized": rel(w4a4, ref),
        "w4a16_vs_bf16_weight": rel(w4a16, ref_bf16_weight),
        "w4a4_vs_bf16_weight": rel(w4a4, ref_bf16_weight),
        "activations_above_calibrated_amax": clipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=32, help="tokens per GEMM (default 32)")
    parser.add_argument("--rows", type=int, default=2048, help="output rows per layer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = [measure(layer, args.m, args.rows, args.seed + i) for i, layer in enumerate(LAYERS)]
    header = [
        "model",
        "layer",
        "N x K",
        "W4A16 vs deq",
        "W4A4 vs deq",
        "W4A16 vs bf16 W",
        "W4A4 vs bf16 W",
    ]
    rows = [
        [
            r["model"],
            r["layer"],
            f"{r['n']} x {r['k']}",
            f"{100 * r['w4a16_vs_dequantized']:.3f}%",
            f"{100 * r['w4a4_vs_dequantized']:.2f}%",
            f"{100 * r['w4a16_vs_bf16_weight']:.2f}%",
            f"{100 * r['w4a4_vs_bf16_weight']:.2f}%",
        ]
        for r in results
    ]
    print(_common.table(rows, header))
    print(f"(normwise relative error ||out - ref|| / ||ref||; M = {args.m} tokens)")
    path = _common.write(
        "numerics_hopper",
        torch.device("cpu"),
        {"m": args.m, "rows": args.rows, "seed": args.seed, "results": results},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
