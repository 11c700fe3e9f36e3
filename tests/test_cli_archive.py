"""export, import and clear as a user runs them: real `python -m fp4select` processes.

What they must never do (delete a directory, overwrite a file, let an archive blacklist the
built-in fallback) and what they must say (the counts of what was actually done).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4select.keys import Problem
from fp4select.probe import Verdict
from fp4select.selector import Decision
from fp4select.store import Store

pytestmark = pytest.mark.subprocess  # export, import and clear run as processes

ENV = {"gpu": "NVIDIA B200", "cc": 100, "torch": "2.9.0"}
KEYS = [Problem(n=4096, k=7168, m_bucket=m).to_json() for m in (1, 2)]


def decision(key: dict, winner: str = "emulation", status: str = "passed") -> dict:
    """A record as the selector writes it: emulation validated and chosen."""
    verdicts = {"emulation": Verdict("emulation", status, "", None, 0.3, True)}
    return Decision(Problem.from_json(key), ENV, winner, verdicts).to_json()


def run(cache: Path, *args: str, expect: int = 0, cwd: Path | None = None) -> tuple[str, str]:
    env = {**os.environ, "FP4SELECT_CACHE_DIR": str(cache), "FP4SELECT_ISOLATION": "inprocess"}
    proc = subprocess.run(
        [sys.executable, "-m", "fp4select", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def tree(root: Path) -> dict[str, bytes | str]:
    return {
        str(p.relative_to(root)): "<dir>" if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def someones_directory(path: Path) -> dict[str, bytes | str]:
    (path / "sub").mkdir(parents=True)
    (path / "thesis.tex").write_text("two years of work")
    (path / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return tree(path)


def test_export_never_deletes_a_directory_or_overwrites_a_file(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    Store(cache).write_entry(ENV, KEYS[0], decision(KEYS[0]))

    target = tmp_path / "out"
    before = someones_directory(target)
    _, err = run(cache, "export", str(target), "--all", "--force", expect=1)
    assert "is a directory" in err
    assert tree(target) == before

    work = tmp_path / "work"
    before = someones_directory(work)
    run(cache, "export", ".", "--all", "--force", expect=1, cwd=work)
    assert tree(work) == before

    archive = tmp_path / "decisions.json"
    out, _ = run(cache, "export", str(archive), "--all")
    assert f"exported 1 entry and 0 blacklist records to {archive}" in out
    archive.write_text("someone's file")
    _, err = run(cache, "export", str(archive), "--all", expect=1)
    assert "already exists; add --overwrite to replace it" in err
    assert "overwrite=True" not in err  # a Python keyword means nothing on the command line
    assert archive.read_text() == "someone's file"
    out, _ = run(cache, "export", str(archive), "--all", "--overwrite", "--json")
    assert json.loads(out) == {"path": str(archive), "entries": 1, "blacklist": 0}
    assert len(json.loads(archive.read_text())["entries"]) == 1


def test_import_and_clear_print_what_was_done(tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    for key in KEYS:
        source.write_entry(ENV, key, decision(key))
    for name in ("emulation", "cutlass"):
        source.add_to_blacklist(ENV, name, {"reason": "hung", "kind": "hang"})
    archive = tmp_path / "a.json"
    source.export_archive(archive)

    cache = tmp_path / "cache"
    out, _ = run(cache, "import", str(archive))
    assert f"imported 2 entries from {archive}" in out
    # made for a B200: none of it applies on this CPU machine, and the output says why
    assert "0 of 2 entries apply here" in out and "2 do not: " in out and "'NVIDIA B200'" in out
    assert "imported 1 blacklist record\n" in out
    assert "refused the blacklist records of emulation" in out
    assert list(Store(cache).blacklist(ENV)) == ["cutlass"]

    out, _ = run(cache, "import", str(archive), "--json")
    fit = json.loads(out).pop("applicability")
    assert fit["entries"] == 2 and fit["apply"] == 0 and fit["do_not_apply"] == 2
    assert json.loads(out) | {"applicability": None} == {
        "applicability": None,
        "path": str(archive),
        "entries_written": 0,
        "entries_in_memory": 0,
        "entries_present": 2,
        "blacklist_written": 0,
        "blacklist_in_memory": 0,
        "blacklist_present": 1,
        "blacklist_protected": ["emulation"],
        "entries_invalid": [],
    }

    entry = sorted((Store(cache).env_dir(ENV) / "entries").iterdir())[0]
    entry.unlink()
    before = someones_directory(entry)  # a directory where an entry file was
    out, err = run(cache, "clear", "--all", "--json", expect=1)
    assert json.loads(out) == {"entries": 1, "blacklist": 1, "not_removed": [str(entry)]}
    assert f"not removed: {entry}" in err
    assert tree(entry) == before


def test_import_that_cannot_reach_the_disk_fails(tmp_path: Path) -> None:
    archive = tmp_path / "a.json"
    source = Store(tmp_path / "source")
    source.write_entry(ENV, KEYS[0], decision(KEYS[0]))
    source.export_archive(archive)
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache directory should be")
    out, err = run(cache, "import", str(archive), expect=1)
    assert "imported 0 entries" in out
    assert "1 record could not be written to the cache" in err


def test_import_skips_a_decision_that_is_not_what_fp4select_writes(tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    source.write_entry(ENV, KEYS[0], decision(KEYS[0]))
    source.write_entry(ENV, KEYS[1], decision(KEYS[1], status="wrong"))  # winner never passed
    archive = tmp_path / "a.json"
    source.export_archive(archive)

    cache = tmp_path / "cache"
    out, _ = run(cache, "import", str(archive))
    assert f"imported 1 entry from {archive}" in out
    assert "skipped an invalid entry: " in out and "winner 'emulation' never passed" in out
    assert [key for _, key, _ in Store(cache).iter_entries()] == [KEYS[0]]
    out, _ = run(cache, "import", str(archive), "--json")
    assert len(json.loads(out)["entries_invalid"]) == 1
