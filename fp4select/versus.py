"""A decision beside keeping the weight dense: is FP4 paying off on this GPU, at this M?

Why this exists: on GPUs without FP4 tensor cores (Hopper and older) fp4select's own kernels
serve, and whether they beat a bfloat16 weight depends on the GPU, the shape and the batch
(docs/hopper.md). A deployment should be able to see that for its own layers before it
serves, not only in our benchmarks. ``fp4select warm --vs-bf16``, ``fp4select explain
--vs-bf16`` and ``fp4select.explain(..., vs_bf16=True)`` report it.

Design rules:

* The FP4 side is the call as a caller makes it: :func:`fp4select.explain` (``vs_bf16``)
  hands in :func:`fp4select.best_mm_fp4`, which dispatches to the stored decision (its host
  path included), never a backend's runner picked here, and only for a key with a decision,
  since comparing would otherwise tune behind the caller's back. (Handed in, not imported:
  this module sits below the API in the import graph.)
* The dense side is ``torch.nn.functional.linear`` (cuBLAS on a GPU, as a dense checkpoint's
  layer runs) with both operands in the key's output dtype: bfloat16, or float16 where the
  key's output is float16.
* Both are timed side by side in one run by ``fp4select.timing`` with the selector's own
  options (CUDA-graph replay and cold L2 on a GPU, wall clock on the CPU; at most
  ``BUDGET_S`` a key), at the bucket's timing M: the two numbers are comparable with each
  other, not with another machine's.
* Inputs are random and made here; nothing is read from or written to the store.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from fp4select import timing, validate
from fp4select.keys import Problem
from fp4select.records import Timing, TimingOptions

__all__ = ["compare"]

FP4 = "fp4select"
DENSE = "dense"
# A report, not a ranking: a second per key (the selector's default budget is 3 s) keeps
# ``warm --vs-bf16`` over a model's keys within minutes; the median of its samples is enough.
BUDGET_S = 1.0


def _dense_inputs(
    problem: Problem, m: int, device: torch.device, sets: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(problem.n * 31 + problem.k)
    dtype = problem.torch_out_dtype
    return [
        (
            torch.randn(m, problem.k, generator=gen, device=device).to(dtype),
            torch.randn(problem.n, problem.k, generator=gen, device=device).to(dtype),
        )
        for _ in range(sets)
    ]


def _json(t: Timing) -> dict[str, Any]:
    return {"median_us": t.median_us, "p10_us": t.p10_us, "p90_us": t.p90_us, "method": t.method}


def compare(
    problem: Problem,
    device: torch.device | str,
    fp4_gemm: Callable[..., torch.Tensor],
    options: TimingOptions,
) -> dict[str, Any]:
    """Time ``fp4_gemm`` (called with :func:`fp4select.best_mm_fp4`'s keyword arguments, in
    ``problem``'s layouts) beside the same product with a dense weight.

    Returns the M timed, both timings, their ratio (FP4 over dense: below 1, FP4 is faster)
    and the timing method.
    """
    device = torch.device(device)
    options = dataclasses.replace(options, budget_s=min(options.budget_s, BUDGET_S))
    m = problem.timing_m()
    first = validate.make_inputs(problem, m, device, seed=7, with_reference=False)
    fp4_sets = timing.input_sets_for_cold_l2(device, first.nbytes(), options.cold_l2)
    fp4_inputs = [first] + [
        validate.make_inputs(problem, m, device, seed=7 + i, with_reference=False)
        for i in range(1, fp4_sets)
    ]
    dense_bytes = (m + problem.n) * problem.k * problem.torch_out_dtype.itemsize
    dense_sets = timing.input_sets_for_cold_l2(device, dense_bytes, options.cold_l2)
    dense = _dense_inputs(problem, m, device, dense_sets)
    invariant = {"batch_invariant": True} if problem.batch_invariant else {}
    calls = {
        FP4: [functools.partial(fp4_gemm, **s.kwargs(problem), **invariant) for s in fp4_inputs],
        DENSE: [functools.partial(torch.nn.functional.linear, x, w) for x, w in dense],
    }
    try:
        timings, method = timing.time_interleaved(calls, device, options)
    finally:
        validate.clear_cache()  # its weight, as after a probe (it may hold a GPU gigabyte)
    fp4, dense_t = timings[FP4], timings[DENSE]
    return {
        "m": m,
        "dense_dtype": problem.out_dtype,
        "fp4": _json(fp4),
        "dense": _json(dense_t),
        "ratio": fp4.median_us / dense_t.median_us if dense_t.median_us > 0 else None,
        "method": method,
    }
