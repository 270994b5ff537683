#!/usr/bin/env python3
"""Where a pytest run's time went, from its JUnit XML (`pytest --junitxml=FILE`; `make test` writes
.test-results/*.xml): seconds per test directory and the slowest modules and tests, as Markdown tables for
docs/testing.md.

    hack/test_times.py FILE.xml [FILE.xml ...] [--top 25]
    hack/test_times.py --failures FILE.xml [...]   # one line per failed test: its id and the first line of why

A test's time is what JUnit records for it: its setup (fixtures, e.g. the first test of a module pays for a module
fixture), call and teardown.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def cases(paths: list[Path]) -> list[tuple[str, str, float, str]]:
    """(module path, test name, seconds, outcome) of every test case in the files."""
    out = []
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            module = case.get("classname", "").split(".")
            # classname is the dotted module (and class): tests.e2e.test_x[.TestClass]
            while module and not module[-1].startswith("test_"):
                module.pop()
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = tag
            out.append(("/".join(module) + ".py", case.get("name", ""), float(case.get("time", 0)), outcome))
    return out


def failures(paths: list[Path]) -> list[str]:
    """`module::test (failure|error): the first line of its message` for every test that did not pass."""
    out = []
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            for tag in ("failure", "error"):
                found = case.find(tag)
                if found is not None:
                    module = case.get("classname", "").replace(".", "/")
                    why = (found.get("message") or found.text or "").strip().splitlines()
                    out.append(f"{module}.py::{case.get('name', '')} ({tag}): {why[0][:300] if why else ''}")
    return out


def tables(rows: list[tuple[str, str, float, str]], top: int) -> str:
    by_dir: dict[str, list[float]] = defaultdict(list)
    by_module: dict[str, list[float]] = defaultdict(list)
    for module, _, secs, _ in rows:
        by_dir[str(Path(module).parent)].append(secs)
        by_module[module].append(secs)
    total = sum(secs for _, _, secs, _ in rows)
    lines = ["| directory | tests | seconds | share |", "|---|---:|---:|---:|"]
    for d, secs in sorted(by_dir.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {d} | {len(secs)} | {sum(secs):.0f} | {100 * sum(secs) / total:.0f} % |")
    lines.append(f"| **all** | {len(rows)} | {total:.0f} | |")
    lines += ["", f"The {top} slowest modules:", "", "| module | tests | seconds |", "|---|---:|---:|"]
    for m, secs in sorted(by_module.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {m} | {len(secs)} | {sum(secs):.0f} |")
    lines += ["", f"The {top} slowest tests:", "", "| test | seconds | outcome |", "|---|---:|---|"]
    for module, name, secs, outcome in sorted(rows, key=lambda r: -r[2])[:top]:
        lines.append(f"| {module}::{name} | {secs:.0f} | {outcome} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--failures", action="store_true", help="only the tests that failed, one line each")
    a = ap.parse_args(argv)
    if a.failures:
        print("\n".join(failures(a.files)) or "no failed test in the JUnit files")
        return 0
    rows = cases(a.files)
    if not rows:
        print("no test cases in " + ", ".join(map(str, a.files)), file=sys.stderr)
        return 1
    print(tables(rows, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
