"""The README and docs/: every Python block runs as written, in a fresh process with its own
cache, and prints what the page says it prints; every link and cited result file exists; the
numbers a test can check come from one source.

A block's output is the ```text block that comes next, before any other fenced block; ``...``
in it stands for any text. A block that prints must show its output that way.

The README is a user's page (what and why, install, quick start, engines, deploying, command
line, configuration, known limits); design notes, the verification record and measurements
live in docs/, linked from it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_LINES_AT_MOST = 300


def _blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """(page, code, expected output or None), one per Python block, in the page's order."""
    fences = re.findall(r"^```(\w*)\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)
    name = page.relative_to(ROOT).as_posix()
    return [
        (
            name,
            code,
            fences[i + 1][1] if i + 1 < len(fences) and fences[i + 1][0] == "text" else None,
        )
        for i, (lang, code) in enumerate(fences)
        if lang == "python"
    ]


BLOCKS = [block for page in PAGES for block in _blocks(page)]


def printed_as_shown(stdout: str, expected: str) -> bool:
    """Every line of ``expected`` matches the line printed there (``...``: any text)."""
    got = stdout.rstrip("\n").splitlines()
    want = expected.rstrip("\n").splitlines()
    pattern = [re.escape(w).replace(re.escape("..."), ".*") for w in want]
    return len(got) == len(want) and all(re.fullmatch(p, g) for p, g in zip(pattern, got))


def test_the_readme_has_python_blocks():
    assert any(page == "README.md" for page, _, _ in BLOCKS), (
        "the README's Python examples are what a new user tries first"
    )


def test_a_block_that_prints_shows_what_it_prints():
    for page, code, expected in BLOCKS:
        if "print(" in code:
            assert expected is not None, f"{page}: no ```text block shows what this prints:\n{code}"


def test_the_output_match_can_fail():
    assert printed_as_shown("emulation {'a': 'x', 'emulation': 'passed'}\n", "emulation {...}")
    assert not printed_as_shown("cutlass {'emulation': 'passed'}", "emulation {...}")
    assert not printed_as_shown("emulation {}\nmore", "emulation {...}")
    assert not printed_as_shown("a*b", "a...c")


@pytest.mark.subprocess
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"{BLOCKS[i][0]}-{i}")
def test_a_python_block_runs(index, tmp_path):
    page, code, expected = BLOCKS[index]
    env = {**os.environ, "FP4SELECT_CACHE_DIR": str(tmp_path), "FP4SELECT_TIME_BUDGET_S": "0.05"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"{page} block {index}:\n{code}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if expected is not None:
        assert printed_as_shown(proc.stdout, expected), (
            f"{page} block {index} printed:\n{proc.stdout}\nthe page shows:\n{expected}"
        )


def test_the_readme_is_a_short_page():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_LINES_AT_MOST, (
        f"README.md has {lines} lines: it is a user's page; put long text in docs/ and link it"
    )


def test_the_quick_start_is_on_the_first_screen():
    text = README.read_text(encoding="utf-8")
    assert text.index("```python") < len("\n".join(text.splitlines()[:40]))


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {_anchor(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_to_a_file_of_ours_resolves(page):
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(file), f"{page.name}: link to {target}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_result_file_cited_exists(page):
    """A number is only as good as the file it comes from: a cited result must be there."""
    text = page.read_text(encoding="utf-8")
    for cited in re.findall(r"benchmarks/results/([\w.\-]+\.(?:json|txt|png))", text):
        assert (ROOT / "benchmarks" / "results" / cited).exists(), f"{page.name} cites {cited}"


def test_the_stated_versions_are_the_declared_ones():
    """The flashinfer range is pyproject.toml's; the engine versions are the plugins' tested
    ones and the versions .ci/engines.sh installs."""
    from fp4select.integrations import sglang, vllm

    readme = README.read_text(encoding="utf-8")
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.search(r'"flashinfer-python(>=[^",]+),(<[^"]+)"', pyproject)
    assert declared is not None
    assert f"`flashinfer-python {declared[1]},{declared[2]}`" in readme
    engines_sh = (ROOT / ".ci" / "engines.sh").read_text(encoding="utf-8")
    assert re.search(r"^SGLANG=(\S+)$", engines_sh, re.M)[1] == sglang.TESTED_VERSIONS[-1]
    assert re.search(r"^VLLM=(\S+)$", engines_sh, re.M)[1] == vllm.TESTED_VERSIONS[-1]
    # The earlier vLLM releases the plugin claims are each tested by engines.sh too.
    earlier = re.search(r"^VLLM_EARLIER=\((.*)\)$", engines_sh, re.M)[1].split()
    assert earlier == list(vllm.TESTED_VERSIONS[:-1])
    stated = re.search(r"Tested with SGLang (\S+) and vLLM ([^;]+);", readme)
    assert stated is not None
    assert stated.groups() == (sglang.TESTED_VERSIONS[-1], " and ".join(vllm.TESTED_VERSIONS))
