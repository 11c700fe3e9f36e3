"""Export and import archives: one JSON file holding a store's entries and blacklist.

Archives are explicit user actions, so problems raise (unlike lookups, which miss):

- ``export_archive`` writes one new file, whole or not at all: a directory is refused, and so
  is any existing name unless ``overwrite`` (which replaces the name, never writing through a
  symlink).
- ``import_archive`` reads a regular file of at most 256 MiB (symlinks followed: the user
  named it), validates everything (``ValueError`` naming the problem) before writing anything,
  refuses blacklist records for ``protected_backends`` and always for ``ALWAYS_PROTECTED``
  (the built-in fallback: an archive can never blacklist it, whoever calls), and returns what
  it did, record by record.
- Nothing received is trusted: every imported entry is written with ``"imported": true``
  (and without any ``proven_here`` the archive carried), so the selector validates its winner
  on this machine before it serves (``Selector.prove``).

This module only reads and writes through a ``Store``'s public methods, named by the
``ArchiveStore`` protocol below, so it needs no import of ``_store`` (which imports it).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Final, Protocol

from ._jsonfile import (
    SCHEMA_VERSION,
    Damage,
    atomic_write,
    decode,
    digest_or_none,
    file_bytes,
    json_type,
)
from ._jsonfile import read_named_file as _read_named_file
from ._records import blacklist_record

__all__ = [
    "ALWAYS_PROTECTED",
    "ExportResult",
    "ImportResult",
    "export_archive",
    "import_archive",
    "read_archive",
]


class ArchiveStore(Protocol):
    """What an archive reads and writes through: the part of ``Store`` it uses."""

    def iter_entries(
        self, env: Mapping[str, Any] | None = None
    ) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]: ...

    def blacklist_items(
        self, env: Mapping[str, Any] | None = None
    ) -> Iterator[tuple[dict[str, Any], str, dict[str, Any]]]: ...

    def read_entry(
        self, env: Mapping[str, Any], key: Mapping[str, Any]
    ) -> dict[str, Any] | None: ...

    def write_entry(
        self, env: Mapping[str, Any], key: Mapping[str, Any], record: Mapping[str, Any]
    ) -> bool: ...

    def blacklist(self, env: Mapping[str, Any]) -> dict[str, dict[str, Any]]: ...

    def add_to_blacklist(
        self, env: Mapping[str, Any], backend: str, record: Mapping[str, Any]
    ) -> bool: ...


KIND_ARCHIVE: Final = "fp4select.archive"
# fp4select.backends.emulation.NAME (the store does not import backends; a test checks they
# agree with fp4select.selector.PROTECTED_BACKENDS).
ALWAYS_PROTECTED: Final = frozenset({"emulation"})
_MAX_ARCHIVE_BYTES: Final = 256 << 20


@dataclass(frozen=True)
class ExportResult:
    """What ``export_archive`` wrote."""

    entries: int = 0
    blacklist: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ImportResult:
    """What ``import_archive`` did, record by record.

    ``*_in_memory`` counts records the store kept in this process only because it could not
    write (it is memory-only): they are lost when the process ends.  ``*_present`` counts
    records skipped because one was already there (``overwrite=False``);
    ``blacklist_protected`` names the backends whose records were refused because the caller
    protects them; ``entries_invalid`` says why each entry the caller's ``check_entry`` refused
    was skipped.
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


def export_archive(
    store: ArchiveStore,
    path: str | os.PathLike[str],
    env: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
) -> ExportResult:
    """Write every entry and blacklist record of ``store`` (of ``env`` or all) to one new file.

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
        why = "already exists; pass overwrite=True to replace it"
        raise FileExistsError(errno.EEXIST, why, str(target))
    entries = [{"env": e, "key": k, "record": r} for e, k, r in store.iter_entries(env)]
    blacklist = [
        {"env": e, "backend": backend, "record": record}
        for e, backend, record in store.blacklist_items(env)
    ]
    archive = {
        "schema": SCHEMA_VERSION,
        "kind": KIND_ARCHIVE,
        "entries": entries,
        "blacklist": blacklist,
    }
    atomic_write(target, file_bytes(archive), replace=overwrite)
    return ExportResult(len(entries), len(blacklist))


def import_archive(
    store: ArchiveStore,
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    protected_backends: Collection[str] = frozenset(),
    check_entry: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None,
) -> ImportResult:
    """Merge an archive into ``store`` and say, record by record, what happened.

    Existing entries and blacklist records win unless ``overwrite``.  Blacklist records
    for ``ALWAYS_PROTECTED`` and ``protected_backends`` (the built-in fallback: an archive
    must not be able to take it away) are refused and named in the result.  Entries are
    marked ``"imported": true``: they serve only once proven on this machine.  A damaged
    archive, or one that is not a regular file of at most 256 MiB, raises ``ValueError`` before
    anything is written; one that cannot be opened raises ``OSError``.  If the store
    turns memory-only midway, the rest is kept in memory only (counted apart).
    ``check_entry(key, record)`` returns why an entry must not be imported (the caller
    knows what a record means; the store does not), or None.
    """
    if isinstance(protected_backends, str):
        raise TypeError("protected_backends must be a collection of backend names, not a str")
    protected = frozenset(protected_backends) | ALWAYS_PROTECTED
    entries, blacklist = read_archive(path)
    invalid: list[str] = []
    if check_entry is not None:
        problems = [check_entry(key, record) for _, key, record in entries]
        invalid = [f"entries[{i}]: {p}" for i, p in enumerate(problems) if p is not None]
        entries = [entry for entry, p in zip(entries, problems) if p is None]
    counts = {f.name: 0 for f in fields(ImportResult) if f.default == 0}
    refused: list[str] = []
    for env, key, record in entries:
        record = {k: v for k, v in record.items() if k != "proven_here"} | {"imported": True}
        if not overwrite and store.read_entry(env, key) is not None:
            counts["entries_present"] += 1
        else:
            written = store.write_entry(env, key, record)
            counts["entries_written" if written else "entries_in_memory"] += 1
    for env, backend, record in blacklist:
        if backend in protected:
            refused.append(backend)
        elif not overwrite and backend in store.blacklist(env):
            counts["blacklist_present"] += 1
        else:
            written = store.add_to_blacklist(env, backend, record)
            counts["blacklist_written" if written else "blacklist_in_memory"] += 1
    return ImportResult(
        **counts, blacklist_protected=tuple(refused), entries_invalid=tuple(invalid)
    )


def read_archive(
    path: str | os.PathLike[str],
) -> tuple[list[tuple[dict, dict, dict]], list[tuple[dict, str, dict]]]:
    """The (env, key, record) entries and (env, backend, record) blacklist of an archive.

    Checked as ``import_archive`` checks it (a regular file, strict JSON, every field's type);
    raises ``ValueError`` for one that is not an archive and ``OSError`` when it cannot be read.
    """
    path = Path(os.fsdecode(path))

    def bad(problem: str) -> ValueError:
        return ValueError(f"{path} is not a usable fp4select archive: {problem}")

    try:
        data = _read_named_file(path, _MAX_ARCHIVE_BYTES)
    except Damage as exc:
        raise bad(str(exc.strerror)) from None
    archive, problem = decode(data)
    if archive is None:
        raise bad(str(problem))
    schema = archive.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise bad(f"schema {schema!r} is not {SCHEMA_VERSION}")
    if archive.get("kind") != KIND_ARCHIVE:
        raise bad(f"kind {archive.get('kind')!r} is not {KIND_ARCHIVE!r}")

    def items(field: str) -> list[dict[str, Any]]:
        value = archive.get(field, [])
        if not isinstance(value, list):
            raise bad(f"{field!r} must be a JSON array, found {json_type(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise bad(f"{field}[{i}] must be a JSON object, found {json_type(item)}")
        return value

    def obj(item: dict[str, Any], where: str, name: str) -> dict[str, Any]:
        value = item.get(name)
        if not isinstance(value, dict):
            raise bad(f"{where}.{name} must be a JSON object, found {json_type(value)}")
        if digest_or_none(value) is None:
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
            record = blacklist_record(item.get("backend"), record)
        except (TypeError, ValueError) as exc:
            raise bad(f"{where}: {exc}") from None
        blacklist.append((env, item["backend"], record))
    return entries, blacklist
