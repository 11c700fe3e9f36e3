"""The reference GEMM as a backend: slow, but right on every device and every layout.

It is what fp4select dispatches to where no native FP4 kernel runs (Hopper, Ada, the CPU), and
the only backend that takes every format, scale layout, b layout and alpha kind. It decodes
both operands to float32 and multiplies with the device's ordinary matrix unit; it never
synchronises with the host, so it is safe inside CUDA graph capture.

Batch invariance: one matrix product over all M rows lets the library pick its algorithm (and
its reduction order) by M, so row i may change with the batch size. For batch-invariant
problems the rows are multiplied in fixed chunks of ``INVARIANT_ROWS``, the last one padded
with zeros: every product then has one shape, so one algorithm and one reduction order, and a
row's bits cannot depend on M or on its neighbours.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fp4select.backends.base import ALL_FORMATS, MODES, Backend, Capabilities, Runner
from fp4select.formats import reference_mm_fp4
from fp4select.keys import A_SF_LAYOUTS, ALPHA_KINDS, B_LAYOUTS, OUT_DTYPES, Problem

NAME = "emulation"
INVARIANT_ROWS = 16


def _run(*args: Any, b_layout: str) -> torch.Tensor:
    """A runner: mm_fp4's positional order (without backend); enable_pdl means nothing here."""
    return reference_mm_fp4(*args[:10], b_layout=b_layout)


def _chunked_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` as products of one fixed shape (INVARIANT_ROWS rows), so rows never mix."""
    m = a.shape[0]
    padded = -(-m // INVARIANT_ROWS) * INVARIANT_ROWS
    if padded != m:
        a = torch.cat([a, a.new_zeros(padded - m, a.shape[1])])
    wt = w.T
    chunks = [a[i : i + INVARIANT_ROWS] @ wt for i in range(0, padded, INVARIANT_ROWS)]
    return torch.cat(chunks)[:m]


def _run_invariant(*args: Any, b_layout: str) -> torch.Tensor:
    return reference_mm_fp4(*args[:10], b_layout=b_layout, matmul=_chunked_matmul)


def make_runner(problem: Problem) -> Runner:
    run = _run_invariant if problem.batch_invariant else _run
    return functools.partial(run, b_layout=problem.b_layout)


BACKEND = Backend(
    name=NAME,
    make_checked_runner=make_runner,
    caps=Capabilities(
        formats=ALL_FORMATS,
        a_sf_layouts=frozenset(A_SF_LAYOUTS),
        b_layouts=frozenset(B_LAYOUTS),
        out_dtypes=frozenset(OUT_DTYPES),
        alpha_kinds=frozenset(ALPHA_KINDS),
        devices=frozenset({"cpu", "cuda"}),
        modes=frozenset(MODES),
    ),
    # Last in every near-tie: a native kernel that is as fast is always the better choice.
    preference=1000,
    # On a GPU every kernel that passes is faster, and probing emulation only slows warm-up
    # (docs/design.md, 'The fallback'): it serves only when none passes. On the CPU it competes.
    fallback_on=frozenset({"cuda"}),
    family="builtin",
    description="decode to float32 and multiply; the fallback and the reference",
)
