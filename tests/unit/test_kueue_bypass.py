"""A job that has a Kueue Workload stays gated by it whatever its labels say now: removing the label
kueue.x-k8s.io/queue-name neither starts a queued job nor frees an admitted one from eviction (the condition and a
Warning Event say why), and a Workload being deleted is never taken for the job's Workload."""

import copy

import kopf

from ddp_operator import handlers, names
from ddp_operator.kueue import indexed_workload, kept_queue, observe_workload, render_workload
from ddp_operator.plan import DELETE, plan
from ddp_operator.reconciler import Config, Reconciler
from ddp_operator.spec import parse_job

from ddp_builders import NOW, job_body, later, observed, rdzv, trainer
from test_kueue import FLAVOR, queued_job, workload


class FakeApi:
    def __init__(self, index):
        self.index = index
        self.created, self.deleted, self.patches, self.events, self.workload_writes = [], [], [], [], []

    def create(self, body):
        obj = copy.deepcopy(dict(body))
        obj["metadata"]["uid"] = f"uid-{obj['metadata']['name']}"
        self.created.append(obj)
        if body["kind"] == names.WORKLOAD_KIND:
            key = (obj["metadata"]["namespace"], obj["metadata"]["labels"][names.LABEL_JOB_NAME])
            self.index["workloads_by_job"].setdefault(key, []).append(obj)
        return obj

    def delete_pod(self, namespace, name, uid, force=False, grace_seconds=None):
        self.deleted.append(name)

    def delete_workload(self, namespace, name, uid):
        self.workload_writes.append(("delete", name))

    def patch_workload(self, namespace, name, uid, patch, status=False):
        self.workload_writes.append(("patch-status" if status else "patch", name))
        return True

    def patch_status(self, namespace, name, status):
        """patches: the whole status after each merge patch."""
        merged = {**(self.patches[-1] if self.patches else {}), **copy.deepcopy(dict(status))}
        self.patches.append({k: v for k, v in merged.items() if v is not None})

    def post_event(self, job, type_, reason, message, component):
        self.events.append((type_, reason, message))

    def node_ready(self, name):
        return True

    def resource_flavor(self, name):
        return FLAVOR

    def workload_priority(self, name):
        return name, 0


def _queued_body():
    body = job_body()
    body["metadata"]["labels"] = {names.LABEL_QUEUE_NAME: "team-a"}
    return body


def _reconciler(body):
    index = {"ddpjobs_by_key": {("ml", "mnist"): [body]}, "pods_by_job": {}, "services_by_job": {},
             "workloads_by_job": {}}
    r = Reconciler(FakeApi(index), Config(kueue=True))
    r.indexes = index
    return r


def _set_workload(r, **state):
    """The job's Workload as Kueue left it (`state`: test_kueue.workload's arguments)."""
    [mine] = [w for w in r.api.created if w["kind"] == names.WORKLOAD_KIND]
    job = parse_job(r.indexes["ddpjobs_by_key"][("ml", "mnist")][0])
    ws = workload(job, **state)
    mine["status"] = {"conditions": [dict(c) for c in ws.conditions],
                      **({"admission": dict(ws.admission)} if ws.admission else {})}


def _remove_label(r):
    body = r.indexes["ddpjobs_by_key"][("ml", "mnist")][0]
    body["metadata"]["labels"] = {}


def _pods_created(r):
    return [c["metadata"]["name"] for c in r.api.created if c["kind"] == "Pod"]


def test_removing_the_label_of_a_queued_job_keeps_it_held_and_says_why():
    r = _reconciler(_queued_body())
    r.reconcile("ml", "mnist")
    assert [c["kind"] for c in r.api.created] == [names.WORKLOAD_KIND]
    _set_workload(r, message="insufficient unused quota for cpu")
    _remove_label(r)
    result = r.reconcile("ml", "mnist")
    assert _pods_created(r) == []  # today: the job starts at once, past Kueue
    status = r.api.patches[-1]
    assert (status["phase"], status["reason"]) == (names.PHASE_SUSPENDED, names.REASON_QUEUED)
    assert f"{names.LABEL_QUEUE_NAME}] was removed" in status["message"]
    assert "insufficient unused quota for cpu" in status["message"]
    assert [e for e in r.api.events if e[1] == names.REASON_QUEUE_LABEL_REMOVED][0][0] == "Warning"
    assert not [a for a in result.actions if a.kind == "Pod"]
    # Seen again: no second Event.
    r.api.events.clear()
    r.reconcile("ml", "mnist")
    assert not [e for e in r.api.events if e[1] == names.REASON_QUEUE_LABEL_REMOVED]
    # Kueue admits the Workload in the queue it was in: the job runs.
    _set_workload(r, admitted=True)
    r.reconcile("ml", "mnist")
    assert sorted(_pods_created(r)) == ["mnist-0", "mnist-1", "mnist-rdzv"]


def test_an_admitted_job_whose_label_was_removed_is_still_evicted():
    r = _reconciler(_queued_body())
    r.reconcile("ml", "mnist")
    _set_workload(r, admitted=True)
    r.reconcile("ml", "mnist")
    assert sorted(_pods_created(r)) == ["mnist-0", "mnist-1", "mnist-rdzv"]
    _remove_label(r)
    r.api.events.clear()
    r.reconcile("ml", "mnist")
    status = r.api.patches[-1]
    cond = next(c for c in status["conditions"] if c["type"] == names.COND_SUSPENDED)
    assert (cond["status"], cond["reason"]) == ("False", names.REASON_ADMITTED)
    assert f"{names.LABEL_QUEUE_NAME}] was removed" in cond["message"]
    assert [e[1] for e in r.api.events] == [names.REASON_QUEUE_LABEL_REMOVED]
    # Kueue preempts it: its pods go, as for any admitted job (today: nothing happens, it holds its quota).
    _set_workload(r, admitted=True, evicted="Preempted")
    r.reconcile("ml", "mnist")
    assert sorted(r.api.deleted) == ["mnist-0", "mnist-1", "mnist-rdzv"]
    assert (r.api.patches[-1]["phase"], r.api.patches[-1]["reason"]) == (names.PHASE_SUSPENDED,
                                                                         names.REASON_EVICTED)


def test_the_gate_of_a_job_without_its_label_is_its_workloads():
    job = queued_job()
    ws = workload(job)
    unlabelled = parse_job(job_body())
    assert unlabelled.queue_name is None
    kept = kept_queue(unlabelled, ws)
    assert (kept.queue_name, kept.queue_label_removed) == ("team-a", True)
    p = plan(kept, {}, observed(kueue=True, workload=ws, flavors={"a100": FLAVOR}, service_exists=False), NOW)
    assert not [a for a in p.actions if a.kind in ("Pod", names.WORKLOAD_KIND)]  # no queue change either
    assert p.status["phase"] == names.PHASE_SUSPENDED
    # Resized past the admission: no new Workload can be queued without the label; the old one is kept.
    bigger = kept_queue(parse_job(job_body(nodes=3)), workload(job, admitted=True))
    running = observed(rdzv(), trainer(0), trainer(1), kueue=True, workload=workload(job, admitted=True),
                       flavors={"a100": FLAVOR})
    p2 = plan(bigger, {}, running, later(1))
    assert not [a for a in p2.actions if a.kind == names.WORKLOAD_KIND and a.verb == DELETE]
    assert "put the label back" in p2.status["message"]


def test_a_workload_being_deleted_is_not_the_jobs_workload():
    job = queued_job()
    body = render_workload(job, 0, None)
    body["metadata"].update(uid="wl-uid", resourceVersion="7", managedFields=[{"manager": "kueue"}] * 50)
    deleting = copy.deepcopy(body)
    deleting["metadata"]["deletionTimestamp"] = "2025-01-01T12:00:00Z"
    labels = body["metadata"]["labels"]
    assert handlers.workloads_by_job("ml", labels, kopf.Body(deleting)) == {}
    kept = handlers.workloads_by_job("ml", labels, kopf.Body(body))[("ml", "mnist")]
    assert observe_workload(kept) == observe_workload(body)
    assert indexed_workload(deleting) is None
    # What the index keeps is what observe_workload reads: no pod templates, no managedFields.
    assert "managedFields" not in kept["metadata"] and "template" not in kept["spec"]["podSets"][0]
