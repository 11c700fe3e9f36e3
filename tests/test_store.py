"""Tests for fp4select.store: real files, real processes, every damaged-cache case.

Locks are tested in test_store_lock.py, archives in test_store_archive.py."""

from __future__ import annotations

import ast
import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any

import platformdirs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from store_helpers import (
    ENV,
    KEY,
    KEY2,
    OTHER_ENV,
    RECORD,
    RECORD2,
    all_files,
    canon,
    entry_path,
    finish,
    no_cache_warnings,
    one_cache_warning,
    spawn,
    squat_directory,
    temp_files,
    tree,
    unprivileged,
)

from fp4select.store import (
    SCHEMA_VERSION,
    CacheWarning,
    ClearResult,
    Store,
    default_root,
    digest,
)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory that an unprivileged uid can reach (pytest's tmp_path is 0o700 root-only)."""
    path = Path(tempfile.mkdtemp(prefix="fp4select-test-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for p in [path, *path.rglob("*")]:
            with contextlib.suppress(OSError):
                p.chmod(0o755)
        shutil.rmtree(path)


# --------------------------------------------------------------------------- location


def test_store_is_the_lowest_layer() -> None:
    import fp4select.store

    files = sorted(Path(fp4select.store.__file__).parent.glob("*.py"))
    assert len(files) > 1
    for file in files:
        for node in ast.walk(ast.parse(file.read_text("utf-8"))):
            if isinstance(node, ast.ImportFrom):
                # Relative imports stay inside fp4select/store; level 2 would leave it.
                assert node.level in (0, 1), f"{file.name} imports from outside the store"
                assert not (node.module or "").startswith("fp4select"), file.name
            elif isinstance(node, ast.Import):
                assert not any(alias.name.startswith("fp4select") for alias in node.names)


def test_default_root_is_the_folder_given(tmp_path: Path) -> None:
    assert default_root(str(tmp_path / "here")) == tmp_path / "here"
    assert default_root(tmp_path / "here") == tmp_path / "here"


@pytest.mark.parametrize("value", [None, ""])
def test_default_root_falls_back_to_platformdirs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str | None
) -> None:
    # The store reads no variable: FP4SELECT_CACHE_DIR reaches it through the settings only.
    monkeypatch.setenv("FP4SELECT_CACHE_DIR", str(tmp_path / "not-read-here"))
    assert default_root(value) == Path(platformdirs.user_cache_dir("fp4select")).absolute()
    assert Store().root == default_root()


def test_relative_root_is_pinned_at_construction(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    store = Store("rel")
    monkeypatch.chdir("/")
    assert store.root == tmp_path / "rel"
    assert store.root.is_absolute()


def test_constructing_touches_nothing(tmp_path: Path) -> None:
    Store(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- digest


def test_digest_canonical_form_is_frozen() -> None:
    # Changing this orphans every cache in the field; bump SCHEMA_VERSION instead.
    expected = hashlib.sha256(b'{"a":[1,2.5,"x"],"b":{"c":null,"d":true}}').hexdigest()[:20]
    assert digest({"b": {"d": True, "c": None}, "a": [1, 2.5, "x"]}) == expected
    assert len(digest({})) == 20
    assert set(digest(KEY)) <= set("0123456789abcdef")


def test_digest_rejects_non_json() -> None:
    with pytest.raises(TypeError):
        digest({"s": {1, 2}})
    with pytest.raises(ValueError):
        digest({"x": float("nan")})


_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_dicts = st.dictionaries(st.text(max_size=6), _json, min_size=1, max_size=6)


def _reordered(value: Any, rnd: Any) -> Any:
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: _reordered(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [_reordered(v, rnd) for v in value]
    return value


@given(_dicts, st.randoms())
def test_digest_ignores_dict_order(obj: dict, rnd: Any) -> None:
    assert digest(_reordered(obj, rnd)) == digest(obj)


@given(_dicts, st.data())
def test_digest_changes_with_any_single_field(obj: dict, data: st.DataObject) -> None:
    field = data.draw(st.sampled_from(sorted(obj)))
    new_value = data.draw(_json)

    def canonical(v: Any) -> str:
        return json.dumps(v, sort_keys=True)

    assume(canonical(new_value) != canonical(obj[field]))
    assert digest({**obj, field: new_value}) != digest(obj)
    renamed = data.draw(st.text(max_size=6))
    assume(renamed not in obj)
    moved = {k: v for k, v in obj.items() if k != field} | {renamed: obj[field]}
    assert digest(moved) != digest(obj)


# --------------------------------------------------------------------------- entries


def test_round_trip_and_misses(store: Store) -> None:
    with no_cache_warnings():
        assert store.read_entry(ENV, KEY) is None
        assert store.write_entry(ENV, KEY, RECORD) is True
        assert store.read_entry(ENV, KEY) == RECORD
        assert store.read_entry(ENV, KEY2) is None
        assert store.read_entry(OTHER_ENV, KEY) is None
        assert not store.memory_only


def test_layout_and_file_contents(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    store.add_to_blacklist(ENV, "cudnn", {"reason": "segfault", "kind": "crash"})
    env_dir = store.root / f"v{SCHEMA_VERSION}" / digest(ENV)
    assert store.env_dir(ENV) == env_dir
    assert all_files(store.root) == sorted(
        [
            env_dir / "env.json",
            env_dir / "entries" / f"{digest(KEY)}.json",
            env_dir / "blacklist" / "cudnn.json",
        ]
    )
    entry = json.loads((env_dir / "entries" / f"{digest(KEY)}.json").read_text("utf-8"))
    assert entry["schema"] == SCHEMA_VERSION
    assert entry["kind"] == "fp4select.entry"
    assert entry["env_hash"] == digest(ENV)
    assert (entry["env"], entry["key"], entry["record"]) == (ENV, KEY, RECORD)
    env_file = json.loads((env_dir / "env.json").read_text("utf-8"))
    assert env_file["kind"] == "fp4select.env"
    assert env_file["env"] == ENV
    assert env_file["env_hash"] == digest(ENV)
    listed = json.loads((env_dir / "blacklist" / "cudnn.json").read_text("utf-8"))
    assert listed["kind"] == "fp4select.blacklist"
    assert listed["schema"] == SCHEMA_VERSION
    assert listed["env_hash"] == digest(ENV)
    with store.lock(ENV, KEY):
        assert (env_dir / "locks" / f"{digest(KEY)}.lock").exists()


def test_no_temp_files_left(store: Store) -> None:
    for i in range(20):
        store.write_entry(ENV, {"m": i}, RECORD)
    store.write_entry(ENV, KEY, RECORD)
    store.write_entry(ENV, KEY, RECORD2)
    store.export_archive(store.root / "archive.json")
    assert temp_files(store.root) == []


def test_files_are_readable_by_others(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    assert entry_path(store, ENV, KEY).stat().st_mode & 0o777 == 0o644


def test_overwrite_replaces(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    store.write_entry(ENV, KEY, RECORD2)
    assert store.read_entry(ENV, KEY) == RECORD2


def test_accepts_any_mapping_and_returns_json_values(store: Store) -> None:
    store.write_entry(MappingProxyType(ENV), MappingProxyType(KEY), MappingProxyType({"t": (1, 2)}))
    assert store.read_entry(ENV, KEY) == {"t": [1, 2]}  # JSON has no tuples


@pytest.mark.parametrize(
    ("record", "error"),
    [({"s": {1, 2}}, TypeError), ({"us": float("nan")}, ValueError), ([1, 2], TypeError)],
)
def test_write_rejects_non_json_before_touching_disk(
    store: Store, record: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        store.write_entry(ENV, KEY, record)
    assert not store.root.exists()
    assert not store.memory_only


def test_delete_entry(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    store.write_entry(ENV, KEY2, RECORD2)
    assert store.delete_entry(ENV, KEY) is True
    assert store.delete_entry(ENV, KEY) is False
    assert store.delete_entry(OTHER_ENV, KEY) is False
    assert store.read_entry(ENV, KEY) is None
    assert store.read_entry(ENV, KEY2) == RECORD2


def test_iter_entries_and_environments(store: Store) -> None:
    assert list(store.iter_entries()) == []
    assert store.environments() == []
    store.write_entry(ENV, KEY, RECORD)
    store.write_entry(ENV, KEY2, RECORD2)
    store.write_entry(OTHER_ENV, KEY, RECORD2)
    everything = list(store.iter_entries())
    assert len(everything) == 3
    assert (OTHER_ENV, KEY, RECORD2) in everything
    assert sorted(map(canon, store.iter_entries(ENV))) == sorted(
        map(canon, [(ENV, KEY, RECORD), (ENV, KEY2, RECORD2)])
    )
    assert list(store.iter_entries({"never": "seen"})) == []
    assert sorted(map(canon, store.environments())) == sorted(map(canon, [ENV, OTHER_ENV]))


def test_iter_entries_ignores_foreign_names(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    entries = store.env_dir(ENV) / "entries"
    (entries / "README.txt").write_text("not ours")
    (entries / f".{digest(KEY2)}.json.abc.tmp").write_text("{half")  # a SIGKILLed writer
    (store.root / f"v{SCHEMA_VERSION}" / "not-a-hash").mkdir()
    (store.root / "v2").mkdir()  # a future schema
    with no_cache_warnings():
        assert list(store.iter_entries()) == [(ENV, KEY, RECORD)]
        assert store.environments() == [ENV]


def test_clear_one_env_and_all(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    store.write_entry(ENV, KEY2, RECORD2)
    store.write_entry(OTHER_ENV, KEY, RECORD)
    store.add_to_blacklist(ENV, "cudnn", {"reason": "r", "kind": "crash"})
    with store.lock(ENV, KEY):
        pass
    assert store.clear(ENV) == ClearResult(entries=2, blacklist=1)
    assert list(store.iter_entries(ENV)) == []
    assert store.blacklist(ENV) == {}
    assert store.read_entry(OTHER_ENV, KEY) == RECORD
    assert (store.env_dir(ENV) / "env.json").exists()  # kept: it names the directory
    assert store.clear() == ClearResult(entries=1, blacklist=0)
    assert list(store.iter_entries()) == []
    assert store.clear() == ClearResult()
    assert store.clear().as_dict() == {"entries": 0, "blacklist": 0, "not_removed": []}


def test_clear_removes_damaged_files(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    entry_path(store, ENV, KEY).write_bytes(b"garbage")
    assert store.clear(ENV).entries == 1
    assert not entry_path(store, ENV, KEY).exists()


# --------------------------------------------------------------------------- damaged files


def _rewrite(**changes: Any) -> Callable[[Path, Path], None]:
    def damage(path: Path, other: Path) -> None:
        obj = json.loads(path.read_bytes())
        for name, value in changes.items():
            if value is _DELETE:
                del obj[name]
            else:
                obj[name] = value
        path.write_text(json.dumps(obj), "utf-8")

    return damage


def _bytes(data: bytes) -> Callable[[Path, Path], None]:
    return lambda path, other: path.write_bytes(data)


def _truncate(path: Path, other: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _bad_utf8_inside_json(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes().replace(b'"nvfp4"', b'"nvfp4\xff"'))


def _other_keys_file(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)


def _directory(path: Path, other: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("x")


_DELETE = object()
DAMAGES: dict[str, Callable[[Path, Path], None]] = {
    "truncated": _truncate,
    "empty": _bytes(b""),
    "whitespace only": _bytes(b" \n\t"),
    "garbage bytes": _bytes(b"\x00\xff\xfe\x80garbage"),
    "non-utf8 inside json": _bad_utf8_inside_json,
    "utf8 bom": lambda path, other: path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes()),
    "json array": _bytes(b"[1, 2, 3]"),
    "json string": _bytes(b'"entry"'),
    "json null": _bytes(b"null"),
    "deeply nested": _bytes(b"[" * 100_000 + b"]" * 100_000),
    "schema 2": _rewrite(schema=2),
    "schema as string": _rewrite(schema="1"),
    "schema as bool": _rewrite(schema=True),
    "schema missing": _rewrite(schema=_DELETE),
    "wrong kind": _rewrite(kind="fp4select.blacklist"),
    "env_hash mismatch": _rewrite(env_hash=digest(OTHER_ENV)),
    "env tampered": _rewrite(env=OTHER_ENV),
    "env not a dict": _rewrite(env=["gpu"]),
    "key mismatch": _other_keys_file,
    "key missing": _rewrite(key=_DELETE),
    "record not a dict": _rewrite(record=[1, 2]),
    "nan in env": lambda path, other: path.write_bytes(
        path.read_bytes().replace(b'"sm": 100', b'"sm": NaN')
    ),
    "directory instead of file": _directory,
}


def _snapshot(path: Path) -> bytes | str:
    return "<dir>" if path.is_dir() else path.read_bytes()


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_entry_is_a_miss_with_one_warning(store: Store, damage: str) -> None:
    store.write_entry(ENV, KEY, RECORD)
    store.write_entry(ENV, KEY2, RECORD2)
    path, other = entry_path(store, ENV, KEY), entry_path(store, ENV, KEY2)
    DAMAGES[damage](path, other)
    before = _snapshot(path)

    with one_cache_warning(str(path)) as caught:
        assert store.read_entry(ENV, KEY) is None
    assert caught[0].filename == __file__  # points at the caller, not into the store
    with no_cache_warnings():
        assert store.read_entry(ENV, KEY) is None  # once per path per process
        assert list(store.iter_entries(ENV)) == [(ENV, KEY2, RECORD2)]
        assert store.read_entry(ENV, KEY2) == RECORD2
        assert Store(store.root).read_entry(ENV, KEY) is None
    assert _snapshot(path) == before  # left for whoever owns it
    if damage == "directory instead of file":
        return  # not ours to replace: test_directory_at_an_entry_path_is_never_deleted

    with no_cache_warnings():
        assert store.write_entry(ENV, KEY, RECORD) is True
        assert store.read_entry(ENV, KEY) == RECORD
    assert not store.memory_only


@pytest.mark.parametrize("mechanism", ["chmod 000", "unreadable directory"])
def test_unreadable_entry_is_a_miss_with_one_warning(open_dir: Path, mechanism: str) -> None:
    store = Store(open_dir / "cache")
    store.write_entry(ENV, KEY, RECORD)
    store.write_entry(OTHER_ENV, KEY2, RECORD2)
    path = entry_path(store, ENV, KEY)
    target = path if mechanism == "chmod 000" else path.parent
    target.chmod(0o000)
    try:
        with unprivileged():
            with one_cache_warning(str(path)):
                assert store.read_entry(ENV, KEY) is None
            if mechanism == "chmod 000":
                with no_cache_warnings():
                    assert list(store.iter_entries(ENV)) == []
            else:  # listing the directory is a second path, so its own warning
                with one_cache_warning(f"cannot list {path.parent}"):
                    assert list(store.iter_entries(ENV)) == []
            with no_cache_warnings():
                assert list(store.iter_entries(ENV)) == []
                assert store.read_entry(ENV, KEY) is None
                assert store.read_entry(OTHER_ENV, KEY2) == RECORD2
    finally:
        target.chmod(0o755 if target.is_dir() else 0o644)
    assert path.exists()
    assert store.write_entry(ENV, KEY, RECORD2) is True
    assert store.read_entry(ENV, KEY) == RECORD2


@pytest.mark.parametrize(
    "damage", ["garbage bytes", "wrong kind", "env_hash mismatch", "schema 2", "env tampered"]
)
def test_damaged_env_file_hides_only_that_environment(store: Store, damage: str) -> None:
    store.write_entry(ENV, KEY, RECORD)
    store.write_entry(OTHER_ENV, KEY, RECORD)
    path = store.env_dir(ENV) / "env.json"
    DAMAGES[damage](path, path)
    with one_cache_warning(str(path)):
        assert store.environments() == [OTHER_ENV]
    with no_cache_warnings():
        assert store.read_entry(ENV, KEY) == RECORD  # entries carry their own env
        store.write_entry(ENV, KEY2, RECORD)  # and a write repairs env.json
        assert len(store.environments()) == 2


def test_damaged_blacklist_file_is_skipped_with_one_warning(store: Store) -> None:
    store.add_to_blacklist(ENV, "cudnn", {"reason": "r", "kind": "crash"})
    store.add_to_blacklist(ENV, "cutlass", {"reason": "r", "kind": "hang"})
    bl = store.env_dir(ENV) / "blacklist"
    (bl / "cudnn.json").write_bytes(b"{trunc")
    shutil.copyfile(bl / "cutlass.json", bl / "trtllm.json")  # right file, wrong name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(store.blacklist(ENV)) == ["cutlass"]
    assert len(caught) == 2
    assert {Path(str(w.message).split(": ")[1]).name for w in caught} == {
        "cudnn.json",
        "trtllm.json",
    }
    with no_cache_warnings():
        assert list(store.blacklist(ENV)) == ["cutlass"]
        store.add_to_blacklist(ENV, "cudnn", {"reason": "again", "kind": "crash"})
        assert store.blacklist(ENV)["cudnn"]["reason"] == "again"


def test_foreign_schema_file_under_v1_is_left_alone(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    path = entry_path(store, ENV, KEY)
    future = {"schema": 2, "kind": "fp4select.entry", "format": "something new"}
    path.write_text(json.dumps(future))
    with one_cache_warning("schema 2"):
        assert store.read_entry(ENV, KEY) is None
    assert json.loads(path.read_text()) == future


# --------------------------------------------------------------------------- what is not ours


def test_directory_at_an_entry_path_is_never_deleted(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    store.write_entry(ENV, KEY2, RECORD2)
    path = entry_path(store, ENV, KEY)
    before = squat_directory(path)
    with one_cache_warning(f"{path}: it is a directory"):
        assert store.read_entry(ENV, KEY) is None
    with one_cache_warning("memory"):  # a write cannot put the entry there: rule 6
        assert store.write_entry(ENV, KEY, RECORD) is False
    assert store.memory_only
    assert tree(path) == before
    assert temp_files(store.root) == []
    with no_cache_warnings():
        assert store.read_entry(ENV, KEY) == RECORD  # this process still remembers it
        assert store.read_entry(ENV, KEY2) == RECORD2


def test_clear_leaves_a_directory_at_an_entry_path_and_says_so(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    store.write_entry(ENV, KEY2, RECORD2)
    store.add_to_blacklist(ENV, "cudnn", {"reason": "r", "kind": "crash"})
    store.add_to_blacklist(ENV, "cutlass", {"reason": "r", "kind": "crash"})
    path = entry_path(store, ENV, KEY)
    listed = store.env_dir(ENV) / "blacklist" / "cudnn.json"
    before, before_listed = squat_directory(path), squat_directory(listed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = store.clear()
    assert result == ClearResult(entries=1, blacklist=1, not_removed=(str(path), str(listed)))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    for squatted in (path, listed):
        assert any(f"not removing {squatted}: it is a directory" in m for m in messages)
    assert tree(path) == before and tree(listed) == before_listed
    assert not store.memory_only  # nothing failed: the store just does not own these
    with no_cache_warnings():
        assert store.delete_entry(ENV, KEY) is False
        assert store.remove_from_blacklist(ENV, "cudnn") == 0
    assert tree(path) == before and tree(listed) == before_listed
    assert not entry_path(store, ENV, KEY2).exists()


def test_symlink_at_an_entry_path_is_not_followed(store: Store, tmp_path: Path) -> None:
    store.write_entry(ENV, KEY, RECORD)
    path = entry_path(store, ENV, KEY)
    elsewhere = tmp_path / "elsewhere.json"
    shutil.copyfile(path, elsewhere)  # a valid entry for this very key, outside the cache
    original = elsewhere.read_bytes()
    path.unlink()
    path.symlink_to(elsewhere)
    with one_cache_warning(f"{path}: it is a symbolic link"):
        assert store.read_entry(ENV, KEY) is None
    with no_cache_warnings():
        assert list(store.iter_entries(ENV)) == []
        assert store.write_entry(ENV, KEY, RECORD2) is True  # replaces the link, not its target
    assert not path.is_symlink()
    assert store.read_entry(ENV, KEY) == RECORD2
    path.unlink()
    path.symlink_to(elsewhere)
    assert store.delete_entry(ENV, KEY) is True  # the name goes; what it points at stays
    assert not os.path.lexists(path)
    assert elsewhere.read_bytes() == original


@pytest.mark.parametrize("which", ["entries", "environment", "schema"])
def test_symlinked_directory_inside_the_cache_is_not_followed(tmp_path: Path, which: str) -> None:
    store = Store(tmp_path / "cache")
    store.write_entry(ENV, KEY, RECORD)
    store.add_to_blacklist(ENV, "cudnn", {"reason": "r", "kind": "crash"})
    directory = {
        "entries": store.env_dir(ENV) / "entries",
        "environment": store.env_dir(ENV),
        "schema": store.root / f"v{SCHEMA_VERSION}",
    }[which]
    elsewhere = tmp_path / "elsewhere"
    directory.rename(elsewhere)
    directory.symlink_to(elsewhere, target_is_directory=True)
    before = tree(elsewhere)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.read_entry(ENV, KEY) is None
        assert list(store.iter_entries()) == []
        if which != "entries":
            assert store.blacklist(ENV) == {}
    messages = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert messages and all("symbolic link" in m for m in messages), messages
    with pytest.warns(CacheWarning, match="memory"):
        assert store.write_entry(ENV, KEY2, RECORD2) is False
    with no_cache_warnings():
        assert store.read_entry(ENV, KEY2) == RECORD2
    assert tree(elsewhere) == before  # nothing written, replaced or deleted out there
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")  # a listing blocked by the link may warn once more
        store.clear()
    assert tree(elsewhere) == before


SPECIAL_TARGETS = {
    "entry": lambda store: entry_path(store, ENV, KEY),
    "blacklist": lambda store: store.env_dir(ENV) / "blacklist" / "cudnn.json",
    "env": lambda store: store.env_dir(ENV) / "env.json",
}


@pytest.mark.subprocess
@pytest.mark.parametrize("thing", ["fifo", "symlink to /dev/zero"])
@pytest.mark.parametrize("where", list(SPECIAL_TARGETS))
def test_fifo_or_device_in_the_cache_is_a_miss_at_once(
    store: Store, where: str, thing: str
) -> None:
    # In a child with a deadline and a memory cap: before the fix a FIFO hung every lookup and
    # /dev/zero was read until MemoryError, and neither may take the test run down with it.
    if not hasattr(os, "mkfifo") or not Path("/dev/zero").exists():
        pytest.skip("needs mkfifo and /dev/zero")
    store.write_entry(ENV, KEY, RECORD)
    store.add_to_blacklist(ENV, "cudnn", {"reason": "r", "kind": "crash"})
    path = SPECIAL_TARGETS[where](store)
    path.unlink()
    if thing == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    (out,) = finish([spawn("read", store.root, env=ENV, key=KEY, max_memory=1 << 29)], 60)
    result = json.loads(out)
    assert len(result["warnings"]) == 1, result["warnings"]
    expected = "a FIFO" if thing == "fifo" else "a symbolic link"
    assert f"{path}: it is {expected}" in result["warnings"][0]
    assert result["entry"] == (None if where == "entry" else RECORD)
    assert result["blacklist"] == ([] if where == "blacklist" else ["cudnn"])
    assert result["environments"] == (0 if where == "env" else 1)
    assert os.path.lexists(path)  # reported, not removed


def test_oversized_file_in_the_cache_is_a_miss(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    path = entry_path(store, ENV, KEY)
    obj = json.loads(path.read_bytes())
    obj["padding"] = " " * (1 << 20)  # valid, matching, and larger than fp4select ever writes
    path.write_text(json.dumps(obj))
    with one_cache_warning("larger than 1048576 bytes"):
        assert store.read_entry(ENV, KEY) is None
    with pytest.raises(ValueError, match="the limit is 1048576"):
        store.write_entry(ENV, KEY2, {"padding": " " * (1 << 20)})
    assert not entry_path(store, ENV, KEY2).exists()


# --------------------------------------------------------------------------- failing disk


@pytest.mark.parametrize("mechanism", ["root is a regular file", "root under /proc"])
def test_unwritable_root_degrades_to_memory(tmp_path: Path, mechanism: str) -> None:
    if mechanism == "root is a regular file":
        root = tmp_path / "cache"
        root.write_text("I am a file")
    else:
        if not Path("/proc/self").exists():
            pytest.skip("no /proc on this system")
        root = Path(f"/proc/fp4select-test-{os.getpid()}-{time.monotonic_ns()}")
    store = Store(root)
    with no_cache_warnings():
        assert store.read_entry(ENV, KEY) is None
    with one_cache_warning("memory"):
        assert store.write_entry(ENV, KEY, RECORD) is False
        assert store.write_entry(ENV, KEY2, RECORD2) is False
        store.add_to_blacklist(ENV, "cudnn", {"reason": "r", "kind": "crash"})
    assert store.memory_only
    with no_cache_warnings():
        assert store.read_entry(ENV, KEY) == RECORD
        assert store.read_entry(ENV, KEY2) == RECORD2
        assert list(store.blacklist(ENV)) == ["cudnn"]
        assert len(list(store.iter_entries())) == 2
        assert store.environments() == [ENV]
        with store.lock(ENV, KEY):
            pass
        again = Store(root)  # the process as a whole stays memory-only
        assert again.memory_only
        assert again.read_entry(ENV, KEY) == RECORD
    if mechanism == "root is a regular file":
        assert root.read_text() == "I am a file"


def test_read_only_directory_degrades_to_memory(open_dir: Path) -> None:
    seeded = Store(open_dir / "cache")
    seeded.write_entry(ENV, KEY, RECORD)
    (open_dir / "cache").chmod(0o555)
    for p in (open_dir / "cache").rglob("*"):
        if p.is_dir():
            p.chmod(0o555)
    try:
        with unprivileged():
            store = Store(open_dir / "cache")
            with no_cache_warnings():
                assert store.read_entry(ENV, KEY) == RECORD  # a read-only cache still serves
            with one_cache_warning("memory"):
                assert store.write_entry(ENV, KEY2, RECORD2) is False
                assert store.write_entry(ENV, KEY, RECORD2) is False
            with no_cache_warnings():
                assert store.memory_only
                assert store.read_entry(ENV, KEY2) == RECORD2
                assert store.read_entry(ENV, KEY) == RECORD2
    finally:
        for p in [open_dir / "cache", *(open_dir / "cache").rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
    assert temp_files(open_dir) == []
    assert not entry_path(store, ENV, KEY2).exists()


@pytest.mark.parametrize("call", ["write", "fsync"])
def test_disk_full_degrades_to_memory_without_temp_files(
    store: Store, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    store.write_entry(ENV, KEY, RECORD)

    def full(*args: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, call, full)
    with one_cache_warning("No space left"):
        assert store.write_entry(ENV, KEY2, RECORD2) is False
        assert store.write_entry(OTHER_ENV, KEY2, RECORD) is False
    monkeypatch.undo()
    assert store.memory_only
    assert temp_files(store.root) == []
    assert not entry_path(store, ENV, KEY2).exists()
    with no_cache_warnings():
        assert store.read_entry(ENV, KEY2) == RECORD2
        assert store.read_entry(OTHER_ENV, KEY2) == RECORD
        assert store.read_entry(ENV, KEY) == RECORD  # disk entries still serve
        assert store.write_entry(ENV, KEY2, RECORD) is False  # no retry for this process


def test_memory_only_overlay_semantics(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    store.write_entry(ENV, KEY, RECORD)
    store.add_to_blacklist(ENV, "cudnn", {"reason": "r", "kind": "crash"})
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EROFS, "ro")))
    with pytest.warns(CacheWarning):
        store.write_entry(OTHER_ENV, KEY, RECORD2)
    monkeypatch.undo()
    on_disk = entry_path(store, ENV, KEY)
    with no_cache_warnings():
        assert store.delete_entry(ENV, KEY) is True  # hidden in this process ...
        assert on_disk.exists()  # ... but not touched on disk
        assert store.read_entry(ENV, KEY) is None
        assert store.delete_entry(ENV, KEY) is False
        assert list(store.iter_entries()) == [(OTHER_ENV, KEY, RECORD2)]
        assert sorted(map(canon, store.environments())) == sorted(map(canon, [ENV, OTHER_ENV]))
        store.write_entry(ENV, KEY, RECORD2)
        assert store.read_entry(ENV, KEY) == RECORD2
        assert store.remove_from_blacklist(ENV, "cudnn") == 1
        assert store.blacklist(ENV) == {}
        store.add_to_blacklist(ENV, "cutlass", {"reason": "r", "kind": "hang"})
        # KEY was written again in memory over the file that stays on disk: not removed.
        assert store.clear() == ClearResult(entries=1, blacklist=1, not_removed=(str(on_disk),))
        assert list(store.iter_entries()) == []
        assert store.blacklist(ENV) == {}
        assert store.read_entry(ENV, KEY) is None
        store.write_entry(ENV, KEY, {"nested": {"a": 1}})
        got = store.read_entry(ENV, KEY)
        assert got is not None
        got["nested"]["a"] = 2  # callers get copies, not the overlay itself
        assert store.read_entry(ENV, KEY) == {"nested": {"a": 1}}
    assert on_disk.exists()


# --------------------------------------------------------------------------- blacklist


def test_blacklist_round_trip(store: Store) -> None:
    assert store.blacklist(ENV) == {}
    store.add_to_blacklist(
        ENV,
        "trtllm",
        {"reason": "hung for 60 s", "kind": "hang", "key": KEY, "detail": {"signal": 9}},
    )
    record = store.blacklist(ENV)["trtllm"]
    assert record["backend"] == "trtllm"
    assert (record["reason"], record["kind"]) == ("hung for 60 s", "hang")
    assert (record["key"], record["detail"]) == (KEY, {"signal": 9})
    when = datetime.fromisoformat(record["when"])
    assert when.utcoffset() == timedelta(0)
    assert abs(datetime.now(timezone.utc) - when) < timedelta(minutes=1)
    assert store.blacklist(OTHER_ENV) == {}
    when = "2026-01-02T03:04:05+00:00"
    store.add_to_blacklist(ENV, "trtllm", {"reason": "again", "kind": "error", "when": when})
    assert store.blacklist(ENV)["trtllm"] == {
        "backend": "trtllm",
        "reason": "again",
        "kind": "error",
        "when": when,
    }


def test_remove_from_blacklist(store: Store) -> None:
    for name in ("a", "b", "c"):
        store.add_to_blacklist(ENV, name, {"reason": "r", "kind": "crash"})
    store.add_to_blacklist(OTHER_ENV, "a", {"reason": "r", "kind": "crash"})
    assert store.remove_from_blacklist(ENV, "a") == 1
    assert store.remove_from_blacklist(ENV, "a") == 0
    assert store.remove_from_blacklist(ENV, "never") == 0
    assert store.remove_from_blacklist(ENV) == 2
    assert store.blacklist(ENV) == {}
    assert list(store.blacklist(OTHER_ENV)) == ["a"]


def test_blacklist_names_that_are_not_file_names(store: Store) -> None:
    names = ["Cutlass", "cutlass", "cutlass/sm100", "cutlass_sm100", ".hidden", "..", "x" * 300]
    for name in names:
        store.add_to_blacklist(ENV, name, {"reason": name, "kind": "crash"})
    with no_cache_warnings():
        listed = store.blacklist(ENV)
    assert sorted(listed) == sorted(names)
    assert all(listed[name]["reason"] == name for name in names)
    files = list((store.env_dir(ENV) / "blacklist").iterdir())
    assert len(files) == len(names)
    assert all(not f.name.startswith(".") and len(f.name) < 100 for f in files)
    assert store.remove_from_blacklist(ENV, "cutlass/sm100") == 1
    assert "cutlass_sm100" in store.blacklist(ENV)


@pytest.mark.parametrize(
    ("backend", "record", "match"),
    [
        ("", {"reason": "r", "kind": "crash"}, "non-empty"),
        ("cudnn", {"kind": "crash"}, "reason"),
        ("cudnn", {"reason": "r"}, "kind"),
        ("cudnn", {"reason": "r", "kind": 3}, "kind"),
        ("cudnn", {"reason": "r", "kind": "crash", "backend": "cutlass"}, "cutlass"),
        ("cudnn", {"reason": "r", "kind": "crash", "key": [1]}, "key"),
        ("cudnn", {"reason": "r", "kind": "crash", "when": 5}, "when"),
        ("cudnn", {"reason": "r", "kind": "crash", "when": "yesterday"}, "ISO 8601"),
        ("cudnn", {"reason": "r", "kind": "crash", "scope": 1}, "scope"),
        ("cudnn", {"reason": "r", "kind": "crash", "scope": "key"}, "needs a 'key'"),
    ],
)
def test_add_to_blacklist_rejects_bad_records(
    store: Store, backend: str, record: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        store.add_to_blacklist(ENV, backend, record)
    assert not store.root.exists()


def test_first_time_says_yes_once_per_tag_and_set():
    """fp4select's one say-it-once helper (the selector, tactics and plugins use it too)."""
    from fp4select.store import first_time

    tag = f"test-{os.getpid()}-{id(object())}"
    assert first_time(tag) and not first_time(tag)
    mine: set[str] = set()
    assert first_time(tag, mine) and not first_time(tag, mine) and mine == {tag}
