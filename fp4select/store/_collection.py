"""One kind of record file per environment, and the root they live under.

Entries and blacklist records are the same thing on disk: one self-describing JSON file per
(environment, stem) in ``<root>/v<SCHEMA_VERSION>/<env_hash>/<folder>/<stem>.json``, read as a
miss when damaged, written atomically, overlaid by this process's memory when the disk fails.
So they are two instances of ``Collection``, which differ only in a ``RecordKind`` (the
folder, the file-name pattern, the check of a decoded file).

Rules kept here:

- Only below real directories.  The root itself may be a symlink (the user chose it); a
  symlink or file where a directory of ours belongs is damage: never followed.
- Damaged files are misses: truncated, not strict JSON, another schema, kind, env or key,
  unreadable or not a regular file: the lookup misses with one ``CacheWarning`` per path
  per process, never an exception.  The file stays until a write replaces it; deleting
  removes it, never a directory (that is left, warned about and reported as "left").
- Failing disk.  Any ``OSError`` while writing switches the root to memory-only for the
  rest of the process, with one warning.  Writes then go to an in-memory overlay that reads
  consult first; existing files stay readable.  The state is per root and per process (a
  fresh ``Store`` does not retry).  ``write`` returns whether the record reached the disk;
  deleting on a memory-only root only hides a file from this process ("hidden").

Why keep the overlay when the Selector already keeps its decisions in memory: the blacklist
has no other memory (a backend that crashed the sandbox would be probed, and crash, again on
every new problem), the overlay is one code path for both kinds so entries cost nothing
extra, and every ``Store`` of one root in a process (several selectors, an import followed
by a lookup) sees the same records.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ._jsonfile import (
    MAX_FILE_BYTES,
    SCHEMA_VERSION,
    Damage,
    atomic_write,
    check_header,
    decode,
    file_bytes,
    read_file,
    remove,
    what,
)
from ._warn import warn_once

if TYPE_CHECKING:
    from ._records import RecordKind

KIND_ENV: Final = "fp4select.env"
_ENV_DIR = re.compile(r"[0-9a-f]{20}")

_Table = dict[tuple[str, str], "bytes | None"]


def _header(kind: str, env_hash: str, env: dict[str, Any]) -> dict[str, Any]:
    """What every file of ours starts with: what it is, and for which environment."""
    return {"schema": SCHEMA_VERSION, "kind": kind, "env_hash": env_hash, "env": env}


def _check_env(obj: dict[str, Any], env_hash: str) -> str | None:
    return check_header(obj, KIND_ENV, env_hash)


# --------------------------------------------------------------------------- the root


class _RootState:
    """What this process knows about one root beyond its files, shared by all its Stores.

    ``tables`` maps a collection's folder to (env_hash, file stem) -> the bytes the file would
    hold, or None for "deleted in this process"; a slot present there overrides the disk.
    """

    __slots__ = ("envs", "guard", "memory_only", "tables")

    def __init__(self) -> None:
        self.guard = threading.Lock()
        self.memory_only = False
        self.tables: dict[str, _Table] = {}
        self.envs: dict[str, bytes] = {}


_REGISTRY_LOCK = threading.Lock()
_ROOT_STATES: dict[str, _RootState] = {}


def _after_fork_in_child() -> None:
    # Another thread may have held any of these at fork time; the child must not inherit that.
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()
    for state in _ROOT_STATES.values():
        state.guard = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Root:
    """One cache root as this process sees it: paths, shared state, guarded listing and loading."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with _REGISTRY_LOCK:
            state = _ROOT_STATES.get(str(path))
            if state is None:
                state = _ROOT_STATES[str(path)] = _RootState()
        self.state = state

    @property
    def schema_dir(self) -> Path:
        return self.path / f"v{SCHEMA_VERSION}"

    def table(self, folder: str) -> _Table:
        with self.state.guard:
            return self.state.tables.setdefault(folder, {})

    def check_dirs(self, directory: Path) -> None:
        """Raise ``Damage`` if a directory between the root and ``directory`` is not a real one.

        The root itself may be a symlink (the user chose it); below it, a symlink would lead
        reads and writes out of the cache.  A missing component is fine: nothing is there.
        """
        current = self.path
        for part in directory.relative_to(self.path).parts:
            current = current / part
            try:
                info = os.lstat(current)
            except (FileNotFoundError, NotADirectoryError):
                return
            if not stat.S_ISDIR(info.st_mode):
                raise Damage(
                    errno.ENOTDIR,
                    f"{current} is {what(info.st_mode)}, not a directory",
                    str(current),
                )

    def load(
        self, path: Path, check: Callable[[dict[str, Any]], str | None], *, quiet: bool = False
    ) -> dict[str, Any] | None:
        """The checked object in the file at ``path``, or None (with one warning if damaged)."""
        after = "the file is left in place until the next write to it replaces it"
        problem: str | None
        try:
            self.check_dirs(path.parent)
            data = read_file(path)
        except Damage as exc:
            problem = str(exc.strerror)
            after = "fp4select does not write such a thing, so it is not read, followed or deleted"
        except OSError as exc:
            problem = f"cannot read it ({exc.strerror or exc})"
        else:
            if data is None:
                return None
            obj, problem = decode(data)
            if obj is not None:
                problem = check(obj)
                if problem is None:
                    return obj
        if not quiet:
            warn_once(
                str(path),
                f"fp4select cache: ignoring {path}: {problem}. Treated as a miss; {after}.",
            )
        return None

    def _scan(self, directory: Path) -> builtins.list[os.DirEntry[str]]:
        """What is in ``directory``: nothing when it is absent, or unreadable (warned once)."""
        try:
            self.check_dirs(directory)
            with os.scandir(directory) as entries:
                return builtins.list(entries)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            warn_once(
                str(directory),
                f"fp4select cache: cannot list {directory} ({exc.strerror or exc}); skipping it.",
            )
            return []

    def list(self, directory: Path, pattern: re.Pattern[str]) -> dict[str, Path]:
        """Stem -> path of the names in ``directory`` that this package could have written."""
        found = {}
        for entry in self._scan(directory):
            match = pattern.fullmatch(entry.name)
            if match:
                found[match.group(1)] = directory / entry.name
        return found

    # builtins.list: inside this class, ``list`` is the method above
    def _list_dirs(self, directory: Path) -> builtins.list[str]:
        found = self._scan(directory)
        for entry in found:
            if entry.is_symlink():
                warn_once(
                    entry.path,
                    f"fp4select cache: ignoring {entry.path}: it is a symbolic link; it is not "
                    "read, followed or deleted.",
                )
        return [e.name for e in found if e.is_dir(follow_symlinks=False)]

    def env_hashes(self) -> builtins.list[str]:
        """Every environment with a directory, or with records in this process's memory."""
        hashes = {name for name in self._list_dirs(self.schema_dir) if _ENV_DIR.fullmatch(name)}
        with self.state.guard:
            hashes.update(self.state.envs)
            for table in self.state.tables.values():
                hashes.update(eh for eh, _ in table)
        return sorted(hashes)

    def degrade(self, exc: OSError) -> None:
        """Turn this root memory-only for the rest of the process, with one warning."""
        with self.state.guard:
            self.state.memory_only = True
        warn_once(
            f"memory-only:{self.path}",
            f"fp4select cache: cannot write under {self.path} ({exc}); decisions are kept in "
            "memory for the rest of this process and will be tuned again next time.",
        )

    # ----------------------------------------------------------------- env.json

    def env_bytes(self, env: dict[str, Any], env_hash: str) -> bytes:
        return file_bytes(_header(KIND_ENV, env_hash, env))

    def ensure_env_file(self, env_hash: str, env_data: bytes) -> None:
        path = self.schema_dir / env_hash / "env.json"
        if self.load(path, partial(_check_env, env_hash=env_hash), quiet=True) is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, env_data)

    def read_env(self, env_hash: str) -> dict[str, Any] | None:
        """The environment ``env_hash`` names, from its ``env.json`` or this process's memory."""
        obj = self.load(
            self.schema_dir / env_hash / "env.json", partial(_check_env, env_hash=env_hash)
        )
        if obj is None:
            with self.state.guard:
                data = self.state.envs.get(env_hash)
            obj = None if data is None else json.loads(data)
        return None if obj is None else obj["env"]


# --------------------------------------------------------------------------- collections


class Collection:
    """The records of one ``RecordKind`` under one root: this process's overlay over the disk."""

    def __init__(self, root: Root, kind: RecordKind) -> None:
        self._root = root
        self._kind = kind
        self._table = root.table(kind.folder)

    def _directory(self, env_hash: str) -> Path:
        return self._root.schema_dir / env_hash / self._kind.folder

    def _check(self, env_hash: str, stem: str) -> Callable[[dict[str, Any]], str | None]:
        return lambda obj: self._kind.check(obj, env_hash, stem)

    def _overlay(self, env_hash: str) -> dict[str, bytes | None]:
        with self._root.state.guard:
            return {stem: data for (eh, stem), data in self._table.items() if eh == env_hash}

    def read(self, env_hash: str, stem: str) -> dict[str, Any] | None:
        """The checked object stored as ``stem``, or None on any kind of miss."""
        with self._root.state.guard:
            slot = (env_hash, stem)
            in_memory = slot in self._table
            data = self._table.get(slot)
        if in_memory:
            return None if data is None else json.loads(data)
        path = self._directory(env_hash) / f"{stem}.json"
        return self._root.load(path, self._check(env_hash, stem))

    def items(self, env_hash: str) -> Iterator[dict[str, Any]]:
        """Every readable object of one environment, by stem."""
        on_disk = self._root.list(self._directory(env_hash), self._kind.pattern)
        in_memory = self._overlay(env_hash)
        for stem in sorted(on_disk.keys() | in_memory.keys()):
            if stem in in_memory:
                data = in_memory[stem]
                obj = None if data is None else json.loads(data)
            else:
                obj = self._root.load(on_disk[stem], self._check(env_hash, stem))
            if obj is not None:
                yield obj

    def write(self, env: dict[str, Any], env_hash: str, stem: str, fields: dict[str, Any]) -> bool:
        """Store ``fields`` under a header; True if it reached the disk, False if memory only.

        Raises ``TypeError``/``ValueError`` for what is not strict JSON or too large to read back.
        """
        data = file_bytes({**_header(self._kind.kind, env_hash, env), **fields})
        if len(data) > MAX_FILE_BYTES:  # it would be refused when read back
            raise ValueError(f"record is {len(data)} bytes as JSON; the limit is {MAX_FILE_BYTES}")
        env_data = self._root.env_bytes(env, env_hash)
        path = self._directory(env_hash) / f"{stem}.json"
        root, state = self._root, self._root.state
        if not state.memory_only:
            try:
                # mkdir and mkstemp follow symlinks: check first that none leads out of the cache.
                root.check_dirs(path.parent)
                root.ensure_env_file(env_hash, env_data)
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(path, data)
            except OSError as exc:
                root.degrade(exc)
            else:
                with state.guard:
                    self._table.pop((env_hash, stem), None)
                return True
        with state.guard:
            state.envs.setdefault(env_hash, env_data)
            self._table[(env_hash, stem)] = data
        return False

    def delete(self, env_hash: str, stem: str) -> str:
        """Forget one record: "removed", "absent", "hidden" (from this process only: the
        root is memory-only and the file stays) or "left" (something not ours is there)."""
        root, state = self._root, self._root.state
        path = self._directory(env_hash) / f"{stem}.json"
        slot = (env_hash, stem)
        if not state.memory_only:
            try:
                root.check_dirs(path.parent)
                on_disk = remove(path)
            except Damage as exc:
                warn_once(
                    f"left:{path}",
                    f"fp4select cache: not removing {path}: {exc.strerror}. Remove it yourself "
                    "if it is not needed.",
                )
                return "left"
            except OSError as exc:
                root.degrade(exc)
            else:
                with state.guard:
                    in_memory = self._table.pop(slot, None) is not None
                return "removed" if on_disk or in_memory else "absent"
        with state.guard:
            forgotten = slot in self._table and self._table[slot] is None
            in_memory = self._table.get(slot) is not None
            self._table[slot] = None
        if forgotten:
            return "absent"
        if os.path.lexists(path):
            return "hidden"
        return "removed" if in_memory else "absent"

    def delete_all(self, env_hash: str) -> dict[str, list[Path]]:
        """Status -> paths, for every record of this kind in one environment (damaged too)."""
        directory = self._directory(env_hash)
        stems = self._root.list(directory, self._kind.pattern).keys() | self._overlay(env_hash)
        done: dict[str, list[Path]] = {}
        for stem in sorted(stems):
            done.setdefault(self.delete(env_hash, stem), []).append(directory / f"{stem}.json")
        return done
