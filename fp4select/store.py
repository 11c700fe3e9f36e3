"""On-disk memory of fp4select's decisions: one JSON file per (environment, problem key).

This is the lowest layer of fp4select and imports nothing else from it: environments,
keys and records are plain JSON-able dicts here.  The rules below exist because a cache
that can break the program it is meant to speed up is worse than no cache.

Rules
-----
1. Location.  ``Store(root)``; ``root=None`` means ``$FP4SELECT_CACHE_DIR`` when set and
   non-empty, else ``platformdirs.user_cache_dir("fp4select")``.  Relative roots are made
   absolute at construction so a later ``chdir`` cannot move the cache.  Layout::

       <root>/v<SCHEMA_VERSION>/<env_hash>/env.json
                                          /entries/<key_hash>.json
                                          /locks/<key_hash>.lock
                                          /blacklist/<backend_file_name>.json

   The schema number is part of the path so that two fp4select versions with different
   schemas can share a root without ever reading each other's files.
2. Hashes.  ``digest(obj)`` is the first 20 hex digits of the sha256 of the canonical JSON
   (``sort_keys=True, separators=(",", ":")``, ASCII, no NaN or infinity).  Dict order never
   matters; tuples and lists hash alike because JSON cannot tell them apart.  Changing the
   canonical form orphans every existing cache, so it is frozen by a test.
3. JSON only.  Nothing read is imported or executed.  Every file carries
   ``{"schema": SCHEMA_VERSION, "kind": "fp4select.<entry|blacklist|env>", "env_hash": ...}``
   plus its payload.  Entry and blacklist files also carry the ``env`` dict (and entries the
   ``key`` dict) so each file is self-describing: ``iter_entries`` and exports need nothing
   else, and ``read_entry`` can check the file really answers the question asked.  Writing a
   value that is not strict JSON (a set, a NaN) raises at once, before anything is written.
4. One file per entry, written atomically: temp file in the same directory (``mkstemp``,
   name starting with ``.`` so no reader ever lists it), ``fsync``, ``os.replace``.  A damaged
   file can therefore only lose itself, and a reader sees the old or the new file, never half
   of one.  The directory is not fsynced: after a power cut an entry may be missing, which
   is a miss, never a corrupt read.  Temp files are removed on any failure; only a killed
   process (SIGKILL between create and rename) can leave one, and readers ignore it.
5. Damaged files are misses.  A file that is truncated, empty, not UTF-8, not JSON, not an
   object, of another schema or kind, or that answers a different env or key, or that cannot
   be read (permissions, a directory in its place) makes the lookup a miss plus exactly one
   ``CacheWarning`` per path per process.  Never an exception: the caller re-tunes, which is
   what an empty cache would cost anyway.  The file is left in place (a newer fp4select may
   own it); the next successful write for that key replaces it.  ``clear`` and the ``remove``
   methods are explicit requests and do delete damaged files.
6. Failing disk.  Any ``OSError`` while writing (read-only directory, ``ENOSPC``, quota, ...)
   switches the root to memory-only for the rest of the process, with one warning.  Writes
   then go to an in-memory overlay that reads consult before the disk, so the process still
   remembers its own decisions; existing files stay readable.  The state is per root and per
   process, shared by every ``Store`` on that root: constructing a fresh ``Store`` does not
   retry the disk.  ``write_entry`` returns whether the record reached the disk.
7. Locks.  ``store.lock(env, key)`` serializes tuning of one key across processes, so that N
   processes missing the same key at once tune it once::

       record = store.read_entry(env, key)
       if record is None:
           with store.lock(env, key):
               record = store.read_entry(env, key)  # someone may have tuned it meanwhile
               if record is None:
                   record = tune()
                   store.write_entry(env, key, record)

   It is a ``filelock.FileLock`` on ``locks/<key_hash>.lock`` taken behind a per-process
   ``threading.RLock``, so threads are serialized too and the lock is reentrant within a
   thread.  When the root is memory-only, or the lock file cannot be made (then with one
   warning), only the per-process lock is taken: other processes may tune the same key, which
   costs time, never correctness.  A wait longer than ``timeout`` seconds (negative or
   infinite: wait forever) raises ``filelock.Timeout``.  Lock files are never deleted by this
   module: unlinking a lock file another process holds breaks mutual exclusion.
8. Blacklist.  Per environment, one file per backend (``add_to_blacklist`` replaces that
   backend's record: last writer wins).  Separate files mean concurrent additions of
   different backends from different processes cannot lose each other; there is no
   read-modify-write of a shared file.  Backend names that are not safe lowercase file names
   (case-insensitive file systems would merge ``"Cutlass"`` and ``"cutlass"``) get a
   sanitized name plus a hash suffix.  Numerical rejections of one (backend, key) belong in
   that key's entry record, not here.
9. Archives.  ``export_archive``/``import_archive`` move a cache between machines as one JSON
   file.  Import is an explicit user action, so a damaged archive raises ``ValueError`` naming
   the problem, and everything is validated before anything is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
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


def _decode(data: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """Parse one file; a problem comes back as text because it becomes a warning or error."""
    if not data.strip():
        return None, "empty file"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    try:
        obj = json.loads(text)
    except RecursionError:
        return None, "JSON nested too deeply"
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
    if not isinstance(out.setdefault("when", _utc_now()), str):
        raise ValueError(f"blacklist record for {backend!r}: 'when' must be an ISO 8601 string")
    for field in ("key", "detail"):
        value = out.get(field)
        if value is not None:
            if not isinstance(value, Mapping):
                raise ValueError(f"blacklist record for {backend!r}: {field!r} must be a mapping")
            out[field] = dict(value)
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


def _read_file(path: Path) -> bytes | None:
    """None when nothing is there; other failures raise, since they mean damage."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        # NotADirectoryError: a parent is a file, so nothing of ours is here; a write reports it.
        return None


def _remove(path: Path) -> bool:
    try:
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        if not path.is_dir() or path.is_symlink():
            raise
        shutil.rmtree(path)
    return True


def _atomic_write(path: Path, data: bytes) -> None:
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
        try:
            os.replace(tmp, path)
        except OSError:
            # A directory squatting on the name is damage in our namespace; the write fixes it.
            if not path.is_dir() or path.is_symlink():
                raise
            shutil.rmtree(path)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
        """True once a write under this root failed in this process; see rule 6."""
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

    def _load(
        self, path: Path, check: Callable[[dict[str, Any]], str | None], *, quiet: bool = False
    ) -> dict[str, Any] | None:
        try:
            data = _read_file(path)
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
                f"fp4select cache: ignoring {path}: {problem}. Treated as a miss; the file is "
                "left in place until the next write to it replaces it.",
            )
        return None

    def _list(self, directory: Path, pattern: re.Pattern[str]) -> dict[str, Path]:
        """Stem -> path of the names in ``directory`` that this module could have written."""
        try:
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
            return [entry.name for entry in os.scandir(directory) if entry.is_dir()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            _warn_once(
                str(directory),
                f"fp4select cache: cannot list {directory} ({exc.strerror or exc}); skipping it.",
            )
            return []

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
        state = self._state
        if not state.memory_only:
            try:
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

    def _delete(self, table: _Table, env_hash: str, stem: str, path: Path) -> bool:
        state = self._state
        if not state.memory_only:
            with state.guard:
                in_memory = table.get((env_hash, stem)) is not None
            try:
                on_disk = _remove(path)
            except OSError as exc:
                self._degrade(exc)
            else:
                with state.guard:
                    table.pop((env_hash, stem), None)
                return on_disk or in_memory
        with state.guard:
            slot = (env_hash, stem)
            removed = table[slot] is not None if slot in table else os.path.lexists(path)
            table[slot] = None
        return removed

    def _delete_all(
        self, table: _Table, env_hash: str, directory: Path, pattern: re.Pattern[str]
    ) -> int:
        stems = self._list(directory, pattern).keys() | self._overlay(table, env_hash).keys()
        return sum(
            self._delete(table, env_hash, stem, directory / f"{stem}.json")
            for stem in sorted(stems)
        )

    def _env_bytes(self, env: dict[str, Any], env_hash: str) -> bytes:
        return _file_bytes(
            {"schema": SCHEMA_VERSION, "kind": _KIND_ENV, "env_hash": env_hash, "env": env}
        )

    # ----------------------------------------------------------------- entries

    def read_entry(self, env: Mapping[str, Any], key: Mapping[str, Any]) -> dict[str, Any] | None:
        """The record last written for (env, key), or None on any kind of miss (rule 5)."""
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
        return self._delete(
            self._state.entries, env_hash, key_hash, self._entry_path(env_hash, key_hash)
        )

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

    def clear(self, env: Mapping[str, Any] | None = None) -> int:
        """Delete the entries and blacklist of ``env`` (or of all); returns entries removed.

        ``env.json`` and lock files stay: another process may hold a lock right now.
        """
        env_hashes = [_hash(env, "env")] if env is not None else self._env_hashes()
        removed = 0
        for env_hash in env_hashes:
            env_dir = self._schema_dir / env_hash
            removed += self._delete_all(
                self._state.entries, env_hash, env_dir / "entries", _ENTRY_FILE
            )
            self._delete_all(
                self._state.blacklist, env_hash, env_dir / "blacklist", _BLACKLIST_FILE
            )
        return removed

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
            path.parent.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            # No environment directory means no entries either: one memory-only warning
            # says it all, rather than a lock warning now and a write warning later.
            self._degrade(exc)
            return None
        try:
            path.parent.mkdir(exist_ok=True)
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
    ) -> None:
        """Record that ``backend`` is unusable in ``env``, replacing its previous record.

        ``record`` needs string ``reason`` and ``kind``; ``backend`` and ``when`` (now, UTC)
        are filled in when missing.  Raises ``ValueError`` otherwise.
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
        self._persist(
            self._state.blacklist,
            env_hash,
            name,
            self._blacklist_path(env_hash, name),
            data,
            self._env_bytes(env, env_hash),
        )

    def remove_from_blacklist(self, env: Mapping[str, Any], backend: str | None = None) -> int:
        """Lift one backend's ban, or all (damaged files too) when None; returns files removed."""
        env_hash = _hash(env, "env")
        if backend is None:
            directory = self._schema_dir / env_hash / "blacklist"
            return self._delete_all(self._state.blacklist, env_hash, directory, _BLACKLIST_FILE)
        name = _backend_file_name(backend)
        path = self._blacklist_path(env_hash, name)
        return int(self._delete(self._state.blacklist, env_hash, name, path))

    # ----------------------------------------------------------------- archives

    def export_archive(
        self, path: str | os.PathLike[str], env: Mapping[str, Any] | None = None
    ) -> int:
        """Write every entry and blacklist record (of ``env`` or all) to one JSON file.

        Returns the number of entries.  Failing to write raises: the user asked for a file.
        """
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
        _atomic_write(Path(os.fsdecode(path)), _file_bytes(archive))
        return len(entries)

    def import_archive(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> int:
        """Merge an archive into this store; returns the number of entries written.

        Existing entries and blacklist records win unless ``overwrite``.  A damaged archive
        raises ``ValueError`` before anything is written; a missing one raises ``OSError``.
        If the store turns memory-only midway, the rest is imported into memory (check
        ``memory_only`` afterwards).
        """
        path = Path(os.fsdecode(path))
        entries, blacklist = _parse_archive(path, path.read_bytes())
        imported = 0
        for env, key, record in entries:
            if overwrite or self.read_entry(env, key) is None:
                self.write_entry(env, key, record)
                imported += 1
        for env, backend, record in blacklist:
            if overwrite or backend not in self.blacklist(env):
                self.add_to_blacklist(env, backend, record)
        return imported


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
