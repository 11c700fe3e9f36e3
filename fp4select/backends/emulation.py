"""The reference GEMM as a backend: slow, but right on every device and every layout.

It is what fp4select dispatches to where no native FP4 kernel runs (Hopper, Ada, the CPU), and
the only backend that takes every format, scale layout, b layout and alpha kind. It decodes
both operands to float32 and multiplies with the device's ordinary matrix unit; it never
synchronises with the host, so it is safe inside CUDA graph capture.
"""

from __future__ import annotations

import functools

import torch

from fp4select.backends.base import ALL_FORMATS, Backend, Capabilities, Runner
from fp4select.formats import reference_mm_fp4
from fp4select.keys import A_SF_LAYOUTS, ALPHA_KINDS, B_LAYOUTS, OUT_DTYPES, Problem

NAME = "emulation"


def _run(*args: object, b_layout: str) -> torch.Tensor:
    """A runner: mm_fp4's positional order (without backend); enable_pdl means nothing here."""
    return reference_mm_fp4(*args[:10], b_layout=b_layout)  # type: ignore[arg-type]


def bind(problem: Problem) -> Runner:
    return functools.partial(_run, b_layout=problem.b_layout)


BACKEND = Backend(
    name=NAME,
    bind=bind,
    caps=Capabilities(
        formats=ALL_FORMATS,
        a_sf_layouts=frozenset(A_SF_LAYOUTS),
        b_layouts=frozenset(B_LAYOUTS),
        out_dtypes=frozenset(OUT_DTYPES),
        alpha_kinds=frozenset(ALPHA_KINDS),
        devices=frozenset({"cpu", "cuda"}),
    ),
    # Last in every near-tie: a native kernel that is as fast is always the better choice.
    preference=1000,
    family="builtin",
    description="decode to float32 and multiply; the fallback and the reference",
)
