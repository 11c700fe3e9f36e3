"""fp4select's one way to say a thing once per process: ``first_time(tag)``, and on it the
store's way to complain, ``warn_once``: a ``CacheWarning``, once per path (or tag).

A cache problem never raises into the caller's program (it re-tunes instead), and a damaged
file looked up a thousand times must not print a thousand warnings. It lives in the store, the
lowest layer (which imports nothing else of fp4select), so that every module can use it; the
selector, the tactic pinning and the engine plugins do (``fp4select.store`` exports both).
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


def first_time(tag: str, seen: set[str] | None = None) -> bool:
    """True the first time ``tag`` comes in this process, then False; thread-safe.

    ``seen``: a set of the caller's own to remember it in (a test may swap it for a new one);
    by default the one set every caller shares, so tags should say whose they are.
    """
    with _WARNED_LOCK:
        seen = _WARNED if seen is None else seen
        if tag in seen:
            return False
        seen.add(tag)
        return True


def warn_once(tag: str, message: str) -> None:
    """Warn with ``message`` unless ``tag`` was warned about before in this process."""
    if not first_time(tag):
        return
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
