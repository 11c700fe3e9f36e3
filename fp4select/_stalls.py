"""When a timing's samples were stretched by something outside the kernels it timed.

Design rules:

* A candidate's calibration runs the same calls launched one by one, with the host waiting at
  the end; a CUDA graph replaying them is not meaningfully slower. Samples over
  ``STALL_FACTOR`` times slower a call than that, and by at least ``STALL_MARGIN_US``, were
  stretched (a few graphs in a thousand stay slow for life: docs/design.md), so whoever times
  takes them again, once, from a new sampler (``timing.time_interleaved``,
  ``backends.hopper_tactics``).
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
