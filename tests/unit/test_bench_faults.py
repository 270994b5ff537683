"""tests/benchmarks/faults.py's measuring, on synthetic trainer log lines (no cluster)."""

from __future__ import annotations

import time

import pytest

from ddp_trainer.testing import StepsLostError
from tests.benchmarks import faults
from tests.e2e import harness as h

T0 = 1_800_000_000.0


def line(t: float, rank: int, event: str, **fields) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(round(t * 1000)) % 1000:03d}Z"
    return " ".join([stamp, "ddp_trainer", f"rank={rank}", f"event={event}", *(f"{k}={v}" for k, v in fields.items())])


def evs(*texts: tuple[str, list[str]]) -> list[h.Event]:
    out = []
    for pod, lines in texts:
        out += h.events("\n".join(lines), pod)
    return sorted(out, key=lambda e: e.time)


def run(steps: range, t: float, rank: int = 0) -> list[str]:
    return [line(t + i * 0.2, rank, "step", step=s) for i, s in enumerate(steps)]


def test_a_peer_resume_after_the_injection():
    pod0 = [line(T0, 0, "start", source="fresh"), *run(range(1, 31), T0 + 1),            # steps 1..30 until T0+6.8
            line(T0 + 15, 0, "resume", source="peer", step=29), *run(range(30, 40), T0 + 16)]
    pod1 = run(range(1, 29), T0 + 1, rank=1)  # the killed pod's lines up to step 28
    m = faults.measure(evs(("p0", pod0), ("p1", pod1)), injected_at=T0 + 6.9, succeeded=True)
    assert m["resumed_from"] == "peer"
    assert m["steps_lost"] == 1  # highest completed 30, restored 29
    assert m["recovery_s"] == pytest.approx(16 - 6.9, abs=0.01)  # step 30, the first past 29 after the resume
    assert len(m["restores"]) == 1


def test_a_fresh_start_loses_everything_and_maps_to_start():
    lines = [line(T0, 0, "start", source="fresh"), *run(range(1, 31), T0 + 1),
             line(T0 + 20, 0, "start", source="fresh"), *run(range(1, 5), T0 + 21)]
    m = faults.measure(evs(("p0", lines)), injected_at=T0 + 7, succeeded=True)
    assert (m["resumed_from"], m["steps_lost"]) == ("start", 30)
    assert m["recovery_s"] == pytest.approx(14.0, abs=0.01)


def test_checkpoint_is_disk_and_two_restores_add_up():
    lines = [line(T0, 0, "start", source="fresh"), *run(range(1, 21), T0 + 1),
             line(T0 + 10, 0, "resume", source="checkpoint", step=18), *run(range(19, 25), T0 + 11),
             line(T0 + 20, 0, "resume", source="local", step=23), *run(range(24, 30), T0 + 21)]
    m = faults.measure(evs(("p0", lines)), injected_at=T0 + 5.5, succeeded=True)
    assert m["resumed_from"] == "disk"
    assert m["steps_lost"] == (20 - 18) + (24 - 23)
    assert m["recovery_s"] == pytest.approx(21 - 5.5, abs=0.01)  # after the last restore


def test_no_restore_means_nothing_lost_only_when_the_job_succeeded():
    lines = [line(T0, 0, "start", source="fresh"), *run(range(1, 50), T0 + 1)]
    m = faults.measure(evs(("p0", lines)), T0 + 3, succeeded=True)
    assert (m["recovery_s"], m["steps_lost"], m["resumed_from"]) == (None, 0, None)
    assert faults.measure(evs(("p0", lines)), T0 + 3, succeeded=False)["steps_lost"] is None


def test_a_restore_ahead_of_every_logged_step_is_a_bug_not_clamped():
    lines = [line(T0, 0, "start", source="fresh"), *run(range(1, 10), T0 + 1),
             line(T0 + 10, 0, "resume", source="peer", step=12)]
    with pytest.raises(StepsLostError):
        faults.measure(evs(("p0", lines)), T0 + 3, succeeded=True)


def test_cri_log_lines_are_unwrapped():
    text = ("2026-12-01T05:20:32.602334809Z stdout F 2026-12-01T05:20:32.601Z ddp_trainer rank=0 event=step step=3\n"
            "2026-12-01T05:20:32.7Z stderr P part one \n2026-12-01T05:20:32.7Z stderr F and two\n")
    assert faults.cri_text(text) == ("2026-12-01T05:20:32.601Z ddp_trainer rank=0 event=step step=3\n"
                                     "part one and two\n")
    assert [e.int("step") for e in h.events(faults.cri_text(text))] == [3]


@pytest.mark.parametrize("fault,want", sorted(faults.EXPECTED_FAULT.items()))
def test_last_recovery_must_name_the_fault(fault, want):
    assert faults.wrong_fault(fault, {"lastRecovery": {"fault": want}}) is None
    assert "'Unknown'" in faults.wrong_fault(fault, {"lastRecovery": {"fault": "Unknown"}})
    assert "None" in faults.wrong_fault(fault, {})  # no lastRecovery at all: the user is told nothing


def test_a_fault_without_a_recovery_expects_no_last_recovery():
    assert faults.wrong_fault("apiserver_restart", {}) is None


def test_evict_all_every_pod_gone_resumes_from_the_disk_one_step_behind():
    """Both pods' lines, followed to their end (rank 1 completed step 31 as rank 0 wrote its SIGTERM checkpoint of
    30); the replacements resume from that checkpoint: one step lost, resumed from the disk."""
    pod0 = [line(T0, 0, "start", source="fresh"), *run(range(1, 31), T0 + 1),
            line(T0 + 7.0, 0, "checkpoint", step=30, reason="sigterm", highest_step=30)]
    pod1 = run(range(1, 32), T0 + 1, rank=1)
    new0 = [line(T0 + 20, 0, "resume", source="checkpoint", step=30), *run(range(31, 40), T0 + 21)]
    m = faults.measure(evs(("ev-0#-1", pod0), ("ev-1#-1", pod1), ("ev-0#0", new0)), injected_at=T0 + 6.9,
                       succeeded=True)
    assert (m["resumed_from"], m["steps_lost"]) == ("disk", 1)
    assert m["recovery_s"] == pytest.approx(21 - 6.9, abs=0.01)


GOOD_EVICTION = {"phase": "Succeeded", "restarts": 0, "disruptions": 2,
                 "lastRecovery": {"fault": "NodeDisrupted", "resumedFrom": "disk", "stepsLost": 1}}


@pytest.mark.parametrize("change,wrong", [
    ({"lastRecovery": {**GOOD_EVICTION["lastRecovery"], "resumedFrom": "start"}}, "'start', not 'disk'"),
    ({"lastRecovery": {**GOOD_EVICTION["lastRecovery"], "resumedFrom": "peer"}}, "'peer', not 'disk'"),
    ({"lastRecovery": {"fault": "NodeDisrupted", "resumedFrom": "disk"}}, "stepsLost is None"),  # no mark survived
    ({"lastRecovery": {**GOOD_EVICTION["lastRecovery"], "stepsLost": 2}}, "stepsLost is 2, not at most 1"),
    ({"lastRecovery": {**GOOD_EVICTION["lastRecovery"], "stepsLost": 0, "estimated": ["stepsLost"]}},
     "the operator's estimate"),  # no mark survived: the operator's lower bound is no proof
    ({"restarts": 1}, "spent a failure budget"),
    ({"infraRestarts": 1}, "spent a failure budget"),
    ({"disruptions": 1}, "disruptions 1 < 2"),
    ({"lastRecovery": None}, "resumedFrom is None"),
])
def test_evict_all_judges_what_the_status_tells_the_user(change, wrong):
    assert faults.evict_all_wrong(GOOD_EVICTION, 2) == []
    got = faults.evict_all_wrong({**GOOD_EVICTION, **change}, 2)
    assert len(got) >= 1 and any(wrong in w for w in got), got


def test_a_fault_is_survived_only_within_one_step_and_without_a_violation():
    assert faults.verdict(True, {}, 0) == (True, [])
    assert faults.verdict(True, {}, 1) == (True, [])
    assert faults.verdict(True, {}, 2) == (False, ["steps lost 2 (at most 1 allowed)"])
    assert faults.verdict(True, {}, None)[0] is False  # not measured: not shown to be within the goal
    assert faults.verdict(False, {}, 0)[0] is False
    assert faults.verdict(True, {"violations": ["status.restarts 1: the evictions spent backoffLimit"]}, 0) == \
        (False, ["status.restarts 1: the evictions spent backoffLimit"])
    assert faults.verdict(True, {}, 557, judge_steps=False) == (True, [])  # node_notready on one node
    assert faults.verdict(False, {"error": "job Failed"}, 3) == (False, ["job Failed"])  # the error says why


GOOD_OPERATOR_KILL = {"phase": "Succeeded", "restarts": 0, "infraRestarts": 1,
                      "lastRecovery": {"fault": "NodeFailed", "resumedFrom": "peer", "stepsLost": 0},
                      "goodput": {"ratio": 0.91, "recoveries": 1, "stepsLost": 0,
                                  "byFault": {"NodeFailed": {"recoveries": 1, "seconds": 10.4, "stepsLost": 0}}}}


@pytest.mark.parametrize("goodput,wrong", [
    ({**GOOD_OPERATOR_KILL["goodput"], "recoveries": 2,
      "byFault": {"NodeFailed": {"recoveries": 2, "seconds": 20.8, "stepsLost": 0}}}, "recoveries 2, not 1"),
    ({**GOOD_OPERATOR_KILL["goodput"], "recoveries": 0, "byFault": {}}, "recoveries 0, not 1"),
    ({"ratio": 0.9}, "recoveries None, not 1"),
    (None, "no status.goodput"),
])
def test_operator_kill_takes_the_one_incident_into_goodput_once(goodput, wrong):
    """A second operator derives status.goodput again: the one pod deleted must still be one recovery."""
    assert faults.operator_kill_wrong(GOOD_OPERATOR_KILL) == []
    got = faults.operator_kill_wrong({**GOOD_OPERATOR_KILL, "goodput": goodput})
    assert len(got) == 1 and wrong in got[0], got
    survived, why = faults.verdict(True, {"violations": got}, 0)
    assert not survived and why == got


def test_a_pod_the_killed_operator_never_recorded_may_be_named_missing_by_its_successor():
    missing = {"lastRecovery": {"fault": "NodeMissing"}}
    assert "'NodeMissing'" in faults.wrong_fault("operator_kill", missing)  # it had recorded the pod: NodeFailed only
    assert faults.wrong_fault("operator_kill", missing, unseen=True) is None
    assert faults.wrong_fault("operator_kill", {"lastRecovery": {"fault": "NodeFailed"}}, unseen=True) is None
    assert "'Unknown'" in faults.wrong_fault("operator_kill", {"lastRecovery": {"fault": "Unknown"}}, unseen=True)
