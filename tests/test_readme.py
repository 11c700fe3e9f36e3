"""Every Python block in the README runs as written, in a fresh process with its own cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)


def test_the_readme_has_python_blocks():
    assert BLOCKS, "the README's Python examples are what a new user tries first"


@pytest.mark.subprocess
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_python_block_runs(index, tmp_path):
    env = {**os.environ, "FP4SELECT_CACHE_DIR": str(tmp_path), "FP4SELECT_TIME_BUDGET_S": "0.05"}
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"README block {index}:\n{BLOCKS[index]}\n{proc.stderr[-3000:]}"
