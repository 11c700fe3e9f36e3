"""On-disk memory of fp4select's decisions: one JSON file per (environment, problem key).

This is the lowest layer of fp4select and imports nothing else from it: environments,
keys and records are plain JSON-able dicts here.  The rules below exist because a cache
that can break the program it is meant to speed up is worse than no cache.

Rules
-----
1. Location.  ``Store(root)``; ``root=None`` means ``$FP4SELECT_CACHE_DIR`` when set and
   non-empty, else ``platformdirs.user_cache_dir("fp4select")``; made absolute at
   construction so a later ``chdir`` cannot move it.  Layout::

       <root>/v<SCHEMA_VERSION>/<env_hash>/env.json
                                          /entries/<key_hash>.json
                                          /locks/<key_hash>.lock
                                          /blacklist/<backend_file_name>.json

   The schema number is in the path so that fp4select versions with different schemas can
   share a root without reading each other's files.
2. Hashes.  ``digest(obj)`` is the first 20 hex digits of the sha256 of the canonical JSON
   (``sort_keys=True, separators=(",", ":")``, ASCII, no NaN or infinity): dict order never
   matters, tuples and lists hash alike.  Changing it orphans every cache; a test freezes it.
3. Strict JSON only.  Nothing read is imported or executed, and parsing refuses NaN,
   Infinity and floats that overflow to infinity (Python's json accepts all three).  Every
   file carries ``{"schema", "kind": "fp4select.<entry|blacklist|env>", "env_hash", "env"}``
   (entries also their ``key``) so each is self-describing and ``read_entry`` can check it
   answers the question asked; blacklist records are checked field by field.  Writing
   what is not strict JSON, or a file over 1 MiB, raises before anything is written.
4. Only what fp4select made.  A file is read only if it is a regular file of at most 1 MiB,
   opened with ``O_NONBLOCK | O_NOFOLLOW`` (a FIFO cannot block, a symlink to ``/dev/zero``
   is never followed), and only below directories that are real ones (the root itself may
   be a symlink: the user chose it).  A directory, symlink, FIFO or device where fp4select
   keeps a file is damage (rule 6): never read, followed or deleted.  A write or ``clear``
   may replace or unlink such a *name* (a symlink, a FIFO), never what it points at, and
   nothing here removes a directory: there is no recursive delete in this module.
5. Atomic writes: temp file in the same directory (``mkstemp``, named ``.*`` so no reader
   lists it), ``fsync``, ``os.replace``.  A reader sees the old file or the new one, never
   half; a damaged file loses only itself.  The directory is not fsynced: after a power cut
   an entry may be missing, which is a miss.  Temp files are removed on any failure.
6. Damaged files are misses.  Truncated, empty, not UTF-8, not strict JSON, not an object,
   another schema or kind, another env or key, unreadable, or not ours (rule 4): the lookup
   misses with exactly one ``CacheWarning`` per path per process, never an exception (the
   caller re-tunes).  The file stays (a newer fp4select may own it) until a write replaces
   it.  ``clear`` and the ``remove`` methods delete damaged files, never a directory: that
   is left, warned about and listed in ``ClearResult.not_removed``.
7. Failing disk.  Any ``OSError`` while writing (read-only, ``ENOSPC``, a directory in the
   way, a symlinked directory in the path) switches the root to memory-only for the rest of
   the process, with one warning.  Writes then go to an in-memory overlay that reads consult
   first; existing files stay readable.  The state is per root and per process (a fresh
   ``Store`` does not retry).  ``write_entry`` and ``add_to_blacklist`` return whether the
   record reached the disk, and deletes report a record only hidden from this process.
8. Locks.  ``store.lock(env, key)`` serializes tuning of one key across processes, so that N
   processes missing the same key at once tune it once::

       record = store.read_entry(env, key)
       if record is None:
           with store.lock(env, key):
               record = store.read_entry(env, key)  # someone may have tuned it meanwhile
               if record is None:
                   record = tune()
                   store.write_entry(env, key, record)

   A ``filelock.FileLock`` on ``locks/<key_hash>.lock`` behind a per-process
   ``threading.RLock`` (threads are serialized too, reentrant within a thread, and still
   when no lock file can be used).  filelock >= 3.20.3 opens it with ``O_NOFOLLOW``, so a
   planted symlink fails the file lock instead of truncating its target; a planted hard
   link (which filelock 4.2.0 and older truncate once locked) is refused before filelock
   sees it.  Memory-only, or no usable lock file (one warning): only the per-process lock
   is held, and other processes may tune the same key, which costs time, never correctness.
   Waiting longer than ``timeout`` s (negative or infinite: forever) raises
   ``filelock.Timeout``.  Lock files are never deleted: unlinking one that another process
   holds breaks mutual exclusion.
9. Blacklist.  Per environment, one file per backend (last writer wins): concurrent
   additions of different backends cannot lose each other.  Names that are not safe
   lowercase file names get a sanitized name plus a hash suffix.  Numerical rejections of
   one (backend, key) belong in that key's entry, not here.
10. Archives are explicit user actions, so problems raise.  ``export_archive`` writes one
    new file, whole or not at all: a directory is refused, and so is any existing name
    unless ``overwrite`` (which replaces the name, never writing through a symlink).
    ``import_archive`` reads a regular file of at most 256 MiB, validates everything
    (``ValueError`` naming the problem) before writing anything, refuses blacklist records
    for ``protected_backends``, and returns what it did, record by record.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import stat
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import filelock
import platformdirs

__all__ = [
    "ENV_VAR",
    "SCHEMA_VERSION",
    "CacheWarning",
    "ClearResult",
    "ExportResult",
    "ImportResult",
    "Store",
    "default_root",
    "digest",
]

SCHEMA_VERSION: Final[int] = 1
ENV_VAR: Final[str] = "FP4SELECT_CACHE_DIR"

_KIND_ENTRY: Final = "fp4select.entry"
_KIND_BLACKLIST: Final = "fp4select.blacklist"
_KIND_ENV: Final = "fp4select.env"
_KIND_ARCHIVE: Final = "fp4select.archive"

_DIGEST_CHARS: Final = 20
_ENV_DIR = re.compile(r"[0-9a-f]{20}")
_ENTRY_FILE = re.compile(r"([0-9a-f]{20})\.json")
_BLACKLIST_FILE = re.compile(r"([a-z0-9][a-z0-9._-]*)\.json")
_SAFE_BACKEND = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_UNSAFE_CHARS = re.compile(r"[^a-z0-9._-]+")


class CacheWarning(UserWarning):
    """The cache could not be used as is; fp4select carries on as if it missed."""


@dataclass(frozen=True)
class ClearResult:
    """What ``Store.clear`` did.  A record only hidden from this process is not counted.

    ``not_removed`` names the files still on disk: a directory squatting on an entry's name
    (never ours to delete), or a file the disk refused to delete (the store is memory-only).
    """

    entries: int = 0
    blacklist: int = 0
    not_removed: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "not_removed": list(self.not_removed)}


@dataclass(frozen=True)
class ExportResult:
    """What ``Store.export_archive`` wrote."""

    entries: int = 0
    blacklist: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ImportResult:
    """What ``Store.import_archive`` did, record by record.

    ``*_in_memory`` counts records the store kept in this process only because it could not
    write (rule 7): they are lost when the process ends.  ``*_present`` counts records skipped
    because one was already there (``overwrite=False``); ``blacklist_protected`` names the
    backends whose records were refused because the caller protects them; ``entries_invalid``
    says why each entry the caller's ``check_entry`` refused was skipped.
    """

    entries_written: int = 0
    entries_in_memory: int = 0
    entries_present: int = 0
    blacklist_written: int = 0
    blacklist_in_memory: int = 0
    blacklist_present: int = 0
    blacklist_protected: tuple[str, ...] = ()
    entries_invalid: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "blacklist_protected": list(self.blacklist_protected),
            "entries_invalid": list(self.entries_invalid),
        }


# --------------------------------------------------------------------------- hashing / JSON


def _canonical(obj: Any) -> str:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


def digest(obj: Any) -> str:
    """Name a JSON-able value by content, so equal dicts share a file whatever their order.

    Raises ``TypeError`` for values JSON cannot hold and ``ValueError`` for NaN or infinity.
    """
    return hashlib.sha256(_canonical(obj).encode("ascii")).hexdigest()[:_DIGEST_CHARS]


def _file_bytes(obj: Mapping[str, Any]) -> bytes:
    # Indented for people reading the cache; ASCII so any lone surrogate survives encoding.
    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False)
    return (text + "\n").encode("ascii")


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


class _NotStrictJSON(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotStrictJSON(f"holds {name}, which strict JSON does not allow")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to infinity without ever saying "Infinity"
        raise _NotStrictJSON(f"holds {text}, which is not a finite number")
    return value


def _decode(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """Parse one file as strict JSON (no NaN or infinity, which Python's json accepts);
    a problem comes back as text because it becomes a warning or an error."""
    if not data.strip():
        return None, "empty file"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        return None, "JSON nested too deeply"
    except _NotStrictJSON as exc:
        return None, str(exc)
    except ValueError as exc:
        return None, f"not valid JSON, truncated or corrupt ({exc})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, found {_json_type(obj)}"
    return obj, None


def _digest_or_none(obj: Any) -> str | None:
    try:
        return digest(obj)
    except (TypeError, ValueError, RecursionError):
        return None


def _as_dict(value: Mapping[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping, not {type(value).__name__}")
    return value if isinstance(value, dict) else dict(value)


def _hash(value: Mapping[str, Any], what: str) -> str:
    return digest(_as_dict(value, what))


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _backend_file_name(backend: str) -> str:
    if _SAFE_BACKEND.fullmatch(backend):
        return backend
    cleaned = _UNSAFE_CHARS.sub("_", backend.lower()).strip("._-")[:40] or "backend"
    return f"{cleaned}-{digest(backend)[:12]}"


# --------------------------------------------------------------------------- file checks


def _check_header(obj: dict[str, Any], kind: str, env_hash: str) -> str | None:
    # Schema first: a newer fp4select may have changed everything else.
    schema = obj.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:
        return f"schema {schema!r} is not {SCHEMA_VERSION} (written by another fp4select version?)"
    if obj.get("kind") != kind:
        return f"kind {obj.get('kind')!r} is not {kind!r}"
    if obj.get("env_hash") != env_hash:
        return f"env_hash {obj.get('env_hash')!r} is not the requested environment {env_hash}"
    env = obj.get("env")
    if not isinstance(env, dict):
        return f"'env' must be a JSON object, found {_json_type(env)}"
    if _digest_or_none(env) != env_hash:
        return "its 'env' does not hash to its env_hash"
    return None


def _check_env(obj: dict[str, Any], env_hash: str) -> str | None:
    return _check_header(obj, _KIND_ENV, env_hash)


def _check_entry(obj: dict[str, Any], env_hash: str, key_hash: str) -> str | None:
    problem = _check_header(obj, _KIND_ENTRY, env_hash)
    if problem is not None:
        return problem
    key = obj.get("key")
    if not isinstance(key, dict):
        return f"'key' must be a JSON object, found {_json_type(key)}"
    if _digest_or_none(key) != key_hash:
        return f"its key does not match the requested key {key_hash}"
    if not isinstance(obj.get("record"), dict):
        return f"'record' must be a JSON object, found {_json_type(obj.get('record'))}"
    return None


def _check_blacklist(obj: dict[str, Any], env_hash: str, file_name: str) -> str | None:
    problem = _check_header(obj, _KIND_BLACKLIST, env_hash)
    if problem is not None:
        return problem
    backend = obj.get("backend")
    if not isinstance(backend, str) or not backend:
        return "'backend' must be a non-empty string"
    if _backend_file_name(backend) != file_name:
        return f"backend {backend!r} does not belong in this file"
    record = obj.get("record")
    if not isinstance(record, dict):
        return f"'record' must be a JSON object, found {_json_type(record)}"
    if record.get("backend") != backend:
        return "its record names another backend"
    try:
        _blacklist_record(backend, record)
    except ValueError as exc:
        return str(exc)
    return None


def _blacklist_record(backend: Any, record: Mapping[str, Any]) -> dict[str, Any]:
    """Normalize a blacklist record; reject early what would make an unreadable file later."""
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a non-empty string, not {backend!r}")
    out = dict(_as_dict(record, "blacklist record"))
    if out.setdefault("backend", backend) != backend:
        raise ValueError(f"record names backend {out['backend']!r}, not {backend!r}")
    for field in ("reason", "kind"):
        if not isinstance(out.get(field), str):
            raise ValueError(f"blacklist record for {backend!r} needs a string {field!r}")
    when = out.setdefault("when", _utc_now())
    try:
        datetime.fromisoformat(when)
    except (TypeError, ValueError):
        raise ValueError(
            f"blacklist record for {backend!r}: 'when' must be an ISO 8601 string, not {when!r}"
        ) from None
    for field in ("key", "detail"):
        value = out.get(field)
        if value is not None:
            if not isinstance(value, Mapping):
                raise ValueError(f"blacklist record for {backend!r}: {field!r} must be a mapping")
            out[field] = dict(value)
    scope = out.get("scope")
    if scope is not None and not isinstance(scope, str):
        raise ValueError(f"blacklist record for {backend!r}: 'scope' must be a string")
    if scope == "key" and out.get("key") is None:
        raise ValueError(f"blacklist record for {backend!r}: scope 'key' needs a 'key' mapping")
    return out


# --------------------------------------------------------------------------- warnings


_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def _warn_once(tag: str, message: str) -> None:
    with _WARNED_LOCK:
        if tag in _WARNED:
            return
        _WARNED.add(tag)
    # Point at the first caller outside this module, however deep the call came from.
    frame = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
        level += 1
    warnings.warn(message, CacheWarning, stacklevel=level)


# --------------------------------------------------------------------------- file primitives


class _Damage(OSError):
    """Something at one of our paths that fp4select never creates there.

    A directory, a symlink, a FIFO, a device, or a file larger than anything it writes: such a
    thing is not ours, so it is never read, followed or deleted, only reported.
    """


_MAX_FILE_BYTES: Final = 1 << 20  # an entry, blacklist or env file; real ones are a few KiB
_MAX_ARCHIVE_BYTES: Final = 256 << 20
# O_NONBLOCK: opening a FIFO must not wait for a writer.  O_NOFOLLOW: a symlink is refused by
# the kernel, closing the gap between the lstat check and the open where the flag exists.
_READ_FLAGS: Final = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


def _what(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _read_fd(fd: int, path: Path, limit: int) -> bytes:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise _Damage(errno.EINVAL, f"it is {_what(info.st_mode)}, not a regular file", str(path))
    if info.st_size > limit:
        raise _Damage(errno.EFBIG, f"it is larger than {limit} bytes", str(path))
    data = bytearray()
    while len(data) <= limit:  # the size may have grown since fstat
        chunk = os.read(fd, limit + 1 - len(data))
        if not chunk:
            return bytes(data)
        data += chunk
    raise _Damage(errno.EFBIG, f"it is larger than {limit} bytes", str(path))


def _read_file(path: Path, limit: int = _MAX_FILE_BYTES) -> bytes | None:
    """The bytes of the regular file at ``path``, None when nothing is there.

    Anything else raises: ``_Damage`` for what fp4select never writes (a FIFO would block every
    lookup, a symlink to ``/dev/zero`` would never end), ``OSError`` when it cannot be read.
    """
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        # NotADirectoryError: a parent is a file, so nothing of ours is here; a write reports it.
        return None
    if not stat.S_ISREG(info.st_mode):
        raise _Damage(errno.EINVAL, f"it is {_what(info.st_mode)}, not a regular file", str(path))
    try:
        fd = os.open(path, _READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a symlink made just now
            raise _Damage(exc.errno, "it is a symbolic link", str(path)) from None
        raise
    try:
        return _read_fd(fd, path, limit)
    finally:
        os.close(fd)


def _read_archive(path: Path) -> bytes:
    """An archive the user named: symlinks are followed (the user chose the path), but only a
    regular file of at most ``_MAX_ARCHIVE_BYTES`` is read; anything else is ``ValueError``."""
    fd = os.open(path, _READ_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    try:
        return _read_fd(fd, path, _MAX_ARCHIVE_BYTES)
    except _Damage as exc:
        raise ValueError(f"{path} is not a usable fp4select archive: {exc.strerror}") from None
    finally:
        os.close(fd)


def _remove(path: Path) -> bool:
    """Unlink the name at ``path``; True if there was one.  A directory is not ours: it stays."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISDIR(info.st_mode):
        raise _Damage(
            errno.EISDIR, "it is a directory, which fp4select never makes there", str(path)
        )
    try:
        os.unlink(path)  # a symlink or FIFO goes as a name; what it points at is untouched
    except FileNotFoundError:
        return False
    return True


def _check_lock_file(path: Path) -> None:
    """Refuse a lock file that something else was made into before filelock opens it.

    filelock >= 3.20.3 (the pyproject floor) opens with ``O_NOFOLLOW``, so a planted symlink
    fails there; but a planted hard link would be opened and, by filelock 4.2.0 and older,
    truncated.  This check narrows that to a race with an active attacker.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(info.st_mode):
        raise _Damage(errno.EPERM, f"it is {_what(info.st_mode)}, not a lock file", str(path))
    if info.st_nlink > 1:
        raise _Damage(errno.EPERM, "it is a hard link to another file", str(path))


def _atomic_write(path: Path, data: bytes, *, replace: bool = True) -> None:
    """Write ``data`` so that a reader sees the old file or the new one, never half of one.

    ``replace=False`` claims the name atomically and raises ``FileExistsError`` if anything is
    there.  A directory at ``path`` is never replaced: that raises ``_Damage``.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            if hasattr(os, "fchmod"):  # mkstemp's 0o600 would hide a shared cache from others
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            if os.path.isdir(path) and not os.path.islink(path):
                raise _Damage(
                    errno.EISDIR, "a directory is in the way; it is left as it is", str(path)
                )
            os.replace(tmp, path)  # onto a directory this fails (EISDIR): never destructive
        else:
            _link_exclusive(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _link_exclusive(tmp: str, path: Path) -> None:
    try:
        os.link(tmp, path)  # fails with EEXIST if anything, even a dangling symlink, is there
    except FileExistsError:
        raise
    except OSError:
        # No hard links on this file system: claim the name with O_EXCL, then move onto it.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        os.close(os.open(path, flags, 0o644))
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)  # the empty placeholder made just above
            raise
        return
    with contextlib.suppress(OSError):
        os.unlink(tmp)


# --------------------------------------------------------------------------- per-process state


_Table = dict[tuple[str, str], "bytes | None"]


class _RootState:
    """What this process knows about one root beyond its files, shared by all its Stores.

    ``entries`` and ``blacklist`` map (env_hash, file stem) to the bytes the file would hold,
    or None for "deleted in this process"; a slot present here overrides the disk.
    """

    __slots__ = ("blacklist", "entries", "envs", "guard", "memory_only")

    def __init__(self) -> None:
        self.guard = threading.Lock()
        self.memory_only = False
        self.entries: _Table = {}
        self.blacklist: _Table = {}
        self.envs: dict[str, bytes] = {}


class _ProcessLock:
    """Serializes threads for one lock path and holds the file lock once per outermost entry.

    Two FileLock objects on one path in one process would block each other (flock is per open
    file), so threads queue here first and only the outermost holder touches the file.
    """

    __slots__ = ("depth", "file_lock", "rlock")

    def __init__(self) -> None:
        self.rlock = threading.RLock()
        self.depth = 0
        self.file_lock: filelock.BaseFileLock | None = None


_REGISTRY_LOCK = threading.Lock()
_ROOT_STATES: dict[str, _RootState] = {}
_PROCESS_LOCKS: dict[str, _ProcessLock] = {}


def _root_state(root: Path) -> _RootState:
    with _REGISTRY_LOCK:
        state = _ROOT_STATES.get(str(root))
        if state is None:
            state = _ROOT_STATES[str(root)] = _RootState()
        return state


def _process_lock(path: Path) -> _ProcessLock:
    with _REGISTRY_LOCK:
        plock = _PROCESS_LOCKS.get(str(path))
        if plock is None:
            plock = _PROCESS_LOCKS[str(path)] = _ProcessLock()
        return plock


def _after_fork_in_child() -> None:
    # Another thread may have held any of these at fork time; the child must not inherit that.
    global _REGISTRY_LOCK, _WARNED_LOCK
    _REGISTRY_LOCK = threading.Lock()
    _WARNED_LOCK = threading.Lock()
    _PROCESS_LOCKS.clear()
    for state in _ROOT_STATES.values():
        state.guard = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _KeyLock(AbstractContextManager[None]):
    def __init__(self, store: Store, path: Path, timeout: float) -> None:
        self._store = store
        self._path = path
        self._timeout = timeout
        self._plock: _ProcessLock | None = None

    def __enter__(self) -> None:
        timeout = self._timeout
        forever = timeout < 0 or math.isinf(timeout)
        deadline = time.monotonic() + timeout
        plock = self._plock = self._plock or _process_lock(self._path)
        if not plock.rlock.acquire(timeout=-1 if forever else timeout):
            raise filelock.Timeout(str(self._path))
        try:
            if plock.depth == 0:
                remaining = -1.0 if forever else max(0.0, deadline - time.monotonic())
                plock.file_lock = self._store._file_lock(self._path, remaining)
            plock.depth += 1
        except BaseException:
            plock.rlock.release()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        plock = self._plock
        assert plock is not None, "lock released without being acquired"
        plock.depth -= 1
        try:
            if plock.depth == 0 and plock.file_lock is not None:
                file_lock, plock.file_lock = plock.file_lock, None
                file_lock.release()
        finally:
            plock.rlock.release()


# --------------------------------------------------------------------------- the store


def default_root() -> Path:
    """Where the cache lives unless told otherwise; an empty variable counts as unset."""
    value = os.environ.get(ENV_VAR)
    if value:
        return Path(value).expanduser().absolute()
    return Path(platformdirs.user_cache_dir("fp4select")).absolute()


class Store:
    """The decisions of every environment under one root; see the module docstring."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self._root = (
            default_root() if root is None else Path(os.fsdecode(root)).expanduser().absolute()
        )
        self._state = _root_state(self._root)

    def __repr__(self) -> str:
        mode = ", memory_only" if self.memory_only else ""
        return f"Store({str(self._root)!r}{mode})"

    @property
    def root(self) -> Path:
        return self._root

    @property
    def memory_only(self) -> bool:
        """True once a write under this root failed in this process; see rule 7."""
        return self._state.memory_only

    # ----------------------------------------------------------------- paths

    @property
    def _schema_dir(self) -> Path:
        return self._root / f"v{SCHEMA_VERSION}"

    def env_dir(self, env: Mapping[str, Any]) -> Path:
        return self._schema_dir / _hash(env, "env")

    def _entry_path(self, env_hash: str, key_hash: str) -> Path:
        return self._schema_dir / env_hash / "entries" / f"{key_hash}.json"

    def _blacklist_path(self, env_hash: str, file_name: str) -> Path:
        return self._schema_dir / env_hash / "blacklist" / f"{file_name}.json"

    # ----------------------------------------------------------------- plumbing

    def _check_dirs(self, directory: Path) -> None:
        """Raise ``_Damage`` if a directory between the root and ``directory`` is not a real one.

        The root itself may be a symlink (the user chose it); below it, a symlink would lead
        reads and writes out of the cache.  A missing component is fine: nothing is there.
        """
        current = self._root
        for part in directory.relative_to(self._root).parts:
            current = current / part
            try:
                info = os.lstat(current)
            except (FileNotFoundError, NotADirectoryError):
                return
            if not stat.S_ISDIR(info.st_mode):
                raise _Damage(
                    errno.ENOTDIR,
                    f"{current} is {_what(info.st_mode)}, not a directory",
                    str(current),
                )

    def _load(
        self, path: Path, check: Callable[[dict[str, Any]], str | None], *, quiet: bool = False
    ) -> dict[str, Any] | None:
        after = "the file is left in place until the next write to it replaces it"
        try:
            self._check_dirs(path.parent)
            data = _read_file(path)
        except _Damage as exc:
            problem = str(exc.strerror)
            after = "fp4select does not write such a thing, so it is not read, followed or deleted"
        except OSError as exc:
            problem = f"cannot read it ({exc.strerror or exc})"
        else:
            if data is None:
                return None
            obj, problem = _decode(data)
            if obj is not None:
                problem = check(obj)
                if problem is None:
                    return obj
        if not quiet:
            _warn_once(
                str(path),
                f"fp4select cache: ignoring {path}: {problem}. Treated as a miss; {after}.",
            )
        return None

    def _list(self, directory: Path, pattern: re.Pattern[str]) -> dict[str, Path]:
        """Stem -> path of the names in ``directory`` that this module could have written."""
        try:
            self._check_dirs(directory)
            names = os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as exc:
            _warn_once(
                str(directory),
                f"fp4select cache: cannot list {directory} ({exc.strerror or exc}); skipping it.",
            )
            return {}
        found = {}
        for name in names:
            match = pattern.fullmatch(name)
            if match:
                found[match.group(1)] = directory / name
        return found

    def _overlay(self, table: _Table, env_hash: str) -> dict[str, bytes | None]:
        with self._state.guard:
            return {stem: data for (eh, stem), data in table.items() if eh == env_hash}

    def _env_hashes(self) -> list[str]:
        hashes = {name for name in self._list_dirs(self._schema_dir) if _ENV_DIR.fullmatch(name)}
        with self._state.guard:
            hashes.update(self._state.envs)
            hashes.update(eh for eh, _ in self._state.entries)
            hashes.update(eh for eh, _ in self._state.blacklist)
        return sorted(hashes)

    def _list_dirs(self, directory: Path) -> list[str]:
        try:
            self._check_dirs(directory)
            with os.scandir(directory) as entries:
                found = list(entries)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            _warn_once(
                str(directory),
                f"fp4select cache: cannot list {directory} ({exc.strerror or exc}); skipping it.",
            )
            return []
        for entry in found:
            if entry.is_symlink():
                _warn_once(
                    entry.path,
                    f"fp4select cache: ignoring {entry.path}: it is a symbolic link; it is not "
                    "read, followed or deleted.",
                )
        return [e.name for e in found if e.is_dir(follow_symlinks=False)]

    def _degrade(self, exc: OSError) -> None:
        with self._state.guard:
            self._state.memory_only = True
        _warn_once(
            f"memory-only:{self._root}",
            f"fp4select cache: cannot write under {self._root} ({exc}); decisions are kept in "
            "memory for the rest of this process and will be tuned again next time.",
        )

    def _ensure_env_file(self, env_hash: str, env_data: bytes) -> None:
        path = self._schema_dir / env_hash / "env.json"
        if self._load(path, partial(_check_env, env_hash=env_hash), quiet=True) is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, env_data)

    def _persist(
        self, table: _Table, env_hash: str, stem: str, path: Path, data: bytes, env_data: bytes
    ) -> bool:
        if len(data) > _MAX_FILE_BYTES:  # it would be refused when read back (rule 6)
            raise ValueError(f"record is {len(data)} bytes as JSON; the limit is {_MAX_FILE_BYTES}")
        state = self._state
        if not state.memory_only:
            try:
                # mkdir and mkstemp follow symlinks: check first that none leads out of the cache.
                self._check_dirs(path.parent)
                self._ensure_env_file(env_hash, env_data)
                path.parent.mkdir(parents=True, exist_ok=True)
                _atomic_write(path, data)
            except OSError as exc:
                self._degrade(exc)
            else:
                with state.guard:
                    table.pop((env_hash, stem), None)
                return True
        with state.guard:
            state.envs.setdefault(env_hash, env_data)
            table[(env_hash, stem)] = data
        return False

    def _delete(self, table: _Table, env_hash: str, stem: str, path: Path) -> str:
        """Forget one record: "removed", "absent", "hidden" (from this process only: the
        root is memory-only and the file stays) or "left" (something not ours is there)."""
        state = self._state
        slot = (env_hash, stem)
        if not state.memory_only:
            try:
                self._check_dirs(path.parent)
                on_disk = _remove(path)
            except _Damage as exc:
                _warn_once(
                    f"left:{path}",
                    f"fp4select cache: not removing {path}: {exc.strerror}. Remove it yourself "
                    "if it is not needed.",
                )
                return "left"
            except OSError as exc:
                self._degrade(exc)
            else:
                with state.guard:
                    in_memory = table.pop(slot, None) is not None
                return "removed" if on_disk or in_memory else "absent"
        with state.guard:
            forgotten = slot in table and table[slot] is None
            in_memory = table.get(slot) is not None
            table[slot] = None
        if forgotten:
            return "absent"
        if os.path.lexists(path):
            return "hidden"
        return "removed" if in_memory else "absent"

    def _delete_all(
        self, table: _Table, env_hash: str, directory: Path, pattern: re.Pattern[str]
    ) -> dict[str, list[Path]]:
        """Status -> paths, for every record of one kind in one environment."""
        stems = self._list(directory, pattern).keys() | self._overlay(table, env_hash).keys()
        done: dict[str, list[Path]] = {}
        for stem in sorted(stems):
            path = directory / f"{stem}.json"
            done.setdefault(self._delete(table, env_hash, stem, path), []).append(path)
        return done

    def _env_bytes(self, env: dict[str, Any], env_hash: str) -> bytes:
        return _file_bytes(
            {"schema": SCHEMA_VERSION, "kind": _KIND_ENV, "env_hash": env_hash, "env": env}
        )

    # ----------------------------------------------------------------- entries

    def read_entry(self, env: Mapping[str, Any], key: Mapping[str, Any]) -> dict[str, Any] | None:
        """The record last written for (env, key), or None on any kind of miss (rule 6)."""
        env_hash, key_hash = _hash(env, "env"), _hash(key, "key")
        with self._state.guard:
            slot = (env_hash, key_hash)
            in_memory = slot in self._state.entries
            data = self._state.entries.get(slot)
        if in_memory:
            return None if data is None else json.loads(data)["record"]
        obj = self._load(
            self._entry_path(env_hash, key_hash),
            partial(_check_entry, env_hash=env_hash, key_hash=key_hash),
        )
        return None if obj is None else obj["record"]

    def write_entry(
        self, env: Mapping[str, Any], key: Mapping[str, Any], record: Mapping[str, Any]
    ) -> bool:
        """Remember ``record``; True if it reached the disk, False if only this process has it.

        Raises ``TypeError``/``ValueError`` for values that are not strict JSON.
        """
        env, key = _as_dict(env, "env"), _as_dict(key, "key")
        record = _as_dict(record, "record")
        env_hash, key_hash = _hash(env, "env"), _hash(key, "key")
        data = _file_bytes(
            {
                "schema": SCHEMA_VERSION,
                "kind": _KIND_ENTRY,
                "env_hash": env_hash,
                "key_hash": key_hash,
                "env": env,
                "key": key,
                "record": record,
            }
        )
        return self._persist(
            self._state.entries,
            env_hash,
            key_hash,
            self._entry_path(env_hash, key_hash),
            data,
            self._env_bytes(env, env_hash),
        )

    def delete_entry(self, env: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        """Forget one key, damaged file included; True if there was something to forget."""
        env_hash, key_hash = _hash(env, "env"), _hash(key, "key")
        path = self._entry_path(env_hash, key_hash)
        return self._delete(self._state.entries, env_hash, key_hash, path) in ("removed", "hidden")

    def iter_entries(
        self, env: Mapping[str, Any] | None = None
    ) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
        """(env, key, record) of every readable entry of ``env``, or of all environments."""
        env_hashes = [_hash(env, "env")] if env is not None else self._env_hashes()
        for env_hash in env_hashes:
            for obj in self._merged(
                env_hash,
                "entries",
                _ENTRY_FILE,
                self._state.entries,
                partial(_check_entry, env_hash=env_hash),
                "key_hash",
            ):
                yield obj["env"], obj["key"], obj["record"]

    def _merged(
        self,
        env_hash: str,
        folder: str,
        pattern: re.Pattern[str],
        table: _Table,
        check: Callable[..., str | None],
        stem_name: str,
    ) -> Iterator[dict[str, Any]]:
        """Every readable object of one kind: this process's memory overlay over the disk."""
        on_disk = self._list(self._schema_dir / env_hash / folder, pattern)
        in_memory = self._overlay(table, env_hash)
        for stem in sorted(on_disk.keys() | in_memory.keys()):
            if stem in in_memory:
                data = in_memory[stem]
                obj = None if data is None else json.loads(data)
            else:
                obj = self._load(on_disk[stem], partial(check, **{stem_name: stem}))
            if obj is not None:
                yield obj

    def environments(self) -> list[dict[str, Any]]:
        """Every environment with a directory (or, memory-only, an overlay) under this schema."""
        found = []
        for env_hash in self._env_hashes():
            obj = self._load(
                self._schema_dir / env_hash / "env.json", partial(_check_env, env_hash=env_hash)
            )
            if obj is None:
                with self._state.guard:
                    data = self._state.envs.get(env_hash)
                obj = None if data is None else json.loads(data)
            if obj is not None:
                found.append(obj["env"])
        return found

    def clear(self, env: Mapping[str, Any] | None = None) -> ClearResult:
        """Delete the entries and blacklist of ``env`` (or of all); says what was removed.

        ``env.json`` and lock files stay: another process may hold a lock right now.
        """
        env_hashes = [_hash(env, "env")] if env is not None else self._env_hashes()
        entries = blacklist = 0
        not_removed: list[str] = []
        for env_hash in env_hashes:
            env_dir = self._schema_dir / env_hash
            for table, folder, pattern in (
                (self._state.entries, "entries", _ENTRY_FILE),
                (self._state.blacklist, "blacklist", _BLACKLIST_FILE),
            ):
                done = self._delete_all(table, env_hash, env_dir / folder, pattern)
                if folder == "entries":
                    entries += len(done.get("removed", []))
                else:
                    blacklist += len(done.get("removed", []))
                not_removed += [str(p) for p in done.get("hidden", []) + done.get("left", [])]
        return ClearResult(entries, blacklist, tuple(not_removed))

    # ----------------------------------------------------------------- locks

    def lock(
        self, env: Mapping[str, Any], key: Mapping[str, Any], timeout: float = 600.0
    ) -> AbstractContextManager[None]:
        """Hold while tuning (env, key); raises ``filelock.Timeout`` after ``timeout`` s."""
        key_hash = _hash(key, "key")
        return _KeyLock(self, self.env_dir(env) / "locks" / f"{key_hash}.lock", timeout)

    def _file_lock(self, path: Path, timeout: float) -> filelock.BaseFileLock | None:
        if self.memory_only:
            return None
        try:
            self._check_dirs(path.parent.parent)  # before mkdir, which follows symlinks
            path.parent.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            # No environment directory means no entries either: one memory-only warning
            # says it all, rather than a lock warning now and a write warning later.
            self._degrade(exc)
            return None
        try:
            self._check_dirs(path.parent)
            path.parent.mkdir(exist_ok=True)
            _check_lock_file(path)
            lock = filelock.FileLock(str(path))
            lock.acquire(timeout=timeout)
        except filelock.Timeout:  # an OSError too, so it must go first
            raise
        except (OSError, NotImplementedError) as exc:
            _warn_once(
                f"lock:{self._root}",
                f"fp4select cache: cannot lock files under {self._root} ({exc}); only threads "
                "of this process are serialized, so other processes may tune the same problem.",
            )
            return None
        return lock

    # ----------------------------------------------------------------- blacklist

    def _blacklist_items(
        self, env_hash: str
    ) -> Iterator[tuple[dict[str, Any], str, dict[str, Any]]]:
        for obj in self._merged(
            env_hash,
            "blacklist",
            _BLACKLIST_FILE,
            self._state.blacklist,
            partial(_check_blacklist, env_hash=env_hash),
            "file_name",
        ):
            yield obj["env"], obj["backend"], obj["record"]

    def blacklist(self, env: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Backend name -> why it must not be used in ``env``."""
        items = self._blacklist_items(_hash(env, "env"))
        return {backend: record for _, backend, record in sorted(items, key=lambda i: i[1])}

    def add_to_blacklist(
        self, env: Mapping[str, Any], backend: str, record: Mapping[str, Any]
    ) -> bool:
        """Record that ``backend`` is unusable in ``env``, replacing its previous record.

        ``record`` needs string ``reason`` and ``kind``; ``backend`` and ``when`` (now, UTC)
        are filled in when missing.  Raises ``ValueError`` otherwise.  Returns whether the
        record reached the disk, as ``write_entry`` does.
        """
        env = _as_dict(env, "env")
        record = _blacklist_record(backend, record)
        env_hash, name = _hash(env, "env"), _backend_file_name(backend)
        data = _file_bytes(
            {
                "schema": SCHEMA_VERSION,
                "kind": _KIND_BLACKLIST,
                "env_hash": env_hash,
                "env": env,
                "backend": backend,
                "record": record,
            }
        )
        return self._persist(
            self._state.blacklist,
            env_hash,
            name,
            self._blacklist_path(env_hash, name),
            data,
            self._env_bytes(env, env_hash),
        )

    def remove_from_blacklist(self, env: Mapping[str, Any], backend: str | None = None) -> int:
        """Lift one backend's ban, or all (damaged files too) when None; returns how many.

        A memory-only root (rule 7) can only hide a record from this process; that counts.
        """
        env_hash = _hash(env, "env")
        if backend is None:
            directory = self._schema_dir / env_hash / "blacklist"
            done = self._delete_all(self._state.blacklist, env_hash, directory, _BLACKLIST_FILE)
            return len(done.get("removed", [])) + len(done.get("hidden", []))
        name = _backend_file_name(backend)
        path = self._blacklist_path(env_hash, name)
        return int(
            self._delete(self._state.blacklist, env_hash, name, path) in ("removed", "hidden")
        )

    # ----------------------------------------------------------------- archives

    def export_archive(
        self,
        path: str | os.PathLike[str],
        env: Mapping[str, Any] | None = None,
        *,
        overwrite: bool = False,
    ) -> ExportResult:
        """Write every entry and blacklist record (of ``env`` or all) to one new JSON file.

        Refuses (``IsADirectoryError``) a directory, and (``FileExistsError``) any existing
        name unless ``overwrite``, which replaces the name (a symlink itself, not its target).
        The file appears whole or not at all.  Failing to write raises: the user asked for it.
        """
        target = Path(os.fsdecode(path))
        if os.path.isdir(target):
            raise IsADirectoryError(
                errno.EISDIR, "is a directory; export writes one file: name a file", str(target)
            )
        if not overwrite and os.path.lexists(target):
            raise FileExistsError(
                errno.EEXIST,
                "already exists; pass overwrite=True (--force) to replace it",
                str(target),
            )
        env_hashes = [_hash(env, "env")] if env is not None else self._env_hashes()
        entries = [{"env": e, "key": k, "record": r} for e, k, r in self.iter_entries(env)]
        blacklist = [
            {"env": e, "backend": backend, "record": record}
            for env_hash in env_hashes
            for e, backend, record in self._blacklist_items(env_hash)
        ]
        archive = {
            "schema": SCHEMA_VERSION,
            "kind": _KIND_ARCHIVE,
            "entries": entries,
            "blacklist": blacklist,
        }
        _atomic_write(target, _file_bytes(archive), replace=overwrite)
        return ExportResult(len(entries), len(blacklist))

    def import_archive(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        protected_backends: Collection[str] = frozenset(),
        check_entry: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None,
    ) -> ImportResult:
        """Merge an archive into this store and say, record by record, what happened.

        Existing entries and blacklist records win unless ``overwrite``.  Blacklist records
        for ``protected_backends`` (the caller's built-in fallback: an archive must not be
        able to take it away) are refused and named in the result.  A damaged archive, or
        one that is not a regular file of at most 256 MiB, raises ``ValueError`` before
        anything is written; one that cannot be opened raises ``OSError``.  If the store
        turns memory-only midway, the rest is kept in memory only (counted apart).
        ``check_entry(key, record)`` returns why an entry must not be imported (the caller
        knows what a record means; this module does not), or None.
        """
        if isinstance(protected_backends, str):
            raise TypeError("protected_backends must be a collection of backend names, not a str")
        protected = frozenset(protected_backends)
        entries, blacklist = read_archive(path)
        invalid: list[str] = []
        if check_entry is not None:
            checked = []
            for i, (env, key, record) in enumerate(entries):
                problem = check_entry(key, record)
                if problem is None:
                    checked.append((env, key, record))
                else:
                    invalid.append(f"entries[{i}]: {problem}")
            entries = checked
        counts = dict.fromkeys(
            ("written", "in_memory", "present", "bl_written", "bl_in_memory", "bl_present"), 0
        )
        refused: list[str] = []
        for env, key, record in entries:
            if not overwrite and self.read_entry(env, key) is not None:
                counts["present"] += 1
            else:
                counts["written" if self.write_entry(env, key, record) else "in_memory"] += 1
        for env, backend, record in blacklist:
            if backend in protected:
                refused.append(backend)
            elif not overwrite and backend in self.blacklist(env):
                counts["bl_present"] += 1
            else:
                written = self.add_to_blacklist(env, backend, record)
                counts["bl_written" if written else "bl_in_memory"] += 1
        return ImportResult(
            entries_written=counts["written"],
            entries_in_memory=counts["in_memory"],
            entries_present=counts["present"],
            blacklist_written=counts["bl_written"],
            blacklist_in_memory=counts["bl_in_memory"],
            blacklist_present=counts["bl_present"],
            blacklist_protected=tuple(refused),
            entries_invalid=tuple(invalid),
        )


def read_archive(
    path: str | os.PathLike[str],
) -> tuple[list[tuple[dict, dict, dict]], list[tuple[dict, str, dict]]]:
    """The (env, key, record) entries and (env, backend, record) blacklist of an archive.

    Checked as ``import_archive`` checks it (a regular file, strict JSON, every field's type);
    raises ``ValueError`` for one that is not an archive and ``OSError`` when it cannot be read.
    """
    path = Path(os.fsdecode(path))
    return _parse_archive(path, _read_archive(path))


def _parse_archive(
    path: Path, data: bytes
) -> tuple[list[tuple[dict, dict, dict]], list[tuple[dict, str, dict]]]:
    def bad(problem: str) -> ValueError:
        return ValueError(f"{path} is not a usable fp4select archive: {problem}")

    archive, problem = _decode(data)
    if archive is None:
        raise bad(str(problem))
    schema = archive.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise bad(f"schema {schema!r} is not {SCHEMA_VERSION}")
    if archive.get("kind") != _KIND_ARCHIVE:
        raise bad(f"kind {archive.get('kind')!r} is not {_KIND_ARCHIVE!r}")

    def items(field: str) -> list[dict[str, Any]]:
        value = archive.get(field, [])
        if not isinstance(value, list):
            raise bad(f"{field!r} must be a JSON array, found {_json_type(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise bad(f"{field}[{i}] must be a JSON object, found {_json_type(item)}")
        return value

    def obj(item: dict[str, Any], where: str, name: str) -> dict[str, Any]:
        value = item.get(name)
        if not isinstance(value, dict):
            raise bad(f"{where}.{name} must be a JSON object, found {_json_type(value)}")
        if _digest_or_none(value) is None:
            raise bad(f"{where}.{name} holds NaN or infinity")
        return value

    entries = []
    for i, item in enumerate(items("entries")):
        where = f"entries[{i}]"
        entries.append(
            (obj(item, where, "env"), obj(item, where, "key"), obj(item, where, "record"))
        )
    blacklist = []
    for i, item in enumerate(items("blacklist")):
        where = f"blacklist[{i}]"
        env, record = obj(item, where, "env"), obj(item, where, "record")
        try:
            record = _blacklist_record(item.get("backend"), record)
        except (TypeError, ValueError) as exc:
            raise bad(f"{where}: {exc}") from None
        blacklist.append((env, item["backend"], record))
    return entries, blacklist
