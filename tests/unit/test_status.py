"""observed.observe_pod and status helpers: what a pod means, conditions, Events, progress."""

import json

import pytest

from ddp_operator import names
from ddp_operator.observed import observe_pod
from ddp_operator.status import condition_events, progress_status, progress_summary, set_condition

from ddp_builders import pod, rdzv, trainer

SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : 7 (pid: 90)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 3 (pid: 89)
"""


def test_trainer_pod_fields():
    s = observe_pod(trainer(1, phase="Failed", exit_code=1, message=SUMMARY, node="n2"))
    assert (s.name, s.index, s.role, s.group, s.node) == ("mnist-1", 1, "trainer", 0, "n2")
    assert s.terminal and not s.active and not s.running and not s.succeeded
    assert s.exit_code == 1 and s.worker_exit_codes == (7, 3) and s.exit_codes == (1, 7, 3)


def test_disruption_from_condition_or_reason():
    assert observe_pod(trainer(0, phase="Failed", disruption="PreemptionByScheduler")).disruption == \
        "PreemptionByScheduler"
    assert observe_pod(trainer(0, phase="Failed", status_reason="Evicted")).disruption == "Evicted"
    assert observe_pod(trainer(0, phase="Failed", exit_code=137, reason="OOMKilled")).disruption is None


def test_final_report_and_tombstone():
    s = observe_pod(trainer(0, phase="Succeeded", exit_code=0, message='{"step": 3, "final": true}'))
    assert s.succeeded and s.final_report == {"step": 3, "final": True}
    assert observe_pod(trainer(0, phase="Succeeded", exit_code=0, message="bye")).final_report is None
    gone = observe_pod(trainer(0), gone=True)
    assert gone.phase == "Gone" and gone.terminal and gone.reason == "Deleted"
    assert gone.gone and not observe_pod(trainer(0)).gone
    # A pod that ended before it was deleted keeps its exit; `gone` still says it no longer exists.
    failed = observe_pod(trainer(0, phase="Failed", exit_code=1), gone=True)
    assert failed.gone and failed.phase == "Failed" and failed.exit_code == 1 and not failed.active


def test_store_pod_role():
    s = observe_pod(rdzv(group=2))
    assert s.role == names.ROLE_RDZV and s.index is None and s.group == 2


def test_unlabelled_index_is_none():
    assert observe_pod(pod("x")).index is None


def test_conditions_keep_transition_time_and_emit_events_on_change():
    c1 = set_condition([], "Running", True, "AllNodesRunning", "2/2", "t1", 1)
    c2 = set_condition(c1, "Running", True, "AllNodesRunning", "still 2/2", "t2", 2)
    assert c2[0]["lastTransitionTime"] == "t1" and c2[0]["observedGeneration"] == 2
    assert condition_events(c1, c2) == []
    c3 = set_condition(c2, "Running", False, "NodeFailed", "1/2", "t3", 2)
    assert c3[0]["lastTransitionTime"] == "t3"
    assert [(e.type, e.reason) for e in condition_events(c2, c3)] == [("Normal", "NodeFailed")]
    c4 = set_condition(c3, "Failed", True, "BackoffLimitExceeded", "x", "t4", 2)
    assert [c["type"] for c in c4] == ["Running", "Failed"]
    assert [(e.type, e.reason) for e in condition_events(c3, c4)] == [("Warning", "BackoffLimitExceeded")]


def test_new_false_condition_is_not_an_event():
    assert condition_events([], set_condition([], "Restarting", False, "AllNodesRunning", "", "t", 1)) == []


def test_progress_status_keeps_known_fields():
    report = {"step": 120, "epoch": 2, "loss": 0.41234, "samplesPerSecond": 512.5, "lastCheckpointStep": None,
              "worldSize": 4, "metrics": {"testAccuracy": 0.97}, "time": 1.5, "junk": "x"}
    out = progress_status(report)
    assert "junk" not in out and "lastCheckpointStep" not in out
    assert out["summary"] == "step 120 epoch 2 loss 0.4123 testAccuracy 0.97"
    assert progress_summary({"final": True}) == "final"


def test_progress_status_shows_the_snapshot_interval_that_bounds_the_steps_lost():
    out = progress_status({"step": 120, "snapshotEvery": 3, "lastSnapshotStep": 120.0, "snapshotResident": True})
    assert out["snapshotEvery"] == 3 and out["lastSnapshotStep"] == 120 and out["snapshotResident"] is True
    assert "snapshotResident" not in progress_status({"step": 1, "snapshotResident": "yes"})  # only a boolean


def test_progress_status_drops_non_finite_numbers():
    import json
    report = {"step": 3, "loss": float("nan"), "samplesPerSecond": float("inf"), "time": float("-inf"),
              "metrics": {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 0.5, "e": float("nan")}},
              "epoch": float("inf")}
    out = progress_status(report)
    json.dumps(out, allow_nan=False)
    assert out["step"] == 3 and "loss" not in out and "epoch" not in out and "time" not in out
    assert out["metrics"] == {"b": [1.0, None], "c": {"d": 0.5}}
    assert "nan" not in out["summary"] and "inf" not in out["summary"]


def test_newer_progress_never_goes_backwards():
    from ddp_operator.status import newer_progress
    assert newer_progress({"step": 61}, {"step": 54}) == {"step": 61}
    assert newer_progress({"step": 54}, {"step": 61}) == {"step": 61}
    assert newer_progress(None, {"step": 1}) == {"step": 1}
    assert newer_progress({"step": 5}, {"step": 5, "loss": 0.1}) == {"step": 5, "loss": 0.1}
    assert newer_progress({"step": 5}, {"summary": "final", "final": True})["step"] == 5


# --- status.lastRecovery / status.lastIncident ------------------------------------------------------------------
def _report(**recovery):
    rec = {"resumedFrom": "peer", "step": 50, "highestStep": 51, "stepsLost": 1, "restoredFromPod": "job-0",
           "seconds": 10.0, "at": 1735732900.0}  # 12:01:40Z; the last step before the fault at 12:01:30Z
    rec.update(recovery)
    return {"rank": 0, "step": 55, "workerRestarts": 0, "recovery": rec}


def test_last_recovery_takes_the_fault_from_the_incident_the_operator_recorded_for_it():
    from ddp_operator.status import last_recovery

    incident = {"reason": names.REASON_HANG, "time": "2025-01-01T12:01:35Z"}
    assert last_recovery(None, incident, _report()) == {
        "fault": names.REASON_HANG, "startedAt": "2025-01-01T12:01:35Z", "seconds": 10.0, "stepsLost": 1,
        "resumedFrom": "peer", "restoredFromPod": "job-0"}
    # an older incident is another recovery's: torchrun restarted the workers in place
    old = {"reason": names.REASON_NODE_FAILED, "time": "2025-01-01T11:00:00Z"}
    worker = last_recovery(None, old, {**_report(), "workerRestarts": 2})
    assert worker["fault"] == names.FAULT_WORKER_RESTART and worker["startedAt"] == "2025-01-01T12:01:30Z"
    assert last_recovery(None, old, _report())["fault"] == names.FAULT_UNKNOWN
    # never clamped
    assert last_recovery(None, incident, _report(stepsLost=-1))["stepsLost"] == -1


def test_last_recovery_is_left_alone_without_a_complete_recovery_report():
    from ddp_operator.status import last_recovery

    prev = {"fault": "NodeFailed", "resumedFrom": "peer"}
    assert last_recovery(prev, None, {"step": 5}) is prev  # a plain script / an older trainer
    assert last_recovery(None, None, None) is None
    assert last_recovery(prev, None, _report(at=None, seconds=None)) is prev  # first resumed step not done yet
    assert last_recovery(prev, None, _report(resumedFrom="elsewhere")) is prev
    # unknown figures (no high-water mark survived) are left out
    out = last_recovery(None, None, _report(seconds=None, stepsLost=None, highestStep=None, resumedFrom="disk",
                                            restoredFromPod=None))
    assert out == {"fault": names.FAULT_UNKNOWN, "resumedFrom": "disk"}
    # idempotent
    assert last_recovery(out, None, _report(seconds=None, stepsLost=None, highestStep=None, resumedFrom="disk",
                                            restoredFromPod=None)) == out


# A start-over the trainer could not measure (every pod lost, no checkpoint volume: no high-water mark survived).
# The last progress the operator wrote before the fault: step 300 at 12:01:30Z; the incident at 12:01:35Z; the first
# step of the new run (from step 0) at 12:02:30Z.
SEEN = {"step": 300, "time": 1735732890.0}
INCIDENT = {"reason": names.REASON_NODE_FAILED, "time": "2025-01-01T12:01:35Z"}


def _start_over(**recovery):
    rec = {"resumedFrom": "start", "step": 0, "at": 1735732950.0, **recovery}
    return {"rank": 0, "step": 1, "workerRestarts": 0, "recovery": rec}


def test_a_start_over_the_trainer_could_not_measure_is_estimated_by_the_operator():
    from ddp_operator.status import last_recovery

    out = last_recovery(None, INCIDENT, _start_over(), SEEN)
    assert out == {"fault": names.REASON_NODE_FAILED, "startedAt": "2025-01-01T12:01:35Z", "seconds": 55.0,
                   "stepsLost": 300, "resumedFrom": "start", "estimated": ["seconds", "stepsLost"]}
    # a resume from a checkpoint below the step seen (no mark survived): the steps since that checkpoint
    disk = last_recovery(None, INCIDENT, _start_over(resumedFrom="disk", step=250), SEEN)
    assert disk["stepsLost"] == 50 and disk["estimated"] == ["seconds", "stepsLost"]
    # a figure the trainer measured is its own; only the missing one is estimated
    own = last_recovery(None, INCIDENT, _start_over(seconds=70.0), SEEN)
    assert (own["seconds"], own["stepsLost"], own["estimated"]) == (70.0, 300, ["stepsLost"])
    measured = last_recovery(None, INCIDENT, _start_over(seconds=70.0, stepsLost=305, highestStep=305), SEEN)
    assert "estimated" not in measured and measured["stepsLost"] == 305


def test_the_estimate_is_kept_when_progress_moves_on():
    """Level-based: later polls (the new run at step 20, then past the old step) and the pass leave it as it was."""
    from ddp_operator.status import last_recovery

    first = last_recovery(None, INCIDENT, _start_over(), SEEN)
    for later in ({"step": 20, "time": 1735732970.0}, {"step": 320, "time": 1735733300.0}, SEEN, None):
        report = {**_start_over(), "step": later["step"] if later else 5}
        assert last_recovery(first, INCIDENT, report, later) is first
    # progress written after the resume (the operator first saw the record late) is no step before the fault
    late = last_recovery(None, INCIDENT, _start_over(), {"step": 320, "time": 1735733300.0})
    assert (late["seconds"], late.get("stepsLost"), late["estimated"]) == (55.0, None, ["seconds"])


@pytest.mark.parametrize("step", [-1, True, False, 10 ** 30, 2 ** 53 + 1, "300", float("nan"), None, [300]])
def test_a_garbage_progress_step_is_no_estimate(step):
    from ddp_operator.status import last_recovery

    out = last_recovery(None, INCIDENT, _start_over(), {"step": step, "time": SEEN["time"]})
    assert "stepsLost" not in out and out["estimated"] == ["seconds"]
    json.dumps(out, allow_nan=False)


@pytest.mark.parametrize("progress", [{"step": 300, "time": t} for t in (-1.0, 1e300, "x", True, float("nan"))]
                         + [{"step": 300}, "junk", [300]])
def test_a_garbage_progress_time_is_no_estimate(progress):
    from ddp_operator.status import last_recovery

    out = last_recovery(None, INCIDENT, _start_over(), progress)
    assert "stepsLost" not in out and out["estimated"] == ["seconds"]


def test_no_estimate_from_what_an_earlier_recovery_already_holds():
    from ddp_operator.status import last_recovery

    # No incident recorded: the operator saw no fault of its own and estimates nothing (as before).
    assert last_recovery(None, None, _start_over(), SEEN) == {"fault": names.FAULT_UNKNOWN, "resumedFrom": "start"}
    # The incident is the previous recovery's (it ended at 12:01:45Z): not this one's start.
    prev = {"fault": names.REASON_NODE_FAILED, "startedAt": "2025-01-01T12:01:35Z", "seconds": 10.0,
            "stepsLost": 1, "resumedFrom": "peer"}
    assert "estimated" not in last_recovery(prev, INCIDENT, _start_over(), SEEN)
    # A new incident, but the progress shown is from before the previous recovery (the run that started over failed
    # again before it passed that step): those steps were that recovery's.
    second = {"reason": names.REASON_HANG, "time": "2025-01-01T12:02:10Z"}
    prev = {"fault": names.REASON_NODE_FAILED, "startedAt": "2025-01-01T12:00:00Z", "seconds": 30.0,
            "stepsLost": 300, "resumedFrom": "start", "estimated": ["seconds", "stepsLost"]}
    out = last_recovery(prev, second, _start_over(), {"step": 300, "time": 1735732790.0})  # 11:59:50Z
    assert (out["startedAt"], out["seconds"], out.get("stepsLost")) == ("2025-01-01T12:02:10Z", 20.0, None)


def test_incident_record_keeps_the_first_reason_within_the_window():
    from datetime import datetime, timezone

    from ddp_operator.status import incident_record

    t0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    first = incident_record(None, names.REASON_HANG, t0, 20)
    assert first == {"reason": names.REASON_HANG, "time": "2025-01-01T12:00:00Z"}
    same = incident_record(first, names.REASON_NODE_FAILED, t0.replace(second=10), 20)
    assert same == first
    later = incident_record(first, names.REASON_NODE_FAILED, t0.replace(minute=5), 20)
    assert later == {"reason": names.REASON_NODE_FAILED, "time": "2025-01-01T12:05:00Z"}


def test_progress_status_keeps_worker_restarts():
    assert progress_status({"step": 3, "workerRestarts": 2, "rank": 0})["workerRestarts"] == 2
