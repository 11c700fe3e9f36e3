"""Backends for selector tests, registered through the public path (importable by children).

Each appends its name to the file named by FP4SELECT_TEST_MARKER (when set) the first time it
runs in a process, so a test can tell whether a process ran it (once, so that the file write
does not skew the timings).
"""

from __future__ import annotations

import os
import time

import torch

from fp4select.formats import reference_mm_fp4

_marked: set[str] = set()


def _mark(name: str) -> None:
    path = os.environ.get("FP4SELECT_TEST_MARKER")
    if path and name not in _marked:
        _marked.add(name)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(name + "\n")


def _ref(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, use_nvfp4, pdl):
    return reference_mm_fp4(
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, use_nvfp4
    )


def fast(*args):
    _mark("fast")
    return _ref(*args)


def slow(*args):
    _mark("slow")
    time.sleep(0.003)
    return _ref(*args)


def wrong_fast(a, b, *args):
    """Fastest of all, and wrong: must never win."""
    _mark("wrong_fast")
    out = args[4]
    result = torch.zeros(a.shape[0], b.shape[1], dtype=args[3])
    if out is not None:
        out.copy_(result)
        return out
    return result


def nan_fast(a, b, *args):
    _mark("nan_fast")
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=args[3])
    if args[4] is not None:
        args[4].copy_(out)
        return args[4]
    return out


def off_by_alpha(*args):
    """Right layout, right decode, alpha 1% off: only the aggregate bound sees it."""
    _mark("off_by_alpha")
    return _ref(*args) * 1.01 if args[6] is None else args[6].copy_(_ref(*args) * 1.01)


def raises(*args):
    _mark("raises")
    raise RuntimeError("kernel launch failed: invalid configuration")


def ignores_out(a, b, a_descale, b_descale, alpha, out_dtype, out, *rest):
    """Right numbers, but into a fresh tensor even when the caller passed out=."""
    _mark("ignores_out")
    return _ref(a, b, a_descale, b_descale, alpha, out_dtype, None, *rest)
