"""The engines' W4A4 path on a GPU, without an engine: fp4select's activation quantizer (the
Triton kernel) and the layer (quantize + ``best_mm_fp4``) at real layer shapes.

Skipped where no CUDA device is visible. Needs torch and triton only (no flashinfer, no
engine): ``PYTHONPATH=. python3 -m pytest -m gpu tests/test_hopper_gpu.py``. The quantizer's
speed is measured by benchmarks/bench_gpu.py (against the GEMM) and quant_sweep.py (tilings).
"""

from __future__ import annotations

import pytest
import torch

import fp4select
from fp4select import formats, timing
from fp4select import quantize as q
from fp4select.integrations import _layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (N, K) of Llama-3.1-8B (qkv, o, gate_up, down) and of Llama-3.1-70B at TP 8 (qkv, down).
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1280, 8192), (8192, 3584)]
MS = [1, 16, 128, 1000]


def _activations(m: int, k: int, seed: int, device="cuda") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, k)[torch.randperm(k, generator=g)]
    x[:, torch.randperm(k, generator=g)[: max(1, k // 64)]] *= 60.0
    return x.to(torch.bfloat16).to(device)


def _layer_weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[torch.randperm(n, generator=g)[: n // 100]] *= 8.0
    w = w.to(torch.bfloat16).cuda()
    qw = formats.quantize_nvfp4(w, None, "linear")  # linear scales, as the checkpoint has them
    weight_scale_2 = (1.0 / qw.global_scale).reshape(1).float()
    return qw.data, qw.scales, weight_scale_2


@pytest.fixture
def gpu_selector(tmp_path):
    sel = fp4select.configure(
        cache_dir=tmp_path, isolation="inprocess", timing=timing.TimingOptions(budget_s=0.05)
    )
    yield sel
    fp4select.configure(cache_dir=tmp_path, isolation="inprocess")


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k", sorted({k for _, k in SHAPES}))
def test_the_triton_quantizer_equals_the_torch_path_byte_for_byte(m, k):
    x = _activations(m, k, seed=m + k)
    for factor in (1.0, 4.0, 1e-3):  # calibrated, saturating scales, subnormal scales
        gs = (448.0 * 6.0 / x.abs().max().float() * factor).reshape(1)
        a, a_sf = q.fp4_quantize(x, gs)
        assert a.is_cuda and a_sf.is_cuda
        ref_a, ref_sf = q.quantize_torch(x.cpu(), gs.cpu())
        assert torch.equal(a.cpu(), ref_a)
        assert torch.equal(a_sf.view(torch.uint8).cpu(), ref_sf.view(torch.uint8))
        # The PyTorch path on the GPU agrees too (float32 division is correctly rounded there).
        gpu_a, gpu_sf = q.quantize_torch(x, gs)
        assert torch.equal(gpu_a, a) and torch.equal(
            gpu_sf.view(torch.uint8), a_sf.view(torch.uint8)
        )


# Every code path of the kernel: the tables' tiles, the kernel before them, split and paired
# loads, padding rows by programs of their own and by tiles, tiles larger and smaller than M.
TILINGS = sorted(
    {cfg for _, cfg in q.QUANT_BY_M + q.QUANT_BEFORE}
    | {
        q.QuantConfig(1, 16, 1),
        q.QuantConfig(1, 32, 2),
        q.QuantConfig(2, 16, 4, split=False),
        q.QuantConfig(8, 32, 1),
        q.QuantConfig(16, 4, 4, pad_programs=False),
    },
    key=lambda c: c.label,
)


@pytest.mark.parametrize("cfg", TILINGS, ids=lambda c: c.label.replace(" ", "-"))
@pytest.mark.parametrize("m", [1, 3, 16, 130])
def test_every_tiling_writes_every_output_byte_as_the_torch_path(monkeypatch, cfg, m):
    k = 4112  # K/16 = 257: padding scale columns as well as padding rows
    x = _activations(m, k, seed=m)
    gs = (448.0 * 6.0 / x.abs().max().float()).reshape(1)
    ref_a, ref_sf = q.quantize_torch(x, gs)
    empty = torch.empty

    def poisoned(*args, **kwargs):  # a byte the kernel does not write shows as 0xAB
        return empty(*args, **kwargs).fill_(0xAB)

    monkeypatch.setattr(torch, "empty", poisoned)
    a, a_sf = q.fp4_quantize(x, gs, implementation="triton", config=cfg)
    monkeypatch.undo()
    assert a_sf.shape == q.scale_shape(m, k)
    assert torch.equal(a, ref_a)
    assert torch.equal(a_sf.view(torch.uint8), ref_sf.view(torch.uint8))


def test_the_quantizer_captures_in_a_cuda_graph_and_reads_the_scale_on_the_device():
    x = _activations(16, 4096, seed=1)
    gs = torch.tensor([100.0], device="cuda")
    q.fp4_quantize(x, gs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, a_sf = q.fp4_quantize(x, gs)
    gs.fill_(37.0)  # a new scale, read by the replay
    graph.replay()
    ref_a, ref_sf = q.quantize_torch(x.cpu(), torch.tensor([37.0]))
    assert torch.equal(a.cpu(), ref_a) and torch.equal(
        a_sf.view(torch.uint8).cpu(), ref_sf.view(torch.uint8)
    )


@pytest.mark.parametrize("n, k", SHAPES)
def test_the_layer_path_computes_w4a4_at_real_shapes(gpu_selector, n, k):
    weight, weight_scale_linear, weight_scale_2 = _layer_weights(n, k, seed=n + k)
    weight_scale = _layer.prepare_weight_scale(weight_scale_linear)
    sf_w = weight_scale_linear.float().repeat_interleave(16, dim=1)
    w_deq = formats.e2m1_decode(formats.unpack_nibbles(weight)) * sf_w * weight_scale_2
    for m in MS:
        x = _activations(m, k, seed=m)
        input_scale = (x.abs().max().float() / (448.0 * 6.0)).reshape(1)  # calibrated
        alpha = input_scale * weight_scale_2
        out = _layer.linear_nvfp4(x, weight, weight_scale, 1.0 / input_scale, alpha)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        # 1. The exact W4A4 product of the same operands (float64), up to fp32 summation
        #    order and the bf16 output rounding.
        a, a_sf = q.fp4_quantize(x, 1.0 / input_scale)
        exact = formats.reference_mm_fp4(
            a, weight.T, a_sf, weight_scale.T, alpha, torch.float32, compute_dtype=torch.float64
        ).double()
        err = (out.double() - exact).norm() / exact.norm()
        assert err < 4e-3, (m, float(err))
        # 2. Against bf16 activations x the dequantized weight (what W4A16 computes): the
        #    activation quantization error only (docs/hopper.md has the measured table).
        bf16_ref = x.double() @ w_deq.double().T
        rel = (out.double() - bf16_ref).norm() / bf16_ref.norm()
        assert rel < 0.12, (m, float(rel))


def test_the_layer_op_is_opaque_and_replays_in_a_cuda_graph(gpu_selector):
    n, k = 4096, 4096
    weight, weight_scale_linear, weight_scale_2 = _layer_weights(n, k, seed=3)
    weight_scale = _layer.prepare_weight_scale(weight_scale_linear)
    x = _activations(8, k, seed=4)
    input_scale_inv = (448.0 * 6.0 / x.abs().max().float()).reshape(1)
    alpha = weight_scale_2 / input_scale_inv
    op = _layer.linear_op()
    eager = op(x, weight, weight_scale, input_scale_inv, alpha, torch.bfloat16)  # tunes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(x, weight, weight_scale, input_scale_inv, alpha, torch.bfloat16)
    graph.replay()
    assert torch.equal(captured, eager)
    compiled = torch.compile(
        lambda t: op(t, weight, weight_scale, input_scale_inv, alpha, torch.bfloat16),
        fullgraph=True,
    )
    assert torch.equal(compiled(x), eager)


@pytest.mark.parametrize("m", [1, 4, 16, 128])
def test_layers_chained_with_pdl_in_a_graph_compute_what_they_compute_apart(gpu_selector, m):
    """Launched with PDL (the default from SM90), the quantizer starts before the GEMM whose
    output it reads has finished, and the GEMM before its quantizer has: each kernel's wait
    must hold it until then. Four layers (quantize, GEMM, the output the next layer's input)
    replayed in one graph give the bits of the same layers run eagerly without PDL."""
    n = k = 4096
    layers = []
    for i in range(4):
        weight, weight_scale_linear, weight_scale_2 = _layer_weights(n, k, seed=10 + i)
        layers.append((weight, _layer.prepare_weight_scale(weight_scale_linear), weight_scale_2))
    x0 = _activations(m, k, seed=m)

    def chain(x, scales, pdl):
        outs = []
        for (weight, weight_scale, weight_scale_2), gs in zip(layers, scales):
            a, a_sf = q.fp4_quantize(x, gs, enable_pdl=pdl)
            alpha = weight_scale_2 / gs
            x = fp4select.best_mm_fp4(
                a, weight.T, a_sf, weight_scale.T, alpha, torch.bfloat16, enable_pdl=pdl
            )
            outs.append(x)
        return outs

    scales, x = [], x0  # each layer's calibrated global scale, from the eager chain
    for weight, weight_scale, weight_scale_2 in layers:
        gs = (448.0 * 6.0 / x.abs().max().float()).reshape(1)
        scales.append(gs)
        a, a_sf = q.fp4_quantize(x, gs, enable_pdl=False)
        x = fp4select.best_mm_fp4(  # tunes each key once, eagerly
            a, weight.T, a_sf, weight_scale.T, weight_scale_2 / gs, torch.bfloat16,
            enable_pdl=False,
        )  # fmt: skip
    eager = chain(x0, scales, pdl=False)
    chain(x0, scales, pdl=True)  # compiles the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x0, scales, pdl=True)
    for _ in range(3):
        for out in captured:
            out.fill_(float("nan"))  # a layer that read before its input was written shows
        graph.replay()
        torch.cuda.synchronize()
        for i, (got, want) in enumerate(zip(captured, eager)):
            assert torch.equal(got, want), f"layer {i} differs at M={m}"
