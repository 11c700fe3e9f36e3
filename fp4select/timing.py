"""Timing candidates the way engines run them, and ranking them so every process agrees.

Design rules:

* On CUDA a sample is one CUDA-graph replay of R calls, timed with events, divided by R:
  engines replay graphs, so launch overhead counts as it does in serving, no more. Where a
  candidate cannot be captured, every candidate of that key is timed eagerly instead, so
  times stay comparable; the method is recorded.
* Cold L2: the R calls rotate over enough input sets to overflow the L2 cache (three times
  its size), because in serving the weights of a layer are not in L2 when its GEMM starts.
* Candidates are interleaved round by round (the order rotating), so clock and thermal drift
  hit all of them alike. The statistic is the median; the spread is the 10th-90th percentile.
* Ranking: the fastest median wins unless another candidate is within the tie window of it;
  then the lower ``preference`` wins, so ranks and restarts pick the same backend when the
  measurement cannot tell them apart. The window is the *fastest* candidate's half-spread
  (p10-p90), at least 2% and at most ``MAX_TIE_TOLERANCE`` (5%): a slow candidate's own noise
  never widens it, so no candidate slower than the fastest by more than the cap can win,
  however noisy. When the fastest's spread exceeds the cap the ranking says ``too_noisy``.
  The margin to the runner-up is recorded. When nothing was timed (one correct candidate, or
  timing failed) the preference order alone decides (``preference_ranking``).
* On the CPU the same statistics come from ``time.perf_counter``.
* A time budget bounds each key: rounds stop once it is spent and the minimum is met.
* Hopeless candidates stop costing time (docs/hopper_kernels.md, 'Where the time goes').
  Once the minimum is met, a candidate sits out the later rounds when its median is over
  ``DROP_FACTOR`` times the fastest's, or when even its p10 is over twice the widest tie
  window behind the fastest's median: it could neither win nor tie. Rounds end when one
  candidate is left (one timed alone still gets the budget: repetition is the point).
  Calibration starts with one call per candidate; one whose call took over
  ``HOPELESS_FACTOR`` times the fastest's is not sampled at all, its timing that one
  wall-clock call (never less than the truth). Before that it gets ``CALIBRATION_RETRIES``
  calls more and its fastest counts: the first may pay for a compile, and one wall-clock call
  can be stretched by the host (docs/hopper_kernels.md, 'Measured', cfc0bea's outlier).
  Emulation, a fallback, is not timed on a GPU at all (the selector's rules).
* A candidate whose samples ran far slower per call than its own calibration (``_stalls``)
  gets a new sampler (on CUDA its graph captured again) and its samples taken again, once;
  its method then ends in ``+resampled``. So does one far slower than the fastest if its new
  sampler's first sample is far faster: where launching outlasts the kernels, calibration is
  as slow as a stalled graph, and only a new capture tells (docs/hopper_kernels.md, 'In turn').
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypedDict, cast

import torch

from fp4select._stalls import stalled
from fp4select.records import Timing, TimingOptions

MIN_TIE_TOLERANCE = 0.02
MAX_TIE_TOLERANCE = 0.05
DROP_FACTOR = 1.25  # after min_rounds, a median this far behind the fastest stops being sampled
HOPELESS_FACTOR = 10.0  # a calibration this far behind the fastest's: not sampled at all
CALIBRATION_RETRIES = 2  # calls more for a candidate whose first looked hopeless


def input_sets_for_cold_l2(device: torch.device, bytes_per_set: int, cold_l2: bool) -> int:
    """How many input sets the rotation needs so that L2 never holds the next one."""
    if not cold_l2 or device.type != "cuda" or bytes_per_set <= 0:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return max(1, min(64, -(-3 * l2 // bytes_per_set)))


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_us: Sequence[float], calls_per_sample: int, method: str) -> Timing:
    ordered = sorted(samples_us)
    return Timing(
        median_us=statistics.median(ordered),
        p10_us=_quantile(ordered, 0.1),
        p90_us=_quantile(ordered, 0.9),
        samples=len(ordered),
        calls_per_sample=calls_per_sample,
        method=method,
    )


class _Sampler:
    """Runs R calls of one candidate and returns microseconds per call."""

    def __init__(
        self, calls: Sequence[Callable[[], Any]], reps: int, device: torch.device, graph: bool
    ):
        self.calls = calls
        self.reps = reps
        self.device = device
        self.graph: Any = None
        if graph:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for fn in calls:  # warm-up on the capture stream, as torch recommends
                    fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            # torch.cuda.graph empties the allocator's cache first, which frees the pools of
            # the graphs captured before; without it they pile up until a capture runs OOM.
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._loop()

    def _loop(self) -> None:
        calls, n = self.calls, len(self.calls)
        for i in range(self.reps):
            calls[i % n]()

    def sample(self) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            self._loop()
            return (time.perf_counter() - start) * 1e6 / self.reps
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._loop()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e3 / self.reps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _calls_per_sample(
    calls: Sequence[Callable[[], Any]], device: torch.device, target_s: float
) -> tuple[int, float]:
    """Enough calls that one sample dwarfs event and launch resolution (a multiple of the
    sets), and the seconds per call this calibration run took."""
    sync(device)
    start = time.perf_counter()
    for fn in calls:
        fn()
    sync(device)
    per_call = max((time.perf_counter() - start) / len(calls), 1e-7)
    reps = max(1, int(target_s / per_call))
    sets = len(calls)
    return max(sets, -(-reps // sets) * sets), per_call


def time_interleaved(
    calls: Mapping[str, Sequence[Callable[[], Any]]],
    device: torch.device,
    options: TimingOptions = TimingOptions(),
    on_start: Callable[[str], None] | None = None,
) -> tuple[dict[str, Timing], str]:
    """Time every candidate; returns (timings, method). ``calls[name]`` rotates over input sets.

    ``on_start(name)`` is called before a candidate first runs here, so that a sandbox parent
    knows whom to blame if the process dies while timing.
    """
    names = list(calls)
    if not names:
        return {}, "none"
    use_graph = device.type == "cuda" and options.use_cuda_graph
    samplers: dict[str, _Sampler] = {}
    method = (
        "cuda-graph" if use_graph else ("cuda-events" if device.type == "cuda" else "wall-clock")
    )

    def one_call_s(name: str) -> float:
        if on_start:
            on_start(name)
        return _calls_per_sample(calls[name][:1], device, 0.0)[1]

    # One call each first: a hopeless candidate is found before it runs once per input set.
    calibration_s = {name: one_call_s(name) for name in names}
    for name in _hopeless(calibration_s):  # again (see the module rules): the fastest call counts
        for _ in range(CALIBRATION_RETRIES):
            calibration_s[name] = min(calibration_s[name], one_call_s(name))
            if name not in _hopeless(calibration_s):
                break
    hopeless = _hopeless(calibration_s)
    reps = {}
    for name in [n for n in names if n not in hopeless]:
        if on_start:
            on_start(name)
        reps[name], calibration_s[name] = _calls_per_sample(
            calls[name], device, options.target_sample_s
        )
    # The full calibration may show one more. One found hopeless before stays so: it has no
    # reps, and sampled without them its timing would fail (and the key lose every timing).
    later = _hopeless({n: calibration_s[n] for n in reps})
    hopeless = [n for n in names if n not in reps or n in later]
    names = [n for n in names if n not in hopeless]
    if use_graph:
        try:
            for name in names:
                if on_start:
                    on_start(name)
                samplers[name] = _Sampler(calls[name], reps[name], device, graph=True)
        except Exception as exc:  # one uncapturable candidate: time everyone eagerly
            samplers.clear()
            method = f"cuda-events (graph capture failed: {type(exc).__name__}: {exc})"[:200]
            use_graph = False
            sync(device)
    if not samplers:
        samplers = {n: _Sampler(calls[n], reps[n], device, graph=False) for n in names}
    if options.cold_l2 and device.type == "cuda":
        method += "+cold-l2"

    samples: dict[str, list[float]] = {n: [] for n in names}
    deadline = time.perf_counter() + options.budget_s
    active = list(names)
    for round_index in range(options.max_rounds):
        shift = round_index % len(active)
        for name in active[shift:] + active[:shift]:
            if on_start:
                on_start(name)
            samples[name].append(samplers[name].sample())
        if round_index + 1 >= options.min_rounds:
            if time.perf_counter() > deadline:
                break
            active = _contenders(active, samples)
            if len(active) == 1 and len(calls) > 1:  # rivals dropped: nothing left to rank
                break
    methods = dict.fromkeys(names, method)
    fastest = min(statistics.median(samples[n]) for n in names)
    for name in names:  # a stalled sampler: built again and sampled again, once (module rules)
        median = statistics.median(samples[name])
        behind_own_calls = stalled(median, calibration_s[name] * 1e6)
        if not (behind_own_calls or stalled(median, fastest)):
            continue
        if on_start:
            on_start(name)
        del samplers[name]  # a graph's memory pool is freed before the next capture
        samplers[name] = _Sampler(calls[name], reps[name], device, graph=use_graph)
        probe = samplers[name].sample()
        if not behind_own_calls and not stalled(median, probe):
            continue  # as slow from a new capture: the candidate is, not its sampler
        samples[name] = [probe] + [samplers[name].sample() for _ in samples[name][1:]]
        methods[name] = method + "+resampled"
    timings = {n: summarize(samples[n], reps[n], methods[n]) for n in names}
    for name in hopeless:  # the calibration run: one synchronized wall-clock sample
        per_sample = len(calls[name]) if name in reps else 1  # the whole rotation, or one call
        timings[name] = summarize([calibration_s[name] * 1e6], per_sample, "calibration")
    return timings, method


def _hopeless(calibration_s: Mapping[str, float]) -> list[str]:
    fastest = min(calibration_s.values())
    return [n for n, s in calibration_s.items() if s > HOPELESS_FACTOR * fastest]


def _contenders(active: list[str], samples: Mapping[str, list[float]]) -> list[str]:
    """The candidates still worth sampling (see the module rules)."""
    stats = {n: summarize(samples[n], 1, "") for n in active}
    fastest = min(t.median_us for t in stats.values())
    separated = fastest * (1 + 2 * MAX_TIE_TOLERANCE)
    return [
        n
        for n, t in stats.items()
        if t.median_us <= fastest * DROP_FACTOR and t.p10_us <= separated
    ]


class _RankingCore(TypedDict):
    winner: str
    order: list[str]  # the winner first, then the rest fastest first (or by preference)
    margin: float | None  # runner-up median / winner median - 1; None when nothing was timed
    tie_broken_by_preference: bool


class RankingRecord(_RankingCore, total=False):
    """A ranking as a decision records it (``Decision.ranking``, JSON).

    ``tie_window`` and ``too_noisy`` are there when timings decided (``Ranking.to_json``), not
    when the preference order alone did (``preference_ranking``).
    """

    tie_window: float
    too_noisy: bool


@dataclass
class Ranking:
    winner: str
    order: list[str]
    margin: float | None  # runner-up median / winner median - 1; None with one candidate
    tie_broken_by_preference: bool
    tie_window: float = MIN_TIE_TOLERANCE  # relative to the fastest median
    too_noisy: bool = False  # the fastest's own spread was wider than MAX_TIE_TOLERANCE

    def to_json(self) -> RankingRecord:
        return cast(RankingRecord, asdict(self))  # the same fields, the order list copied


def tie_window(fastest: Timing) -> float:
    """How far behind the fastest median a candidate may be and still count as tied with it."""
    return min(MAX_TIE_TOLERANCE, max(MIN_TIE_TOLERANCE, fastest.half_spread))


def rank(timings: Mapping[str, Timing], preference: Mapping[str, int]) -> Ranking:
    """The fastest candidate, unless a preferred one is inside the tie window of it."""
    if not timings:
        raise ValueError("rank() needs at least one timing")
    by_speed = sorted(timings, key=lambda n: (timings[n].median_us, preference.get(n, 100), n))
    fastest = by_speed[0]
    best = timings[fastest]
    window = tie_window(best)
    tied = [n for n in by_speed if timings[n].median_us <= best.median_us * (1 + window)]
    winner = min(tied, key=lambda n: (preference.get(n, 100), n))
    order = [winner] + [n for n in by_speed if n != winner]
    margin = None
    if len(order) > 1:
        margin = timings[order[1]].median_us / timings[winner].median_us - 1
    return Ranking(
        winner,
        order,
        margin,
        winner != fastest,
        tie_window=window,
        too_noisy=best.half_spread > MAX_TIE_TOLERANCE,
    )


def preference_ranking(names: Iterable[str], preference: Mapping[str, int]) -> RankingRecord:
    """The ranking when nothing was timed: the lowest ``preference`` wins, then the name."""
    order = sorted(names, key=lambda n: (preference.get(n, 100), n))
    if not order:
        raise ValueError("preference_ranking() needs at least one name")
    return RankingRecord(
        winner=order[0], order=order, margin=None, tie_broken_by_preference=len(order) > 1
    )
