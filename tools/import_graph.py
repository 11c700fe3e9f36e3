"""Print the import graph of fp4select/: its levels, its circles, and the modules over 500 lines.

Usage: ``python tools/import_graph.py [--json]`` from the repository root. It reads the source
(``ast``), imports nothing, and counts every ``import``/``from ... import`` of an fp4select
module anywhere in a file (lazy imports inside functions included: a circle through a lazy
import is still a circle of responsibilities). A module's level is 1 for a module that imports
no other fp4select module, else one more than the highest level among those it imports; a
package's ``__init__`` counts as the module of the package's name. Exit status 1 when the
graph has a circle or is more than ``MAX_LEVELS`` deep, so CI or a test can hold the line.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "fp4select"
MAX_LEVELS = 10  # issue 17's bound on the depth of every import, lazy ones included


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _statements(tree: ast.AST, eager: bool) -> list[ast.AST]:
    """Every node, less ``if TYPE_CHECKING:`` blocks (types only, never run), and with
    ``eager`` less the bodies of functions (imports run on call, not on import)."""
    found: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        if eager and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        found.append(node)
        todo += ast.iter_child_nodes(node)
    return found


def imports_of(name: str, path: Path, known: set[str], eager: bool = False) -> set[str]:
    """The fp4select modules ``path`` imports (``from pkg import mod`` names the module).

    ``eager``: only the imports run when the module is imported, not those inside functions.
    """
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _statements(ast.parse(path.read_text(), str(path)), eager):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from pkg import mod`` imports the module ``mod``; ``from mod import name`` the
            # module ``mod``. The package ``__init__`` run on the way is not counted (every
            # module of a package would otherwise import it), as pydeps does.
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(eager: bool = False) -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known, eager) for name, path in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def levels(edges: dict[str, set[str]]) -> dict[str, int]:
    """Level of each module; the modules of one circle share a level (the circle is one node)."""
    component_of = {m: tuple(c) for c in circles(edges) for m in c}
    level: dict[str, int] = {}

    def of(v: str, seen: frozenset[str]) -> int:
        if v in level:
            return level[v]
        group = component_of.get(v, (v,))
        below = {w for m in group for w in edges[m]} - set(group)
        value = 1 + max((of(w, seen | set(group)) for w in below if w not in seen), default=0)
        for m in group:
            level[m] = value
        return value

    for v in sorted(edges):
        of(v, frozenset())
    return level


def long_files(limit: int = 500) -> dict[str, int]:
    """Path -> line count of each fp4select file longer than ``limit`` lines."""
    return {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / PACKAGE).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > limit
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--eager", action="store_true", help="count only imports run on import, not in functions"
    )
    args = parser.parse_args(argv)
    edges = graph(args.eager)
    found = circles(edges)
    level = levels(edges)
    total = sum(len(p.read_text().splitlines()) for p in (ROOT / PACKAGE).rglob("*.py"))
    report = {
        "modules": len(edges),
        "lines": total,
        "depth": max(level.values()),
        "circles": found,
        "files_over_500_lines": long_files(),
        "levels": {m: level[m] for m in sorted(edges, key=lambda m: (-level[m], m))},
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{report['modules']} modules, {total} lines, {report['depth']} levels deep")
        print(f"circles: {len(found)}")
        for component in found:
            print("  " + " <-> ".join(component))
        print("files over 500 lines:")
        for path, n in report["files_over_500_lines"].items():
            print(f"  {path}: {n}")
        deepest = [m for m, lv in report["levels"].items() if lv == report["depth"]]
        print(f"deepest: {', '.join(deepest)}")
    return 1 if found or report["depth"] > MAX_LEVELS else 0


if __name__ == "__main__":
    sys.exit(main())
