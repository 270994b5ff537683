"""plan/nodes.py's stuck rule: a pod the kubelet cannot kill (every process frozen, or in uninterruptible sleep on a
hung mount) stays Terminating on a Ready node forever; past its grace period plus
failurePolicy.stuckTerminatingTimeoutSeconds it is force-deleted on any node, recorded and replaced."""

from ddp_operator import names
from ddp_operator.plan import CREATE, DELETE, FORCE_DELETE, plan

from ddp_builders import NOW, later, make_job, observed, rdzv, trainer

TIMEOUT = 30


def _running(**failure_policy):
    job = make_job(failurePolicy={"hangTimeoutSeconds": 20, "stuckTerminatingTimeoutSeconds": TIMEOUT,
                                  **failure_policy})
    first = plan(job, {}, observed(service_exists=False), NOW)
    return job, plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status


def _acts(p):
    return sorted((a.verb, a.name) for a in p.actions)


def _force_events(p):
    return [e for e in p.events if e.reason == names.REASON_FORCE_DELETED]


def test_a_hung_pod_the_kubelet_cannot_kill_is_force_deleted_on_a_ready_node_and_replaced():
    """The issue's scenario: hang detection deletes pod 1 (grace 1 s), every process of it is frozen, so it stays
    Terminating on a Ready node; deletionTimestamp already includes the grace period."""
    job, status = _running()
    hung = plan(job, status, observed(rdzv(), trainer(0), trainer(1),
                                      hang_reports={"uid-mnist-0-0": {"rank": 0, "step": 41},
                                                    "uid-mnist-1-0": None}), later(30))
    assert _acts(hung) == [(DELETE, "mnist-1")]
    stuck = trainer(1, deleting_since=later(31), node="node-2")  # now + HANG_DELETE_GRACE_SECONDS
    ready = {"node-2": True}
    early = plan(job, hung.status, observed(rdzv(), trainer(0), stuck, node_ready=ready), later(31 + TIMEOUT - 1))
    assert FORCE_DELETE not in [a.verb for a in early.actions] and early.requeue_after == 1
    assert early.status["phase"] == names.PHASE_RESTARTING

    due = plan(job, early.status, observed(rdzv(), trainer(0), stuck, node_ready=ready), later(31 + TIMEOUT))
    assert _acts(due) == [(FORCE_DELETE, "mnist-1")]
    [event] = _force_events(due)
    assert event.type == "Warning" and "mnist-1" in event.message and "node-2" in event.message
    assert f"stuckTerminatingTimeoutSeconds={TIMEOUT}" in event.message
    # the attempt the hang recorded keeps its cause (Hang) and says the pod was force-deleted; nothing counted twice
    [attempt] = due.status["attempts"]
    assert attempt["reason"] == names.REASON_HANG and "force-deleted" in attempt["message"], attempt
    assert due.status["restarts"] == 1

    # a repeated pass (the DELETED event not seen yet) deletes again but posts and records nothing new
    again = plan(job, due.status, observed(rdzv(), trainer(0), stuck, node_ready=ready), later(32 + TIMEOUT))
    assert _acts(again) == [(FORCE_DELETE, "mnist-1")] and _force_events(again) == []
    assert again.status["attempts"] == due.status["attempts"]

    # gone: replaced under the same name; running again is a recovery from the Hang incident
    gone = plan(job, again.status, observed(rdzv(), trainer(0), gone=[stuck]), later(33 + TIMEOUT))
    assert _acts(gone) == [(CREATE, "mnist-1")] and gone.status["restarts"] == 1
    back = plan(job, gone.status, observed(rdzv(), trainer(0), trainer(1, uid="new")), later(40 + TIMEOUT))
    assert back.status["phase"] == names.PHASE_RUNNING and back.status["lastIncident"]["reason"] == names.REASON_HANG


def test_a_pod_stuck_terminating_that_nobody_recorded_is_recorded_as_force_deleted():
    """Deleted by someone else (kubectl, an eviction) and stuck: recorded once with reason StuckPodForceDeleted,
    the job Restarting, whatever its node's state (unknown without RBAC on Nodes)."""
    job, status = _running()
    stuck = trainer(1, deleting_since=later(0), node="node-2")
    for node_ready in ({"node-2": True}, {"node-2": None}, {}):
        p = plan(job, status, observed(rdzv(), trainer(0), stuck, node_ready=node_ready), later(TIMEOUT))
        assert _acts(p) == [(FORCE_DELETE, "mnist-1")], node_ready
        attempt = p.status["attempts"][-1]
        assert (attempt["pod"], attempt["reason"]) == ("mnist-1", names.REASON_FORCE_DELETED), attempt
        assert p.status["phase"] == names.PHASE_RESTARTING
        assert len(_force_events(p)) == 1
        again = plan(job, p.status, observed(rdzv(), trainer(0), stuck, node_ready=node_ready), later(TIMEOUT + 1))
        assert len(again.status["attempts"]) == len(p.status["attempts"]) and _force_events(again) == []
        assert again.status["restarts"] == p.status["restarts"]


def test_a_store_pod_stuck_terminating_is_force_deleted_too():
    job, status = _running()
    stuck = rdzv(deleting_since=later(0), node="node-2")
    p = plan(job, status, observed(stuck, trainer(0), trainer(1), node_ready={"node-2": True}), later(TIMEOUT))
    assert (FORCE_DELETE, "mnist-rdzv") in _acts(p) and len(_force_events(p)) == 1


def test_a_pod_terminating_within_its_grace_period_plus_the_timeout_is_left_to_the_kubelet():
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, deleting_since=later(10)),
                                   node_ready={"node-1": True}), later(10 + TIMEOUT - 5))
    assert FORCE_DELETE not in [a.verb for a in p.actions] and p.requeue_after == 5
