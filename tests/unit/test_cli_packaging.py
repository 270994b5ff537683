"""`pip install .` gives a kubectl-ddp that starts: pyproject.toml declares every library the plugin imports (directly,
or through the operator modules it shares), pinned as the requirement files pin them."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"kubectl_ddp", "ddp_operator"}
SOURCES = {"kubectl_ddp": REPO / "cli" / "kubectl_ddp", "ddp_operator": REPO / "operator" / "ddp_operator"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def declared() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {_name(d): d.replace(" ", "") for d in deps}


def pinned_in_files() -> dict[str, str]:
    out = {}
    for f in ("requirements.txt", "requirements-cli.txt"):
        for line in (REPO / f).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                out[_name(line)] = line.replace(" ", "")
    return out


def _module_file(module: str) -> Path | None:
    top, *rest = module.split(".")
    base = SOURCES[top].joinpath(*rest)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def plugin_imports() -> set[str]:
    """Top-level third-party modules imported anywhere the plugin's code reaches: every module of kubectl_ddp, and the
    ddp_operator modules they import, followed transitively (function-level imports included)."""
    todo = [f"kubectl_ddp.{p.stem}" for p in SOURCES["kubectl_ddp"].glob("*.py")]
    seen: set[str] = set()
    third: set[str] = set()
    while todo:
        module = todo.pop()
        path = _module_file(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in found:
                top = name.split(".")[0]
                if top in FIRST_PARTY:
                    todo.append(name)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    third.add(top)
    return third


def test_every_dependency_is_pinned_as_the_requirement_files_pin_it():
    deps, pins = declared(), pinned_in_files()
    assert set(deps) == {"kubernetes", "pyyaml", "rich", "matplotlib", "plotext"}, deps
    for name, requirement in deps.items():
        assert requirement == pins.get(name), (name, requirement, pins.get(name))


def test_every_library_the_plugin_imports_is_declared_or_required_by_a_declared_one():
    deps = declared()
    # What the declared distributions bring with them (urllib3 with kubernetes, pillow with matplotlib, ...).
    brought = {_name(r) for d in deps for r in (md.requires(d) or []) if "extra ==" not in r}
    by_module = md.packages_distributions()
    imports = plugin_imports()
    assert {"kubernetes", "rich", "matplotlib", "plotext", "yaml"} <= imports, imports
    assert "kopf" not in imports and "torch" not in imports, imports
    for module in imports:
        dists = {_name(d) for d in by_module.get(module, [])}
        assert dists & (set(deps) | brought), f"{module} (from {dists or 'no installed distribution'}) is not declared"
