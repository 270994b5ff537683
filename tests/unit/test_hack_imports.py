"""hack/'s Python scripts import one another without a cycle (cluster.py runs image.py, never imports it)."""
from __future__ import annotations

import ast

from tests import tools

HACK = tools.REPO_ROOT / "hack"


def imports_of_siblings() -> dict[str, set[str]]:
    modules = {p.stem: p for p in HACK.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_cycle_in_hack():
    graph = imports_of_siblings()
    assert graph["image"] == {"cluster"} and "image" not in graph["cluster"], graph

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in graph[start])

    assert [m for m in graph if reaches(m, m, {m})] == []
