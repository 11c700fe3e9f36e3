"""Tests for fp4select.store's per-key locks: real threads, real processes, real forks."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import filelock
import pytest
from store_helpers import (
    ENV,
    KEY,
    KEY2,
    RECORD,
    finish,
    no_cache_warnings,
    one_cache_warning,
    spawn,
    start_together,
    temp_files,
    tree,
)

from fp4select.store import (
    Store,
    digest,
)

# --------------------------------------------------------------------------- locks


def times_out(store: Store, key: dict, timeout: float = 0.3) -> bool:
    try:
        with store.lock(ENV, key, timeout=timeout):
            return False
    except filelock.Timeout:
        return True


@contextlib.contextmanager
def held_by_another_thread(store: Store) -> Iterator[None]:
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with store.lock(ENV, KEY):
            held.set()
            release.wait(60)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        yield
    finally:
        release.set()
        thread.join()


def test_lock_is_reentrant_within_a_thread(store: Store) -> None:
    with store.lock(ENV, KEY), store.lock(ENV, KEY, timeout=0.5):
        store.write_entry(ENV, KEY, RECORD)
    with store.lock(ENV, KEY, timeout=0):
        pass


def test_lock_serializes_threads(store: Store) -> None:
    tunings = []

    def worker() -> None:
        with store.lock(ENV, KEY):
            if store.read_entry(ENV, KEY) is None:
                time.sleep(0.05)
                tunings.append(threading.get_ident())
                store.write_entry(ENV, KEY, {"by": threading.get_ident()})

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tunings) == 1
    assert store.read_entry(ENV, KEY) == {"by": tunings[0]}


def test_lock_timeout_between_threads(store: Store) -> None:
    with held_by_another_thread(store):
        with pytest.raises(filelock.Timeout), store.lock(ENV, KEY, timeout=0.1):
            pass
        with store.lock(ENV, KEY2, timeout=0.1):  # other keys are independent
            pass
    with store.lock(ENV, KEY, timeout=1):
        pass


@pytest.mark.subprocess
def test_lock_timeout_across_processes(store: Store, tmp_path: Path) -> None:
    held, release = tmp_path / "held", tmp_path / "release"
    proc = spawn("hold", store.root, env=ENV, key=KEY, held=str(held), release=str(release))
    try:
        deadline = time.monotonic() + 30
        while not held.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(filelock.Timeout), store.lock(ENV, KEY, timeout=0.3):
            pass
        assert time.monotonic() - start >= 0.25
    finally:
        release.touch()
        finish([proc])
    with store.lock(ENV, KEY, timeout=5):
        pass


def test_lock_falls_back_when_lock_file_cannot_be_made(store: Store) -> None:
    store.write_entry(ENV, KEY, RECORD)
    (store.env_dir(ENV) / "locks").write_text("a file where the locks directory should be")
    with one_cache_warning("cannot lock"):
        with store.lock(ENV, KEY, timeout=1):
            pass
        with store.lock(ENV, KEY2, timeout=1):
            pass
    assert not store.memory_only
    active, peak = [0], [0]
    guard = threading.Lock()

    def worker() -> None:
        with store.lock(ENV, KEY2):
            with guard:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.01)
            with guard:
                active[0] -= 1

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 1


@pytest.mark.subprocess
def test_processes_missing_the_same_key_tune_once(store: Store, tmp_path: Path) -> None:
    go, log, ready = tmp_path / "go", tmp_path / "tunings.log", tmp_path / "ready"
    ready.mkdir()
    args = {"env": ENV, "key": KEY, "log": str(log), "tune_seconds": 0.3}
    procs = [spawn("tune", store.root, go=str(go), ready=str(ready), **args) for _ in range(8)]
    start_together(procs, ready, go)
    results = [json.loads(out) for out in finish(procs)]
    tuners = log.read_text().split()
    assert len(tuners) == 1
    expected = {"tuned_by": int(tuners[0])}
    assert [r["record"] for r in results] == [expected] * 8
    assert sum(r["missed"] for r in results) >= 2  # they really did contend
    assert store.read_entry(ENV, KEY) == expected
    assert temp_files(store.root) == []


@pytest.mark.subprocess
def test_blacklist_additions_from_processes_all_survive(store: Store, tmp_path: Path) -> None:
    go, ready = tmp_path / "go", tmp_path / "ready"
    ready.mkdir()
    backends = [f"backend-{i}" for i in range(8)]
    procs = [
        spawn("blacklist", store.root, env=ENV, backend=b, go=str(go), ready=str(ready))
        for b in backends
    ]
    start_together(procs, ready, go)
    finish(procs)
    with no_cache_warnings():
        assert sorted(store.blacklist(ENV)) == backends


@pytest.mark.subprocess
def test_concurrent_writers_never_expose_partial_files(store: Store, tmp_path: Path) -> None:
    go, ready = tmp_path / "go", tmp_path / "ready"
    ready.mkdir()
    args = {"env": ENV, "key": KEY, "go": str(go), "ready": str(ready), "rounds": 40}
    procs = [spawn("churn", store.root, id=i, **args) for i in range(4)]
    start_together(procs, ready, go)
    with no_cache_warnings():
        deadline = time.monotonic() + 60
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            store.read_entry(ENV, KEY)
        finish(procs)
    assert store.read_entry(ENV, KEY)["round"] == 39
    assert temp_files(store.root) == []


@pytest.mark.parametrize("planted", ["lock file", "hard link", "locks directory"])
def test_symlink_planted_at_a_lock_path_leaves_its_target_intact(
    store: Store, tmp_path: Path, planted: str
) -> None:
    # filelock below 3.20.1 opened the lock file with O_TRUNC through a symlink, and below
    # 4.2.1 truncates it through a hard link once locked.
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / f"{digest(KEY)}.lock").write_text("someone's data\n")
    lock_path = store.env_dir(ENV) / "locks" / f"{digest(KEY)}.lock"
    lock_path.parent.mkdir(parents=True)
    if planted == "lock file":
        lock_path.symlink_to(precious / f"{digest(KEY)}.lock")
    elif planted == "hard link":
        os.link(precious / f"{digest(KEY)}.lock", lock_path)
    else:
        lock_path.parent.rmdir()
        lock_path.parent.symlink_to(precious, target_is_directory=True)
    before = tree(precious)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with store.lock(ENV, KEY, timeout=5):
            assert store.write_entry(ENV, KEY, RECORD) is True
    assert tree(precious) == before  # the target's content first: that is the data at stake
    assert [str(w.message) for w in caught if "cannot lock files" in str(w.message)]
    assert os.path.lexists(lock_path)  # not ours to delete either
    # Still usable, still reentrant: threads of this process are serialized as before.
    with no_cache_warnings(), store.lock(ENV, KEY, timeout=0), store.lock(ENV, KEY, timeout=0):
        assert store.read_entry(ENV, KEY) == RECORD


def test_pyproject_requires_a_filelock_that_does_not_follow_symlinks() -> None:
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement
    from packaging.version import Version

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text("utf-8"))["project"]["dependencies"]
    (spec,) = [Requirement(d).specifier for d in deps if Requirement(d).name == "filelock"]
    # 3.20.1: UnixFileLock opens with O_NOFOLLOW; 3.20.3: SoftFileLock too (CVE-2026-22701).
    assert not spec.contains("3.20.2") and spec.contains("3.20.3")
    assert spec.contains(Version(filelock.__version__))


def test_a_lock_file_planted_after_first_use_is_refused_too(store: Store, tmp_path: Path) -> None:
    # This process keeps one FileLock per path; the lock file is checked at every outermost
    # acquisition, not only when that FileLock was made.
    with store.lock(ENV, KEY, timeout=5):
        pass
    lock_path = store.env_dir(ENV) / "locks" / f"{digest(KEY)}.lock"
    precious = tmp_path / "precious"
    precious.write_text("someone's data\n")
    lock_path.unlink()
    os.link(precious, lock_path)
    with one_cache_warning("hard link"), store.lock(ENV, KEY, timeout=5):
        assert store.write_entry(ENV, KEY, RECORD) is True
    assert precious.read_text() == "someone's data\n"


# --------------------------------------------------------------------------- fork

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
# The warning Python 3.12+ gives for a fork beside other threads is the very case tested here.
fork_beside_threads = pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")


def wait_child(pid: int, limit: float = 60.0) -> int:
    """The exit code of a forked child; kills it if it hangs (a deadlock is a failure)."""
    deadline = time.monotonic() + limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.01)


def forked(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child and return its exit code (5: it raised)."""
    pid = os.fork()
    if pid == 0:
        code = 5
        try:
            code = body()
        finally:
            os._exit(code)
    return wait_child(pid)


@needs_fork
@pytest.mark.subprocess
@fork_beside_threads
def test_child_forked_while_another_thread_holds_a_lock_waits_for_the_parent(
    store: Store, tmp_path: Path
) -> None:
    waiting = tmp_path / "child waiting"

    def child() -> int:
        if times_out(store, KEY2, timeout=5):  # other keys are free, nothing is stuck
            return 10
        if times_out(store, KEY):  # the parent holds KEY: the child must wait like any process
            waiting.touch()
            with store.lock(ENV, KEY, timeout=30):  # and gets it once the parent lets go
                return 0
        return 11

    with held_by_another_thread(store):
        pid = os.fork()
        if pid == 0:
            code = 5
            try:
                code = child()
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while not waiting.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert wait_child(pid) == 0


@needs_fork
@pytest.mark.subprocess
@fork_beside_threads
def test_memory_only_lock_held_by_another_thread_is_not_inherited(tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("a file where the cache root should be")
    store = Store(tmp_path / "cache")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with store.lock(ENV, KEY, timeout=1):
            pass
    assert store.memory_only  # only the per-process lock is left
    with held_by_another_thread(store):
        assert times_out(store, KEY)  # threads of this process are still serialized
        # In the child, no thread holds anything: the parent's thread is not there.
        assert forked(lambda: 0 if not times_out(store, KEY, timeout=5) else 12) == 0


@needs_fork
@pytest.mark.subprocess
@fork_beside_threads
def test_child_forked_inside_a_lock_neither_holds_it_nor_releases_it(store: Store) -> None:
    pid, code, others_waited = -1, 5, None
    try:
        with store.lock(ENV, KEY):
            pid = os.fork()
            if pid == 0:
                # The parent holds KEY; this child must not think it does too.
                code = 0 if times_out(store, KEY) else 13
            else:
                assert wait_child(pid) == 0
                # The child left the `with` it inherited: the parent must still hold the lock.
                result: list[bool] = []
                thread = threading.Thread(target=lambda: result.append(times_out(store, KEY)))
                thread.start()
                thread.join()
                others_waited = result == [True]
    finally:
        if pid == 0:
            os._exit(code)
    assert others_waited
    with store.lock(ENV, KEY, timeout=0):  # and let go of it at the end
        pass


def test_one_lock_object_can_be_entered_twice(store: Store) -> None:
    lock = store.lock(ENV, KEY, timeout=1)
    with lock, lock:
        assert times_out(store, KEY2, timeout=1) is False
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(times_out(store, KEY, timeout=1)))
    thread.start()
    thread.join()
    assert result == [False]  # both entries were left: another thread gets it at once
