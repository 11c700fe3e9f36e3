"""The warm path's C++ key: exact, built on this machine, loaded only when it can be trusted."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST_TIMING
from test_tensor_guard import CHANGED, _pair

import fp4select
from fp4select import api, native_build, native_key
from fp4select.keys import Problem
from fp4select.validate import make_inputs

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

PROBLEM = Problem(n=128, k=256, m_bucket=16)


@pytest.fixture(scope="module")
def key(native_dir):
    loaded = native_key.load(native_dir)
    assert loaded is not None, native_key.status(native_dir)
    return loaded


def test_the_same_metadata_gives_the_same_key(key):
    assert key(*_pair()) == key(*_pair())
    assert isinstance(key(*_pair()), int)


@pytest.mark.parametrize("change", CHANGED)
def test_each_property_the_checks_read_changes_the_key(key, change):
    """The ten changes the Python guard refuses: each one is another key."""
    assert key(*CHANGED[change](*_pair())) != key(*_pair())


def test_none_a_tensor_and_the_position_of_each_are_told_apart(key):
    a, s = _pair()
    keys = {key(a, s, None), key(a, s, s.clone()), key(a, None, s), key(s, a, None)}
    assert len(keys) == 4


def test_type_grad_and_dispatch_keys_are_part_of_the_key(key):
    plain = torch.zeros(4, 4)
    assert key(torch.nn.Parameter(plain.clone(), requires_grad=False)) != key(plain)
    assert key(torch.zeros(4, 4, requires_grad=True)) != key(plain)
    with torch.inference_mode():
        inference = torch.zeros(4, 4)
    assert key(inference) != key(plain)


def test_what_it_cannot_read_exactly_is_left_to_the_python_path(key):
    assert key(1.0) is None
    assert key(torch.zeros(4, 4), "b") is None
    assert key(torch.zeros(4, 4).to_sparse()) is None
    assert key(torch.zeros([1] * 80)) is None  # more words than the key holds


def test_the_library_is_named_after_the_torch_it_was_built_for(native_dir, monkeypatch):
    built = native_key.library_path(native_dir)
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+another")
    assert native_key.library_path(native_dir) != built
    assert native_key.load(native_dir) is None, "a build for another torch was loaded"


def _copy_of_build(native_dir, tmp_path):
    """A private copy of the session's build (so a test may damage or expose it)."""
    source = native_key.library_path(native_dir)
    target = native_key.library_path(tmp_path / "copy")
    target.parent.mkdir(mode=0o700, parents=True)
    target.parent.parent.chmod(0o700)
    target.write_bytes(source.read_bytes())
    target.chmod(0o755)
    return target


def test_a_library_others_may_write_is_refused_once(native_dir, tmp_path, caplog):
    library = _copy_of_build(native_dir, tmp_path)
    folder = tmp_path / "copy"
    assert native_key.load(folder) is not None  # trusted as it is
    native_key._loaded.clear()
    library.parent.chmod(0o770)
    with caplog.at_level(logging.WARNING, logger="fp4select.native_key"):
        assert native_key.load(folder) is None
        assert native_key.load(folder) is None
    refusals = [r for r in caplog.records if "not using the native" in r.getMessage()]
    assert len(refusals) == 1 and "may be written by others" in refusals[0].getMessage()
    assert native_key.status(folder)["status"].startswith("refused")
    with pytest.raises(RuntimeError, match="will not build"):
        native_build.build(folder)
    assert library.exists(), "a library fp4select refused was deleted or replaced"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_a_library_that_belongs_to_another_user_is_refused(native_dir, tmp_path):
    library = _copy_of_build(native_dir, tmp_path)
    os.chown(library, 4242, 4242)
    assert native_key.load(tmp_path / "copy") is None
    assert "belongs to uid 4242" in native_key.status(tmp_path / "copy")["status"]


def _refusal(folder) -> str:
    native_key._loaded.clear()
    assert native_key.load(folder) is None, "an untrusted library was loaded"
    return native_key.status(folder)["status"]


def test_a_symbolic_link_as_the_library_is_refused(native_dir, tmp_path):
    library = _copy_of_build(native_dir, tmp_path)
    real = library.with_name("real.so")
    library.rename(real)
    library.symlink_to(real)
    assert "is a symbolic link" in _refusal(tmp_path / "copy")


def test_a_fifo_as_the_library_is_refused_without_blocking(native_dir, tmp_path):
    library = _copy_of_build(native_dir, tmp_path)
    library.unlink()
    os.mkfifo(library, 0o755)
    assert "is not a regular file" in _refusal(tmp_path / "copy")


def test_a_folder_others_may_write_higher_up_is_refused(native_dir, tmp_path):
    """Two and more levels above the library: earlier releases checked only the last three
    path components."""
    outer = tmp_path / "open" / "deeper"
    outer.mkdir(parents=True)
    library = _copy_of_build(native_dir, outer)
    assert native_key.load(outer / "copy") is not None
    (tmp_path / "open").chmod(0o777)  # writable by all, not sticky: anyone may rename "deeper"
    try:
        assert f"folder {tmp_path / 'open'} may be written by others" in _refusal(outer / "copy")
        (tmp_path / "open").chmod(0o1777 if os.geteuid() == 0 else 0o755)
        native_key._status.clear()
        if os.geteuid() == 0:  # sticky and root's: only an entry's owner may rename it
            assert native_key.load(outer / "copy") is not None
    finally:
        (tmp_path / "open").chmod(0o755)
    assert library.exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_a_folder_of_another_user_higher_up_is_refused(native_dir, tmp_path):
    outer = tmp_path / "theirs" / "deeper"
    outer.mkdir(parents=True)
    _copy_of_build(native_dir, outer)
    os.chown(tmp_path / "theirs", 4242, 4242)
    assert "belongs to uid 4242, neither root nor this user" in _refusal(outer / "copy")


def test_the_file_that_was_checked_is_the_file_that_is_loaded(native_dir, tmp_path):
    """Swapping the library between the checks and the load changes nothing: the loader maps
    the descriptor that was checked (/proc/self/fd/N), not the path."""
    library = _copy_of_build(native_dir, tmp_path)
    fd = native_key._open_trusted(library)
    native_key._kept_open.append(fd)
    swapped = library.with_name("swapped")
    swapped.write_bytes(b"\x7fELF not what was checked")
    os.replace(swapped, library)
    key = native_key._import_fd(fd)
    assert native_key._self_test(key) is None


def test_a_damaged_library_is_refused_and_the_python_path_serves(tmp_path, cache_dir):
    folder = tmp_path / "native"
    library = native_key.library_path(folder)
    library.parent.mkdir(mode=0o700, parents=True)
    folder.chmod(0o700)
    library.write_bytes(b"\x7fELF but not really a library")
    library.chmod(0o755)
    fp4select.configure(
        cache_dir=cache_dir, isolation="inprocess", timing=FAST_TIMING, native_dir=folder,
        native="auto",
    )  # fmt: skip
    kwargs = make_inputs(PROBLEM, 13, "cpu").kwargs(PROBLEM)
    first = fp4select.best_mm_fp4(**kwargs)
    assert torch.equal(fp4select.best_mm_fp4(**kwargs), first)
    assert api._native_key is None and len(api._bound) == 1
    assert "does not load" in native_key.status(folder)["status"]
    assert not any(t.name == "fp4select-native-build" for t in threading.enumerate())
    assert library.read_bytes().startswith(b"\x7fELF but not"), "a file we did not build changed"


def test_no_compiler_means_a_clear_error_and_the_python_path(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        native_build.build(tmp_path / "direct")
    assert not list((tmp_path / "direct").rglob("*.tmp")), "a failed build left a file"
    fp4select.configure(
        cache_dir=cache_dir, isolation="inprocess", timing=FAST_TIMING,
        native_dir=tmp_path / "direct", native="auto",
    )  # fmt: skip
    kwargs = make_inputs(PROBLEM, 13, "cpu").kwargs(PROBLEM)
    fp4select.best_mm_fp4(**kwargs)
    fp4select.best_mm_fp4(**kwargs)
    assert api._native_key is None and len(api._bound) == 1


SERVE_SCRIPT = """
import sys, threading, time
import fp4select
from fp4select.keys import Problem
from fp4select.validate import make_inputs

problem = Problem(n=128, k=256, m_bucket=16)
fp4select.configure(isolation="inprocess", native="auto", native_dir=sys.argv[1])
fp4select.best_mm_fp4(**make_inputs(problem, 13, "cpu").kwargs(problem))
time.sleep(1.0)
print("threads", sorted(t.name for t in threading.enumerate()))
print("native_build imported", "fp4select.native_build" in sys.modules)
print("status", fp4select.native_key.status(sys.argv[1])["status"])
"""


def test_a_serving_process_never_starts_a_compiler(tmp_path, cache_dir):
    """FP4SELECT_NATIVE=auto, no build yet: a miss serves by the Python path and compiles
    nothing (the compiler is a script that would leave a mark)."""
    mark = tmp_path / "compiler-ran"
    compiler = tmp_path / "cxx"
    compiler.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    compiler.chmod(0o755)
    folder = tmp_path / "native"
    done = subprocess.run(
        [sys.executable, "-c", SERVE_SCRIPT, str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CXX": str(compiler), "FP4SELECT_CACHE_DIR": str(cache_dir)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not mark.exists(), "a serving process started the compiler"
    assert "fp4select-native-build" not in done.stdout
    assert "native_build imported False" in done.stdout
    assert "status not built" in done.stdout
    assert not folder.exists(), "a serving process made the build folder"


BUILD_SCRIPT = """
import sys
from fp4select import native_build, native_key
native_build.build(sys.argv[1])
print("built", native_key.library_path(sys.argv[1]))
"""


def test_processes_building_at_once_share_one_library(tmp_path):
    """Two builders, one folder (with a space in its name): one compiles, the other waits."""
    folder = tmp_path / "a folder"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD_SCRIPT, str(folder)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    library = native_key.library_path(folder)
    assert all(f"built {library}" in out for out, _ in outputs)
    assert sorted(p.name for p in library.parent.iterdir()) == ["build.lock", library.name]
    assert (library.stat().st_mode & 0o777) == 0o755


def _cli(*args, **env):
    return subprocess.run(
        [sys.executable, "-m", "fp4select", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env},
    )


def test_the_command_line_shows_builds_and_explains_a_failed_build(native_dir, tmp_path):
    done = _cli("native", "--build", FP4SELECT_NATIVE_DIR=str(native_dir), FP4SELECT_NATIVE="auto")
    assert done.returncode == 0, done.stderr
    assert f"native key: loaded ({native_key.library_path(native_dir)})" in done.stdout
    empty = tmp_path / "empty"
    done = _cli("native", "--json", FP4SELECT_NATIVE_DIR=str(empty), FP4SELECT_NATIVE="auto")
    assert done.returncode == 0 and '"status": "not built"' in done.stdout
    assert not empty.exists(), "showing the status created a folder"
    done = _cli(
        "native", "--build", FP4SELECT_NATIVE_DIR=str(empty), CXX=str(tmp_path / "no-compiler")
    )
    assert done.returncode == 1
    assert "the build failed: no C++ compiler" in done.stdout


def test_a_fork_while_another_thread_holds_the_locks_does_not_deadlock(native_dir, cache_dir):
    """Both locks held by a thread at the fork: the child can still configure and load the key."""
    fp4select.configure(
        cache_dir=cache_dir, isolation="inprocess", timing=FAST_TIMING, native_dir=native_dir,
        native="auto",
    )  # fmt: skip
    fp4select.best_mm_fp4(**make_inputs(PROBLEM, 13, "cpu").kwargs(PROBLEM))
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with api._table_lock, native_key._state_lock:
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(60)
    pid = os.fork()
    if pid == 0:  # the child takes both locks (no tensor math: OpenMP hangs after a fork)
        try:
            settings = fp4select.configure(
                cache_dir=cache_dir, isolation="inprocess", native_dir=native_dir,
                native="auto",
            ).settings  # fmt: skip
            ok = settings.native == "auto" and api._native_key is not None
            ok = ok and native_key.status(native_dir)["loaded"]
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    try:
        deadline = time.monotonic() + 60
        while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                pytest.fail("the child deadlocked on a lock held at the fork")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(waited[1]) == 0
    finally:
        release.set()
        holder.join()


def test_the_default_folder_is_pytorchs_own_extension_folder(monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert native_key.default_dir() == Path(get_default_build_root()) / "fp4select"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    assert native_key.default_dir() == Path("/somewhere/else/fp4select")


def test_cxx_may_name_a_wrapper_and_its_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "ccache g++ -fdiagnostics-color=never")
    assert native_build._compiler() == ["ccache", "g++", "-fdiagnostics-color=never"]
    command = native_build._compile_command(native_key.SOURCE, Path("/tmp/x.so"))
    assert command[:3] == ["ccache", "g++", "-fdiagnostics-color=never"]


def test_the_key_is_compiled_in_the_c_plus_plus_the_installed_torch_requires():
    """ATen.h says which C++ it needs (C++17 to torch 2.13, C++20 from 2.14, whose headers
    refuse anything older); a key compiled as C++17 did not build against torch 2.14 and 2.15."""
    header = Path(torch.__file__).parent / "include" / "ATen" / "ATen.h"
    if not header.is_file():
        pytest.skip("this torch ships no C++ headers")
    needed = re.search(r"#error C\+\+(\d+) or later", header.read_text(encoding="utf-8"))
    assert needed is not None
    chosen = native_build.cxx_standard()
    assert int(chosen.removeprefix("c++")) >= int(needed[1]), (torch.__version__, chosen)
    assert f"-std={chosen}" in native_build._compile_command(native_key.SOURCE, Path("/x.so"))
    # as torch's own extension builder: C++20 from 2.12; the H200's 2.11 built it as C++17
    assert [native_build.cxx_standard(v) for v in ("2.11.0+cu130", "2.12.0", "2.15.0")] == [
        "c++17",
        "c++20",
        "c++20",
    ]


def test_doctor_reports_the_key(native_dir):
    import json

    done = _cli("doctor", "--json", FP4SELECT_NATIVE_DIR=str(native_dir), FP4SELECT_NATIVE="auto")
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout)["native_key"]
    assert state["mode"] == "auto" and state["loaded"] and state["status"] == "loaded"
    assert state["path"] == str(native_key.library_path(native_dir))
    done = _cli("doctor", FP4SELECT_NATIVE_DIR=str(native_dir), FP4SELECT_NATIVE="off")
    assert "native key: off (FP4SELECT_NATIVE=off)" in done.stdout
