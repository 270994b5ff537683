"""tests/benchmarks/node_loss.py: the node-loss figures from the test's per-case lines."""

import pytest

from tests.benchmarks import node_loss


def case(how, notready, recovery, lost=0, source="peer"):
    return {"how": how, "node": "w2", "node_lost_timeout_s": 20, "notready_s": notready, "recovery_s": recovery,
            "steps_lost": lost, "resumed_from": 30, "source": source}


def test_the_operators_part_is_what_follows_notready_and_is_judged_against_the_timeout():
    r = node_loss.summarize([case("stop", 24.3, 48.9), case("pause", 17.4, 60.0, lost=1)])
    assert r["cases"]["stop"]["after_notready_s"] == 24.6 and r["cases"]["stop"]["within_target"]
    assert r["cases"]["pause"]["after_notready_s"] == 42.6 and not r["cases"]["pause"]["within_target"]
    assert (r["recovery_s_max"], r["after_notready_s_max"], r["notready_s_max"]) == (60.0, 42.6, 24.3)
    assert r["steps_lost_max"] == 1 and r["all_from_peer"] and r["target_after_notready_s"] == 35.0


def test_a_resume_from_elsewhere_than_a_peer_shows():
    assert not node_loss.summarize([case("stop", 20, 40, source="disk")])["all_from_peer"]


def test_no_results_is_an_error_not_an_empty_figure():
    with pytest.raises(SystemExit):
        node_loss.summarize([])
