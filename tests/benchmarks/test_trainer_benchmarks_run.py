"""The trainer benchmarks run in quick mode and print their JSON keys (figures are not judged here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def _run(script: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / script), "--quick"], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_recovery_benchmark_quick():
    result = _run("trainer_recovery.py")
    keys = {"recovery_s_p50", "recovery_s_max", "steps_lost_max", "bitwise_equal", "baseline_survived",
            "baseline_recovery_s_p50"}  # fmt: skip
    assert keys <= set(result), result
    assert result["kills"] == 1 and isinstance(result["bitwise_equal"], bool)


def test_overhead_benchmark_quick():
    result = _run("trainer_overhead.py")
    assert {"ratio", "snapshot_overhead_pct", "bare_samples_per_s", "full_samples_per_s"} <= set(result), result
    assert result["ratio"] > 0
