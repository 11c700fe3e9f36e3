"""The store's one way to complain: a ``CacheWarning``, once per path (or tag) per process.

A cache problem never raises into the caller's program (it re-tunes instead), and a damaged
file looked up a thousand times must not print a thousand warnings.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from types import FrameType

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


class CacheWarning(UserWarning):
    """The cache could not be used as is; fp4select carries on as if it missed."""


def warn_once(tag: str, message: str) -> None:
    """Warn with ``message`` unless ``tag`` was warned about before in this process."""
    with _WARNED_LOCK:
        if tag in _WARNED:
            return
        _WARNED.add(tag)
    # Point at the first caller outside this package, however deep the call came from.
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _PACKAGE_DIR:
        frame = frame.f_back
        level += 1
    warnings.warn(message, CacheWarning, stacklevel=level)


def _after_fork_in_child() -> None:
    # Another thread may have held the lock at fork time; the child must not inherit that.
    global _WARNED_LOCK
    _WARNED_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
