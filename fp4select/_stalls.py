"""When a timing's samples were stretched by something outside the kernels it timed.

Design rules:

* A candidate's calibration runs the same calls launched one by one, with the host waiting at
  the end; a CUDA graph replaying them, or the same loop timed again, is not meaningfully
  slower. Samples over ``STALL_FACTOR`` times slower a call than that, and by at least
  ``STALL_MARGIN_US``, were stretched: on the H200 a few graphs in a thousand replayed
  40-180x slower than their kernels run, every replay of their life, while the graphs beside
  them ran normally (docs/hopper_kernels.md). Whoever times takes them again, once, from a
  new sampler (``timing.time_interleaved``; ``backends.hopper_tactics`` for its tactics).
  The same rule between a candidate's samples and the fastest rival's, or a new capture's
  first sample, is how ``time_interleaved`` finds a stalled launch-bound candidate.
* A leaf module: the Hopper tactics' timing sits below ``timing`` in the imports.
"""

from __future__ import annotations

STALL_FACTOR = 3.0  # samples this many times slower per call than calibration: taken again
STALL_MARGIN_US = 50.0  # ... and slower by at least this much per call


def stalled(sampled_us: float, calibration_us: float) -> bool:
    """Whether samples (median, microseconds a call) ran far slower than the calibration."""
    return sampled_us > STALL_FACTOR * calibration_us and sampled_us - calibration_us > (
        STALL_MARGIN_US
    )
