"""What the command line says when something is wrong: one plain line, the right exit status.

The in-process tests call ``main`` (argparse's own errors raise ``SystemExit``); the ones that
need a whole process (warnings as a user sees them, a cache that cannot be written) run
``python -m fp4select`` and are marked ``subprocess``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fp4select
from fp4select.cli import main

ROOT = Path(__file__).resolve().parent.parent

BAD_VARIABLES = [
    ("FP4SELECT_TIME_BUDGET_S", "abc"),
    ("FP4SELECT_ISOLATION", "bogus"),
    ("FP4SELECT_NATIVE", "maybe"),
    ("FP4SELECT_TIME_BUDGET_S", "-1"),
]
EVERY_COMMAND = [
    ["doctor"],
    ["warm", "--shape", "64,128", "--max-m", "1"],
    ["show"],
    ["explain", "--n", "64", "--k", "128", "--m", "1"],
    ["verify", "--shape", "64,128", "--m", "1"],
    ["blacklist"],
    ["export", "{tmp}/out.json"],
    ["import", "{tmp}/in.json"],
    ["native"],
    ["clear"],
]


def _main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's usage errors
        return int(exc.code or 0)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_every_command_is_listed_here():
    """A new command must be added to EVERY_COMMAND: the bad-variable test walks them all."""
    from fp4select.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(argv[0] for argv in EVERY_COMMAND)


@pytest.mark.parametrize(("variable", "value"), BAD_VARIABLES, ids=lambda v: str(v))
@pytest.mark.parametrize("argv", EVERY_COMMAND, ids=lambda a: a[0])
def test_a_bad_variable_is_one_line_naming_it_and_exit_2(
    argv, variable, value, tmp_path, monkeypatch, capsys, cache_dir
):
    monkeypatch.setenv(variable, value)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert _main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"fp4select {argv[0]}: {variable} must be"), line
    assert repr(value) in line
    assert not (tmp_path / "out.json").exists()


def test_a_negative_shape_says_what_is_wrong_with_it(capsys, cache_dir):
    assert _main(["warm", "--shape", "-1,1024"]) == 2
    err = capsys.readouterr().err
    assert "shape must be positive, got '-1,1024'" in err
    assert "expected one argument" not in err
    # A plain negative number still reaches the option's own check, as before.
    assert _main(["explain", "--n", "-5", "--k", "128", "--m", "1"]) == 2
    assert "--n: must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("tune", [[], ["--tune"]])
def test_explain_refuses_a_shape_warm_refuses_with_the_same_line(tune, capsys, cache_dir):
    fp4select.configure(cache_dir=cache_dir)  # the process-wide selector, on this test's cache
    assert _main(["warm", "--shape", "512,1000"]) == 2
    warm = _one_line(capsys.readouterr().err)
    assert _main(["explain", "--n", "512", "--k", "1000", "--m", "1", *tune]) == 2
    explain = _one_line(capsys.readouterr().err)
    assert warm.removeprefix("fp4select warm: ") == explain.removeprefix("fp4select explain: ")
    assert "K must be a multiple of 16 for nvfp4" in explain
    assert not list(cache_dir.rglob("*.json"))  # nothing was tuned
    # mxfp4's blocks are 32 values: K = 1008 is refused for it, and only for it.
    assert _main(["explain", "--n", "512", "--k", "1008", "--m", "1", "--format", "mxfp4"]) == 2
    assert "K must be a multiple of 32 for mxfp4" in capsys.readouterr().err


def test_explain_marks_a_timing_taken_again_after_a_stall(monkeypatch, capsys):
    import fp4select.api

    def timed(median: float, method: str) -> dict:
        return {"median_us": median, "p10_us": median, "p90_us": median, "method": method}

    record = {
        "source": "disk",
        "winner": "a",
        "ranking": {"margin": 0.5},
        "verdicts": {"a": {"status": "passed"}, "b": {"status": "passed"}},
        "timings": {
            "a": timed(10.0, "cuda-graph+cold-l2+resampled"),
            "b": timed(15.0, "cuda-graph+cold-l2"),
        },
        "method": "cuda-graph+cold-l2",
    }
    monkeypatch.setattr(fp4select.api, "explain", lambda **_: record)
    assert _main(["explain", "--n", "512", "--k", "1024", "--m", "1"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert rows["a"].split()[4] == "*" and "*" not in rows["b"]
    assert rows["*"].startswith("* sampled again")


def test_blacklist_clear_of_a_backend_not_blacklisted_fails_and_says_so(capsys, cache_dir):
    from fp4select.keys import environment
    from fp4select.store import Store

    fp4select.configure(cache_dir=cache_dir)  # the process-wide selector, on this test's cache
    Store(cache_dir).add_to_blacklist(
        environment(None), "cutlass", {"reason": "x", "kind": "crash"}
    )
    assert _main(["blacklist", "--clear", "nosuchbackend", "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    line = _one_line(captured.err)
    assert "nosuchbackend is not blacklisted here, nothing cleared" in line
    assert "blacklisted here: cutlass" in line
    assert "removed" not in captured.out
    assert _main(["blacklist", "--clear", "cutlass", "--device", "cpu"]) == 0
    assert "removed 1 blacklist entry" in capsys.readouterr().out
    # Clearing everything when nothing is listed did what it said: exit 0.
    assert _main(["blacklist", "--clear", "--device", "cpu"]) == 0
    assert "removed 0 blacklist entries" in capsys.readouterr().out


def test_export_and_import_both_take_overwrite_and_export_keeps_force(tmp_path, capsys):
    from fp4select.cli import build_parser

    parser = build_parser()
    for spelling in ("--overwrite", "--force"):
        assert parser.parse_args(["export", "x.json", spelling]).overwrite is True
    assert parser.parse_args(["import", "x.json", "--overwrite"]).overwrite is True


def test_verify_shows_a_dash_for_a_backend_that_never_ran(monkeypatch, capsys, tmp_path):
    """A backend unsupported on every problem has no error to show: '-', not 0.00."""
    from types import SimpleNamespace

    from fp4select.cli import checks
    from fp4select.probe import Verdict
    from fp4select.reports import VerifyReport, verify_problems

    problem = verify_problems([(128, 256)], [16])[0]

    def report(device, problems, *, cache_dir=None, on_decision=None):
        r = VerifyReport(environment={"device": "cpu"}, problems=1)
        r.add(
            SimpleNamespace(
                problem=problem,
                winner="emulation",
                timings={},
                verdicts={
                    "emulation": Verdict("emulation", "passed", "", 16, 0.25),
                    "cutlass": Verdict("cutlass", "unavailable", "no CUDA device", 16, None),
                },
            )
        )
        return r

    monkeypatch.setattr(checks, "verify_report", report)
    assert _main(["verify", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cutlass +0 +unavailable 1 +- +-$", out, re.M), out
    assert re.search(r"^emulation +1 +passed 1 +0\.25 +-$", out, re.M), out
    assert report(None, None).to_json()["backends"]["cutlass"]["worst_ratio"] is None


def _run(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "FP4SELECT_ISOLATION": "inprocess",
        "FP4SELECT_TIME_BUDGET_S": "0.02",
        **env_extra,
    }
    return subprocess.run(
        [sys.executable, "-m", "fp4select", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.mark.subprocess
def test_a_bad_variable_in_a_real_process_is_one_line(tmp_path):
    proc = _run({"FP4SELECT_CACHE_DIR": str(tmp_path), "FP4SELECT_NATIVE": "maybe"}, "show")
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert line.startswith("fp4select show: FP4SELECT_NATIVE must be one of"), line


@pytest.mark.subprocess
def test_warm_fails_when_nothing_could_be_stored_and_warns_in_one_line(tmp_path):
    """The cache folder is a file: the decisions would be lost, so warm exits 1 (as import
    does), and the cache's warning is one plain line, not Python's file:line and source."""
    in_the_way = tmp_path / "cache"
    in_the_way.write_text("a file where the cache should be")
    proc = _run(
        {"FP4SELECT_CACHE_DIR": str(in_the_way)},
        "warm",
        "--shape",
        "64,128",
        "--max-m",
        "2",
        "--json",
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(proc.stdout)["results"]
    assert [r["winner"] for r in results] == ["emulation", "emulation"]
    assert [r["stored"] for r in results] == [False, False]
    err = proc.stderr.strip().splitlines()
    warnings = [line for line in err if "cannot write under" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: fp4select cache: "), err
    assert "Warning:" not in proc.stderr and ".py:" not in proc.stderr, proc.stderr
    assert any(
        line.startswith("warm failed: 2 of 2 decisions could not be written") for line in err
    ), err
    # The same warm into a writable cache stores both and exits 0.
    good = _run(
        {"FP4SELECT_CACHE_DIR": str(tmp_path / "ok")},
        "warm",
        "--shape",
        "64,128",
        "--max-m",
        "2",
        "--json",
    )
    assert good.returncode == 0, good.stderr[-3000:]
    assert [r["stored"] for r in json.loads(good.stdout)["results"]] == [True, True]
