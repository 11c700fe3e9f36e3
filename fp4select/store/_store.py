"""The Store: fp4select's decisions of every environment under one cache root.

Location: ``Store(root)``; ``root=None`` means ``platformdirs.user_cache_dir("fp4select")``;
made absolute at construction so a later ``chdir`` cannot move it.  Constructing one touches
nothing on disk.  The store reads no environment variable: ``FP4SELECT_CACHE_DIR`` is the
``cache_dir`` of ``fp4select.settings``, which the Selector passes in as ``root``; the store
stays the lowest layer and imports nothing of fp4select.

The Store holds two ``Collection``s (entries keyed by key hash, the blacklist keyed by backend
file name), a per-key ``KeyLock``, and delegates archives to ``archive``; its methods turn
caller values (environments, keys, records as mappings) into hashes and checked records.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import platformdirs

from . import archive as _archive
from ._collection import Collection as _Collection
from ._collection import Root
from ._lock import KeyLock
from ._records import BLACKLIST, ENTRIES, as_dict, backend_file_name, blacklist_record, hash_of


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


def default_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``cache_dir`` made absolute when given and non-empty, else platformdirs' cache folder."""
    value = os.fsdecode(cache_dir) if cache_dir is not None else ""
    if value:
        return Path(value).expanduser().absolute()
    return Path(platformdirs.user_cache_dir("fp4select")).absolute()


class Store:
    """The decisions of every environment under one root; see the package docstring."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        path = default_root() if root is None else Path(os.fsdecode(root)).expanduser().absolute()
        self._root = Root(path)
        self._entries = _Collection(self._root, ENTRIES)
        self._blacklist = _Collection(self._root, BLACKLIST)

    def __repr__(self) -> str:
        mode = ", memory_only" if self.memory_only else ""
        return f"Store({str(self.root)!r}{mode})"

    @property
    def root(self) -> Path:
        return self._root.path

    @property
    def memory_only(self) -> bool:
        """True once a write under this root failed in this process (the disk is failing)."""
        return self._root.state.memory_only

    def env_dir(self, env: Mapping[str, Any]) -> Path:
        return self._root.schema_dir / hash_of(env, "env")

    def _env_hashes(self, env: Mapping[str, Any] | None) -> list[str]:
        return [hash_of(env, "env")] if env is not None else self._root.env_hashes()

    # ----------------------------------------------------------------- entries

    def read_entry(self, env: Mapping[str, Any], key: Mapping[str, Any]) -> dict[str, Any] | None:
        """The record last written for (env, key), or None on any kind of miss."""
        obj = self._entries.read(hash_of(env, "env"), hash_of(key, "key"))
        return None if obj is None else obj["record"]

    def write_entry(
        self, env: Mapping[str, Any], key: Mapping[str, Any], record: Mapping[str, Any]
    ) -> bool:
        """Remember ``record``; True if it reached the disk, False if only this process has it.

        Raises ``TypeError``/``ValueError`` for values that are not strict JSON.
        """
        env, key = as_dict(env, "env"), as_dict(key, "key")
        record = as_dict(record, "record")
        env_hash, key_hash = hash_of(env, "env"), hash_of(key, "key")
        fields = {"key_hash": key_hash, "key": key, "record": record}
        return self._entries.write(env, env_hash, key_hash, fields)

    def delete_entry(self, env: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        """Forget one key, damaged file included; True if there was something to forget."""
        status = self._entries.delete(hash_of(env, "env"), hash_of(key, "key"))
        return status in ("removed", "hidden")

    def iter_entries(
        self, env: Mapping[str, Any] | None = None
    ) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
        """(env, key, record) of every readable entry of ``env``, or of all environments."""
        for env_hash in self._env_hashes(env):
            for obj in self._entries.items(env_hash):
                yield obj["env"], obj["key"], obj["record"]

    def environments(self) -> list[dict[str, Any]]:
        """Every environment with a directory (or, memory-only, an overlay) under this schema."""
        found = (self._root.read_env(env_hash) for env_hash in self._root.env_hashes())
        return [env for env in found if env is not None]

    def clear(self, env: Mapping[str, Any] | None = None) -> ClearResult:
        """Delete the entries and blacklist of ``env`` (or of all); says what was removed.

        ``env.json`` and lock files stay: another process may hold a lock right now.
        """
        counts = {"entries": 0, "blacklist": 0}
        not_removed: list[str] = []
        for env_hash in self._env_hashes(env):
            for name, collection in (("entries", self._entries), ("blacklist", self._blacklist)):
                done = collection.delete_all(env_hash)
                counts[name] += len(done.get("removed", []))
                not_removed += [str(p) for p in done.get("hidden", []) + done.get("left", [])]
        return ClearResult(counts["entries"], counts["blacklist"], tuple(not_removed))

    # ----------------------------------------------------------------- locks

    def lock(
        self, env: Mapping[str, Any], key: Mapping[str, Any], timeout: float = 600.0
    ) -> AbstractContextManager[None]:
        """Hold while tuning (env, key); raises ``filelock.Timeout`` after ``timeout`` s.

        Read the entry again once the lock is held (``Selector.decide``): when N processes miss
        one key at once, one tunes and the others read its result.
        """
        env_dir = self.env_dir(env)
        path = env_dir / "locks" / f"{hash_of(key, 'key')}.lock"
        return KeyLock(path, timeout, lambda: self._lock_dir_ready(env_dir), str(self.root))

    def _lock_dir_ready(self, env_dir: Path) -> bool:
        """Make ``<env>/locks``; False when the store is (or just turned) memory-only."""
        if self.memory_only:
            return False
        try:
            self._root.check_dirs(env_dir)  # before mkdir, which follows symlinks
            env_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            # No environment directory, no entries: one memory-only warning says it all.
            self._root.degrade(exc)
            return False
        self._root.check_dirs(env_dir / "locks")
        (env_dir / "locks").mkdir(exist_ok=True)
        return True

    # ----------------------------------------------------------------- blacklist

    def blacklist_items(
        self, env: Mapping[str, Any] | None = None
    ) -> Iterator[tuple[dict[str, Any], str, dict[str, Any]]]:
        """(env, backend, record) of every readable blacklist record of ``env``, or of all."""
        for env_hash in self._env_hashes(env):
            for obj in self._blacklist.items(env_hash):
                yield obj["env"], obj["backend"], obj["record"]

    def blacklist(self, env: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Backend name -> why it must not be used in ``env``."""
        items = sorted(self.blacklist_items(as_dict(env, "env")), key=lambda i: i[1])
        return {backend: record for _, backend, record in items}

    def add_to_blacklist(
        self, env: Mapping[str, Any], backend: str, record: Mapping[str, Any]
    ) -> bool:
        """Record that ``backend`` is unusable in ``env``, replacing its previous record.

        ``record`` needs string ``reason`` and ``kind``; ``backend`` and ``when`` (now, UTC)
        are filled in when missing.  Raises ``ValueError`` otherwise.  Returns whether the
        record reached the disk, as ``write_entry`` does.
        """
        env = as_dict(env, "env")
        record = blacklist_record(backend, record)
        fields = {"backend": backend, "record": record}
        return self._blacklist.write(env, hash_of(env, "env"), backend_file_name(backend), fields)

    def remove_from_blacklist(self, env: Mapping[str, Any], backend: str | None = None) -> int:
        """Lift one backend's ban, or all (damaged files too) when None; returns how many.

        A memory-only root can only hide a record from this process; that counts.
        """
        env_hash = hash_of(env, "env")
        if backend is None:
            done = self._blacklist.delete_all(env_hash)
            return len(done.get("removed", [])) + len(done.get("hidden", []))
        status = self._blacklist.delete(env_hash, backend_file_name(backend))
        return int(status in ("removed", "hidden"))

    # ----------------------------------------------------------------- archives

    def export_archive(
        self,
        path: str | os.PathLike[str],
        env: Mapping[str, Any] | None = None,
        *,
        overwrite: bool = False,
    ) -> _archive.ExportResult:
        """``archive.export_archive`` of this store."""
        return _archive.export_archive(self, path, env, overwrite=overwrite)

    def import_archive(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        protected_backends: Collection[str] = frozenset(),
        check_entry: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None,
    ) -> _archive.ImportResult:
        """``archive.import_archive`` into this store."""
        return _archive.import_archive(
            self,
            path,
            overwrite=overwrite,
            protected_backends=protected_backends,
            check_entry=check_entry,
        )
