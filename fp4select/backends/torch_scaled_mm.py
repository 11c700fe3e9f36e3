"""``torch-scaled-mm``: cuBLASLt's block-scaled FP4 GEMM through ``torch.nn.functional.scaled_mm``.

Design rules:

* Only where it can run: torch with ``float4_e2m1fn_x2`` and ``nn.functional.scaled_mm``
  (torch >= 2.10) and FP4 tensor cores (compute capability >= 10.0); anywhere else
  ``why_unavailable`` says why, so ``verify`` and ``doctor`` list it as unsupported.
* The arguments are mm_fp4's tensors, reinterpreted, never copied: a as ``(M, K/2)``
  float4_e2m1fn_x2 row-major, b as the ``(K/2, N)`` column-major view it already is, scales in
  the 128x4 layout, which is cuBLASLt's ``SWIZZLE_32_4_4``. NVFP4 uses two-level scaling
  (``BlockWise1x16`` e4m3 plus a ``TensorWise`` float32), with alpha as a's tensor-wise scale and
  a constant 1 as b's; MXFP4 uses ``BlockWise1x32`` with the scale bytes viewed as
  ``float8_e8m0fnu``, and alpha, which that recipe cannot take, multiplies the output after.
* Declared honestly: 128x4 scales for a only (cuBLASLt has no 8x4 swizzle), plain b, alpha
  none or one scalar (no per-token alpha in the recipe), N % 16 == 0 and K % 32 == 0 (torch
  wants the packed operands' dimensions multiples of 16).
* MXFP4 is declared from torch 2.14, whose op checks its arguments in C++ before any kernel
  (``validate_scaled_mm_v2_inputs``, the same checks on the CPU as on CUDA) and takes MXFP4's
  K/32 scales. torch 2.13 has only its Python meta function to read without a GPU, and that
  counts MX scales from the packed ``a.shape[1] = K/2`` and refuses them.
* :func:`scaled_mm_arguments` builds exactly what is passed, so CPU tests check it against
  torch's own rules: its C++ checks on CPU tensors from torch 2.14 (these caught a ``.T`` view
  passed as b's scales, which torch refuses: "both scales should be contiguous"), its meta
  function on fake CUDA tensors before. No result of this backend on a Blackwell GPU has been
  measured by this project.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from packaging.version import Version

from fp4select import formats
from fp4select.backends.base import Backend, Capabilities
from fp4select.keys import OUT_DTYPES

NAME = "torch-scaled-mm"
MIN_CC = 100
MXFP4_FROM_TORCH = (2, 14)  # the first torch whose checks (read on the CPU) take MXFP4's scales

_ones: dict[Any, torch.Tensor] = {}


def missing_torch_support() -> str | None:
    """Why the installed torch cannot express a block-scaled FP4 GEMM, or None."""
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    if fn is None or not hasattr(torch.nn.functional, "ScalingType"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    if not hasattr(torch, "float4_e2m1fn_x2") or not hasattr(torch, "float8_e8m0fnu"):
        return f"torch {torch.__version__} has no float4_e2m1fn_x2 / float8_e8m0fnu dtypes"
    scaling = torch.nn.functional.ScalingType
    if not all(hasattr(scaling, n) for n in ("BlockWise1x16", "BlockWise1x32", "TensorWise")):
        return f"torch {torch.__version__} scaled_mm lacks the BlockWise1x16/1x32 recipes"
    return None


def declared_formats(torch_version: str = torch.__version__) -> frozenset[str]:
    """MXFP4 only where torch's own checks were read to take its scales (the note at the top)."""
    mxfp4 = Version(torch_version).release >= MXFP4_FROM_TORCH
    return frozenset({"nvfp4", "mxfp4"} if mxfp4 else {"nvfp4"})


def why_unavailable(env: Mapping[str, Any]) -> str | None:
    why = missing_torch_support()
    if why:
        return why
    if env.get("device") != "cuda":
        return "needs a CUDA GPU with FP4 tensor cores (compute capability >= 10.0)"
    cc = env.get("cc")
    if cc is not None and cc < MIN_CC:
        return (
            f"cuBLASLt block-scaled FP4 needs FP4 tensor cores (compute capability >= 10.0, "
            f"Blackwell); this GPU is {cc / 10:.1f}"
        )
    return None


def _one(device: torch.device) -> torch.Tensor:
    """b's tensor-wise scale: made once per device (never inside a call, never per layer)."""
    one = _ones.get(device)
    if one is None:
        one = _ones[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def scaled_mm_arguments(
    a: torch.Tensor,
    b: torch.Tensor,
    a_descale: torch.Tensor,
    b_descale: torch.Tensor,
    alpha: torch.Tensor | None,
    out_dtype: torch.dtype,
    use_nvfp4: bool,
    one: torch.Tensor | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments for ``torch.nn.functional.scaled_mm``.

    ``alpha`` must be None or a one-element float32 tensor here; the runner handles the rest.
    """
    f = torch.nn.functional
    fp4 = torch.float4_e2m1fn_x2
    mat_a = a if a.dtype == fp4 else a.view(torch.uint8).view(fp4)
    mat_b = b if b.dtype == fp4 else b.view(torch.uint8).view(fp4)
    swizzle: Any = f.SwizzleType.SWIZZLE_32_4_4
    cols = 2 * a.shape[1] // (16 if use_nvfp4 else 32)
    a_descale = formats.without_spare_row_tiles(a_descale, a.shape[0], cols, "128x4")
    # cuBLASLt reads a block-scale tensor as its memory, the swizzled rows of the matrix it
    # scales, and torch refuses one that is not contiguous: b_descale's .T view goes in as
    # the (N, K/block_size) buffer under it, the same bytes.
    b_descale = b_descale.T if b_descale.dim() == 2 else b_descale
    if not b_descale.is_contiguous():
        raise ValueError(
            "b_descale must be the .T view of a contiguous (N, K/block_size) scale tensor, got "
            f"shape {tuple(b_descale.T.shape)} strides {b_descale.T.stride()}"
        )
    if use_nvfp4:
        sa = (
            a_descale
            if a_descale.dtype == torch.float8_e4m3fn
            else a_descale.view(torch.float8_e4m3fn)
        )
        sb = (
            b_descale
            if b_descale.dtype == torch.float8_e4m3fn
            else b_descale.view(torch.float8_e4m3fn)
        )
        if alpha is None:
            recipe: Any = f.ScalingType.BlockWise1x16
            args: tuple[Any, ...] = (mat_a, mat_b, sa, recipe, sb, recipe)
        else:  # alpha rides as a second, tensor-wise scale of a (and 1 of b)
            if one is None:
                one = torch.ones((), dtype=torch.float32, device=a.device)
            recipe = [f.ScalingType.BlockWise1x16, f.ScalingType.TensorWise]
            swizzle = [swizzle, f.SwizzleType.NO_SWIZZLE]
            args = (mat_a, mat_b, [sa, alpha.reshape(())], recipe, [sb, one], recipe)
    else:
        e8m0 = torch.float8_e8m0fnu
        sa = a_descale.view(torch.uint8).view(e8m0)
        sb = b_descale.view(torch.uint8).view(e8m0)
        recipe = f.ScalingType.BlockWise1x32
        args = (mat_a, mat_b, sa, recipe, sb, recipe)
    return args, {"swizzle_a": swizzle, "swizzle_b": swizzle, "output_dtype": out_dtype}


def _run(
    a: torch.Tensor,
    b: torch.Tensor,
    a_descale: torch.Tensor,
    b_descale: torch.Tensor,
    alpha: torch.Tensor | float | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None,
    block_size: int,
    use_8x4_sf_layout: bool,
    use_nvfp4: bool,
    enable_pdl: bool,
) -> torch.Tensor:
    """mm_fp4's positional order (without backend)."""
    if use_8x4_sf_layout:
        raise ValueError("use_8x4_sf_layout=True: cuBLASLt takes 128x4 (SWIZZLE_32_4_4) only")
    formats.check_block_size(block_size, use_nvfp4)
    m = a.shape[0]
    post: torch.Tensor | float | None = None
    if isinstance(alpha, (int, float)):
        post, alpha = float(alpha), None
    elif alpha is not None:
        if alpha.numel() != 1:
            raise ValueError(f"alpha must have one element here, got shape {tuple(alpha.shape)}")
        if alpha.dtype != torch.float32 or not use_nvfp4:
            post, alpha = alpha, None
    args, kwargs = scaled_mm_arguments(
        a, b, a_descale, b_descale, alpha, out_dtype, use_nvfp4, _one(a.device)
    )
    result = torch.nn.functional.scaled_mm(*args, **kwargs)
    if post is not None:
        result.mul_(post.reshape(()) if isinstance(post, torch.Tensor) else post)
    if out is None:
        return result
    formats.check_out(out, m, b.shape[1], out_dtype)
    return out.copy_(result)


BACKEND = Backend(
    name=NAME,
    checked_runner=_run,
    why_unavailable=why_unavailable,
    caps=Capabilities(
        formats=declared_formats(),
        a_sf_layouts=frozenset({"128x4"}),
        b_layouts=frozenset({"plain"}),
        out_dtypes=frozenset(OUT_DTYPES),
        alpha_kinds=frozenset({"none", "scalar"}),
        # torch's _scaled_mm_v2 checks: mat2's dims (K/2, N) and a's K/2 divisible by 16.
        n_multiple=16,
        k_multiple=32,
        devices=frozenset({"cuda"}),
    ),
    preference=150,
    family="native",
    description="cuBLASLt block-scaled FP4 via torch.nn.functional.scaled_mm (SM100+)",
)
