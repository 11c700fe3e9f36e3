"""The argument checks of ``best_mm_fp4``: every check that can be made without running a kernel.

Design rules:

* Bad input gets a ``TypeError`` or ``ValueError`` that names the argument and what was
  expected, raised before any kernel runs; the same call gets the same error whether it is a
  signature's first call or a later one (fp4select.api re-runs these checks when a bound runner
  fails, and its warm path never serves what they would refuse).
* The checks return the problem key: what the selection depends on is derived here, once, from
  the arguments the checks have just accepted.
"""

from __future__ import annotations

from typing import Any

import torch

from fp4select import formats
from fp4select.keys import B_LAYOUTS, INVARIANT_BUCKET, OUT_DTYPES, Problem, m_bucket

_FP4_DTYPES = tuple(
    d for d in (torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None
)
_SF_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_DTYPE_NAMES = {v: k for k, v in OUT_DTYPES.items()}


def _need_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _pad(x: int, to: int) -> int:
    return -(-x // to) * to


def check_arguments(
    a: Any,
    b: Any,
    a_descale: Any,
    b_descale: Any,
    alpha: Any = None,
    out_dtype: Any = torch.bfloat16,
    out: Any = None,
    block_size: Any = 16,
    use_8x4_sf_layout: Any = False,
    backend: Any = "auto",
    use_nvfp4: Any = True,
    enable_pdl: Any = True,
    b_layout: Any = "plain",
    batch_invariant: Any = False,
    allow_blacklisted: Any = False,
) -> Problem:
    """Every check that can be made without running a kernel; returns the problem key."""
    a = _need_tensor("a", a)
    b = _need_tensor("b", b)
    a_descale = _need_tensor("a_descale", a_descale)
    b_descale = _need_tensor("b_descale", b_descale)
    for name, flag in (
        ("use_8x4_sf_layout", use_8x4_sf_layout),
        ("use_nvfp4", use_nvfp4),
        ("enable_pdl", enable_pdl),
        ("batch_invariant", batch_invariant),
        ("allow_blacklisted", allow_blacklisted),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str ('auto' or a backend name), got {backend!r}")
    if batch_invariant and backend != "auto":
        raise ValueError(
            f"batch_invariant=True needs backend='auto' (one backend must serve every M of the "
            f"shape, so fp4select picks it), got backend={backend!r}"
        )
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"b_layout must be one of {B_LAYOUTS}, got {b_layout!r}")
    if out_dtype not in _DTYPE_NAMES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype!r}")
    if a.ndim != 2:
        raise ValueError(f"a must be 2-D (M, K/2), got shape {tuple(a.shape)}")
    if b.ndim != 2:
        raise ValueError(f"b must be 2-D (K/2, N), got shape {tuple(b.shape)}")
    if a.dtype not in _FP4_DTYPES:
        raise TypeError(f"a must hold packed FP4 (uint8 or float4_e2m1fn_x2), got {a.dtype}")
    if b.dtype not in _FP4_DTYPES:
        raise TypeError(f"b must hold packed FP4 (uint8 or float4_e2m1fn_x2), got {b.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"K mismatch: a is {tuple(a.shape)} and b is {tuple(b.shape)}; "
            "a.shape[1] must equal b.shape[0] (both K/2)"
        )
    m, n, k = a.shape[0], b.shape[1], 2 * a.shape[1]
    if m < 1 or n < 1 or k < 1:
        raise ValueError(f"a and b must be non-empty, got M={m}, N={n}, K={k}")
    if not a.is_contiguous():
        raise ValueError(f"a must be row-major contiguous (M, K/2), got strides {a.stride()}")
    if not b.t().is_contiguous():
        raise ValueError(
            f"b must be the transposed view (weight.T) of a row-major (N, K/2) weight, i.e. "
            f"strides (1, K/2) = (1, {b.shape[0]}), got strides {b.stride()}; a row-major "
            "(K/2, N) tensor holds the same shape but not the same matrix"
        )
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    formats.check_block_size(block_size, use_nvfp4)
    if k % block_size:
        raise ValueError(f"K={k} (2 * a.shape[1]) must be a multiple of block_size={block_size}")
    if b_layout == "trtllm" and n % 128:
        raise ValueError(f"b_layout='trtllm' needs N % 128 == 0 (row shuffle in tiles), got N={n}")
    for name, sf in (("a_descale", a_descale), ("b_descale", b_descale)):
        if sf.dtype not in _SF_DTYPES:
            raise TypeError(f"{name} must be float8_e4m3fn or uint8, got {sf.dtype}")
        if not use_nvfp4 and sf.dtype != torch.uint8:
            raise TypeError(f"{name} must be uint8 (UE8M0) for mxfp4, got {sf.dtype}")
    cols = _pad(k // block_size, 4)
    row_tile = 8 if use_8x4_sf_layout else 128
    need_a = _pad(m, row_tile) * cols
    extra = a_descale.numel() - need_a
    if extra < 0 or extra % (row_tile * cols):
        layout = "8x4" if use_8x4_sf_layout else "128x4"
        raise ValueError(
            f"a_descale has {a_descale.numel()} elements; the {layout} layout for M={m}, "
            f"K/block={k // block_size} needs {need_a} ({_pad(m, row_tile)} x {cols}), "
            "or that plus whole row tiles"
        )
    need_b = _pad(n, 128) * cols
    if b_descale.numel() != need_b:
        raise ValueError(
            f"b_descale has {b_descale.numel()} elements; the 128x4 layout for N={n}, "
            f"K/block={k // block_size} needs {need_b} ({cols} x {_pad(n, 128)})"
        )
    if alpha is None:
        alpha_kind = "none"
    else:
        alpha = _need_tensor("alpha", alpha)
        if alpha.dtype != torch.float32:
            raise TypeError(f"alpha must be a float32 tensor, got {alpha.dtype}")
        if alpha.numel() == 1:
            alpha_kind = "scalar"
        elif alpha.numel() == m:
            alpha_kind = "per_token"
        else:
            raise ValueError(
                f"alpha must have 1 element or M={m} (one per row of a), got {alpha.numel()}"
            )
    tensors = [("b", b), ("a_descale", a_descale), ("b_descale", b_descale)]
    if alpha is not None:
        tensors.append(("alpha", alpha))
    if out is not None:
        out = _need_tensor("out", out)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out must have shape (M, N) = {(m, n)}, got {tuple(out.shape)}")
        if out.dtype != out_dtype:
            raise TypeError(f"out must have dtype out_dtype={out_dtype}, got {out.dtype}")
        tensors.append(("out", out))
    for name, t in tensors:
        if t.device != a.device:
            raise ValueError(
                f"{name} is on {t.device} but a is on {a.device}; all must be on one device"
            )
    return Problem(
        n=n,
        k=k,
        m_bucket=INVARIANT_BUCKET if batch_invariant else m_bucket(m),
        out_dtype=_DTYPE_NAMES[out_dtype],
        block_size=block_size,
        use_nvfp4=use_nvfp4,
        a_sf_layout="8x4" if use_8x4_sf_layout else "128x4",
        b_layout=b_layout,
        alpha_kind=alpha_kind,
        batch_invariant=batch_invariant,
    )
