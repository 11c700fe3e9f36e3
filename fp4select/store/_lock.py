"""Per-key locks: N processes (and threads) missing the same key at once tune it once.

``filelock.FileLock`` does the work: an ``flock`` on ``locks/<key_hash>.lock``, reentrant
within a thread, and, being thread-local, it serializes the threads of one process as well
(each thread opens its own descriptor, and ``flock`` locks conflict between descriptors;
a waiting thread polls every 50 ms, which is nothing beside a tuning that takes seconds).
What stays here, and why:

- One ``FileLock`` per path per process, in a registry emptied in a forked child, instead of
  ``FileLock(..., is_singleton=True)``: filelock before its fork fix (the floor, 3.20.3,
  is before it) hands a forked child the parent's singleton with the forking thread's hold
  count, so the child would believe it holds a lock its parent holds.  A fresh instance in
  the child opens its own descriptor and waits for the parent like any other process.
- A lock entered in a parent and left (or collected) in a forked child is not released
  there: on filelock 3.x, releasing unlocks the open file description the child shares with
  its parent, so the parent would lose its lock.  The child closes its duplicate descriptor
  instead (``_forget_inherited_hold``, which reads filelock 3.x's per-thread context: the one
  place this module touches filelock's internals, and only on versions without fork handling).
- ``check_lock_file``: filelock >= 3.20.3 opens with ``O_NOFOLLOW``, so a planted symlink
  fails there; a planted hard link would be opened and, by filelock 4.2.0 and older,
  truncated.  So anything but a regular file with one link is refused before filelock opens
  it (a race with an active attacker remains).
- A per-path ``threading.RLock`` when no lock file can be used (memory-only root, a refused
  or unopenable lock file; one warning): threads of this process stay serialized, other
  processes may tune the same key, which costs time, never correctness.

Waiting longer than ``timeout`` s (negative or infinite: forever) raises
``filelock.Timeout``.  Lock files are never deleted: unlinking one that another process holds
breaks mutual exclusion.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import filelock

from ._jsonfile import Damage, what
from ._warn import warn_once

_GUARD = threading.Lock()
_FILE_LOCKS: dict[str, filelock.BaseFileLock] = {}
_THREAD_LOCKS: dict[str, threading.RLock] = {}


def _after_fork_in_child() -> None:
    # Another thread may have held any of these at fork time; the child must not inherit that.
    global _GUARD
    _GUARD = threading.Lock()
    for lock in _FILE_LOCKS.values():
        _forget_inherited_hold(lock)
    _FILE_LOCKS.clear()
    _THREAD_LOCKS.clear()


def _forget_inherited_hold(lock: filelock.BaseFileLock) -> None:
    """Drop, in a forked child, the forking thread's hold on ``lock`` without unlocking it.

    filelock without its own fork handling (3.x: no creator pid on the object) would release
    it when the child collects the object (``__del__``), unlocking the open file description
    the child shares with its parent.  Closing the child's duplicate descriptor never unlocks.
    """
    if hasattr(lock, "_creator_pid"):
        return  # this filelock tracks the creating process and never unlocks from a child
    context = getattr(lock, "_context", None)
    fd = getattr(context, "lock_file_fd", None)
    if context is None or not isinstance(fd, int):
        return
    with contextlib.suppress(OSError):
        os.close(fd)
    context.lock_file_fd = None
    context.lock_counter = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def check_lock_file(path: Path) -> None:
    """Refuse (``Damage``) a lock file that something else was made into: see the docstring."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(info.st_mode):
        raise Damage(errno.EPERM, f"it is {what(info.st_mode)}, not a lock file", str(path))
    if info.st_nlink > 1:
        raise Damage(errno.EPERM, "it is a hard link to another file", str(path))


def _file_lock(path: Path) -> filelock.BaseFileLock:
    with _GUARD:
        lock = _FILE_LOCKS.get(str(path))
        if lock is None:
            lock = _FILE_LOCKS[str(path)] = filelock.FileLock(str(path))
        return lock


def _thread_lock(path: Path) -> threading.RLock:
    with _GUARD:
        lock = _THREAD_LOCKS.get(str(path))
        if lock is None:
            lock = _THREAD_LOCKS[str(path)] = threading.RLock()
        return lock


class KeyLock(AbstractContextManager[None]):
    """Hold the lock at ``path``; see the module docstring.

    ``prepare()`` makes the lock's directory; it returns False when no lock file may be used
    (the store is memory-only) and raises ``OSError`` when the directory is unusable.
    ``what_root`` names the root in the one fallback warning.
    """

    def __init__(
        self, path: Path, timeout: float, prepare: Callable[[], bool], what_root: str
    ) -> None:
        self._path = path
        self._timeout = -1.0 if timeout < 0 or math.isinf(timeout) else timeout
        self._prepare = prepare
        self._what_root = what_root
        self._held: list[filelock.BaseFileLock | threading.RLock] = []  # one per nested entry

    def __enter__(self) -> None:
        lock = _FILE_LOCKS.get(str(self._path))
        if lock is None or not lock.is_locked:  # reentry needs no checks: the file is ours
            lock = self._usable_file_lock()
        if lock is not None:
            try:
                lock.acquire(timeout=self._timeout)
            except filelock.Timeout:  # an OSError too, so it must go first
                raise
            except (OSError, NotImplementedError) as exc:
                self._cannot_lock(exc)
                lock = None
        if lock is None:
            rlock = _thread_lock(self._path)
            if not rlock.acquire(timeout=self._timeout):
                raise filelock.Timeout(str(self._path))
            self._held.append(rlock)
        else:
            self._held.append(lock)

    def _usable_file_lock(self) -> filelock.BaseFileLock | None:
        try:
            if not self._prepare():
                return None
            check_lock_file(self._path)
        except OSError as exc:
            self._cannot_lock(exc)
            return None
        return _file_lock(self._path)

    def _cannot_lock(self, exc: BaseException) -> None:
        warn_once(
            f"lock:{self._what_root}",
            f"fp4select cache: cannot lock files under {self._what_root} ({exc}); only threads "
            "of this process are serialized, so other processes may tune the same problem.",
        )

    def __exit__(self, *exc_info: object) -> None:
        assert self._held, "lock released without being acquired"
        self._held.pop().release()
