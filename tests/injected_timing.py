"""Deterministic timings for tests that assert a winner: never race two kernels' speeds.

``install(medians)`` replaces ``fp4select.timing.time_interleaved`` for this process: each
candidate is still called once (so a crash while timing is still seen and blamed), then gets
the median given for its name (``default`` for the others) with no spread. Used in-process
through the ``injected_timings`` fixture, and by test worker scripts through the
``FP4SELECT_TEST_TIMINGS`` variable (a JSON object), which only the test scripts read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fp4select import timing

DEFAULT_MEDIANS = {"fast": 10.0, "slow": 30.0, "emulation": 20.0}


def fake_time_interleaved(
    medians: Mapping[str, float], default: float = 25.0
) -> Callable[..., tuple[dict[str, timing.Timing], str]]:
    def time_interleaved(
        calls: Mapping[str, Sequence[Callable[[], Any]]],
        device: torch.device,
        options: timing.TimingOptions | None = None,
        on_start: Callable[[str], None] | None = None,
    ) -> tuple[dict[str, timing.Timing], str]:
        out = {}
        for name, fns in calls.items():
            if on_start:
                on_start(name)
            fns[0]()
            median = float(medians.get(name, default))
            out[name] = timing.Timing(median, median, median, 1, 1, "injected")
        return out, "injected"

    return time_interleaved


def install(medians: Mapping[str, float] | None = None) -> None:
    timing.time_interleaved = fake_time_interleaved(medians or DEFAULT_MEDIANS)


def install_from_environment() -> None:
    text = os.environ.get("FP4SELECT_TEST_TIMINGS")
    if text:
        install(json.loads(text))
