"""Capturing a CUDA graph to time from, without ``torch.cuda.graph``'s flush of the caches.

``torch.cuda.graph`` synchronizes and empties the caching allocator (and the host allocator)
before every capture, to give the capture as much free memory as it can. Timing captures one
graph per candidate, hundreds in a model's warm-up, and tuning may run in the caller's own
process (``FP4SELECT_ISOLATION=inprocess``): each flush would hand the caller's cached blocks
back to the driver, a side effect on memory fp4select does not own. The graphs here are small
and short-lived, so they need no flush: a capture that runs out of memory fails like any
other, and the caller falls back to eager launches or reports it. (It was first written to
shorten warm-up; on the H200 it did not, measurably: docs/hopper_kernels.md.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any], device: torch.device) -> torch.cuda.CUDAGraph:
    """A graph of what ``fn`` launches on ``device``, captured on a side stream as
    ``torch.cuda.graph`` does (capture needs a stream other than the legacy default one)."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            fn()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return graph
