"""Time fp4select's NVFP4 activation quantizer (the Triton kernel) against the GEMM it feeds.

The engines' W4A4 path on Hopper quantizes every linear layer's input before its GEMM; the
issue's target is a quantizer costing at most 10% of the GEMM at M <= 16. For each layer shape
and M this times, with CUDA events over CUDA-graph replays (launch overhead out, as engines
run decode): the quantizer alone, ``best_mm_fp4`` on the quantized operands (tuned first), and
the bf16 GEMM of a bf16 weight of that shape (cuBLAS), and checks the
kernel's bytes against the PyTorch path. Needs a CUDA GPU, torch and triton (no flashinfer).

    python3 benchmarks/bench_quant.py            # table + benchmarks/results/bench_quant_cuda.json
"""

from __future__ import annotations

import argparse
import tempfile

import _common
import torch

import fp4select
from fp4select import formats, timing
from fp4select import quantize as q

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1280, 8192), (8192, 3584)]
MS = [1, 4, 16, 64, 256, 2048]


def graph_us(fn, replays: int = 200) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph (20 runs of N)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm (compile, tune) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays // 10):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / replays)
    return sorted(times)[len(times) // 2]


def measure(n: int, k: int, m: int) -> dict:
    g = torch.Generator().manual_seed(n + k + m)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16).cuda()
    qw = formats.quantize_nvfp4(w, None, "128x4")
    gs = (448.0 * 6.0 / x.abs().max().float()).reshape(1)
    alpha = (1.0 / (gs * qw.global_scale)).float()
    a, a_sf = q.fp4_quantize(x, gs)
    ref_a, ref_sf = q.quantize_torch(x, gs)
    exact = torch.equal(a, ref_a) and torch.equal(a_sf.view(torch.uint8), ref_sf.view(torch.uint8))
    fp4select.best_mm_fp4(a, qw.data.T, a_sf, qw.scales.T, alpha)  # tune on the default stream
    torch.cuda.synchronize()
    quant = graph_us(lambda: q.fp4_quantize(x, gs))
    gemm = graph_us(lambda: fp4select.best_mm_fp4(a, qw.data.T, a_sf, qw.scales.T, alpha))
    bf16 = graph_us(lambda: x @ w.T)  # same shape and dtype as the dequantized weight
    winner = fp4select.explain(a, qw.data.T, a_sf, qw.scales.T, alpha).get("winner")
    return {
        "n": n,
        "k": k,
        "m": m,
        "quantize_us": quant,
        "gemm_us": gemm,
        "gemm_winner": winner,
        "bf16_us": bf16,
        "quantize_share_of_gemm": quant / gemm,
        "bytes_equal_torch_path": exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="*", default=MS)
    parser.add_argument("--budget-s", type=float, default=0.3, help="tuning budget per problem")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant needs a CUDA GPU")
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as cache:
        fp4select.configure(
            cache_dir=cache,
            isolation="inprocess",
            timing=timing.TimingOptions(budget_s=args.budget_s),
        )
        results = [measure(n, k, m) for n, k in SHAPES for m in args.ms]
    rows = [
        [
            f"{r['n']} x {r['k']}",
            r["m"],
            f"{r['quantize_us']:.2f}",
            f"{r['gemm_us']:.2f}",
            r["gemm_winner"],
            f"{r['bf16_us']:.2f}",
            f"{100 * r['quantize_share_of_gemm']:.1f}%",
            "yes" if r["bytes_equal_torch_path"] else "NO",
        ]
        for r in results
    ]
    header = ["N x K", "M", "quant us", "W4A4 GEMM us", "winner", "bf16 us", "quant/GEMM", "exact"]
    print(_common.table(rows, header))
    small = [r["quantize_share_of_gemm"] for r in results if r["m"] <= 16]
    if small:
        print(f"quantizer share of the GEMM at M <= 16: worst {100 * max(small):.1f}% (target 10%)")
    path = _common.write("bench_quant", device, {"results": results, "budget_s": args.budget_s})
    print(f"wrote {path}")
    if not all(r["bytes_equal_torch_path"] for r in results):
        raise SystemExit("the Triton quantizer's bytes differ from the PyTorch path")


if __name__ == "__main__":
    main()
