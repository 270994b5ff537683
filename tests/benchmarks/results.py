"""Where every benchmark's result goes: its last line of output and, with --record, docs/bench/<name>.json.

`make bench-*` passes --record, so each figure in the README's Measured table and in docs/recovery.md's
baseline table comes from a committed file that says what produced it: the commit (and whether the tree
had uncommitted changes), the date, the machine (cores, memory, torch version), the command line and the
mode (`full`, or `quick` for the short smoke runs the test suite makes). `make bench-report` rewrites the
tables from these files (tests/benchmarks/report.py).

A benchmark also judges its outcomes (never its timings): a pure `goals_missed(result)` of its own lists every goal
missed, one message each (`goal()`), and `emit_judged` puts that list in the result as `goals_missed` and turns
it into the exit status, so a smoke test fails on a missed outcome and a unit test can show each check failing on a
forced bad value.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "docs" / "bench"


def add_record_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", action="store_true",
                        help=f"also write the result to {BENCH_DIR.relative_to(ROOT)}/<name>.json (make bench-* does)")


def rounds_args(description: str, rounds: int, extra=None) -> argparse.Namespace:
    """The command line of a benchmark made of rounds: --rounds, --quick (one round: the smoke test), --record;
    `extra(parser)` adds its own options."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--quick", action="store_true", help="one round (smoke test)")
    if extra is not None:
        extra(p)
    add_record_arg(p)
    a = p.parse_args()
    if a.quick:
        a.rounds = 1
    return a


def _git(*args: str) -> str | None:
    try:
        p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def machine() -> dict[str, Any]:
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "torch": torch_version,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def envelope(name: str, result: dict[str, Any], mode: str) -> dict[str, Any]:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "benchmark": name,
        "mode": mode,
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "result": result,
    }


def emit(name: str, result: dict[str, Any], *, mode: str, record: bool) -> Path | None:
    """Print the result as the last line of output; with ``record``, also write docs/bench/<name>.json."""
    path = None
    if record:
        BENCH_DIR.mkdir(parents=True, exist_ok=True)
        path = BENCH_DIR / f"{name}.json"
        path.write_text(json.dumps(envelope(name, result, mode), indent=2, sort_keys=False) + "\n")
        print(f"recorded {path.relative_to(ROOT)}", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return path


def measured(values: list[float | None]) -> list[float]:
    """The values that were measured (None: not measured, e.g. a round whose job never reached its first step)."""
    return [v for v in values if v is not None]


def difference(a: float | None, b: float | None) -> float | None:
    """a - b, or None where either was not measured."""
    return None if a is None or b is None else round(a - b, 2)


def goal(held: bool, figure: str, value: Any, want: str) -> list[str]:
    """[] when a goal held, else its one message, naming the figure, its value and the goal."""
    return [] if held else [f"{figure} = {value!r}, goal: {want}"]


def emit_judged(name: str, result: dict[str, Any], missed: list[str], *, mode: str, record: bool) -> int:
    """emit() with `goals_missed` (the messages of `goal()`, [] when every goal held) in the result, each miss also on
    stderr; returns the exit status: 1 when a goal was missed. A run that missed is still recorded: its figures are
    what was measured, and its JSON says what missed."""
    emit(name, {**result, "goals_missed": list(missed)}, mode=mode, record=record)
    for message in missed:
        print(f"goal missed: {message}", file=sys.stderr)
    return 1 if missed else 0


def load(name: str, bench_dir: Path = BENCH_DIR) -> dict[str, Any] | None:
    path = bench_dir / f"{name}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())
