"""Tests for fp4select.store.archive: export and import of one archive file."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from store_helpers import (
    ENV,
    KEY,
    KEY2,
    OTHER_ENV,
    RECORD,
    RECORD2,
    canon,
    finish,
    one_cache_warning,
    spawn,
    squat_directory,
    temp_files,
    tree,
)

from fp4select.store import (
    SCHEMA_VERSION,
    ExportResult,
    ImportResult,
    Store,
)

# --------------------------------------------------------------------------- archives


def test_archive_round_trip_between_roots(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    a.write_entry(ENV, KEY, RECORD)
    a.write_entry(ENV, KEY2, RECORD2)
    a.write_entry(OTHER_ENV, KEY, RECORD2)
    a.add_to_blacklist(OTHER_ENV, "cudnn", {"reason": "r", "kind": "crash", "key": KEY})
    archive = tmp_path / "x" / "cache.json"
    archive.parent.mkdir()
    assert a.export_archive(archive) == ExportResult(entries=3, blacklist=1)
    obj = json.loads(archive.read_text())
    assert (obj["schema"], obj["kind"]) == (SCHEMA_VERSION, "fp4select.archive")
    assert len(obj["entries"]) == 3
    assert len(obj["blacklist"]) == 1

    assert b.import_archive(archive) == ImportResult(entries_written=3, blacklist_written=1)
    # what was received is marked so, to be proven on this machine before it serves
    imported = [(e, k, {**r, "imported": True}) for e, k, r in a.iter_entries()]
    assert sorted(map(canon, b.iter_entries())) == sorted(map(canon, imported))
    assert b.blacklist(OTHER_ENV) == a.blacklist(OTHER_ENV)
    assert b.blacklist(ENV) == {}
    assert temp_files(tmp_path) == []


def test_export_one_environment(tmp_path: Path) -> None:
    a = Store(tmp_path / "a")
    a.write_entry(ENV, KEY, RECORD)
    a.write_entry(OTHER_ENV, KEY, RECORD2)
    a.add_to_blacklist(ENV, "cudnn", {"reason": "r", "kind": "crash"})
    a.add_to_blacklist(OTHER_ENV, "cutlass", {"reason": "r", "kind": "crash"})
    assert a.export_archive(tmp_path / "env.json", env=ENV) == ExportResult(1, 1)
    obj = json.loads((tmp_path / "env.json").read_text())
    assert [e["env"] for e in obj["entries"]] == [ENV]
    assert [(e["env"], e["backend"]) for e in obj["blacklist"]] == [(ENV, "cudnn")]


def test_import_keeps_existing_unless_overwrite(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    a.write_entry(ENV, KEY, RECORD)
    a.write_entry(ENV, KEY2, RECORD)
    a.add_to_blacklist(ENV, "cudnn", {"reason": "from a", "kind": "crash"})
    a.export_archive(tmp_path / "a.json")
    b.write_entry(ENV, KEY, RECORD2)
    b.add_to_blacklist(ENV, "cudnn", {"reason": "from b", "kind": "crash"})
    assert b.import_archive(tmp_path / "a.json") == ImportResult(
        entries_written=1, entries_present=1, blacklist_present=1
    )
    assert b.read_entry(ENV, KEY) == RECORD2
    assert b.read_entry(ENV, KEY2) == {**RECORD, "imported": True}
    assert b.blacklist(ENV)["cudnn"]["reason"] == "from b"
    assert b.import_archive(tmp_path / "a.json", overwrite=True) == ImportResult(
        entries_written=2, blacklist_written=1
    )
    assert b.read_entry(ENV, KEY) == {**RECORD, "imported": True}
    assert b.blacklist(ENV)["cudnn"]["reason"] == "from a"


def _archive(**changes: Any) -> bytes:
    good = {
        "schema": SCHEMA_VERSION,
        "kind": "fp4select.archive",
        "entries": [{"env": ENV, "key": KEY, "record": RECORD}],
        "blacklist": [{"env": ENV, "backend": "cudnn", "record": {"reason": "r", "kind": "c"}}],
    }
    return json.dumps({**good, **changes}).encode()


BAD_ARCHIVES = {
    "empty": (b"", "empty file"),
    "truncated": (_archive()[:40], "not valid JSON"),
    "not utf-8": (b'{"schema": 1, "kind": "\xff"}', "not UTF-8"),
    "array": (b"[]", "found array"),
    "schema": (_archive(schema=2), "schema 2"),
    "kind": (_archive(kind="fp4select.entry"), "kind 'fp4select.entry'"),
    "entries not a list": (_archive(entries={}), "'entries' must be a JSON array"),
    "entry not an object": (
        _archive(entries=[{"env": ENV, "key": KEY, "record": RECORD}, 3]),
        "entries[1] must be a JSON object",
    ),
    "entry without key": (_archive(entries=[{"env": ENV, "record": RECORD}]), "entries[0].key"),
    "record not an object": (
        _archive(entries=[{"env": ENV, "key": KEY, "record": "fast"}]),
        "entries[0].record",
    ),
    "nan in env": (_archive().replace(b'"sm": 100', b'"sm": NaN'), "NaN, which strict JSON"),
    "infinity in a record": (
        _archive().replace(b'"us": 12.5', b'"us": Infinity'),
        "Infinity, which strict JSON",
    ),
    "-infinity in a key": (
        _archive().replace(b'"m": 128', b'"m": -Infinity'),
        "-Infinity, which strict JSON",
    ),
    "overflowing float": (_archive().replace(b'"us": 12.5', b'"us": 1e999'), "1e999"),
    "blacklist record with a bad when": (
        _archive(
            blacklist=[
                {"env": ENV, "backend": "x", "record": {"reason": "r", "kind": "c", "when": 3}}
            ]
        ),
        "'when' must be an ISO 8601 string",
    ),
    "blacklist record with a bad key": (
        _archive(
            blacklist=[
                {"env": ENV, "backend": "x", "record": {"reason": "r", "kind": "c", "key": "k"}}
            ]
        ),
        "'key' must be a mapping",
    ),
    "blacklist without reason": (
        _archive(blacklist=[{"env": ENV, "backend": "cudnn", "record": {"kind": "c"}}]),
        "blacklist[0]: blacklist record for 'cudnn' needs a string 'reason'",
    ),
    "blacklist without backend": (
        _archive(blacklist=[{"env": ENV, "record": {"reason": "r", "kind": "c"}}]),
        "blacklist[0]: backend must be a non-empty string",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARCHIVES))
def test_import_of_a_damaged_archive_raises_and_writes_nothing(
    tmp_path: Path, store: Store, case: str
) -> None:
    data, problem = BAD_ARCHIVES[case]
    archive = tmp_path / "bad.json"
    archive.write_bytes(data)
    with pytest.raises(ValueError, match="not a usable fp4select archive") as info:
        store.import_archive(archive)
    assert problem in str(info.value)
    assert str(archive) in str(info.value)
    assert not store.root.exists()


def test_import_of_a_missing_archive_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Store(tmp_path / "cache").import_archive(tmp_path / "nope.json")


def test_export_failure_raises(tmp_path: Path, store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    with pytest.raises(OSError):
        store.export_archive(tmp_path / "missing-dir" / "a.json")
    assert not store.memory_only


# --------------------------------------------------------------------------- export never destroys


def seeded(tmp_path: Path) -> Store:
    store = Store(tmp_path / "cache")
    store.write_entry(ENV, KEY, RECORD)
    store.add_to_blacklist(ENV, "cudnn", {"reason": "r", "kind": "crash"})
    return store


def assert_archive(path: Path, entries: int = 1) -> None:
    obj = json.loads(path.read_bytes())
    assert (obj["kind"], len(obj["entries"])) == ("fp4select.archive", entries)


def test_export_refuses_a_directory_and_touches_nothing(tmp_path: Path) -> None:
    store = seeded(tmp_path)
    target = tmp_path / "out"
    before = squat_directory(target)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        store.export_archive(target)
    with pytest.raises(IsADirectoryError):
        store.export_archive(target, overwrite=True)
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    with pytest.raises(IsADirectoryError):
        store.export_archive(link, overwrite=True)
    assert tree(target) == before and link.is_symlink()
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("name", [".", ""])
def test_export_to_the_working_directory_empties_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    store = seeded(tmp_path)
    work = tmp_path / "work"
    before = squat_directory(work)
    monkeypatch.chdir(work)
    with pytest.raises(IsADirectoryError):
        store.export_archive(name, overwrite=True)
    assert tree(work) == before


def test_export_refuses_an_existing_file_unless_overwrite(tmp_path: Path) -> None:
    store = seeded(tmp_path)
    target = tmp_path / "decisions.json"
    target.write_text("someone's file")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        store.export_archive(target)
    assert target.read_text() == "someone's file"
    assert store.export_archive(target, overwrite=True) == ExportResult(1, 1)
    assert_archive(target)
    assert temp_files(tmp_path) == []


def test_export_onto_a_symlink_never_writes_through_it(tmp_path: Path) -> None:
    store = seeded(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for pointing_at in (victim, tmp_path / "nowhere"):
        link = tmp_path / "link.json"
        link.symlink_to(pointing_at)
        with pytest.raises(FileExistsError):  # a dangling link is still a name in use
            store.export_archive(link)
        store.export_archive(link, overwrite=True)  # replaces the link itself
        assert not link.is_symlink()
        assert_archive(link)
        link.unlink()
    assert victim.read_text() == "precious"
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("hard_links", [True, False])
def test_exclusive_write_never_replaces_a_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool
) -> None:
    # The check in export_archive can race a file created just after it; the write cannot.
    from fp4select.store._jsonfile import atomic_write

    if not hard_links:  # a file system without them takes the O_EXCL path
        monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(PermissionError()))
    taken = tmp_path / "taken"
    taken.write_text("first")
    with pytest.raises(FileExistsError):
        atomic_write(taken, b"second", replace=False)
    assert taken.read_text() == "first"
    atomic_write(tmp_path / "free", b"new", replace=False)
    assert (tmp_path / "free").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["free", "taken"]


# --------------------------------------------------------------------------- import is checked


def test_import_refuses_to_blacklist_protected_backends(tmp_path: Path, store: Store) -> None:
    archive = tmp_path / "a.json"
    blacklist = [
        {"env": ENV, "backend": name, "record": {"reason": "r", "kind": "hang"}}
        for name in ("emulation", "cutlass")
    ]
    archive.write_bytes(_archive(blacklist=blacklist))
    with pytest.raises(TypeError, match="protected_backends"):
        store.import_archive(archive, protected_backends="emulation")
    result = store.import_archive(archive, protected_backends=frozenset({"emulation"}))
    assert result == ImportResult(
        entries_written=1, blacklist_written=1, blacklist_protected=("emulation",)
    )
    assert list(store.blacklist(ENV)) == ["cutlass"]
    assert result.as_dict()["blacklist_protected"] == ["emulation"]
    again = store.import_archive(archive, protected_backends={"emulation"}, overwrite=False)
    assert again == ImportResult(
        entries_present=1, blacklist_present=1, blacklist_protected=("emulation",)
    )


def test_import_into_a_failing_disk_counts_what_stayed_in_memory(
    tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "a.json"
    archive.write_bytes(_archive())
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EROFS, "ro")))
    with one_cache_warning("memory"):
        result = store.import_archive(archive)
    assert result == ImportResult(entries_in_memory=1, blacklist_in_memory=1)


@pytest.mark.parametrize("what", ["directory", "too large"])
def test_import_reads_only_a_regular_file_of_bounded_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    from fp4select.store import archive as archive_module

    archive = tmp_path / "a.json"
    if what == "directory":
        archive.mkdir()
        match = "it is a directory, not a regular file"
    else:
        archive.write_bytes(_archive())
        monkeypatch.setattr(archive_module, "_MAX_ARCHIVE_BYTES", 100)
        match = "larger than 100 bytes"
    with pytest.raises(ValueError, match=match):
        Store(tmp_path / "cache").import_archive(archive)
    assert not (tmp_path / "cache").exists()


@pytest.mark.subprocess
@pytest.mark.parametrize("thing", ["fifo", "/dev/zero"])
def test_import_of_a_fifo_or_device_fails_at_once(tmp_path: Path, thing: str) -> None:
    if not hasattr(os, "mkfifo") or not Path("/dev/zero").exists():
        pytest.skip("needs mkfifo and /dev/zero")
    archive = tmp_path / "a.json"
    if thing == "fifo":
        os.mkfifo(archive)
    else:
        archive = Path("/dev/zero")
    (out,) = finish(
        [spawn("import", tmp_path / "cache", archive=str(archive), max_memory=1 << 29)], 60
    )
    result = json.loads(out)
    assert result["error"] == "ValueError"
    assert "not a regular file" in result["message"]
    assert not (tmp_path / "cache").exists()
