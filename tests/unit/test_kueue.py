"""The Kueue gate (kueue.py) and how plan/suspend.py applies it: a queued DDPJob is one Workload, runs only while
admitted, is placed by its flavors, gives its quota back after an eviction and marks its Workload finished."""

import pytest

from ddp_operator import names
from ddp_operator.kueue import gate, observe_workload, render_workload, workload_name
from ddp_operator.plan import CREATE, DELETE, PATCH, PATCH_STATUS, plan
from ddp_operator.spec import SpecError, parse_job

from ddp_builders import NOW, job_body, later, observed, rdzv, trainer

FLAVOR = {"nodeLabels": {"pool": "a100"}, "tolerations": [{"key": "gpu", "operator": "Exists",
                                                            "effect": "NoSchedule"}]}


def queued_job(queue="team-a", priority=None, **spec):
    body = job_body(**spec)
    body["metadata"]["labels"] = {names.LABEL_QUEUE_NAME: queue}
    if priority:
        body["metadata"]["labels"][names.LABEL_PRIORITY_CLASS] = priority
    return parse_job(body)


def workload(job, *, admitted=False, evicted=None, finished=False, trainers=None, reserved=None, message="",
             active=True, queue=None, annotations=None):
    body = render_workload(job, 0, None)
    body["metadata"].update(uid="wl-uid", resourceVersion="42", generation=1, annotations=annotations or {})
    body["spec"]["active"] = active
    if queue:
        body["spec"]["queueName"] = queue
    if trainers is not None:
        body["spec"]["podSets"][0]["count"] = trainers
    conditions = []
    reserved = admitted if reserved is None else reserved
    conditions.append({"type": names.WL_QUOTA_RESERVED, "status": "True" if reserved else "False",
                       "reason": "QuotaReserved" if reserved else "Pending", "message": message})
    if admitted:
        conditions.append({"type": names.WL_ADMITTED, "status": "True", "reason": "Admitted", "message": ""})
    if evicted:
        conditions.append({"type": names.WL_EVICTED, "status": "True", "reason": evicted,
                           "message": "Preempted to accommodate a workload due to prioritization"})
    if finished:
        conditions.append({"type": names.WL_FINISHED, "status": "True", "reason": "Succeeded", "message": ""})
    body["status"] = {"conditions": conditions}
    if reserved:
        count = body["spec"]["podSets"][0]["count"]
        body["status"]["admission"] = {"clusterQueue": "team-a-cq", "podSetAssignments": [
            {"name": "trainer", "flavors": {"cpu": "a100", "memory": "a100"}, "count": count},
            {"name": "rdzv", "flavors": {"cpu": "a100"}, "count": 1}]}
    return observe_workload(body)


def kueue_observed(*pods, ws=None, flavors=None, **kw):
    return observed(*pods, kueue=True, workload=ws, flavors={"a100": FLAVOR} if flavors is None else flavors, **kw)


def acts(p):
    return [(a.verb, a.kind, a.name) for a in p.actions]


def suspended_condition(status):
    return next(c for c in status["conditions"] if c["type"] == names.COND_SUSPENDED)


def test_the_workload_stands_for_the_whole_job():
    job = queued_job(spares=1, priority="high")
    body = render_workload(job, 0, ("high", 1000))
    assert body["metadata"]["name"] == workload_name(job)
    assert body["metadata"]["ownerReferences"][0]["uid"] == job.uid
    assert body["metadata"]["labels"][names.LABEL_JOB_NAME] == "mnist"
    spec = body["spec"]
    assert spec["queueName"] == "team-a" and spec["active"] is True
    assert [(p["name"], p["count"]) for p in spec["podSets"]] == [("trainer", 3), ("rdzv", 1)]
    assert spec["podSets"][1]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "10m"
    assert spec["priorityClassRef"] == {"group": names.KUEUE_GROUP, "kind": "WorkloadPriorityClass", "name": "high"}
    assert spec["priority"] == 1000


def test_workload_names_are_dns_labels_and_differ_per_job_uid():
    long_job = parse_job({**job_body(name="a" * 58), "metadata": {"name": "a" * 58, "uid": "u1"}})
    other = parse_job({**job_body(name="a" * 58), "metadata": {"name": "a" * 58, "uid": "u2"}})
    assert len(workload_name(long_job)) <= 63
    assert workload_name(long_job) != workload_name(other)


def test_a_bad_queue_label_is_a_spec_error():
    body = job_body()
    body["metadata"]["labels"] = {names.LABEL_QUEUE_NAME: "Team_A"}
    with pytest.raises(SpecError, match="queue-name"):
        parse_job(body)


def test_a_queued_job_creates_only_its_workload_and_waits():
    job = queued_job()
    p = plan(job, {}, kueue_observed(service_exists=False), NOW)
    assert acts(p) == [(CREATE, "Workload", workload_name(job))]
    assert p.status["phase"] == names.PHASE_SUSPENDED and p.status["reason"] == names.REASON_QUEUED
    assert "LocalQueue team-a" in p.status["message"]
    # Kueue's own words on why it waits reach the user.
    ws = workload(job, message="insufficient unused quota for cpu in flavor default-flavor, 1 more needed")
    p2 = plan(job, p.status, kueue_observed(ws=ws, service_exists=False), later(1))
    assert p2.actions == ()
    assert "insufficient unused quota for cpu" in p2.status["message"]
    assert suspended_condition(p2.status)["reason"] == names.REASON_QUEUED


def test_admission_starts_the_pods_placed_by_the_flavors():
    job = queued_job()
    queued = plan(job, {}, kueue_observed(ws=workload(job), service_exists=False), NOW)
    p = plan(job, queued.status, kueue_observed(ws=workload(job, admitted=True), service_exists=False), later(1))
    pods = {a.name: a.body for a in p.actions if a.kind == "Pod"}
    assert sorted(pods) == ["mnist-0", "mnist-1", "mnist-rdzv"]
    for body in pods.values():
        assert body["spec"]["nodeSelector"] == {"pool": "a100"}
        assert body["spec"]["tolerations"] == FLAVOR["tolerations"]
    cond = suspended_condition(p.status)
    assert cond["status"] == "False" and cond["reason"] == names.REASON_ADMITTED
    assert "team-a-cq" in cond["message"]
    assert names.REASON_ADMITTED in [e.reason for e in p.events]
    # The stored template is untouched: placement is on the pods only.
    assert "nodeSelector" not in job.spec.template["spec"]


def test_a_missing_flavor_holds_the_job_with_its_name():
    job = queued_job()
    p = plan(job, {}, kueue_observed(ws=workload(job, admitted=True), flavors={"a100": None}), NOW)
    assert p.status["phase"] == names.PHASE_SUSPENDED and "ResourceFlavor a100" in p.status["message"]
    assert not [a for a in p.actions if a.kind == "Pod"]


def _admitted_running(job):
    ws = workload(job, admitted=True)
    first = plan(job, {}, kueue_observed(ws=ws, service_exists=False), NOW)
    running = plan(job, first.status, kueue_observed(rdzv(), trainer(0), trainer(1), ws=ws), later(1))
    assert running.status["phase"] == names.PHASE_RUNNING
    return running.status


def test_a_pod_kill_in_an_admitted_job_is_recovered_without_touching_the_workload():
    job = queued_job()
    status = _admitted_running(job)
    ws = workload(job, admitted=True)
    p = plan(job, status, kueue_observed(rdzv(), trainer(1), ws=ws, gone=[trainer(0, phase="Failed")]), later(5))
    assert acts(p) == [("create", "Pod", "mnist-0")]
    assert p.status["phase"] == names.PHASE_RESTARTING


def test_eviction_stops_the_pods_then_gives_the_quota_back():
    job = queued_job()
    status = _admitted_running(job)
    ws = workload(job, admitted=True, evicted="Preempted")
    p = plan(job, status, kueue_observed(rdzv(), trainer(0), trainer(1), ws=ws), later(10))
    assert sorted(a.name for a in p.actions if a.verb == DELETE) == ["mnist-0", "mnist-1", "mnist-rdzv"]
    assert not [a for a in p.actions if a.kind == "Workload"]  # the pods first
    assert p.status["phase"] == names.PHASE_SUSPENDED and p.status["reason"] == names.REASON_EVICTED
    assert "Preempted" in p.status["message"]
    assert p.status["disruptions"] == 1 and p.status["restarts"] == 0
    # The incident names the eviction: the recovery after the readmission is put down to it (lastRecovery.fault).
    assert p.status["lastIncident"]["reason"] == names.REASON_EVICTED
    # The same eviction seen again is not a second disruption; once the pods are gone the admission is released.
    p2 = plan(job, p.status, kueue_observed(ws=ws, gone=[trainer(0), trainer(1), rdzv()]), later(12))
    assert p2.status["disruptions"] == 1 and p2.status["restarts"] == 0
    [release] = [a for a in p2.actions if a.kind == "Workload"]
    assert release.verb == PATCH_STATUS and release.uid == "wl-uid"
    assert release.body["metadata"]["resourceVersion"] == "42"
    assert release.body["status"]["admission"] is None
    conds = {c["type"]: c for c in release.body["status"]["conditions"]}
    assert conds[names.WL_QUOTA_RESERVED]["status"] == "False"
    assert conds[names.WL_QUOTA_RESERVED]["reason"] == names.WL_REASON_PENDING
    assert conds[names.WL_ADMITTED]["status"] == "False"
    assert conds[names.WL_REQUEUED]["status"] == "True"
    assert conds[names.WL_EVICTED]["status"] == "True"  # Kueue's own condition stays as Kueue set it
    # Readmitted: the pods come back and the job keeps its progress.
    p3 = plan(job, {**p2.status, "progress": {"step": 40}}, kueue_observed(ws=workload(job, admitted=True)), later(30))
    assert sorted(a.name for a in p3.actions if a.verb == CREATE) == ["mnist-0", "mnist-1", "mnist-rdzv"]
    assert p3.status["progress"] == {"step": 40}
    assert suspended_condition(p3.status)["reason"] == names.REASON_ADMITTED


def test_a_finished_job_finishes_its_workload():
    job = queued_job()
    status = _admitted_running(job)
    ws = workload(job, admitted=True)
    done = plan(job, status, kueue_observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                            trainer(1, phase="Succeeded", exit_code=0), ws=ws), later(60))
    assert done.status["phase"] == names.PHASE_SUCCEEDED
    [fin] = [a for a in done.actions if a.kind == "Workload"]
    assert fin.verb == PATCH_STATUS
    cond = next(c for c in fin.body["status"]["conditions"] if c["type"] == names.WL_FINISHED)
    assert cond["status"] == "True" and cond["reason"] == names.WL_REASON_SUCCEEDED
    # Already finished: nothing more is written.
    again = plan(job, done.status, kueue_observed(ws=workload(job, admitted=True, finished=True)), later(61))
    assert not [a for a in again.actions if a.kind == "Workload"]


def test_scale_down_keeps_the_admission_scale_up_queues_a_new_workload():
    job = queued_job()
    status = _admitted_running(job)
    ws = workload(job, admitted=True)
    smaller = queued_job(nodes=1, minNodes=1, maxNodes=3)
    p = plan(smaller, status, kueue_observed(rdzv(), trainer(0), trainer(1), ws=ws), later(5))
    assert not [a for a in p.actions if a.kind == "Workload"]
    assert ("delete", "Pod", "mnist-1") in acts(p)
    bigger = queued_job(nodes=3, minNodes=1, maxNodes=3)
    p2 = plan(bigger, status, kueue_observed(rdzv(), trainer(0), trainer(1), ws=ws), later(5))
    assert (DELETE, "Workload", ws.name) in acts(p2)
    assert p2.status["phase"] == names.PHASE_SUSPENDED
    assert "Kueue cannot grow an admitted workload" in p2.status["message"]
    # The next pass (the old workload gone) queues one of the new size.
    p3 = plan(bigger, p2.status, kueue_observed(gone=[trainer(0), trainer(1), rdzv()]), later(6))
    [created] = [a for a in p3.actions if a.kind == "Workload"]
    assert created.body["spec"]["podSets"][0]["count"] == 3


def test_suspend_deactivates_the_workload():
    job = queued_job(runPolicy={"suspend": True})
    ws = workload(job, admitted=True)
    p = plan(job, {}, kueue_observed(rdzv(), trainer(0), trainer(1), ws=ws), NOW)
    assert (PATCH, "Workload", ws.name) in acts(p)
    patch = next(a for a in p.actions if a.kind == "Workload").body
    assert patch == {"spec": {"active": False}, "metadata": {"annotations": {names.WORKLOAD_SUSPENDED_ANNOTATION: "true"}}}
    assert p.status["reason"] == names.REASON_SUSPENDED
    # Resumed: what the suspend did is undone; a Workload someone else deactivated stays inactive.
    resumed = queued_job()
    ours = workload(resumed, active=False, annotations={names.WORKLOAD_SUSPENDED_ANNOTATION: "true"})
    p2 = plan(resumed, p.status, kueue_observed(ws=ours), later(5))
    assert [a.body for a in p2.actions if a.kind == "Workload"] == [
        {"spec": {"active": True}, "metadata": {"annotations": {names.WORKLOAD_SUSPENDED_ANNOTATION: None}}}]
    theirs = workload(resumed, active=False)
    p3 = plan(resumed, p.status, kueue_observed(ws=theirs), later(5))
    assert not [a for a in p3.actions if a.kind == "Workload"]
    assert p3.status["phase"] == names.PHASE_SUSPENDED and "inactive" in p3.status["message"]


def test_a_changed_queue_moves_a_waiting_workload_only():
    job = queued_job(queue="team-b")
    waiting = plan(job, {}, kueue_observed(ws=workload(job, queue="team-a")), NOW)
    assert [a.body for a in waiting.actions if a.kind == "Workload"] == [{"spec": {"queueName": "team-b"}}]
    running = plan(job, {}, kueue_observed(ws=workload(job, admitted=True, queue="team-a")), NOW)
    assert not [a for a in running.actions if a.kind == "Workload"]


def test_without_the_integration_a_queued_job_waits_with_a_clear_message():
    p = plan(queued_job(), {}, observed(service_exists=False), NOW)
    assert p.actions == ()
    assert p.status["reason"] == names.REASON_QUEUE_DISABLED and "kueue.enabled" in p.status["message"]


def test_a_missing_priority_class_is_named():
    job = queued_job(priority="urgent")
    g = gate(job, None, group=0, pods_live=False, now="t", flavors={}, priority="WorkloadPriorityClass urgent ...")
    assert g.hold and g.create is None and "urgent" in g.message


def test_jobs_without_the_label_never_see_kueue():
    from ddp_builders import make_job
    p = plan(make_job(), {}, observed(service_exists=False, kueue=True), NOW)
    assert not [a for a in p.actions if a.kind == "Workload"]
    assert p.status["phase"] == names.PHASE_PENDING


def test_a_job_is_queued_again_only_once_its_last_pods_are_gone():
    job = queued_job(nodes=3, minNodes=1, maxNodes=3)
    terminating = [trainer(0, deleting_since=NOW), trainer(1, deleting_since=NOW)]
    # Its Workload went (scale-up beyond the admission): no new one while the old pods terminate.
    p = plan(job, {}, kueue_observed(*terminating), NOW)
    assert not [a for a in p.actions if a.kind == "Workload"]
    assert p.status["phase"] == names.PHASE_SUSPENDED and "pods to stop" in p.status["message"]
    p2 = plan(job, p.status, kueue_observed(gone=terminating), later(5))
    assert [a.verb for a in p2.actions if a.kind == "Workload"] == [CREATE]
    # Admitted while pods of the last run still terminate: no pods yet, nothing counted.
    ws = workload(job, admitted=True)
    p3 = plan(job, p2.status, kueue_observed(trainer(0, deleting_since=NOW), ws=ws), later(6))
    assert not [a for a in p3.actions if a.verb == CREATE] and p3.status["phase"] == names.PHASE_SUSPENDED
    p4 = plan(job, p3.status, kueue_observed(ws=ws, gone=[trainer(0)]), later(8))
    assert sorted(a.name for a in p4.actions if a.verb == CREATE) == ["mnist-0", "mnist-1", "mnist-2", "mnist-rdzv"]
    assert p4.status["restarts"] == 0 and p4.status.get("disruptions", 0) == 0
