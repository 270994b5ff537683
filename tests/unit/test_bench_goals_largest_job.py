"""tests/benchmarks/largest_job.py's judging (`goals_missed`) on synthetic results (no cluster): a good run misses
nothing; each outcome goal fails, with one message naming its figure, on a forced bad value."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmarks import largest_job
from tests.unit.test_bench_goals import changed, one_miss


def good() -> dict:
    fault = {"recovered": True, "recovery_s": 9.5, "resumed_from": 12, "source": "peer", "steps_lost": 0}
    return {"faults": {"two_pods": dict(fault), "store": {**fault, "resumed_from": 22, "source": "local",
                                                          "steps_lost": 1}},
            "phases": {"ref": "Succeeded", "big": "Succeeded"},
            "digests": {"ref": ["ab12"], "big": ["ab12"]}, "bitwise_equal": True}


def test_a_good_run_misses_nothing():
    assert largest_job.goals_missed(good()) == []


@pytest.mark.parametrize("path, bad, figure", [
    (("faults", "two_pods", "steps_lost"), 2, "faults.two_pods.steps_lost"),
    (("faults", "store", "steps_lost"), None, "faults.store.steps_lost"),
    (("faults", "store", "steps_lost"), -1, "faults.store.steps_lost"),
    (("faults", "two_pods", "source"), "fresh", "faults.two_pods.source"),
    (("faults", "store", "resumed_from"), 0, "faults.store.source"),
    (("faults", "two_pods"), {"recovered": False, "error": "timed out"}, "faults.two_pods.recovered"),
    (("faults", "store"), None, "faults.store.recovered"),
    (("phases", "big"), "Failed", "phases.big"),
    (("phases", "ref"), "Running", "phases.ref"),
    (("digests", "big"), ["ab12", "cd34"], "digests.big"),
    (("bitwise_equal",), False, "bitwise_equal"),
])
def test_each_goal_fails_on_a_bad_value(path, bad, figure):
    one_miss(largest_job.goals_missed(changed(good(), path, bad)), figure)


@pytest.mark.parametrize("nodes, epochs", [(8, 9), (3, 3), (2, 3)])
def test_the_job_trains_long_enough_for_both_faults(nodes, epochs):
    a = argparse.Namespace(nodes=nodes, kill_step=12, gap_steps=10, tail_steps=15)
    assert largest_job.epochs_for(a) == epochs
    per_epoch = -(-largest_job.TRAIN_SAMPLES // (nodes * largest_job.BATCH))
    assert epochs * per_epoch >= a.kill_step + a.gap_steps + a.tail_steps
