"""Hang detection (failurePolicy.hangTimeoutSeconds): hang.py's rules and plan/hang.py's."""

from ddp_operator import hang, names
from ddp_operator.plan import DELETE, plan

from ddp_builders import NOW, later, make_job, observed, rdzv, trainer

PODS = ("uid-a", "uid-b")


# --- when is a job hung -------------------------------------------------------------------------------------------
def test_poll_interval_is_short_enough_to_act_within_the_timeout_plus_ten_seconds():
    assert hang.poll_interval(30, 0) == 30  # off: the progress period
    assert hang.poll_interval(30, 20) == 2.0  # a tenth of the timeout...
    assert hang.poll_interval(30, 1800) == hang.MAX_POLL_SECONDS  # ...at most 5 s...
    assert hang.poll_interval(30, 3) == hang.MIN_POLL_SECONDS  # ...at least 1 s...
    assert hang.poll_interval(1, 1800) == 1  # ...never slower than asked for
    assert hang.poll_interval(0, 20) is None  # progressPeriodSeconds: 0 turns polling (and hang detection) off


def test_the_clock_runs_from_the_first_time_a_step_is_seen_and_restarts_when_it_changes():
    w = hang.watch(None, PODS, {"step": 5}, now=100.0)
    assert hang.due_in(w, PODS, 20, 110.0) == 10.0
    assert hang.watch(w, PODS, {"step": 5}, now=115.0) is w  # unchanged step: the clock keeps running
    assert hang.watch(w, PODS, None, now=118.0) is w  # a failed probe counts as "not advanced"
    assert hang.due_in(w, PODS, 20, 121.0) <= 0  # hung
    moved = hang.watch(w, PODS, {"step": 6}, now=121.0)
    assert hang.due_in(moved, PODS, 20, 121.0) == 20.0
    # an in-pod worker restart that resumes at the same step is a change too
    restarted = hang.watch(moved, PODS, {"step": 6, "workerRestarts": 1}, now=130.0)
    assert restarted.since == 130.0


def test_the_clock_waits_for_a_report_after_every_restart_and_is_off_at_zero():
    w = hang.watch(None, PODS, {"step": 5}, now=100.0)
    replaced = ("uid-a", "uid-c")
    assert hang.due_in(w, replaced, 20, 1000.0) is None  # the pods changed: not hung until they report
    assert hang.watch(w, replaced, None, now=1000.0) is None  # and nothing reported since
    assert hang.watch(w, replaced, {"step": 5}, now=1000.0).since == 1000.0
    assert hang.due_in(w, PODS, 0, 1000.0) is None  # off
    assert hang.due_in(None, PODS, 20, 1000.0) is None  # a script that never reports is never hung


def test_stuck_pod_is_the_silent_one_else_the_lowest_step_else_the_highest_index():
    r = lambda rank, step: {"rank": rank, "step": step}  # noqa: E731
    assert hang.stuck_pods([("j-0", 0, r(0, 40)), ("j-1", 1, None), ("j-2", 2, r(2, 40))]) == ["j-1"]
    assert hang.stuck_pods([("j-0", 0, None), ("j-1", 1, None), ("j-2", 2, r(2, 40))]) == ["j-0", "j-1"]
    assert hang.stuck_pods([("j-0", 0, r(0, 40)), ("j-1", 1, r(1, 39)), ("j-2", 2, r(2, 40))]) == ["j-1"]
    assert hang.stuck_pods([("j-1", 1, r(1, 40)), ("j-0", 0, r(0, 40))]) == ["j-1"]
    # a trainer that serves on rank 0 alone (no `rank`): the others' silence says nothing -> the highest index
    assert hang.stuck_pods([("j-0", 0, {"step": 40}), ("j-1", 1, None), ("j-2", 2, None)]) == ["j-2"]
    assert hang.stuck_pods([]) == []


# --- the planner's Hang rule ----------------------------------------------------------------------------------------
def _running(**failure_policy):
    job = make_job(failurePolicy={"hangTimeoutSeconds": 20, **failure_policy})
    first = plan(job, {}, observed(service_exists=False), NOW)
    return job, plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status


def test_a_hang_deletes_the_stuck_pod_records_an_attempt_and_restarts():
    job, status = _running()
    reports = {"uid-mnist-0-0": {"rank": 0, "step": 41}, "uid-mnist-1-0": None}
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1), hang_reports=reports), later(30))
    assert [(a.verb, a.name) for a in p.actions] == [(DELETE, "mnist-1")]
    # a stopped process cannot act on SIGTERM: the pod is not given its whole grace period
    assert p.actions[0].grace_seconds == names.HANG_DELETE_GRACE_SECONDS
    assert p.status["phase"] == names.PHASE_RESTARTING and p.status["reason"] == names.REASON_HANG
    last = p.status["attempts"][-1]
    assert last["pod"] == "mnist-1" and last["reason"] == names.REASON_HANG and last["counted"] is True
    assert p.status["restarts"] == 1
    assert ("Warning", names.REASON_HANG) in [(e.type, e.reason) for e in p.events]
    assert p.status["lastIncident"] == {"reason": names.REASON_HANG, "time": "2025-01-01T12:00:30Z",
                                        "budget": "backoffLimit"}
    assert (p.status["lastFailure"]["class"], p.status["lastFailure"]["budget"]) == ("Hang", "backoffLimit")
    # the deleted pod, seen again while it terminates and once it failed, is not recorded twice
    deleting = observed(rdzv(), trainer(0), trainer(1, deleting_since=later(31)))
    again = plan(job, p.status, deleting, later(31))
    assert again.actions == () and again.status["restarts"] == 1 and len(again.status["attempts"]) == 1
    assert again.status["phase"] == names.PHASE_RESTARTING and again.status["reason"] == names.REASON_HANG
    failed = plan(job, again.status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=137)),
                  later(40))
    assert failed.status["restarts"] == 1 and len(failed.status["attempts"]) == 1
    # replaced and running again: recovered, the incident kept for lastRecovery
    back = plan(job, failed.status, observed(rdzv(), trainer(0), trainer(1, uid="new")), later(50))
    assert back.status["phase"] == names.PHASE_RUNNING
    assert back.status["lastIncident"]["reason"] == names.REASON_HANG


def test_no_hang_action_unless_running_with_every_pod_running_and_detection_on():
    job, status = _running()
    reports = {"uid-mnist-0-0": {"rank": 0, "step": 41}, "uid-mnist-1-0": None}
    one_pending = observed(rdzv(), trainer(0), trainer(1, phase="Pending"), hang_reports=reports)
    assert plan(job, status, one_pending, later(30)).actions == ()
    restarting = {**status, "phase": names.PHASE_RESTARTING}
    assert plan(job, restarting, observed(rdzv(), trainer(0), trainer(1), hang_reports=reports),
                later(30)).actions == ()
    off, off_status = _running(hangTimeoutSeconds=0)
    assert plan(off, off_status, observed(rdzv(), trainer(0), trainer(1), hang_reports=reports),
                later(30)).actions == ()
    # without reports (every ordinary pass) nothing happens
    assert plan(job, status, observed(rdzv(), trainer(0), trainer(1)), later(30)).actions == ()


def test_a_hang_over_the_budget_fails_the_job():
    job, status = _running(backoffLimit=0)
    reports = {"uid-mnist-0-0": {"rank": 0, "step": 41}, "uid-mnist-1-0": {"rank": 1, "step": 40}}
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1), hang_reports=reports), later(30))
    assert p.status["phase"] == names.PHASE_FAILED and p.status["reason"] == names.REASON_BACKOFF_LIMIT
    assert p.status["attempts"][-1]["reason"] == names.REASON_HANG


def test_default_hang_timeout_is_torchs_collective_timeout():
    assert make_job().spec.failure_policy.hang_timeout_seconds == 1800


def test_last_recovery_from_rank0s_final_report_and_left_out_for_plain_scripts():
    import json

    job, status = _running()
    status = {**status, "lastIncident": {"reason": names.REASON_NODE_FAILED, "time": "2025-01-01T12:01:35Z"}}
    final = {"rank": 0, "step": 90, "final": True, "workerRestarts": 1,
             "recovery": {"resumedFrom": "peer", "step": 50, "highestStep": 51, "stepsLost": 1,
                          "restoredFromPod": "mnist-0", "seconds": 10.0, "at": 1735732900.0}}
    done = observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0, message=json.dumps(final)),
                    trainer(1, phase="Succeeded", exit_code=0))
    p = plan(job, status, done, later(200))
    assert p.status["phase"] == names.PHASE_SUCCEEDED
    assert p.status["lastRecovery"] == {"fault": names.REASON_NODE_FAILED, "startedAt": "2025-01-01T12:01:35Z",
                                        "seconds": 10.0, "stepsLost": 1, "resumedFrom": "peer",
                                        "restoredFromPod": "mnist-0"}
    # a plain script that reports nothing: no lastRecovery at all
    plain = observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0), trainer(1, phase="Succeeded", exit_code=0))
    assert "lastRecovery" not in plan(job, status, plain, later(200)).status


# --- a newer step from any pod; reports keyed by pod UID -----------------------------------------------------------
def test_a_newer_step_from_any_pod_resets_the_clock_and_nothing_else_does():
    w = hang.watch(None, PODS, {"rank": 0, "step": 40}, now=100.0, others=[{"rank": 1, "step": 40}])
    # rank 0 unreachable from the operator, pod 1 trained on: not hung
    moved = hang.watch(w, PODS, None, now=115.0, others=[None, {"rank": 1, "step": 41}])
    assert moved.since == 115.0 and hang.due_in(moved, PODS, 20, 121.0) > 0
    # the same step again, a lower one, a pod that flaps between answering and not: the clock keeps running
    for others in ([{"rank": 1, "step": 41}], [{"rank": 1, "step": 39}], [None], []):
        assert hang.watch(moved, PODS, None, now=130.0, others=others).since == 115.0
    # a worker restart anywhere (resuming from an earlier step) is a change too
    assert hang.watch(moved, PODS, None, now=131.0, others=[{"rank": 1, "step": 30, "workerRestarts": 1}]).since == 131.0
    # hostile steps are no step at all
    for junk in ("42", [42], float("nan"), float("inf"), True):
        assert hang.watch(moved, PODS, None, now=132.0, others=[{"rank": 1, "step": junk}]).since == 115.0
    # nothing at all answered: nothing changes (and before any report there is no clock)
    assert hang.watch(None, PODS, None, now=1.0, others=[None]) is None


def test_hang_reports_are_keyed_by_pod_uid_a_replacement_never_inherits_them():
    job, status = _running()
    reports = {"uid-mnist-0-0": {"rank": 0, "step": 41}, "uid-mnist-1-0": None}
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1), hang_reports=reports), later(30))
    assert [(a.verb, a.name) for a in p.actions] == [(DELETE, "mnist-1")]
    # mnist-1 was replaced (same name, new UID) between the probes and the pass: the reports are of other pods
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, uid="replacement"), hang_reports=reports),
             later(30))
    assert p.actions == () and p.status["restarts"] == 0
