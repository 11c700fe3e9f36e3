"""Every Python block in the README runs as written, in a fresh process with its own cache, and
prints what the README says it prints.

A block's output is the ```text block that comes next, before any other fenced block; ``...``
in it stands for any text. A block that prints must show its output that way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
_FENCES = re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
# (code, expected output or None), one per Python block, in the README's order
BLOCKS = [
    (code, _FENCES[i + 1][1] if i + 1 < len(_FENCES) and _FENCES[i + 1][0] == "text" else None)
    for i, (lang, code) in enumerate(_FENCES)
    if lang == "python"
]


def printed_as_shown(stdout: str, expected: str) -> bool:
    """Every line of ``expected`` matches the line printed there (``...``: any text)."""
    got = stdout.rstrip("\n").splitlines()
    want = expected.rstrip("\n").splitlines()
    pattern = [re.escape(w).replace(re.escape("..."), ".*") for w in want]
    return len(got) == len(want) and all(re.fullmatch(p, g) for p, g in zip(pattern, got))


def test_the_readme_has_python_blocks():
    assert BLOCKS, "the README's Python examples are what a new user tries first"


def test_a_block_that_prints_shows_what_it_prints():
    for code, expected in BLOCKS:
        if "print(" in code:
            assert expected is not None, f"no ```text block shows what this prints:\n{code}"


def test_the_output_match_can_fail():
    assert printed_as_shown("emulation {'a': 'x', 'emulation': 'passed'}\n", "emulation {...}")
    assert not printed_as_shown("cutlass {'emulation': 'passed'}", "emulation {...}")
    assert not printed_as_shown("emulation {}\nmore", "emulation {...}")
    assert not printed_as_shown("a*b", "a...c")


@pytest.mark.subprocess
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_python_block_runs(index, tmp_path):
    code, expected = BLOCKS[index]
    env = {**os.environ, "FP4SELECT_CACHE_DIR": str(tmp_path), "FP4SELECT_TIME_BUDGET_S": "0.05"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"README block {index}:\n{code}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if expected is not None:
        assert printed_as_shown(proc.stdout, expected), (
            f"README block {index} printed:\n{proc.stdout}\nthe README shows:\n{expected}"
        )
