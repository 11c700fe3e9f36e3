"""What the store tests share: sample values, real worker processes, warning and tree checks."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fp4select.store import (
    CacheWarning,
    Store,
    digest,
)

ENV = {"gpu": "NVIDIA B200", "sm": 100, "cuda": "12.8", "torch": "2.9.0", "flashinfer": "0.4.1"}
OTHER_ENV = {**ENV, "gpu": "NVIDIA GB200"}
KEY = {"m": 128, "n": 4096, "k": 7168, "dtype": "nvfp4"}
KEY2 = {"m": 256, "n": 4096, "k": 7168, "dtype": "nvfp4"}
RECORD = {"backend": "cutlass", "tactic": 3, "us": 12.5}
RECORD2 = {"backend": "cudnn", "tactic": None, "us": 14.0}
WORKER = Path(__file__).with_name("_store_worker.py")


def entry_path(store: Store, env: dict, key: dict) -> Path:
    return store.env_dir(env) / "entries" / f"{digest(key)}.json"


def canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]


@contextlib.contextmanager
def no_cache_warnings() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert [str(w.message) for w in caught if issubclass(w.category, CacheWarning)] == []


@contextlib.contextmanager
def one_cache_warning(match: str) -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    cache = [w for w in caught if issubclass(w.category, CacheWarning)]
    assert len(cache) == 1, [str(w.message) for w in cache]
    assert match in str(cache[0].message)


@contextlib.contextmanager
def unprivileged() -> Iterator[None]:
    """Make permission bits bite: as root, run the block with the effective uid of nobody."""
    if os.geteuid() != 0:
        yield
        return
    try:
        os.seteuid(65534)
    except OSError as exc:
        pytest.skip(f"running as root and cannot drop privileges to test permissions: {exc}")
    try:
        yield
    finally:
        os.seteuid(0)


def spawn(mode: str, root: Path, **args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(root), json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_together(procs: list[subprocess.Popen[str]], ready: Path, go: Path) -> None:
    """Release the workers at once, after every interpreter has started."""
    try:
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < len(procs):
            assert all(p.poll() is None for p in procs), "a worker died before the start"
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.01)
    except BaseException:
        finish(procs, check=False)
        raise
    go.touch()


def finish(
    procs: list[subprocess.Popen[str]], timeout: float = 60.0, *, check: bool = True
) -> list[str]:
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout if check else 0.01)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results.append((proc.returncode, out, err))
    if check:
        for returncode, _, err in results:
            assert returncode == 0, err
    return [out for _, out, _ in results]


def tree(root: Path) -> dict[str, bytes | str]:
    """Everything under ``root`` (symlinks not followed), to prove nothing there changed."""
    found: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            found[rel] = f"-> {os.readlink(p)}"
        elif p.is_dir():
            found[rel] = "<dir>"
        else:
            found[rel] = p.read_bytes()
    return found


def squat_directory(path: Path) -> dict[str, bytes | str]:
    """Put someone's directory, with files in it, where fp4select keeps one of its files."""
    if path.exists():
        path.unlink()
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("someone's notes")
    (path / "sub" / "deep.bin").write_bytes(b"\x00deep")
    return tree(path)
