"""One NVFP4 linear layer, W4A4, through fp4select: what both engines run on GPUs without FP4
tensor cores (Hopper, Ada, Ampere), and what a Blackwell user gets when naming fp4select.

Imports no engine, so the GPU suite can check the layer path where no engine is installed.

Design rules:

* The checkpoint's layout is kept: the weight stays ``(N, K/2)`` uint8 as ModelOpt wrote it
  (``best_mm_fp4`` takes its ``.T`` view); only the block scales are laid out 128x4
  (:func:`prepare_weight_scale`, once at load).
* Activations are quantized with the layer's static input scale (``input_scale_inv = 1 /
  input_scale``, flashinfer's ``global_scale``) by :func:`fp4select.quantize.fp4_quantize`, then
  ``best_mm_fp4(a, weight.T, a_sf, weight_scale.T, alpha)`` with ``alpha = input_scale *
  weight_scale_2``: the numbers Blackwell's NVFP4 GEMMs compute.
* Under ``torch.compile`` the layer is one opaque custom op, ``torch.ops.fp4select.
  nvfp4_linear`` (registered on first use), as the engines do with their own GEMM ops: the
  selector's Python stays out of the traced graph.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from fp4select import formats

_op_lock = threading.Lock()
_op: Any = None


def prepare_weight_scale(weight_scale: torch.Tensor) -> torch.Tensor:
    """The checkpoint's linear ``(N, K/16)`` e4m3 block scales as the 128x4 ``(Np, Cp)`` buffer."""
    if weight_scale.dim() != 2:
        raise ValueError(f"weight_scale must be 2-D (N, K/16), got {tuple(weight_scale.shape)}")
    sf = weight_scale if weight_scale.dtype == torch.uint8 else weight_scale.view(torch.uint8)
    return formats.swizzle_sf(sf.contiguous(), "128x4").view(torch.float8_e4m3fn)


def linear_nvfp4(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale_inv: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x (..., K) -> (..., N)``: quantize x to NVFP4, then ``best_mm_fp4``; eager, no op.

    ``weight`` is ``(N, K/2)`` uint8, ``weight_scale`` the 128x4 buffer from
    :func:`prepare_weight_scale`, ``input_scale_inv`` and ``alpha`` one-element float32 tensors.
    """
    from fp4select.api import best_mm_fp4
    from fp4select.quantize import fp4_quantize

    k = x.shape[-1]
    if weight.shape[-1] * 2 != k:
        raise ValueError(f"x has K={k} but the weight holds K={weight.shape[-1] * 2}")
    flat = x.dim() == 2  # the engines' call: (tokens, K), no reshape either way (eager host time)
    a, a_sf = fp4_quantize(x if flat else x.reshape(-1, k), input_scale_inv)
    alpha = alpha.reshape(1) if alpha.dim() == 0 else alpha
    out = best_mm_fp4(a, weight.T, a_sf, weight_scale.T, alpha, out_dtype or x.dtype)
    return out if flat else out.reshape(*x.shape[:-1], weight.shape[0])


def linear_op() -> Any:
    """``torch.ops.fp4select.nvfp4_linear``, registered once per process (with a fake for
    ``torch.compile``); calls :func:`linear_nvfp4` on every device."""
    global _op
    with _op_lock:
        if _op is None:
            _op = _register()
    return _op


# The op's schema, written out as vLLM's ``direct_register_custom_op`` does for its own ops.
_SCHEMA = (
    "nvfp4_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor input_scale_inv, "
    "Tensor alpha, ScalarType out_dtype) -> Tensor"
)
_library: Any = None  # kept: the op is registered for as long as its Library lives


def _fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale_inv: torch.Tensor,
    alpha: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


def _register() -> Any:
    """Registered with ``torch.library.Library`` (as vLLM registers its ops), not
    ``torch.library.custom_op``, whose Python wrapper (autograd and aliasing checks) cost about
    15 us of host time on every eager call on the development machine, where this costs about
    3: eager calls of a small layer are bound by the host (docs/hopper.md, 'Eager launches')."""
    global _library
    existing = getattr(getattr(torch.ops, "fp4select", None), "nvfp4_linear", None)
    if existing is not None:  # a second import of this module (reloads, tests) reuses it
        return existing
    library = torch.library.Library("fp4select", "FRAGMENT")
    library.define(_SCHEMA)
    library.impl("nvfp4_linear", linear_nvfp4, "CompositeExplicitAutograd")
    torch.library.register_fake("fp4select::nvfp4_linear", _fake, lib=library)
    _library = library
    return torch.ops.fp4select.nvfp4_linear
