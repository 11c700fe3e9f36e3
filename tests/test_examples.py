"""The examples run as written (in a real process, on this machine) and say what they should.

A try-out leaves no trace: the examples that decide anything use a temporary cache, so a run
with no ``FP4SELECT_CACHE_DIR`` writes nothing to fp4select's user cache and leaves no folder
of its own behind.
The engine examples, where the engine is missing, say in one line what to install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # each example runs as a process

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _environment(tmp_path: Path) -> tuple[dict[str, str], list[Path]]:
    """No FP4SELECT_CACHE_DIR: the user cache, $HOME and the temporary folder all in tmp_path."""
    places = [tmp_path / "xdg-cache", tmp_path / "home", tmp_path / "tmp"]
    for place in places:
        place.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "FP4SELECT_CACHE_DIR"}
    env.update(
        XDG_CACHE_HOME=str(places[0]),
        HOME=str(places[1]),
        TMPDIR=str(places[2]),
        FP4SELECT_TIME_BUDGET_S="0.05",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    return env, places


@pytest.mark.parametrize("script", ["quickstart.py", "register_backend.py"])
def test_example_runs_and_leaves_no_trace(script, tmp_path):
    env, places = _environment(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=EXAMPLES,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if script == "quickstart.py":
        assert "chosen backend: emulation" in proc.stdout
        error = float(proc.stdout.split("product: ")[1].split()[0])
        assert error < 0.2  # NVFP4 on Gaussian data: about 0.13
    else:
        assert "mine: passed" in proc.stdout
    # flashinfer, when imported, writes its own JIT log and caches there: not ours to judge.
    left = [p for place in places for p in place.rglob("*fp4select*")]
    assert left == [], f"{script} left {left}"


@pytest.mark.parametrize(
    ("script", "engine", "pin"),
    [
        ("sglang_fp4select.py", "sglang", "sglang==0.5.23"),
        ("vllm_fp4select.py", "vllm", "vllm==0.34.0"),
    ],
)
@pytest.mark.parametrize("flag", [["--check"], []])
def test_an_engine_example_without_its_engine_says_what_to_install(
    script, engine, pin, flag, tmp_path
):
    """Whether or not the engine is installed here, the run sees it missing (None in
    sys.modules is how Python spells "not importable")."""
    code = (
        "import runpy, sys\n"
        f"sys.modules[{engine!r}] = None\n"
        f"sys.argv = [{str(EXAMPLES / script)!r}, *{flag!r}]\n"
        f"runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    env = {**os.environ, "FP4SELECT_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"{engine} not installed: ") and f"pip install {pin}" in lines[0]
