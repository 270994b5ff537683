"""hack/ is one package with one import rule, so that each of its modules is loaded once per process:

- a module imports a sibling as part of the package, `from hack import x` or `from hack.x import name`: never
  by bare name (`import cluster`, which works in a script run as `python hack/x.py` and loads a second copy),
  never by path (importlib);
- a script that imports siblings first puts the repository root on sys.path (`if not __package__:`), and
  nothing puts hack/ itself there, in hack/ or in tests/;
- no cycle, with a script run as a subprocess (`python hack/image.py`, `hack/build-binaries.sh`) counted like
  an import: no module runs a script that imports it back.
"""
from __future__ import annotations

import ast
import re

from tests import tools

HACK = tools.REPO_ROOT / "hack"
MODULES = {p.stem for p in HACK.glob("*.py")}
BOOTSTRAP = "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))"


def hack_imports(tree: ast.AST) -> list[tuple[str, ast.stmt]]:
    """(hack module, statement) for each import in `tree` of a hack module, however it is written."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:  # relative: fails in a script
            found.append((node.module or "", node))
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "hack":
            names = [f"hack.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            module = parts[1] if parts[0] == "hack" and len(parts) > 1 else parts[0]
            if module in MODULES:
                found.append((module, node))
    return found


def wrong_imports(tree: ast.AST) -> list[str]:
    return [ast.unparse(node) for _, node in hack_imports(tree)
            if not ast.unparse(node).startswith(("from hack import ", "from hack."))]


def runs(text: str, python: bool) -> set[str]:
    """File names of the scripts a file may run as a subprocess: in Python, string constants that are a file
    name or path (docstrings and messages have spaces); in a shell script, file names outside comments."""
    if python:
        return {c.value.rsplit("/", 1)[-1] for c in ast.walk(ast.parse(text))
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
                and re.fullmatch(r"[\w./-]*\.(py|sh)", c.value)}
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return set(re.findall(r"(?:^|[/\s\"'])([\w-]+\.(?:py|sh))\b", code, re.M))


def edges() -> dict[str, set[str]]:
    """Each Python and shell file of hack/ -> the hack files it imports or runs."""
    files = {p.name: p.read_text() for p in [*HACK.glob("*.py"), *HACK.glob("*.sh")]}
    out = {}
    for name, text in files.items():
        python = name.endswith(".py")
        imported = {f"{m}.py" for m, _ in hack_imports(ast.parse(text))} if python else set()
        out[name] = (imported | runs(text, python)) & set(files) - {name}
    return out


def test_hack_is_a_package():
    assert (HACK / "__init__.py").is_file()


def test_hack_modules_import_each_other_as_the_package_only():
    wrong = []
    for path in sorted(HACK.glob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        wrong += [f"{path.name}: {how}" for how in wrong_imports(tree)]
        if "importlib" in text:
            wrong.append(f"{path.name}: loads a module by path")
        wrong += [f"{path.name}: {ast.unparse(node)}" for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and ast.unparse(node.func).startswith("sys.path.") and ast.unparse(node) != BOOTSTRAP]
    assert wrong == []


def test_scripts_put_the_repository_root_on_sys_path_before_importing_siblings():
    missing = []
    for path in sorted(HACK.glob("*.py")):
        tree = ast.parse(path.read_text())
        first = min((node.lineno for _, node in hack_imports(tree)), default=None)
        if first is None or 'if __name__ == "__main__":' not in path.read_text():
            continue
        bootstrap = [node.lineno for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test)
                     == "not __package__" and [ast.unparse(s) for s in node.body] == [BOOTSTRAP]]
        if not bootstrap or bootstrap[0] > first:
            missing.append(path.name)
    assert missing == []


def test_tests_import_hack_modules_as_the_package():
    wrong = []
    for path in sorted((tools.REPO_ROOT / "tests").rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(tools.REPO_ROOT)
        wrong += [f"{where}: {how}" for how in wrong_imports(ast.parse(text))]
        if re.search(r"sys\.path\.(insert|append)\(.*[\"']hack[\"']", text):
            wrong.append(f"{where}: puts hack/ on sys.path")
    assert wrong == []


def test_no_cycle_through_imports_or_subprocesses():
    graph = edges()
    # cluster.py imports image.py for the pause image (it ran it as a subprocess, and image.py imported
    # cluster.py); image.py runs install-go.py, which imports nothing of hack/
    assert "image.py" in graph["cluster.py"] and "cluster.py" not in graph["image.py"], graph
    assert "install-go.py" in graph["image.py"] and graph["install-go.py"] == set(), graph

    def back_to(start: str, node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                return path + [start]
            if nxt not in path and (found := back_to(start, nxt, path + [nxt])):
                return found
        return None

    assert [" -> ".join(c) for name in sorted(graph) if (c := back_to(name, name, [name]))] == []
