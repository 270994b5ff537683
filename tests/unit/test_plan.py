"""plan.plan: tables of observed situations -> status, actions and Events."""

from ddp_operator import names
from ddp_operator.plan import CREATE, DELETE, DELETE_JOB, FORCE_DELETE, PATCH, plan

from ddp_builders import NOW, later, make_job, observed, rdzv, trainer


def _acts(p):
    return sorted((a.verb, a.name) for a in p.actions)


def _running(job=None, n=2, **kw):
    """Status after a healthy start: everything created and running."""
    job = job or make_job(**kw)
    first = plan(job, {}, observed(service_exists=False), NOW)
    return job, plan(job, first.status, observed(rdzv(), *(trainer(i) for i in range(n))), NOW).status


def test_fresh_job_creates_service_store_and_pods():
    p = plan(make_job(), {}, observed(service_exists=False), NOW)
    assert _acts(p) == [(CREATE, "mnist"), (CREATE, "mnist-0"), (CREATE, "mnist-1"), (CREATE, "mnist-rdzv")]
    assert p.status["phase"] == "Pending"
    assert p.status["startTime"] == "2025-01-01T12:00:00Z"
    assert [e.reason for e in p.events] == [names.REASON_CREATED]
    assert p.status["rendezvousId"] == "0b5c-uid-0"


def test_nothing_to_do_when_children_exist():
    job = make_job()
    first = plan(job, {}, observed(service_exists=False), NOW)
    pending = observed(rdzv(phase="Pending"), trainer(0, phase="Pending"), trainer(1, phase="Pending"))
    p = plan(job, first.status, pending, later(1))
    assert p.actions == () and p.events == ()
    assert p.status["nodes"]["active"] == 2 and p.status["phase"] == "Pending"
    again = plan(job, p.status, pending, later(2))
    assert again.status == p.status and again.actions == ()


def test_all_running_is_running_and_stable():
    job, status = _running()
    assert status["phase"] == "Running" and status["nodesReady"] == "2/2"
    again = plan(job, status, observed(rdzv(), trainer(0), trainer(1)), later(60))
    assert again.status == status and again.actions == () and again.events == ()


def test_failed_pod_is_recorded_deleted_and_counted_once():
    job, status = _running()
    obs = observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1))
    p = plan(job, status, obs, later(10))
    assert _acts(p) == [(DELETE, "mnist-1")]
    assert p.status["restarts"] == 1 and p.status["phase"] == "Restarting"
    assert p.status["attempts"][-1]["pod"] == "mnist-1" and p.status["attempts"][-1]["counted"] is True
    assert sorted((e.type, e.reason) for e in p.events) == [("Normal", names.REASON_NODE_FAILED),
                                                             ("Warning", names.REASON_NODE_FAILED)]
    # The same failed pod seen again (delete still in flight) is not counted twice.
    again = plan(job, p.status, obs, later(11))
    assert again.status["restarts"] == 1 and len(again.status["attempts"]) == 1
    # Gone -> recreated under the same name; back to Running reports the recovery time.
    gone = plan(job, again.status, observed(rdzv(), trainer(0)), later(12))
    assert _acts(gone) == [(CREATE, "mnist-1")]
    back = plan(job, gone.status, observed(rdzv(), trainer(0), trainer(1, uid="new")), later(20))
    assert back.status["phase"] == "Running" and back.recovery_seconds == 10.0
    assert "recoveryStartTime" not in back.status


def test_survivor_crash_in_the_same_incident_counts_once():
    job, status = _running()
    p1 = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1)), later(10))
    p2 = plan(job, p1.status, observed(rdzv(), trainer(0, phase="Failed", exit_code=1)), later(20))
    assert p2.status["restarts"] == 1
    assert p2.status["attempts"][-1]["counted"] is False
    p3 = plan(job, p2.status, observed(rdzv(), trainer(0, phase="Failed", exit_code=1, uid="x2")), later(200))
    assert p3.status["restarts"] == 2


def test_budget_exhaustion_fails_and_stops_pods():
    job, status = _running(failurePolicy={"backoffLimit": 1, "incidentWindowSeconds": 0})
    p1 = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1)), later(1))
    assert p1.status["restarts"] == 1 and p1.status["phase"] == "Restarting"
    p2 = plan(job, p1.status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1, uid="b")),
              later(2))
    assert p2.status["phase"] == "Failed" and p2.status["reason"] == names.REASON_BACKOFF_LIMIT
    assert "spec.failurePolicy.backoffLimit=1" in p2.status["message"]
    assert _acts(p2) == [(DELETE, "mnist-0"), (DELETE, "mnist-rdzv")]
    assert p2.status["completionTime"] == "2025-01-01T12:00:02Z"
    assert ("Warning", names.REASON_BACKOFF_LIMIT) in [(e.type, e.reason) for e in p2.events]


def test_permanent_exit_code_fails_at_once():
    job, status = _running(failurePolicy={"permanentExitCodes": [3]})
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=3)), later(1))
    assert p.status["phase"] == "Failed" and p.status["reason"] == names.REASON_PERMANENT_EXIT
    assert "exit code 3" in p.status["message"] and "permanentExitCodes" in p.status["message"]
    assert p.status["restarts"] == 0


def test_worker_exit_code_from_torchrun_summary_is_permanent():
    job, status = _running(failurePolicy={"permanentExitCodes": [3]})
    summary = "ChildFailedError\n[0]:\n  time      : 2025\n  rank      : 1\n  exitcode  : 3 (pid: 81)\n"
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1, message=summary)),
             later(1))
    assert p.status["reason"] == names.REASON_PERMANENT_EXIT
    assert "worker exit codes 3" in p.status["message"]


def test_retryable_exit_codes_make_others_permanent():
    job, status = _running(failurePolicy={"retryableExitCodes": [1]})
    ok = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1)), later(1))
    assert ok.status["phase"] == "Restarting"
    bad = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=2)), later(1))
    assert bad.status["phase"] == "Failed" and "retryableExitCodes" in bad.status["message"]


def test_eviction_does_not_count():
    job, status = _running()
    for evicted in (trainer(1, phase="Failed", status_reason="Evicted"),
                    trainer(1, phase="Failed", exit_code=137, disruption="PreemptionByScheduler")):
        p = plan(job, status, observed(rdzv(), trainer(0), evicted), later(1))
        assert p.status["restarts"] == 0 and p.status["disruptions"] == 1
        assert p.status["attempts"][-1]["disruption"] is True
        assert _acts(p) == [(DELETE, "mnist-1")]
        assert p.status["reason"] == names.REASON_NODE_DISRUPTED


def test_eviction_counts_when_asked():
    job, status = _running(failurePolicy={"countDisruptions": True})
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", status_reason="Evicted")), later(1))
    assert p.status["restarts"] == 1


def test_rdzv_loss_recreates_the_store_and_leaves_the_trainers_alone():
    job, status = _running()
    p = plan(job, status, observed(rdzv(phase="Failed", exit_code=137), trainer(0), trainer(1)), later(5))
    # No whole-group restart: same group, same rendezvous id, trainer pods untouched; the dead store is deleted.
    assert p.status["group"] == 0 and p.status["rendezvousId"] == "0b5c-uid-0"
    assert _acts(p) == [(DELETE, "mnist-rdzv")]
    # A lost store is the infrastructure's: it spends infraBackoffLimit, never backoffLimit.
    assert p.status["infraRestarts"] == 1 and p.status["restarts"] == 0
    assert p.status["reason"] == names.REASON_RDZV_LOST and p.status["phase"] == "Restarting"
    assert p.status["lastFailure"]["class"] == "Infrastructure"
    assert p.status["attempts"][-1]["reason"] == names.REASON_RDZV_LOST
    assert ("Warning", names.REASON_RDZV_LOST) in [(e.type, e.reason) for e in p.events]
    # Seen again while its delete is in flight: recorded once, nothing else happens.
    p2 = plan(job, p.status, observed(rdzv(phase="Failed", exit_code=137, deleting_since=later(5)),
                                      trainer(0), trainer(1)), later(6))
    assert p2.status["infraRestarts"] == 1 and len(p2.status["attempts"]) == 1
    assert [a for a in p2.actions if a.verb != FORCE_DELETE] == []
    # Gone: recreated under the same name with the same group; the trainers are still not touched.
    p3 = plan(job, p2.status, observed(trainer(0), trainer(1)), later(8))
    assert _acts(p3) == [(CREATE, "mnist-rdzv")]
    assert p3.actions[0].body["metadata"]["labels"][names.LABEL_GROUP] == "0"
    assert p3.status["phase"] == "Restarting"  # the recovery ends when the new store is up and trainers run
    # The trainers' agents fail on the lost store: their containers restart in place, the same incident.
    store_new = rdzv(phase="Pending", uid="store-2")
    p4 = plan(job, p3.status, observed(store_new,
                                       trainer(0, restart_count=1, last_exit_code=1, waiting="PodInitializing"),
                                       trainer(1, phase="Running", exit_code=1)), later(9))
    assert p4.status["infraRestarts"] == 1 and p4.actions == ()
    assert [a.get("restartCount") for a in p4.status["attempts"]] == [None, 1, 1]
    assert [a["counted"] for a in p4.status["attempts"]] == [True, False, False]
    # Even outside the incident window: restarts while the store is not up are consequences of its loss.
    p5 = plan(job, p4.status, observed(store_new, trainer(0, restart_count=2, last_exit_code=1),
                                       trainer(1, restart_count=1, last_exit_code=1)), later(100))
    assert p5.status["infraRestarts"] == 1 and len(p5.status["attempts"]) == 4
    # The new store up and both trainers running: recovered.
    back = plan(job, p5.status, observed(rdzv(uid="store-2"), trainer(0, restart_count=2, last_exit_code=1),
                                         trainer(1, restart_count=1, last_exit_code=1)), later(101))
    assert back.status["phase"] == "Running" and back.recovery_seconds == 96.0 and back.actions == ()
    assert back.status["infraRestarts"] == 1 and back.status["group"] == 0


def test_deleted_store_pod_is_recreated_without_a_group_bump():
    job, status = _running()
    p = plan(job, status, observed(rdzv(deleting_since=later(1)), trainer(0), trainer(1)), later(1))
    assert p.status["group"] == 0 and p.status["reason"] == names.REASON_RDZV_LOST and p.actions == ()
    gone = plan(job, p.status, observed(trainer(0), trainer(1), gone=[rdzv()]), later(2))
    assert _acts(gone) == [(CREATE, "mnist-rdzv")] and gone.status["infraRestarts"] == 1


def test_in_place_restart_is_recorded_once_and_counted():
    job, status = _running()
    # The container failed; the kubelet restarts it (state terminated, restartCount not moved yet).
    failing = observed(rdzv(), trainer(0), trainer(1, phase="Running", exit_code=137, reason="Error"))
    p = plan(job, status, failing, later(10))
    # 137 with no traceback: killed from outside (the infrastructure's budget).
    assert p.actions == () and p.status["infraRestarts"] == 1 and p.status["phase"] == "Restarting"
    assert p.status["restarts"] == 0
    att = p.status["attempts"][-1]
    assert (att["pod"], att["exitCode"], att["restartCount"], att["counted"]) == ("mnist-1", 137, 1, True)
    assert p.status["recordedPods"] == ["uid-mnist-1-0/1"]
    assert p.status["reason"] == names.REASON_RESTARTED_IN_PLACE
    messages = [e.message for e in p.events if e.reason == names.REASON_RESTARTED_IN_PLACE]
    assert messages and "trainer container of pod mnist-1 exited 137 and was restarted in place" in messages[0]
    # The same failure seen after the restart (restartCount 1, lastState): not recorded again.
    restarted = observed(rdzv(), trainer(0), trainer(1, restart_count=1, last_exit_code=137))
    again = plan(job, p.status, restarted, later(11))
    assert again.status["infraRestarts"] == 1 and len(again.status["attempts"]) == 1 and again.actions == ()
    assert again.status["phase"] == "Running" and again.recovery_seconds == 1.0
    # A restarted operator (status only, no memory) does not count it again either.
    assert plan(job, again.status, restarted, later(12)).status["infraRestarts"] == 1
    # A second failure of the same container, later: a new incident.
    second = plan(job, again.status, observed(rdzv(), trainer(0), trainer(1, restart_count=2, last_exit_code=1)),
                  later(100))
    # ... exit 1 without a traceback: the user's code, backoffLimit's budget.
    assert (second.status["restarts"], second.status["infraRestarts"]) == (1, 1)
    assert second.status["recordedPods"] == ["uid-mnist-1-0/2"]
    assert [a["restartCount"] for a in second.status["attempts"]] == [1, 2]


def test_in_place_restarts_follow_the_incident_rules():
    job, status = _running()
    p1 = plan(job, status, observed(rdzv(), trainer(0), trainer(1, restart_count=1, last_exit_code=137)), later(10))
    # The survivor's agent gives up a few seconds later: same incident, not counted.
    p2 = plan(job, p1.status, observed(rdzv(), trainer(0, restart_count=1, last_exit_code=1),
                                       trainer(1, restart_count=1, last_exit_code=137)), later(15))
    assert p2.status["infraRestarts"] == 1 and p2.status["attempts"][-1]["counted"] is False


def test_in_place_restarts_exhaust_the_backoff_limit_and_stop_the_pods():
    job, status = _running(failurePolicy={"backoffLimit": 1, "incidentWindowSeconds": 0})
    p1 = plan(job, status, observed(rdzv(), trainer(0), trainer(1, restart_count=1, last_exit_code=1)), later(1))
    assert p1.status["restarts"] == 1 and p1.status["phase"] == "Running"
    p2 = plan(job, p1.status, observed(rdzv(), trainer(0), trainer(1, restart_count=2, last_exit_code=1)), later(2))
    assert p2.status["phase"] == "Failed" and p2.status["reason"] == names.REASON_BACKOFF_LIMIT
    assert "restarted in place" in p2.status["message"]
    assert _acts(p2) == [(DELETE, "mnist-0"), (DELETE, "mnist-1"), (DELETE, "mnist-rdzv")]


def test_permanent_exit_code_on_an_in_place_restart_fails_the_job():
    job, status = _running(failurePolicy={"permanentExitCodes": [3]})
    summary = "ChildFailedError\n  rank      : 1\n  exitcode  : 3 (pid: 81)\n"
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, restart_count=1, last_exit_code=1,
                                                                last_message=summary)), later(1))
    assert p.status["phase"] == "Failed" and p.status["reason"] == names.REASON_PERMANENT_EXIT
    assert "worker exit codes 3" in p.status["message"] and "restarted in place" in p.status["message"]
    assert _acts(p) == [(DELETE, "mnist-0"), (DELETE, "mnist-1"), (DELETE, "mnist-rdzv")]
    assert p.status["attempts"][-1]["restartCount"] == 1


def test_restarts_missed_while_the_operator_was_down_are_recorded_once():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, restart_count=3, last_exit_code=1)), later(1))
    assert p.status["restarts"] == 1 and len(p.status["attempts"]) == 1
    assert p.status["attempts"][-1]["restartCount"] == 3
    assert any("2 earlier restart(s) not observed" in e.message for e in p.events)
    assert plan(job, p.status, observed(rdzv(), trainer(0), trainer(1, restart_count=3, last_exit_code=1)),
                later(2)).status["restarts"] == 1


def test_crash_looping_container_is_not_running():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, restart_count=1, last_exit_code=1,
                                                                waiting="CrashLoopBackOff")), later(1))
    assert p.status["phase"] == "Restarting" and p.status["nodes"]["running"] == 1 and p.actions == ()


def test_pod_ending_after_an_in_place_restart_is_replaced_and_recorded_apart():
    job, status = _running(failurePolicy={"incidentWindowSeconds": 0})
    p1 = plan(job, status, observed(rdzv(), trainer(0), trainer(1, restart_count=1, last_exit_code=1)), later(1))
    evicted = trainer(1, phase="Failed", status_reason="Evicted", restart_count=1, last_exit_code=1)
    p2 = plan(job, p1.status, observed(rdzv(), trainer(0), evicted), later(2))
    assert _acts(p2) == [(DELETE, "mnist-1")] and p2.status["disruptions"] == 1
    assert len(p2.status["attempts"]) == 2 and p2.status["recordedPods"] == ["uid-mnist-1-0/1", "uid-mnist-1-0"]


def test_restart_in_place_after_a_peer_succeeded_is_stopped_not_counted():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                   trainer(1, phase="Running", exit_code=1)), later(1))
    assert (DELETE, "mnist-1") in _acts(p) and p.status["restarts"] == 0
    assert p.status["phase"] == names.PHASE_SUCCEEDED


def test_success_rule():
    job, status = _running()
    waiting = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0), trainer(1)), later(1))
    assert waiting.status["phase"] == "Running" and waiting.actions == ()
    report = '{"step": 120, "loss": 0.05, "metrics": {"testAccuracy": 0.97}, "final": true}'
    done = plan(job, waiting.status,
                observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0, message=report),
                         trainer(1, phase="Succeeded", exit_code=0)), later(2))
    assert done.status["phase"] == "Succeeded"
    assert done.status["progress"]["metrics"]["testAccuracy"] == 0.97
    assert "testAccuracy 0.97" in done.status["progress"]["summary"]
    assert _acts(done) == [(DELETE, "mnist-rdzv")]  # cleanPodPolicy Running
    assert [e.reason for e in done.events if e.reason == names.REASON_SUCCEEDED]


def test_failure_after_a_peer_succeeded_is_not_replaced():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                   trainer(1, phase="Failed", exit_code=1)), later(1))
    assert p.status["phase"] == "Succeeded" and p.status["restarts"] == 0
    assert (CREATE, "mnist-1") not in _acts(p)


def test_peer_still_running_long_after_success_is_stopped():
    job, status = _running()
    pods = (rdzv(), trainer(0, phase="Succeeded", exit_code=0, finished_at=NOW), trainer(1))
    waiting = plan(job, status, observed(*pods), later(5))
    assert waiting.status["phase"] == "Running" and (DELETE, "mnist-1") not in _acts(waiting)
    assert waiting.requeue_after == names.SUCCESS_GRACE_SECONDS - 5
    stopped = plan(job, waiting.status, observed(*pods), later(names.SUCCESS_GRACE_SECONDS))
    assert (DELETE, "mnist-1") in _acts(stopped)
    done = plan(job, stopped.status, observed(pods[0], pods[1], gone=[trainer(1)]),
                later(names.SUCCESS_GRACE_SECONDS + 1))
    assert done.status["phase"] == "Succeeded" and done.status["restarts"] == 0
    assert (CREATE, "mnist-1") not in _acts(done)


def test_clean_pod_policies():
    for policy, expected in (("None", []), ("All", [(DELETE, "mnist-0"), (DELETE, "mnist-1"), (DELETE, "mnist-rdzv")])):
        job, status = _running(runPolicy={"cleanPodPolicy": policy})
        p = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                       trainer(1, phase="Succeeded", exit_code=0)), later(1))
        assert p.status["phase"] == "Succeeded" and _acts(p) == expected, policy


def test_suspend_and_resume():
    job, status = _running()
    suspended_job = make_job(runPolicy={"suspend": True})
    p = plan(suspended_job, status, observed(rdzv(), trainer(0), trainer(1)), later(1))
    assert p.status["phase"] == "Suspended"
    assert _acts(p) == [(DELETE, "mnist-0"), (DELETE, "mnist-1"), (DELETE, "mnist-rdzv")]
    assert "startTime" not in p.status
    # Tombstones of the pods deleted while suspended are never counted.
    p2 = plan(suspended_job, p.status, observed(gone=[trainer(0), trainer(1)]), later(2))
    assert p2.status["restarts"] == 0 and p2.actions == ()
    resumed = plan(job, p2.status, observed(), later(3))
    assert _acts(resumed) == [(CREATE, "mnist-0"), (CREATE, "mnist-1"), (CREATE, "mnist-rdzv")]
    assert resumed.status["phase"] == "Pending"
    suspended = [c for c in resumed.status["conditions"] if c["type"] == "Suspended"][0]
    assert suspended["status"] == "False" and suspended["reason"] == names.REASON_RESUMED
    assert resumed.status["restarts"] == 0


def test_a_resume_before_the_suspended_pods_are_gone_waits_for_them_and_counts_nothing():
    """The store pod deleted for the suspension still terminating (or its tombstone) when the user resumes is no
    lost store: the job stays Suspended until it is gone, then starts afresh with nothing counted."""
    job, status = _running()
    suspended_job = make_job(runPolicy={"suspend": True})
    p = plan(suspended_job, status, observed(rdzv(), trainer(0), trainer(1)), later(1))
    store = rdzv(deleting_since=later(1))
    early = plan(job, p.status, observed(store, gone=[trainer(0), trainer(1)]), later(2))
    assert early.status["phase"] == "Suspended" and "waiting for the pods of the last run" in early.status["message"]
    assert (CREATE, "mnist-rdzv") not in _acts(early)
    dead = rdzv(phase="Failed", exit_code=137, deleting_since=later(1))
    resumed = plan(job, early.status, observed(gone=[dead, trainer(0), trainer(1)]), later(3))
    assert resumed.status["phase"] == "Pending" and "lastFailure" not in resumed.status, resumed.status
    assert resumed.status["restarts"] == 0 and resumed.status.get("infraRestarts", 0) == 0, resumed.status
    assert (CREATE, "mnist-rdzv") in _acts(resumed)


def test_deadline():
    job, status = _running(runPolicy={"activeDeadlineSeconds": 100})
    before = plan(job, status, observed(rdzv(), trainer(0), trainer(1)), later(40))
    assert before.status["phase"] == "Running" and before.requeue_after == 60
    after = plan(job, status, observed(rdzv(), trainer(0), trainer(1)), later(100))
    assert after.status["phase"] == "Failed" and after.status["reason"] == names.REASON_DEADLINE
    assert "activeDeadlineSeconds=100" in after.status["message"]
    assert _acts(after) == [(DELETE, "mnist-0"), (DELETE, "mnist-1"), (DELETE, "mnist-rdzv")]


def test_ttl_after_finished():
    job, status = _running(runPolicy={"ttlSecondsAfterFinished": 30, "cleanPodPolicy": "None"})
    done = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                      trainer(1, phase="Succeeded", exit_code=0)), later(10))
    assert done.requeue_after == 30 and done.actions == ()
    waiting = plan(job, done.status, observed(), later(20))
    assert waiting.requeue_after == 20 and waiting.actions == ()
    expired = plan(job, done.status, observed(), later(40))
    assert _acts(expired) == [(DELETE_JOB, "mnist")]


def test_scale_down_and_up():
    job, status = _running(nodes=3, minNodes=1, maxNodes=4, n=3)
    down = make_job(nodes=2, minNodes=1, maxNodes=4)
    p = plan(down, status, observed(rdzv(), trainer(0), trainer(1), trainer(2)), later(1))
    # the survivors are told the new size (an elastic job's rendezvous closes its round at it: plan/spares.py)
    assert _acts(p) == [(DELETE, "mnist-2"), (PATCH, "mnist-0"), (PATCH, "mnist-1")]
    assert p.status["phase"] == "Running" and p.status["restarts"] == 0 and p.status["nodes"]["desired"] == 2
    up = make_job(nodes=4, minNodes=1, maxNodes=4)
    p2 = plan(up, p.status, observed(rdzv(), trainer(0), trainer(1)), later(2))
    assert _acts(p2) == [(CREATE, "mnist-2"), (CREATE, "mnist-3"), (PATCH, "mnist-0"), (PATCH, "mnist-1")]
    assert p2.status["phase"] == "Running" and p2.status["nodesReady"] == "2/4"


def test_scaled_down_pod_failing_is_not_counted():
    job, status = _running(nodes=3, minNodes=1, maxNodes=4, n=3)
    down = make_job(nodes=2, minNodes=1, maxNodes=4)
    p = plan(down, status, observed(rdzv(), trainer(0), trainer(1), trainer(2, phase="Failed", exit_code=143)),
             later(1))
    assert p.status["restarts"] == 0 and _acts(p) == [(DELETE, "mnist-2"), (PATCH, "mnist-0"), (PATCH, "mnist-1")]


def test_stuck_terminating_pod_on_not_ready_node_is_force_deleted():
    job, status = _running()
    stuck = trainer(1, deleting_since=later(0), node="node-2")
    early = plan(job, status, observed(rdzv(), trainer(0), stuck, node_ready={"node-2": False}), later(60))
    assert FORCE_DELETE not in [a.verb for a in early.actions] and early.requeue_after == 60
    late = plan(job, status, observed(rdzv(), trainer(0), stuck, node_ready={"node-2": False}), later(121))
    assert (FORCE_DELETE, "mnist-1") in _acts(late)
    assert names.REASON_FORCE_DELETED in [e.reason for e in late.events]
    # on a Ready node too: a pod the kubelet cannot kill (tests/unit/test_stuck_terminating.py)
    healthy = plan(job, status, observed(rdzv(), trainer(0), stuck, node_ready={"node-2": True}), later(121))
    assert (FORCE_DELETE, "mnist-1") in _acts(healthy)


def test_deleted_running_pod_tombstone_counts():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), gone=[trainer(1)]), later(3))
    assert p.status["infraRestarts"] == 1 and _acts(p) == [(CREATE, "mnist-1")]
    assert (p.status["lastFailure"]["class"], p.status["lastFailure"]["reason"]) == ("Infrastructure", "PodDeleted")
    assert "was deleted" in p.status["attempts"][-1]["reason"] or p.status["attempts"][-1]["reason"] == "Deleted"


def test_missing_pod_after_downtime_is_recreated_as_a_recovery():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0)), later(3))
    assert _acts(p) == [(CREATE, "mnist-1")]
    assert p.status["phase"] == "Restarting" and p.status["reason"] == names.REASON_NODE_MISSING
    # On record, counted like a deleted pod (the infrastructure's budget), once.
    assert p.status["infraRestarts"] == 1
    att = p.status["attempts"][-1]
    assert (att["pod"], att["index"], att["reason"], att["counted"]) == ("mnist-1", 1, names.REASON_NODE_MISSING, True)
    again = plan(job, p.status, observed(rdzv(), trainer(0)), later(4))
    assert again.status["infraRestarts"] == 1 and len(again.status["attempts"]) == 1


def test_operator_killed_between_delete_and_recreate_counts_nothing_twice():
    """Recorded and deleted by the last operator, which died before recreating: the new one only recreates."""
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1)), later(3))
    assert _acts(p) == [(DELETE, "mnist-1")] and p.status["restarts"] == 1
    # A new operator: no tombstone, the pod simply missing.
    q = plan(job, p.status, observed(rdzv(), trainer(0)), later(30))
    assert _acts(q) == [(CREATE, "mnist-1")]
    assert q.status["restarts"] == 1 and len(q.status["attempts"]) == 1


def test_at_most_one_pod_per_index():
    """A replacement is created only once the name is free: never next to a pod still terminating."""
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1,
                                                                deleting_since=later(1))), later(2))
    assert (CREATE, "mnist-1") not in _acts(p)
    p2 = plan(job, p.status, observed(rdzv(), trainer(0), trainer(1, deleting_since=later(1), restart_count=1,
                                                                  last_exit_code=1)), later(3))
    assert (CREATE, "mnist-1") not in _acts(p2)


def test_last_transition_time_is_kept():
    job, status = _running()
    running = [c for c in status["conditions"] if c["type"] == "Running"][0]
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1)), later(500))
    assert [c for c in p.status["conditions"] if c["type"] == "Running"][0] == running


def test_attempts_history_is_bounded():
    job, status = _running(failurePolicy={"backoffLimit": 100, "incidentWindowSeconds": 0})
    for i in range(30):
        status = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1, uid=f"u{i}")),
                      later(i + 1)).status
    assert status["restarts"] == 30 and len(status["attempts"]) == names.ATTEMPTS_HISTORY
    assert status["attempts"][-1]["uid"] == "u29"


def test_gracefully_deleted_pod_is_recreated_on_its_deleted_event():
    # `kubectl delete pod`: Terminating with a grace period, torchrun exits 1 on SIGTERM (phase Failed), then the
    # object goes. Its tombstone is Failed, yet the pod is gone: recreate at once, not at the stuck timeout.
    job, status = _running(failurePolicy={"startupTimeoutSeconds": 0})  # no startup-timeout wake-up either
    deleting = trainer(1, phase="Failed", exit_code=1, deleting_since=later(30), node="node-2")
    failed = plan(job, status, observed(rdzv(), trainer(0), deleting), later(5))
    assert failed.actions == () and failed.status["restarts"] == 1
    gone = plan(job, failed.status, observed(rdzv(), trainer(0), gone=[deleting]), later(8))
    assert _acts(gone) == [(CREATE, "mnist-1")] and gone.requeue_after is None
    assert gone.status["restarts"] == 1 and len(gone.status["attempts"]) == 1
    assert gone.status["nodes"]["failed"] == 0


def test_pod_terminating_on_a_ready_or_unknown_node_is_waited_for_until_the_timeout():
    job, status = _running(failurePolicy={"startupTimeoutSeconds": 0})  # no startup-timeout wake-up either
    stuck = trainer(1, deleting_since=later(0), node="node-2")
    for ready in (True, None):  # None: Nodes may not be read (namespace-scoped RBAC)
        p = plan(job, status, observed(rdzv(), trainer(0), stuck, node_ready={"node-2": ready}), later(119))
        assert p.actions == () and p.requeue_after == 1, ready


def test_final_report_with_nan_still_succeeds_and_status_is_valid_json():
    import json
    job, status = _running()
    report = '{"step": 120, "loss": NaN, "samplesPerSecond": Infinity, "metrics": {"acc": -Infinity, "ok": 1}, ' \
             '"final": true}'
    done = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0, message=report),
                                      trainer(1, phase="Succeeded", exit_code=0)), later(2))
    assert done.status["phase"] == "Succeeded"
    json.dumps(done.status, allow_nan=False)  # what the API server accepts
    assert done.status["progress"]["step"] == 120 and "loss" not in done.status["progress"]
    assert done.status["progress"]["metrics"] == {"ok": 1}


def test_more_than_a_history_of_pods_ending_together_are_counted_once():
    n = names.ATTEMPTS_HISTORY + 5
    job, status = _running(n=n, nodes=n,
                           failurePolicy={"backoffLimit": 100, "incidentWindowSeconds": 0})
    failed = observed(rdzv(), *(trainer(i, phase="Failed", exit_code=1) for i in range(n)))
    first = plan(job, status, failed, later(10))
    assert len(first.status["attempts"]) == names.ATTEMPTS_HISTORY
    assert first.status["restarts"] == n and len(first.actions) == n
    # The same pods seen again (their deletes still in flight): nothing is counted or recorded again.
    again = plan(job, first.status, failed, later(11))
    assert again.status["restarts"] == n and again.status["attempts"] == first.status["attempts"]
    assert again.status == first.status
    # Once they are gone, their UIDs may leave the record (bounded by the pods that still exist).
    gone = plan(job, again.status, observed(rdzv()), later(12))
    bad = plan(job, gone.status, observed(rdzv(), trainer(0, phase="Failed", exit_code=1, uid="new")), later(13))
    assert bad.status["recordedPods"] == ["new"] and bad.status["restarts"] == n + 1


def test_trainer_pod_with_a_garbage_group_label_is_stale_not_a_crash():
    job, status = _running()
    odd = trainer(1, uid="odd")
    odd["metadata"]["labels"][names.LABEL_GROUP] = "not-a-number"
    p = plan(job, status, observed(rdzv(), trainer(0), odd), later(5))
    assert (DELETE, "mnist-1") in _acts(p)
    assert p.status["restarts"] == 0


def test_lifecycle_write_never_carries_older_progress():
    job, status = _running()
    status["progress"] = {"step": 61, "summary": "step 61"}
    # A resumed run's final report at a lower step than already shown keeps the newer step.
    report = '{"step": 54, "loss": 0.5, "final": true}'
    done = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0, message=report),
                                      trainer(1, phase="Succeeded", exit_code=0)), later(2))
    assert done.status["phase"] == "Succeeded" and done.status["progress"]["step"] == 61
    newer = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0,
                                                       message='{"step": 90, "final": true}'),
                                       trainer(1, phase="Succeeded", exit_code=0)), later(2))
    assert newer.status["progress"]["step"] == 90 and newer.status["progress"]["final"] is True


def test_huge_deadline_and_ttl_never_overflow():
    from ddp_operator import crd
    top = crd.MAX_DURATION_SECONDS
    job, status = _running(runPolicy={"activeDeadlineSeconds": top, "ttlSecondsAfterFinished": top})
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1)), later(40))
    assert p.status["phase"] == "Running" and p.requeue_after > 0
    done = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                      trainer(1, phase="Succeeded", exit_code=0)), later(50))
    assert done.status["phase"] == "Succeeded" and done.requeue_after > 0


def test_pod_never_created_is_not_a_vanished_pod():
    """After a scale-up whose create was refused, the new pod is just not there yet: nothing recorded."""
    job, status = _running()
    bigger = make_job(nodes=3)
    p1 = plan(bigger, status, observed(rdzv(), trainer(0), trainer(1)), later(1))
    assert (CREATE, "mnist-2") in _acts(p1)
    p2 = plan(bigger, p1.status, observed(rdzv(), trainer(0), trainer(1)), later(40))
    assert (CREATE, "mnist-2") in _acts(p2)
    assert p2.status["restarts"] == 0 and not p2.status.get("attempts")


def test_store_loss_with_restart_policy_never_replaces_the_trainers_counting_once():
    job, status = _running(failurePolicy={"incidentWindowSeconds": 0})
    p = plan(job, status, observed(trainer(0), trainer(1), gone=[rdzv()]), later(1))
    assert p.status["infraRestarts"] == 1 and _acts(p) == [(CREATE, "mnist-rdzv")]
    failed = [trainer(i, phase="Failed", exit_code=1, restart_policy="Never") for i in range(2)]
    p2 = plan(job, p.status, observed(rdzv(phase="Pending", uid="s2"), *failed), later(30))
    assert p2.status["infraRestarts"] == 1 and _acts(p2) == [(DELETE, "mnist-0"), (DELETE, "mnist-1")]
    assert p2.status["group"] == 0


def test_status_says_which_operator_version_reconciled_the_job_and_a_finished_job_keeps_its_own():
    from ddp_operator import __version__
    job, status = _running()
    p = plan(job, {**status, "operatorVersion": "0.0.9"}, observed(rdzv(), trainer(0), trainer(1)), later(1))
    assert p.status["operatorVersion"] == __version__
    done = plan(job, {**p.status, "phase": "Succeeded", "operatorVersion": "0.0.9"}, observed(), later(2))
    assert done.status["operatorVersion"] == "0.0.9"
    unknown = plan(job, {k: v for k, v in done.status.items() if k != "operatorVersion"}, observed(), later(3))
    assert "operatorVersion" not in unknown.status


CLOSED = ("Traceback (most recent call last):\n  File \"/opt/venv/bin/torchrun\", line 8, in <module>\n"
          "    rdzv_info = spec.rdzv_handler.next_rendezvous()\n"
          "  File \".../dynamic_rendezvous.py\", line 677, in run\n    raise RendezvousClosedError\n"
          "torch.distributed.elastic.rendezvous.api.RendezvousClosedError")


def test_a_closed_rendezvous_renews_the_store_once_and_counts_nothing():
    """Plain torchrun closed the rendezvous when an agent gave up: the restarted agents end at once on it. Recorded,
    not counted, lastFailure kept, the store deleted once (recreated empty) and not taken for a lost store."""
    job, status = _running()
    first = plan(job, status, observed(rdzv(), trainer(0), trainer(1, restart_count=1, last_exit_code=1,
                                       last_message="FileNotFoundError: [Errno 2] No such file: 'config.json'")),
                 later(10))
    assert first.status["restarts"] == 1 and first.status["lastFailure"]["reason"] == "FileNotFoundError"
    echo = observed(rdzv(), trainer(0, restart_count=1, last_exit_code=1, last_message=CLOSED),
                    trainer(1, restart_count=2, last_exit_code=1, last_message=CLOSED))
    p = plan(job, first.status, echo, later(60))
    assert _acts(p) == [(DELETE, "mnist-rdzv")]
    assert (p.status["restarts"], p.status.get("infraRestarts", 0)) == (1, 0)
    assert p.status["lastFailure"]["reason"] == "FileNotFoundError"
    reasons = [(a["pod"], a["reason"], a["counted"]) for a in p.status["attempts"][1:]]
    assert reasons == [("mnist-0", names.REASON_RDZV_CLOSED, False), ("mnist-rdzv", names.REASON_RDZV_RESET, False),
                       ("mnist-1", names.REASON_RDZV_CLOSED, False)]
    assert [e.reason for e in p.events].count(names.REASON_RDZV_RESET) == 1
    # The store's delete in flight: no lost store recorded, nothing counted, nothing deleted again.
    again = plan(job, p.status, observed(rdzv(deleting_since=later(60)), trainer(0, restart_count=1, last_exit_code=1,
                 last_message=CLOSED), trainer(1, restart_count=2, last_exit_code=1, last_message=CLOSED)), later(61))
    assert (again.status["restarts"], again.status.get("infraRestarts", 0)) == (1, 0) and again.actions == ()
    assert names.REASON_RDZV_LOST not in [a["reason"] for a in again.status["attempts"]]
    # The script fails again on the new store: the user's code counts again (a crash loop still ends).
    loop = plan(job, again.status, observed(rdzv(uid="uid-store-2"), trainer(0, restart_count=2, last_exit_code=1,
                last_message="FileNotFoundError: [Errno 2] No such file: 'config.json'"),
                trainer(1, restart_count=2, last_exit_code=1, last_message=CLOSED)), later(120))
    assert loop.status["restarts"] == 2


def test_a_closed_rendezvous_after_a_success_is_left_to_the_success_rule():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                   trainer(1, restart_count=1, last_exit_code=1, last_message=CLOSED)), later(10))
    assert (DELETE, "mnist-rdzv") not in _acts(p) or p.status["phase"] == "Succeeded"
    assert names.REASON_RDZV_RESET not in [a.get("reason") for a in p.status.get("attempts", [])]
