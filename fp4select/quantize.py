"""NVFP4 activation quantization with flashinfer's numbers, on GPUs where flashinfer has none.

Why this exists: on Hopper (SM90) and older, neither engine can quantize an activation to NVFP4.
flashinfer's ``fp4_quantize`` refuses anything below SM100 (``_check_block_scale_quantization_
support``; its CUDA conversion ``cvt_warp_fp16_to_fp4`` is compiled out below ``__CUDA_ARCH__``
1000, and its batch-invariant class runs on SM100/103/107 only), SGLang calls exactly that, and
vLLM's ``scaled_fp4_quant`` is built for SM100+. fp4select's W4A4 path on Hopper quantizes here.

The recipe, per row and per block of 16 values along K (flashinfer's ``nvfp4.quant.te`` class,
which its CUDA kernel computes under ``FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH`` and its CPU
reference ``flashinfer.batch_invariant.quantization.nvfp4_reference.quantize_reference`` states;
every operation one float32 rounding)::

    amax  = max |x|            over the 16 values (a NaN is ignored unless all 16 are NaN)
    sf    = e4m3(amax * (gs * f32(1/6)))       round to nearest even, saturating at 448
    inv   = fmin(1 / (sf * (1 / gs)), FLT_MAX)
    code  = e2m1(x * inv)                       round to nearest even, saturating at 6, NaN -> +6

``gs`` is the global scale flashinfer's ``fp4_quantize`` takes (``448 * 6 / amax``, the inverse
of a checkpoint's ``input_scale``). Codes are packed two per byte (element ``2i`` in the low
nibble), scales are stored 128x4-swizzled and zero-padded to ``(ceil128(M), ceil4(K/16))``,
exactly the ``a`` and ``a_descale`` that ``mm_fp4`` and :func:`fp4select.best_mm_fp4` take.

flashinfer's default CUDA path differs in two places only: it takes ``1/6``, ``1/gs`` and the
final reciprocal with ``rcp.approx.ftz`` (not reproducible off the GPU, and the reason the
batch-invariant class exists), and it writes codes 0 where a nonzero block's scale rounds to 0
(this recipe writes saturated codes there; the scale is 0, so both dequantize to zeros).

Design rules:

* One recipe, two implementations: :func:`quantize_torch` (any device, the CPU's path and the
  definition the tests hold the kernel to) and a Triton kernel (``fp4select._quantize_triton``,
  imported on first use) for CUDA tensors. The kernel rounds with integer and float32
  arithmetic it spells out (no hardware conversion instruction), so the Triton interpreter on
  the CPU runs the same arithmetic as the GPU.
* Capture-safe: no ``.item()``, no host sync, no allocation but the two outputs; the global
  scale is read on the device. One launch per call: the kernel writes the scale buffer's
  padding itself.
* The kernel's tiles are chosen by M from :data:`QUANT_BY_M` (as ``hopper-*``'s tables in
  ``fp4select.backends.triton_hopper``), set from ``benchmarks/quant_sweep.py`` on the GPU.
* ``fp4select.formats.quantize_nvfp4`` is the codec the selector's tests use; it computes the
  scale as ``e4m3(gs * amax / 6)`` and the values as ``e2m1(x * gs / sf)``, a different order
  of roundings. Where no rounding happens (power-of-two scales) the two give the same bytes.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from fp4select import formats

__all__ = [
    "BLOCK",
    "QUANT_BY_M",
    "QuantConfig",
    "config_for",
    "fp4_quantize",
    "quantize_torch",
    "scale_shape",
    "triton_available",
]

BLOCK = 16
# float32(1/6): TransformerEngine and flashinfer multiply by the rounded reciprocal (0x3E2AAAAB).
C_SIXTH = float(torch.tensor(1.0 / 6.0, dtype=torch.float32))
F32_MAX = float(torch.finfo(torch.float32).max)
E4M3_MAX = 448.0
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_kernels: Any = None


@dataclass(frozen=True)
class QuantConfig:
    """The Triton kernel's tiling (``fp4select._quantize_triton`` says what each field does).

    ``block_m``: rows per program (with ``pad_programs``, at most M rounded up to a power of
    two); ``block_c``: scale columns (16 values each) per program; ``num_warps``: per program;
    ``split``: load each block's 16 values as one run and split them in registers (else even
    and odd elements apart); ``pad_programs``: the scale grid's padding rows (up to a multiple
    of 128) written by programs that only store zeros (else quantized from zeros by the tiles).
    """

    block_m: int
    block_c: int
    num_warps: int
    split: bool = True
    pad_programs: bool = True

    def __post_init__(self) -> None:
        for name in ("block_m", "block_c", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")

    @property
    def label(self) -> str:
        flags = ("" if self.split else " pairs") + ("" if self.pad_programs else " tiles-pad")
        return f"m{self.block_m} c{self.block_c} w{self.num_warps}{flags}"


# (largest M, configuration), first match wins; None: any M. Set by rule, not by a sweep: each
# thread holds one 16-byte vector of x (two above M = 16), and no program covers rows that do
# not exist. benchmarks/quant_sweep.py times every tiling against it (docs/hopper.md, 'Speed').
QUANT_BY_M: tuple[tuple[int | None, QuantConfig], ...] = (
    (1, QuantConfig(1, 16, 1)),
    (2, QuantConfig(2, 8, 1)),
    (16, QuantConfig(4, 8, 2)),
    (None, QuantConfig(16, 8, 4)),
)
# Tiles over the padding rows, even and odd elements loaded apart: the sweep's baseline.
QUANT_BEFORE: tuple[tuple[int | None, QuantConfig], ...] = (
    (16, QuantConfig(16, 8, 2, split=False, pad_programs=False)),
    (None, QuantConfig(32, 16, 4, split=False, pad_programs=False)),
)


def config_for(
    m: int, table: tuple[tuple[int | None, QuantConfig], ...] = QUANT_BY_M
) -> QuantConfig:
    """The configuration ``table`` names for M rows."""
    for limit, cfg in table:
        if limit is None or m <= limit:
            return cfg
    return table[-1][1]


def scale_shape(m: int, k: int) -> tuple[int, int]:
    """The 128x4-swizzled scale tensor's shape for an ``(m, k)`` input."""
    return formats.padded_sf_shape(m, k // BLOCK, "128x4")


def _check(x: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    if (  # the serving call: checked with attribute reads only (eager mode pays for each op)
        type(global_scale) is torch.Tensor
        and global_scale.dtype == torch.float32
        and global_scale.shape == (1,)
        and global_scale.device == x.device
        and x.dtype in _DTYPES
        and x.dim() == 2
        and x.shape[1] > 0
        and not x.shape[1] % BLOCK
    ):
        return global_scale
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.shape[1] == 0 or x.shape[1] % BLOCK:
        raise ValueError(f"K={x.shape[1]} must be a positive multiple of {BLOCK}")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    if gs.numel() != 1:
        raise ValueError(f"global_scale must have one element, got shape {tuple(gs.shape)}")
    return gs.reshape(1)


def quantize_torch(
    x: torch.Tensor, global_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe in PyTorch: ``(packed (M, K/2) uint8, scales (Mp, Cp) float8_e4m3fn 128x4)``."""
    gs = _check(x, global_scale).reshape(())
    m, k = x.shape
    xf = x.to(torch.float32).reshape(m, k // BLOCK, BLOCK)
    mag = xf.abs()
    nan = torch.isnan(mag)
    amax = torch.where(nan, torch.zeros_like(mag), mag).amax(dim=-1)
    amax = torch.where(nan.all(dim=-1), torch.full_like(amax, float("nan")), amax)
    sf_f = amax * (gs * torch.tensor(C_SIXTH, dtype=torch.float32, device=x.device))
    # e4m3: clamp first so that values over 448 saturate (torch's cast would make them NaN).
    sf_q = torch.where(torch.isnan(sf_f), sf_f, sf_f.clamp(max=E4M3_MAX)).to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    inv = one / (sf_q.to(torch.float32) * (one / gs))
    inv = torch.where(inv <= F32_MAX, inv, torch.full_like(inv, F32_MAX))  # fmin, NaN -> FLT_MAX
    codes = formats.e2m1_encode(xf * inv.unsqueeze(-1))
    packed = formats.pack_nibbles(codes.reshape(m, k))
    scales = formats.swizzle_sf(sf_q, "128x4")
    return packed, scales


@functools.cache
def triton_available() -> str | None:
    """Why the Triton kernel cannot run here, or None (looked up once per process)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def _pdl_possible(device: torch.device) -> bool:
    """As the GEMMs decide it (``triton_hopper.pdl_possible``, cached per device)."""
    from fp4select.backends.triton_hopper import pdl_possible

    return pdl_possible(device)


def _triton() -> Any:
    global _kernels
    if _kernels is None:
        from fp4select import _quantize_triton

        _kernels = _quantize_triton
    return _kernels


def fp4_quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor | float,
    *,
    implementation: str = "auto",
    config: QuantConfig | None = None,
    enable_pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``(M, K)`` activations to NVFP4 as flashinfer does (see the module docstring).

    Returns ``(a, a_descale)``: ``(M, K/2)`` uint8 codes and the ``(ceil128(M), ceil4(K/16))``
    128x4-swizzled ``float8_e4m3fn`` scales. ``implementation``: ``"auto"`` (the Triton kernel
    for a CUDA tensor, else PyTorch), ``"triton"`` or ``"torch"`` (the kernel also runs on CPU
    tensors under ``TRITON_INTERPRET=1``). ``config`` (default :func:`config_for` M) and
    ``enable_pdl`` (None or True: programmatic dependent launch where the GPU and Triton have
    it, hiding launch gaps in a CUDA graph) change the speed, never the bytes.
    """
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise TypeError(f"enable_pdl must be None, True or False, got {enable_pdl!r}")
    if implementation == "auto":
        use_triton = x.is_cuda and triton_available() is None
    elif implementation in ("triton", "torch"):
        use_triton = implementation == "triton"
    else:
        raise ValueError(f"implementation must be auto, triton or torch, got {implementation!r}")
    if not use_triton:
        return quantize_torch(x, global_scale)
    gs = _check(x, global_scale)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the Triton quantizer runs on CUDA tensors (or under TRITON_INTERPRET=1)"
        )
    kernels = _triton()
    pdl = enable_pdl is not False and x.is_cuda and _pdl_possible(x.device)
    return kernels.quantize(x, gs, config or config_for(x.shape[0]), pdl)
