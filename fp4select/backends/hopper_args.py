"""mm_fp4's tensors as the ``hopper-*`` kernels read them: the packed operands as words, the
weight's scales as words with their byte-shift table, and a call's ``out`` and alpha.

Design rules:

* A view, never a copy: a tensor that cannot be viewed as words (a sliced row at an odd
  offset) gives None, and the caller hands the call to the byte-wise kernel.
* Read anew on every call, never kept: the warm path's plans (``hopper_launch``) keep the
  numbers these decide, not the tensors (``per_call``).
* The shift table is made once per device, never inside a CUDA graph capture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp4select.backends.hopper_configs import _SHIFTS


def words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The (rows, K/2) byte matrix ``t`` viewed as words of ``dtype``, or None if misaligned."""
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    try:
        return t.view(dtype)
    except RuntimeError:
        return None


def operand_words(
    args: tuple[Any, ...], dtype: torch.dtype, with_scales: bool = False, direct: bool = False
) -> tuple[torch.Tensor, ...] | None:
    """a and the weight of mm_fp4's ``args`` as words of ``dtype`` (and with ``with_scales``
    the weight's scales as int32 words), or None where one cannot be viewed so.

    ``direct``: the plan's kernels launch from their compiled launchers, which read only the
    data pointers, the same in the views as in the tensors; so the tensors themselves, without
    the views' host time (``hopper_launch``'s rules)."""
    if direct:
        return (args[0], args[1], args[3]) if with_scales else (args[0], args[1])
    a, w = words(args[0], dtype), words(args[1].T, dtype)
    if a is None or w is None:
        return None
    if not with_scales:
        return a, w
    sw = scale_words(args[3])
    return None if sw is None else (a, w, sw)


def scale_words(scales: torch.Tensor) -> torch.Tensor | None:
    """The swizzled scale bytes' storage viewed as int32 words, or None if it cannot be.

    The kernels index the 128x4 layout from the data pointer, so only the storage matters:
    ``scales`` may be the row-major tensor or its ``.T``.
    """
    raw = scales.view(torch.uint8)
    if not raw.is_contiguous():
        raw = raw.T
    if not raw.is_contiguous() or raw.numel() % 4 or raw.data_ptr() % 4:
        return None
    return raw.reshape(-1).view(torch.int32)


def tiled_words(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The (N, KW) word matrix ``w`` re-laid by tiles: ``out[t, s, r, c] = w[t * rows + r,
    s * cols + c]``, zeros past N and KW, shape (ceil(N / rows), ceil(KW / cols), rows, cols).

    A kernel whose program reads ``rows`` rows ``cols`` words at a time then reads each step
    as one contiguous run instead of ``rows`` runs a row apart (``W_TILE_ROWS`` and ``W_COLS``
    of ``mma_planes`` and ``gemv_dp4a``): an experiment of ``benchmarks/hopper_sweep.py``
    (family ``tiled``), a copy made once, not a view of the caller's weight.
    """
    n, kw = w.shape
    tiles, steps = -(-n // rows), -(-kw // cols)
    padded = w.new_zeros((tiles * rows, steps * cols))
    padded[:n, :kw] = w
    return padded.view(tiles, rows, steps, cols).transpose(1, 2).contiguous()


_shift_tables: dict[tuple[str, int | None], torch.Tensor] = {}


def shift_table(device: torch.device) -> torch.Tensor | None:
    """int32 ``8 * ((i // 2) % 4)``: the byte of a scale word that word i of a step needs."""
    key = (device.type, device.index)
    table = _shift_tables.get(key)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # never copy to the device inside a graph capture
        steps = torch.arange(_SHIFTS, dtype=torch.int32)
        table = _shift_tables[key] = (8 * ((steps // 2) % 4)).to(device)
    return table


def per_call(args: tuple[Any, ...], m: int, n: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A plan's per-call values: ``out`` (made if not given), what the kernels read alpha from
    (alpha, else a tensor they never read), and alpha as a Python number (1.0 otherwise)."""
    alpha, out_dtype, out = args[4], args[5], args[6]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=args[0].device)
    if isinstance(alpha, torch.Tensor):
        return out, alpha, 1.0
    return out, out, 1.0 if alpha is None else float(alpha)


def nothing_to_do(m: int, n: int) -> Callable[[tuple[Any, ...]], torch.Tensor]:
    """The plan of a call with no rows or no columns: its ``out``, written by no kernel."""
    return lambda args: per_call(args, m, n)[0]
