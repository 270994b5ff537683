"""The trainer benchmarks run in quick mode, and their outcomes are judged: a kill that was not survived,
final weights that differ from an uninterrupted run, or more than one step lost fails the test. Times are
never asserted here; they live in the JSON (`make bench-*` runs the benchmarks in full)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def _run(script: str, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / script), "--quick", *args], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_recovery_benchmark_quick():
    result = _run("trainer_recovery.py")
    keys = {"recovery_s_p50", "recovery_s_max", "steps_lost_max", "bitwise_equal", "baseline_survived",
            "baseline_recovery_s_p50", "baselines"}  # fmt: skip
    assert keys <= set(result), result
    assert result["kills"] == 1, result
    assert result["survived"] is True, f"the killed job did not finish: {result}"
    assert result["bitwise_equal"] is True, f"final weights differ from the uninterrupted run: {result}"
    # measured from the log lines (never None: the surviving host logged its steps), at most the snapshot
    # interval K in force (the resume line reports it)
    assert result["snapshot_every_max"] is not None, result
    assert result["steps_lost_max"] is not None and 0 <= result["steps_lost_max"] <= result["snapshot_every_max"], result
    assert result["sources"] == ["peer"], result


def test_baselines_quick():
    """The configurations docs/recovery.md says survive do survive; stock torchrun's outcome is reported."""
    result = _run("baselines.py")
    configs = result["configs"]
    assert set(configs) == {"stock", "share_store_off", "keep_alive", "host_killed", "ddpjob_settings"}, result
    for name, c in configs.items():
        assert c["kills"] == 1, (name, c)
        if c["documented_to_survive"] and c["survived"] != 1:
            # These are stock torchrun's configurations (plain torchrun, a plain script): once in many CI runs a
            # recovered job did not end cleanly (share_store_off). One kill is a sample of one, so a miss is
            # measured again once, and both outcomes are printed; two misses fail.
            again = _run("baselines.py", "--only", name)["configs"][name]
            print(f"{name}: first kill not survived: {c['detail']}; again: {again['detail']}")
            configs[name] = c = again
        if c["documented_to_survive"]:
            assert c["survived"] == 1, f"{name} is documented to survive a lost node: {c}"
            # checkpoint every 10 steps: at most the 10 steps since the last checkpoint are redone
            assert c["steps_lost_max"] is not None and 0 <= c["steps_lost_max"] <= 10, (name, c)


def test_overhead_benchmark_quick():
    result = _run("trainer_overhead.py")
    keys = {"ratio", "ratio_p25", "ratio_p75", "snapshot_overhead_pct", "bare_samples_per_s", "full_samples_per_s",
            "overhead_pct_by_params", "steps_lost_bound_by_params", "snapshot_exact_by_params", "sweep"}  # fmt: skip
    assert keys <= set(result), result
    assert result["ratio"] > 0 and result["ratio_p25"] <= result["ratio"] <= result["ratio_p75"], result
    sizes = result["overhead_pct_by_params"]
    assert len(sizes) == 2 and set(sizes) == set(result["steps_lost_bound_by_params"]), result
    for n, k in result["steps_lost_bound_by_params"].items():
        assert int(n) > 0 and str(int(n)) == n, result  # keys: parameter counts as integer strings
        assert isinstance(k, int) and 1 <= k <= 50, result  # a bound within K's bounds
    # the asynchronous writer, in a real DDP job: the snapshot read back is the live state of its step
    assert all(result["snapshot_exact_by_params"].values()), result
    # resident state (--quick keeps it on), in the same job: sealed with the live state of the last step, so a
    # failure loses at most one
    assert all(result["resident_exact_by_params"].values()), result
    assert set(result["steps_lost_bound_by_params"].values()) == {1}, result
    for size in result["sweep"]:
        assert size["resident"] and size["resident_bytes"] >= 12 * size["params"], size  # weights + Adam's moments
        assert 1 <= size["k"] <= 50, size  # the copies' K within its bounds
    for size in result["sweep"]:
        assert size["snapshot_bytes"] >= 12 * size["params"], size  # weights + Adam's two moments, fp32


def test_resident_commit_benchmark_quick():
    result = _run("resident_commit.py")
    assert set(result["models"]) == {"digits", "mlp-100000"}, result
    assert result["exact"] is True, result  # every model's file read back equals the live state
    for m in result["models"].values():
        assert m["resident_bytes"] >= 12 * m["params"] and m["commit_ms"] > 0, m  # weights + Adam's moments
