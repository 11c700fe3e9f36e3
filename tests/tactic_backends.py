"""A fake flashinfer-style kernel library for the tactic tests: one TunableRunner, two tactics.

``fake_mm_fp4`` takes flashinfer.mm_fp4's tactic path with flashinfer's real AutoTuner:
``AutoTuner.get().choose_one("fp4_gemm", [runner], config, inputs)``, then
``runner(inputs=inputs, tactic=tactic)``. Every tactic computes the exact reference, so every
tactic is correct. Profiling times are injected, never measured: flashinfer's per-tactic timer
is replaced, for the duration of a call, by ``PROFILE_MS`` (tactic 1 is the fastest), and CPU
torch's missing graph-capture query answers "not capturing". So which tactic tuning picks never
depends on machine load.

Each forward run (and each injected profiling) is appended to the file named by
``FP4SELECT_TACTICS_LOG`` when set, so a test can see what another process ran.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from flashinfer.autotuner import (
    AutoTuner,
    ConstraintSpec,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
)
from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets, map_to_hybrid_bucket_uncapped

from fp4select.backends import flashinfer_tactics
from fp4select.backends.base import Backend, Capabilities
from fp4select.formats import reference_mm_fp4

NAME = "two_tactics"
PROFILE_MS = {-1: 3.0, 0: 2.0, 1: 1.0}
LOG_ENV = "FP4SELECT_TACTICS_LOG"
ran: list[object] = []  # tactics forward ran with in this process
profiled: list[object] = []  # tactics flashinfer's autotuner profiled in this process


def _log(line: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


class TwoTacticRunner(TunableRunner):
    def get_valid_tactics(self, inputs, profile):
        return [0, 1]

    def forward(self, inputs, tactic=-1, do_preparation=False, **kwargs):
        if do_preparation:
            return None
        a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_nvfp4 = inputs
        ran.append(tactic)
        _log(f"ran {tactic}")
        result = reference_mm_fp4(
            a, b, a_descale, b_descale, alpha, out_dtype, None, block_size, False, use_nvfp4
        )
        out.copy_(result)
        return out


_RUNNER = TwoTacticRunner()
_CONFIG = TuningConfig(
    dynamic_tensor_specs=(
        DynamicTensorSpec((0,), (0,), get_hybrid_num_tokens_buckets, map_to_hybrid_bucket_uncapped),
    ),
    constraint_specs=(
        ConstraintSpec(2, 0, lambda shapes: -(-shapes[0][0] // 128) * 128),
        ConstraintSpec(6, 0, lambda shapes: shapes[0][0]),
    ),
)


def _injected_profile(self, runner, inputs, tactic, tuning_config, *args, **kwargs):
    profiled.append(tactic)
    _log(f"profiled {tactic}")
    return PROFILE_MS[tactic]


@contextlib.contextmanager
def injected_profiling() -> Iterator[None]:
    """flashinfer's timer answers from PROFILE_MS while a fake_mm_fp4 call runs."""
    saved_profile = AutoTuner._profile_single_kernel
    saved_capturing = torch.cuda.is_current_stream_capturing
    AutoTuner._profile_single_kernel = _injected_profile
    if not torch.cuda.is_available():  # CPU torch raises instead of answering False
        torch.cuda.is_current_stream_capturing = lambda: False
    try:
        yield
    finally:
        AutoTuner._profile_single_kernel = saved_profile
        torch.cuda.is_current_stream_capturing = saved_capturing


def fake_mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_8x4, nvfp4, pdl):
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    inputs = [a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, nvfp4]
    with injected_profiling():
        runner, tactic = AutoTuner.get().choose_one("fp4_gemm", [_RUNNER], _CONFIG, inputs)
    runner(inputs=inputs, tactic=tactic)
    return out


BACKEND = Backend(
    name=NAME,
    checked_runner=fake_mm_fp4,
    caps=Capabilities(devices=frozenset({"cpu"})),
    tune=flashinfer_tactics.tune,
    pin=flashinfer_tactics.pinned,
    description="a fake TunableRunner with two tactics, tuned by flashinfer's AutoTuner",
)


def slow_tune(runner, problem, args, *, name=None, progress=None):
    """A tactic tuning whose first JIT compile outlasts the sandbox's patience."""
    if progress is not None:
        progress()
    import time

    time.sleep(600)
    raise AssertionError("the sandbox should have ended this child")


SLOW_TUNING = Backend(
    name="slow_tuning",
    checked_runner=fake_mm_fp4,
    caps=Capabilities(devices=frozenset({"cpu"})),
    tune=slow_tune,
    pin=flashinfer_tactics.pinned,
    description="two tactics, but tuning them takes longer than the probe timeout",
)
