"""The README's examples run as written (in a real process, on this machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # each example runs as a process

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("script", ["quickstart.py", "register_backend.py"])
def test_example_runs(script, tmp_path):
    env = {**os.environ, "FP4SELECT_CACHE_DIR": str(tmp_path), "FP4SELECT_TIME_BUDGET_S": "0.05"}
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
