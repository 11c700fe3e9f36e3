"""``.ci/run``: a failing test fails CI, a selection of no tests does not, and the last lines say
which step passed and which failed.

Each test runs one real step of the script (``tests``: ``python -m pytest --all``) narrowed
with pytest's own ``PYTEST_ADDOPTS``, so the script's exit-status handling is what is tested.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # each test runs the CI script and pytest in it

ROOT = Path(__file__).resolve().parent.parent
ONE_FAST_TEST = "test_the_readme_is_a_short_page"
# Where it is: collecting the whole suite in each xdist worker took most of a minute a test.
ITS_FILE = "tests/test_readme.py"


def _ci(tmp_path: Path, *steps: str, addopts: str = "", pythonpath: str = ""):
    env = {
        **os.environ,
        "PYTEST_ADDOPTS": addopts,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [pythonpath, str(ROOT), os.environ.get("PYTHONPATH")])
        ),
        "FP4SELECT_CACHE_DIR": str(tmp_path / "cache"),
    }
    # The active interpreter, as CI runs it: first on PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run(
        ["bash", str(ROOT / ".ci" / "run"), *steps],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=tmp_path,
    )


def _summary(out: str) -> list[str]:
    return out.split("== summary\n", 1)[1].strip().splitlines()


def test_a_selection_of_no_tests_passes(tmp_path):
    proc = _ci(tmp_path, "tests", addopts=f"{ITS_FILE} -k no_test_is_named_like_this")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = _summary(proc.stdout)
    assert len(summary) == 1 and summary[0].split()[:2] == ["tests", "passed"], summary


def test_a_failing_test_fails_ci_and_the_summary_says_which_step(tmp_path):
    plugin = tmp_path / "plugins"
    plugin.mkdir()
    (plugin / "planted_failure.py").write_text(
        "def pytest_runtest_call(item):\n    raise AssertionError('planted by test_ci_run')\n"
    )
    proc = _ci(
        tmp_path,
        "tests",
        addopts=f"{ITS_FILE} -p planted_failure -k {ONE_FAST_TEST}",
        pythonpath=str(plugin),
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "planted by test_ci_run" in proc.stdout
    summary = _summary(proc.stdout)
    assert len(summary) == 1 and summary[0].split()[:4] == ["tests", "FAILED", "(exit", "1,"], (
        summary
    )


def test_an_unknown_step_is_refused(tmp_path):
    proc = _ci(tmp_path, "nosuchstep")
    assert proc.returncode == 2
    assert "unknown step 'nosuchstep'" in proc.stderr and "oldest-flashinfer" in proc.stderr
