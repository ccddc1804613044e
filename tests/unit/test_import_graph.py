"""Imports flow one way between rlrunner's packages (docs/architecture.md, "One direction of imports"): no package
imports one that imports it back, counting the imports inside functions too (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import rlrunner

ROOT = Path(rlrunner.__file__).parent


def package_imports(root: Path) -> dict[str, dict[str, str]]:
    """{package: {package it imports: where (file:line)}} of the top-level package at `root`; a module directly in
    `root` (config.py) counts as a package of its own."""
    top = root.name
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        source = parts[0] if parts[0] != "__init__" else top
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                pieces = name.split(".")
                if pieces[0] == top and len(pieces) > 1 and pieces[1] != source:
                    graph.setdefault(source, {}).setdefault(pieces[1], f"{path.relative_to(root.parent)}:{node.lineno}")
    return graph


def package_cycles(graph: dict[str, dict[str, str]]) -> list[str]:
    """Each import a -> b where b reaches a again, with where it is made."""

    def reaches(start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph.get(todo.pop(), {}):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return [
        f"{a} -> {b} ({where})"
        for a, targets in sorted(graph.items())
        for b, where in sorted(targets.items())
        if reaches(b, a)
    ]


def test_no_package_imports_one_that_imports_it_back() -> None:
    graph = package_imports(ROOT)
    assert {"runner", "backends", "checkpoint"} <= set(graph)  # the walk sees the packages
    assert package_cycles(graph) == []


def test_a_cycle_through_a_lazy_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    for folder, text in {
        "a": "from pkg.b.x import f\n",
        "b": "def f():\n    from pkg.c import g\n",
        "c": "import pkg.a.y\n",
    }.items():
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text(text)
    (pkg / "__init__.py").write_text("")
    cycles = package_cycles(package_imports(pkg))
    assert [line.split(" (")[0] for line in cycles] == ["a -> b", "b -> c", "c -> a"]
    assert "pkg/b/__init__.py:2" in cycles[1]
