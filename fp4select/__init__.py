"""fp4select: which FP4 GEMM backend should run this product, here, at this batch size."""

from fp4select._version import __version__
from fp4select.api import (
    best_mm_fp4,
    check_arguments,
    clear_blacklist,
    configure,
    explain,
    reset,
    stats,
)
from fp4select.backends import register_backend, unregister_backend
from fp4select.backends.base import Backend, Capabilities, UnsupportedProblem
from fp4select.keys import Problem, m_bucket
from fp4select.selector import BlacklistedBackendError, NoCorrectBackendError
from fp4select.settings import SettingError, Settings
from fp4select.store import CacheWarning


def tune_pending() -> list:
    """Tune the keys that were served by a fallback while a CUDA graph was being captured."""
    from fp4select.api import selector

    return selector().tune_pending()


__all__ = [
    "Backend",
    "BlacklistedBackendError",
    "CacheWarning",
    "Capabilities",
    "NoCorrectBackendError",
    "Problem",
    "SettingError",
    "Settings",
    "UnsupportedProblem",
    "__version__",
    "best_mm_fp4",
    "check_arguments",
    "clear_blacklist",
    "configure",
    "explain",
    "m_bucket",
    "register_backend",
    "reset",
    "stats",
    "tune_pending",
    "unregister_backend",
]
