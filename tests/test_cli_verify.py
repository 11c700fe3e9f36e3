"""``verify`` as data (``reports.verify_report``) and as a command: its table, its JSON, its bar.

Real runs on the CPU: the built-in emulation backend, tuned in-process with a tiny timing
budget; the command runs as a user runs it (``python -m fp4select``), its stderr on a
pseudo-terminal where the progress bar must (or must not) show.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading

import pytest
import torch

import fp4select
from fp4select.reports import VerifyReport, verify_problems, verify_report

FAST = {"FP4SELECT_ISOLATION": "inprocess", "FP4SELECT_TIME_BUDGET_S": "0.02"}


def test_verify_report_is_typed_data_from_a_real_small_run(tmp_path, monkeypatch):
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "home-cache"
    fp4select.configure(cache_dir=home, isolation="inprocess")
    problems = verify_problems([(128, 256)], [16])
    assert len(problems) == 5  # one per problem kind
    heard = []
    report = verify_report(
        torch.device("cpu"), problems, cache_dir=str(tmp_path / "verify"), on_decision=heard.append
    )
    assert isinstance(report, VerifyReport)
    assert [d.problem for d in heard] == problems  # in order, once each
    assert report.problems == 5 and report.undecided == [] and report.failed == []
    assert report.ok
    emulation = report.backends["emulation"]
    assert emulation["wins"] == 5 and emulation["statuses"] == {"passed": 5}
    assert 0 < emulation["worst_ratio"] <= 1 and emulation["first_failure"] == ""
    assert report.environment["device"] == "cpu"
    data = report.to_json()
    assert json.loads(json.dumps(data)) == data  # plain JSON, as --json prints it
    assert data["failed"] == [] and set(data["backends"]) == set(report.backends)
    # Its decisions went where it was told; the process-wide selector's cache was not touched.
    assert list((tmp_path / "verify").rglob("*.json"))
    assert fp4select.api.selector().store.root == fp4select.configure(cache_dir=home).store.root
    assert not list(home.rglob("*.json"))


def test_a_failure_and_an_undecided_problem_make_the_report_not_ok():
    """``ok`` is what the exit status follows: checked on hand-made decisions, no tuning."""
    from types import SimpleNamespace

    from fp4select.probe import Verdict

    problem = verify_problems([(128, 256)], [16])[0]
    report = VerifyReport(environment={"device": "cpu"}, problems=1)
    report.add(
        SimpleNamespace(
            problem=problem,
            winner=None,
            timings={},
            verdicts={"bad": Verdict("bad", "wrong", "all zero", 16, 3.5)},
        )
    )
    assert report.failed == ["bad"] and report.undecided == [problem.describe()]
    assert not report.ok
    assert report.backends["bad"]["first_failure"].endswith("wrong all zero")
    assert report.backends["bad"]["worst_ratio"] == 3.5


def _verify_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run ``fp4select verify`` with stdout a pipe and stderr a pseudo-terminal."""
    leader, follower = pty.openpty()
    # A terminal 120 columns wide: on a 0-column one (a bare pty) tqdm draws nothing at all.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(leader, 1 << 16)
            except OSError:  # EIO: every writer has closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fp4select", "verify", "--device", "cpu", *args],
            stdout=subprocess.PIPE,
            stderr=follower,
            env={**os.environ, **FAST},
            timeout=600,
        )
    finally:
        os.close(follower)
    reader.join(30)
    os.close(leader)
    return proc.returncode, proc.stdout.decode(), b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.subprocess
def test_verify_shows_a_progress_bar_on_a_terminal_and_keeps_it_off_stdout():
    code, out, terminal = _verify_on_a_terminal("--shape", "128,256", "--m", "16")
    assert code == 0, out + terminal[-2000:]
    assert "fp4select verify" in terminal and "5/5" in terminal  # the bar, on stderr
    assert "fp4select verify" not in out and "5 problems on cpu; no backend failed" in out


@pytest.mark.subprocess
def test_verify_json_is_clean_json_and_shows_no_bar_even_on_a_terminal():
    code, out, terminal = _verify_on_a_terminal("--shape", "128,256", "--m", "16", "--json")
    assert code == 0, out + terminal[-2000:]
    report = json.loads(out)  # nothing but the report on stdout
    assert report["problems"] == 5 and report["backends"]["emulation"]["wins"] == 5
    assert "fp4select verify" not in terminal


def test_verify_shows_no_bar_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    from fp4select.cli import main

    for name, value in FAST.items():
        monkeypatch.setenv(name, value)
    assert main(["verify", "--device", "cpu", "--shape", "128,256", "--m", "16"]) == 0
    captured = capsys.readouterr()  # pytest's capture is not a terminal
    assert "5 problems on cpu; no backend failed" in captured.out
    assert "fp4select verify" not in captured.err  # a log file collects no bar redraws
