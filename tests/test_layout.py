"""The package's shape: no import circles, the records a leaf, long files say why they are long.

Read from the source by tools/import_graph.py (nothing is imported), so these run in a blink.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
assert _spec is not None and _spec.loader is not None
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_the_import_graph_has_no_circles_lazy_imports_included():
    assert import_graph.circles(import_graph.graph()) == []


def test_the_import_graph_is_at_most_ten_levels_deep(capsys):
    level = import_graph.levels(import_graph.graph())
    deepest = max(level.values())
    assert deepest <= import_graph.MAX_LEVELS == 10, sorted(level, key=level.get)[-5:]
    assert import_graph.main([]) == 0  # the tool's exit status says the same
    assert f"{deepest} levels deep" in capsys.readouterr().out


def test_the_circle_finder_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.circles(edges) == [["a", "b", "c"]]
    assert import_graph.levels({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == {
        "a": 2,
        "b": 1,
        "c": 3,
    }


def test_the_records_are_a_leaf():
    """records imports nothing of ours but what it holds (Problem) and the version."""
    edges = import_graph.graph()
    assert edges["fp4select.records"] <= {"fp4select.keys", "fp4select._version"}
    # and the sandbox's attempt, which checks the child's records, needs no probing or validation
    below: set[str] = set()
    todo = ["fp4select.sandbox.attempt"]
    while todo:
        for name in edges[todo.pop()] - below:
            below.add(name)
            todo.append(name)
    # (formats is reached as the leaf holding the keys' vocabulary, not for its codecs)
    assert not below & {"fp4select.probe", "fp4select.validate", "fp4select.timing"}


def test_a_module_over_500_lines_says_why_at_its_top():
    for path, lines in import_graph.long_files(500).items():
        head = (ROOT / path).read_text().split('"""')[1]
        assert "Why one file" in head, f"{path} has {lines} lines and no reason at its top"


def test_benchmark_results_hold_no_local_paths_and_parse():
    import json
    import re

    results = ROOT / "benchmarks" / "results"
    for path in sorted(results.iterdir()):
        if path.suffix == ".png":
            continue
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"/(work|home|root|Users)/", text), f"{path.name} names a local path"
        if path.suffix == ".json":
            json.loads(text)


def test_the_quantizer_kernel_keeps_the_quantizers_constants():
    """_quantize_triton restates two of quantize's values rather than import it back."""
    pytest.importorskip("triton")
    from fp4select import _quantize_triton as kernel
    from fp4select import quantize

    def value(x):  # a tl.constexpr holds its number in .value
        return getattr(x, "value", x)

    kernel_values = (value(kernel.C_SIXTH), value(kernel.F32_MAX))
    assert kernel_values == (quantize.C_SIXTH, quantize.F32_MAX)
    assert all(type(v) is float for v in kernel_values)
