"""FP4SELECT_RECORD and warm --from-record, with real processes writing one file at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from fp4select import record
from fp4select.keys import M_BUCKETS, Problem

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra):
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
    }


@pytest.fixture(autouse=True)
def _fresh_state():
    record._state.update(pid=None, seen=set(), disabled=None)
    yield
    record._state.update(pid=None, seen=set(), disabled=None)


def test_note_appends_each_key_once_per_process(tmp_path, monkeypatch):
    path = tmp_path / "rec.jsonl"
    monkeypatch.setenv(record.RECORD_ENV, str(path))
    p1, p2 = Problem(n=64, k=128, m_bucket=4), Problem(n=64, k=128, m_bucket=8)
    for _ in range(5):
        record.note(p1)
    record.note(p2)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0])["key"] == p1.to_json()
    assert record.read_record(path) == {p1: 1, p2: 1}


def test_note_does_nothing_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(record.RECORD_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    record.note(Problem(n=64, k=128, m_bucket=4))
    assert list(tmp_path.iterdir()) == []


WRITER = textwrap.dedent(
    """
    import sys
    from fp4select import record
    from fp4select.keys import M_BUCKETS, Problem
    start = sys.stdin.read()  # every writer starts when the parent closes stdin
    for n in range(16, 16 * 41, 16):
        for bucket in M_BUCKETS[:6]:
            record.note(Problem(n=n, k=256, m_bucket=bucket))
            record.note(Problem(n=n, k=256, m_bucket=bucket))  # seen twice, recorded once
    """
)


@pytest.mark.subprocess
def test_many_processes_append_whole_lines_with_right_counts(tmp_path):
    path = tmp_path / "rec.jsonl"
    writers = 8
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER],
            stdin=subprocess.PIPE,
            env=_env(FP4SELECT_RECORD=str(path)),
        )
        for _ in range(writers)
    ]
    for p in procs:  # release them together
        p.stdin.close()
    for p in procs:
        assert p.wait(timeout=300) == 0
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    lines = raw.splitlines()
    assert len(lines) == writers * 40 * 6
    pids = set()
    for line in lines:  # no torn or interleaved line: every one parses on its own
        obj = json.loads(line)
        pids.add(obj["pid"])
    assert len(pids) == writers
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no line skipped
        counts = record.read_record(path)
    expected = {
        Problem(n=n, k=256, m_bucket=b) for n in range(16, 16 * 41, 16) for b in M_BUCKETS[:6]
    }
    assert set(counts) == expected
    assert set(counts.values()) == {writers}


def test_damaged_lines_are_skipped_with_one_warning(tmp_path):
    path = tmp_path / "rec.jsonl"
    good = record.record_line(Problem(n=64, k=128, m_bucket=4))
    other = record.record_line(Problem(n=32, k=128, m_bucket=1))
    bad_key = json.loads(good)
    bad_key["key"]["m_bucket"] = 3  # not a bucket
    path.write_bytes(
        good
        + b"{not json\n"
        + json.dumps(bad_key).encode()
        + b"\n"
        + b'{"fp4select_record": 2, "key": {}}\n'
        + good
        + b"\n"
        + other[:-20]  # a torn tail, no newline
    )
    with pytest.warns(record.RecordWarning) as caught:
        counts = record.read_record(path)
    assert len(caught) == 1
    assert "skipped 4 damaged line(s), first at line 2" in str(caught[0].message)
    assert counts == {Problem(n=64, k=128, m_bucket=4): 2}


def test_a_foreign_file_is_never_written_into(tmp_path, monkeypatch):
    path = tmp_path / "notes.txt"
    path.write_text("my own notes\n")
    monkeypatch.setenv(record.RECORD_ENV, str(path))
    with pytest.warns(record.RecordWarning, match="not an fp4select record file"):
        record.note(Problem(n=64, k=128, m_bucket=4))
    record.note(Problem(n=64, k=128, m_bucket=8))  # disabled: no second warning, no write
    assert path.read_text() == "my own notes\n"


def test_an_unwritable_record_warns_once_and_never_raises(tmp_path, monkeypatch):
    monkeypatch.setenv(record.RECORD_ENV, str(tmp_path / "missing-dir" / "rec.jsonl"))
    with pytest.warns(record.RecordWarning, match="cannot append"):
        record.note(Problem(n=64, k=128, m_bucket=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record.note(Problem(n=64, k=128, m_bucket=8))


def test_missing_record_file_raises_oserror(tmp_path):
    with pytest.raises(OSError):
        record.read_record(tmp_path / "nope.jsonl")


RUN = textwrap.dedent(
    """
    import torch
    import fp4select
    from fp4select import formats
    for m, n in ((3, 64), (4, 64), (3, 64), (17, 32)):
        x, w = torch.randn(m, 128), torch.randn(n, 128)
        a, b = formats.quantize_nvfp4(x), formats.quantize_nvfp4(w)
        alpha = (1.0 / (a.global_scale * b.global_scale)).reshape(1).float()
        fp4select.best_mm_fp4(a.data, b.data.T, a.scales, b.scales.T, alpha, torch.bfloat16)
    print(fp4select.stats()["bound_signatures"])
    """
)


@pytest.mark.subprocess
def test_best_mm_fp4_records_first_calls_and_warm_tunes_exactly_those(tmp_path):
    rec = tmp_path / "rec.jsonl"
    env = _env(
        FP4SELECT_RECORD=str(rec),
        FP4SELECT_CACHE_DIR=str(tmp_path / "run-cache"),
        FP4SELECT_ISOLATION="inprocess",
        FP4SELECT_TIME_BUDGET_S="0.02",
    )
    for _ in range(2):  # two processes: every key counted twice
        proc = subprocess.run(
            [sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() == "3"  # M=3, M=4 (same bucket) and M=17: 3 signatures
    counts = record.read_record(rec)
    assert counts == {
        Problem(n=64, k=128, m_bucket=4): 2,
        Problem(n=32, k=128, m_bucket=32): 2,
    }
    # A fresh machine's cache: warm --from-record tunes those keys and nothing else.
    env["FP4SELECT_CACHE_DIR"] = str(tmp_path / "fleet-cache")
    del env["FP4SELECT_RECORD"]
    proc = subprocess.run(
        [sys.executable, "-m", "fp4select", "warm", "--from-record", str(rec), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert sorted(r["problem"] for r in out["results"]) == sorted(p.describe() for p in counts)
    assert out["stats"]["tunings"] == 2


def test_a_fifo_at_the_record_path_never_blocks_a_call(tmp_path, monkeypatch):
    """The first GEMM of a process must not wait for a reader that never comes."""
    import threading

    fifo = tmp_path / "record.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv(record.RECORD_ENV, str(fifo))
    caught: list = []

    def call():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            record.note(Problem(n=64, k=128, m_bucket=4))
        caught.extend(seen)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "note() blocked on a FIFO"
    assert any("not a regular file" in str(w.message) for w in caught)
    with pytest.raises(OSError, match="not a regular file"):
        record.read_record(fifo)


def test_a_symlink_at_the_record_path_is_never_followed(tmp_path, monkeypatch):
    """A dangling link would have had its target created; a live one written through."""
    target = tmp_path / "elsewhere" / "created-by-fp4select"
    target.parent.mkdir()
    link = tmp_path / "rec.jsonl"
    link.symlink_to(target)
    monkeypatch.setenv(record.RECORD_ENV, str(link))
    with pytest.warns(record.RecordWarning, match="symbolic link"):
        record.note(Problem(n=64, k=128, m_bucket=4))
    assert not target.exists(), "the target of a dangling link was created"
    live = tmp_path / "live.jsonl"
    live.write_bytes(b"")
    link.unlink()
    link.symlink_to(live)
    record._state.update(pid=None, seen=set(), disabled=None)
    with pytest.warns(record.RecordWarning, match="symbolic link"):
        record.note(Problem(n=64, k=128, m_bucket=4))
    assert live.read_bytes() == b""


def test_impossible_keys_and_overlong_lines_are_skipped(tmp_path):
    good = Problem(n=64, k=128, m_bucket=4)
    line = json.loads(record.record_line(good))
    bad_n = {**line, "key": {**line["key"], "n": 10**30}}
    bad_block = {**line, "key": {**line["key"], "block_size": 7}}
    path = tmp_path / "rec.jsonl"
    with open(path, "wb") as fh:
        fh.write(record.record_line(good))
        fh.write(json.dumps(bad_n).encode() + b"\n")
        fh.write(json.dumps(bad_block).encode() + b"\n")
        fh.write(b'{"fp4select_record": 1, "key": "' + b"x" * (3 * record._MAX_LINE) + b'"}\n')
        fh.write(b"[" * 5000 + b"\n")
        fh.write(record.record_line(good))
    with pytest.warns(record.RecordWarning, match="skipped 4 damaged line"):
        assert record.read_record(path) == {good: 2}


def test_reading_an_overlong_line_holds_one_bounded_piece(tmp_path, monkeypatch):
    """A 3 GB line used to be read whole; now at most _MAX_LINE + 1 bytes a read."""
    path = tmp_path / "rec.jsonl"
    with open(path, "wb") as fh:
        fh.write(b"x" * (1 << 24) + b"\n")
    sizes = []
    lines = record._bounded_lines
    monkeypatch.setattr(record, "_bounded_lines", lambda fh: lines(_Spy(fh, sizes)))
    with pytest.warns(record.RecordWarning):
        assert record.read_record(path) == {}
    assert sizes and max(sizes) <= record._MAX_LINE + 1


class _Spy:
    def __init__(self, fh, sizes):
        self.fh, self.sizes = fh, sizes

    def readline(self, limit=-1):
        assert limit > 0, "an unbounded read"
        line = self.fh.readline(limit)
        self.sizes.append(len(line))
        return line
