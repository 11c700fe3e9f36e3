"""fp4select's NVFP4 activation quantizer on the CPU: flashinfer's numbers, byte for byte.

The oracle is flashinfer's own CPU reference of the recipe (``flashinfer.batch_invariant.
quantization.nvfp4_reference.quantize_reference``, the ``nvfp4.quant.te`` class that its CUDA
kernel computes without fast math). ``fp4select.formats`` rounds in another order; where no
rounding happens the bytes agree, and elsewhere every difference is a value within a few ulp of
an E2M1 midpoint. The Triton kernel is checked against the PyTorch path under the interpreter
(slow; a child process) and on a GPU (tests/test_hopper_gpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4select import formats
from fp4select import quantize as q

reference = pytest.importorskip(
    "flashinfer.batch_invariant.quantization.nvfp4_reference",
    reason="flashinfer's CPU reference of the NVFP4 recipe is not installed",
)

HERE = Path(__file__).parent


def _activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Activations with outlier channels and a wide dynamic range, as LLM hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x *= torch.logspace(-3, 1, k)[torch.randperm(k, generator=g)]
    x[:, torch.randperm(k, generator=g)[: max(1, k // 64)]] *= 60.0
    return x.to(dtype)


def _global_scale(x: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    finite = x[x.isfinite()].abs().max().float()
    return (448.0 * 6.0 / finite * factor).reshape(1)


def _assert_same(mine, theirs):
    packed, scales = mine
    r_packed, r_scales, _ = theirs
    assert packed.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
    assert torch.equal(packed, r_packed), (packed != r_packed).nonzero()[:5]
    assert torch.equal(scales.view(torch.uint8), r_scales), (
        scales.view(torch.uint8) != r_scales
    ).nonzero()[:5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m, k", [(1, 64), (7, 4096), (130, 272), (33, 1024)])
# factor: calibrated (1), activations above the calibrated amax (scales saturate at 448),
# and far below it (subnormal e4m3 scales).
@pytest.mark.parametrize("factor", [1.0, 3.5, 1e-3])
def test_torch_path_matches_flashinfers_reference(dtype, m, k, factor):
    x = _activations(m, k, dtype, seed=m * k)
    gs = _global_scale(x, factor)
    _assert_same(q.quantize_torch(x, gs), reference.quantize_reference(x, gs))


def test_special_values_match_flashinfers_reference():
    x = _activations(4, 96, torch.float32, seed=1)
    x[0, :16] = 0.0  # a zero block: scale 0
    x[0, 16] = -0.0
    x[1, 3] = float("nan")  # one NaN in a block is ignored by the amax, and encodes as +6
    x[1, 16:32] = float("nan")  # an all-NaN block: scale NaN
    x[2, 5] = float("inf")
    x[2, 40] = float("-inf")
    x[3, 48:64] = 1e-30  # a nonzero block whose scale rounds to 0
    gs = torch.tensor([2.5])
    _assert_same(q.quantize_torch(x, gs), reference.quantize_reference(x, gs))


def test_every_e2m1_and_e4m3_tie_matches_flashinfers_reference():
    # gs = 6: a block whose amax is 1 gets scale e4m3(1.0) = 1 and inv = 1/(1/6) = 6, so x*6
    # lands exactly on every E2M1 midpoint; the amax values sweep e4m3 ties and boundaries.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.5, 0.0, 0.5, 1.0])
    rows = []
    for amax in [1.0, 1.0625, 1.1875, 0.015625, 0.0146484375, 0.001953125, 448.0, 464.0, 1e4]:
        row = torch.cat([mids / 6.0 * amax, torch.tensor([amax, -amax, 0.1, -0.3])])
        rows.append(row)
        rows.append(-row)
    x = torch.stack(rows).to(torch.float32)
    gs = torch.tensor([6.0])
    _assert_same(q.quantize_torch(x, gs), reference.quantize_reference(x, gs))


def test_the_e4m3_rounding_matches_flashinfers_over_its_whole_range():
    # Every e4m3 value, every midpoint between neighbours and points just off them.
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (values[:-1] + values[1:]) / 2
    probe = torch.cat([values, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(mids * 2)])
    probe = torch.cat([probe, torch.tensor([448.0, 460.0, 464.0, 500.0, 1e9, float("inf")])])
    # One block per probe, its amax the probe; gs near 1/f32(1/6) puts sf near the probe.
    x = torch.zeros(probe.numel(), 16)
    x[:, 0] = probe
    gs = torch.tensor([1.0 / q.C_SIXTH])
    mine = q.quantize_torch(x, gs)
    theirs = reference.quantize_reference(x, gs)
    _assert_same(mine, theirs)


def test_bytes_agree_with_formats_where_no_rounding_happens():
    # Power-of-two global and block scales: amax * (gs / 6) and gs * amax / 6 are the same
    # exact value, 1 / (sf / gs) == gs / sf exactly, and both orders encode the same numbers.
    g = torch.Generator().manual_seed(7)
    m, k = 9, 256
    blocks = torch.randint(0, 9, (m, k // 16), generator=g).to(torch.float32)
    amax = 6.0 * torch.exp2(blocks - 4)  # block scale 2**(b-4) * gs
    codes = torch.randint(0, 16, (m, k), generator=g)
    x = formats.e2m1_decode(codes) * (amax / 6.0).repeat_interleave(16, dim=1)
    x[:, ::16] = amax.reshape(m, -1)  # each block reaches its amax
    for gs in (1.0, 0.25, 64.0):
        packed, scales = q.quantize_torch(x, torch.tensor([gs]))
        theirs = formats.quantize_nvfp4(x, gs, "128x4")
        assert torch.equal(packed, theirs.data)
        assert torch.equal(scales.view(torch.uint8), theirs.scales.view(torch.uint8))


def test_where_formats_rounds_in_another_order_only_near_ties_differ():
    x = _activations(64, 2048, torch.bfloat16, seed=3)
    gs = _global_scale(x)
    packed, scales = q.quantize_torch(x, gs)
    theirs = formats.quantize_nvfp4(x, gs, "128x4")
    mine_codes = formats.unpack_nibbles(packed)
    their_codes = formats.unpack_nibbles(theirs.data)
    sf = formats.unswizzle_sf(scales, 64, 2048 // 16, "128x4").float()
    their_sf = formats.unswizzle_sf(theirs.scales, 64, 2048 // 16, "128x4").float()
    # Block scales: e4m3 of the same real number computed two ways.
    assert (sf != their_sf).float().mean() < 1e-3
    same_block = (sf == their_sf).repeat_interleave(16, dim=1)
    differ = (mine_codes != their_codes) & same_block
    assert differ.float().mean() < 1e-3
    # Each differing code: the exact scaled value lies within 4 ulp of an E2M1 midpoint.
    exact = x.double() * gs.double() / sf.double().repeat_interleave(16, dim=1)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    distance = (exact.abs()[differ].unsqueeze(-1) - mids).abs().min(dim=-1).values
    assert bool((distance <= 4 * 2.0**-23 * 6).all()), distance.max()


def test_output_shapes_and_argument_checks():
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    packed, scales = q.fp4_quantize(x, torch.tensor([1.0]))
    assert packed.shape == (3, 24) and scales.shape == (128, 4) == q.scale_shape(3, 48)
    logical = formats.unswizzle_sf(scales, 128, 4, "128x4").view(torch.uint8)  # padding too
    assert logical[:3, :3].all() and not logical[3:].any() and not logical[:, 3].any()
    # A float global scale and a strided input give the same bytes.
    wide = torch.randn(3, 96, dtype=torch.bfloat16)
    wide[:, ::2] = x
    a = q.quantize_torch(wide[:, ::2], 1.0)
    b = q.quantize_torch(x, torch.tensor(1.0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        q.fp4_quantize(torch.randn(2, 40), 1.0)
    with pytest.raises(ValueError, match="2-D"):
        q.fp4_quantize(torch.randn(2, 2, 16), 1.0)
    with pytest.raises(TypeError, match="bfloat16"):
        q.fp4_quantize(torch.ones(2, 16, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="one element"):
        q.fp4_quantize(torch.randn(2, 16), torch.ones(2))
    with pytest.raises(ValueError, match="implementation"):
        q.fp4_quantize(torch.randn(2, 16), 1.0, implementation="cuda")
    with pytest.raises(TypeError, match="enable_pdl must be None, True or False, got 'yes'"):
        q.fp4_quantize(torch.randn(2, 16), 1.0, enable_pdl="yes")
    for pdl in (None, True, False):  # no PDL off CUDA, whatever is asked: the same bytes
        assert torch.equal(q.fp4_quantize(x, 1.0, enable_pdl=pdl)[0], q.quantize_torch(x, 1.0)[0])
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="CUDA tensors"):
            q.fp4_quantize(torch.randn(2, 16), 1.0, implementation="triton")


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.skipif(q.triton_available() is not None, reason="triton is not installed")
def test_the_triton_kernel_equals_the_torch_path_under_the_interpreter():
    env = {
        **os.environ,
        "PYTHONPATH": str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_quantize_interp_worker.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) >= 100
    failed = [r for r in results if not r["same"]]
    assert not failed, failed
    # Every code path ran: the table's tiles and the kernel before them, split and paired
    # loads, padding rows by programs of their own and by the tiles, on every kind of input.
    configs = {r["config"] for r in results if "config" in r}
    assert {c.label for _, c in q.QUANT_BY_M + q.QUANT_BEFORE} <= configs
    assert any("pairs" in c for c in configs) and any("pairs" not in c for c in configs)
    assert any("tiles-pad" in c for c in configs) and any("tiles-pad" not in c for c in configs)
    cases = {r["case"] for r in results}
    assert {
        "special values",
        "ties",
        "infinite global scale",
        "outputs allocated full of 0xAB",
    } <= cases
    # The planted mistake (scales written without the swizzle) must be caught.
    assert any(r["case"] == "plant" and not r["plant_same"] for r in results)
