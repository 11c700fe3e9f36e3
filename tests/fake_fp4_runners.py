"""Fake FP4 runners that behave like flashinfer 0.7.4's real ones, for the tactic tests.

Each one is modelled on a runner read in flashinfer 0.7.4's ``gemm/gemm_base.py`` and
``gemm/kernels/sm12x_cute``: the shape of its tactic values, whether its tactic list depends on
M, whether it has a ``validate_tactic``, and what it does with a tactic it cannot run.

* ``TrtllmGemmRunner``: int tactics (cubin indices) whose list depends on M, N, K and is read
  from the profile; no validator; an invalid tactic raises (``unsupported tactic id in run``).
* ``Sm12xCuTeFp4GemmRunner``: tuples holding strings and bools (``("independent",)``,
  ``("raw", 64, 32, 8, False, True, 128, False, False, False, False)``); "raw" tiles only where
  M % 128 == 0 (and N % 128, K % 256); has ``validate_tactic``; an invalid tactic raises.
* ``CudnnFp4GemmRunner``: ``(engine id, ((knob, value), ...))``; an invalid tactic is silently
  replaced by its default (flashinfer warns and runs tactic -1).
* ``CutlassFp4GemmRunner``: ``range(n)``; -1 is config 0; an invalid tactic raises.

The class names are the real ones, so ``default_kind`` and the pin's class match apply. Every
tactic computes the exact reference, so any tactic is correct: tests compare which one ran
(``ran``: (class, tactic asked, tactic run, M, number of inputs)). Profiling times are injected
(``injected``), never measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
from flashinfer.autotuner import AutoTuner, TunableRunner

from fp4select.formats import reference_mm_fp4

ran: list[tuple[str, Any, Any, int, int]] = []
profiled: list[tuple[str, Any]] = []


def _compute(inputs: list[Any]) -> torch.Tensor:
    a, b, a_descale, b_descale, alpha, out_dtype, out, block_size, use_nvfp4, _ = inputs
    result = reference_mm_fp4(
        a, b, a_descale, b_descale, alpha, out_dtype, None, block_size, False, use_nvfp4
    )
    out.copy_(result)
    return out


def _mnk(inputs: list[Any]) -> tuple[int, int, int]:
    a, b = inputs[0], inputs[1]
    return int(a.shape[0]), int(b.shape[1]), int(a.shape[1]) * 2


class _Base(TunableRunner):
    def _run(self, inputs: list[Any], asked: Any, runs: Any) -> torch.Tensor:
        ran.append((type(self).__name__, asked, runs, int(inputs[0].shape[0]), len(inputs)))
        return _compute(inputs)


class TrtllmGemmRunner(_Base):
    """Cubins by M: small M gets 0-2, large M gets 3-5; N and K narrow it further."""

    @staticmethod
    def tactics(m: int, n: int, k: int) -> list[int]:
        base = [0, 1, 2] if m <= 64 else [3, 4, 5]
        return [t for t in base if not (t == 5 and m % 256)]  # 5: only at M % 256 == 0

    def get_valid_tactics(self, inputs, profile):
        a, b = profile.get_opt_shapes()[0], profile.get_opt_shapes()[1]
        return self.tactics(a[0], b[1], a[1] * 2)

    def forward(self, inputs, tactic=-1, do_preparation=False, **kwargs):
        if do_preparation:
            return None
        m, n, k = _mnk(inputs)
        if tactic != -1 and tactic not in self.tactics(m, n, k):
            raise RuntimeError(f"unsupported tactic id in run: {tactic!r}")
        return self._run(inputs, tactic, tactic if tactic != -1 else "heuristic")


RAW = ("raw", 64, 32, 8, False, True, 128, False, False, False, False)
RAW_SWAP = ("raw", 32, 64, 13, True, True, 128, False, False, False, False)


class Sm12xCuTeFp4GemmRunner(_Base):
    """flashinfer's SM12x policy: "raw" tiles need M % 128 == 0, N % 128 == 0, K % 256 == 0."""

    @staticmethod
    def tactics(m: int, n: int, k: int) -> list[tuple]:
        choices: list[tuple] = [("independent",)] + ([("independent_tma",)] if m > 32 else [])
        if m % 128 == 0 and n % 128 == 0 and k % 256 == 0:
            choices += [RAW, RAW_SWAP]
        return choices

    def validate_tactic(self, inputs, tactic):
        return tactic is None or tactic == -1 or tactic in self.tactics(*_mnk(inputs))

    def get_valid_tactics(self, inputs, profile):
        return self.tactics(*_mnk(inputs))

    def forward(self, inputs, tactic=-1, do_preparation=False, **kwargs):
        if do_preparation:
            return inputs[6]
        if not self.validate_tactic(inputs, tactic):
            raise ValueError("Invalid SM12x cute-dsl tactic or actual input contract")
        runs = tactic if tactic not in (None, -1) else ("independent",)
        return self._run(inputs, tactic, runs)


class CudnnFp4GemmRunner(_Base):
    """Engine id + knob pairs; a plan it cannot build is silently replaced by its default."""

    TACTICS: ClassVar[list[Any]] = [(3, ((1, 0), (7, 2))), (5, ()), (9, ((2, 1),))]
    substituted: ClassVar[list[Any]] = []

    def get_valid_tactics(self, inputs, profile):
        return list(self.TACTICS)

    def forward(self, inputs, tactic=-1, do_preparation=False, **kwargs):
        if do_preparation:
            return None
        if tactic != -1 and tactic not in self.TACTICS:
            CudnnFp4GemmRunner.substituted.append(tactic)  # flashinfer: warn, run tactic -1
            return self._run(inputs, tactic, "heuristic")
        return self._run(inputs, tactic, tactic if tactic != -1 else "heuristic")


class CutlassFp4GemmRunner(_Base):
    """``range(3)``; its -1 is config 0, not a heuristic."""

    def get_valid_tactics(self, inputs, profile):
        return [0, 1, 2]

    def forward(self, inputs, tactic=-1, do_preparation=False, **kwargs):
        if do_preparation:
            return None
        runs = 0 if tactic == -1 else tactic
        if runs not in (0, 1, 2):
            raise RuntimeError(f"Invalid tactic {tactic!r}")
        return self._run(inputs, tactic, runs)


RUNNERS = (TrtllmGemmRunner, Sm12xCuTeFp4GemmRunner, CudnnFp4GemmRunner, CutlassFp4GemmRunner)


@contextlib.contextmanager
def injected(times_ms: Mapping[Any, float], fail: Any = ()) -> Iterator[list[Any]]:
    """flashinfer's per-tactic timer answers ``times_ms[tactic]`` (9.0 if absent); a tactic in
    ``fail`` raises (an exception instance there is raised as it is). Yields the tactics timed."""
    timed: list[Any] = []
    saved_profile = AutoTuner._profile_single_kernel
    saved_capturing = torch.cuda.is_current_stream_capturing

    def profile(self, runner, inputs, tactic, tuning_config, *args, **kwargs):
        timed.append(tactic)
        profiled.append((type(runner).__name__, tactic))
        for failure in fail if isinstance(fail, (list, tuple)) else [fail]:
            if isinstance(failure, BaseException):
                raise failure
            if failure == tactic:
                raise RuntimeError(f"tactic {tactic!r} failed while profiling")
        return times_ms.get(tactic, 9.0)

    AutoTuner._profile_single_kernel = profile
    if not torch.cuda.is_available():  # CPU torch raises instead of answering False
        torch.cuda.is_current_stream_capturing = lambda: False
    try:
        yield timed
    finally:
        AutoTuner._profile_single_kernel = saved_profile
        torch.cuda.is_current_stream_capturing = saved_capturing
