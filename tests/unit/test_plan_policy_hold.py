"""Pods are held back until the job's own NetworkPolicy exists (plan/children.py, plan/startup.py, reconciler.py).

A NetworkPolicy `<job>` the job does not own (a foreign one), or none at all (not created yet, refused), means the
job's pods would run unprotected: no pod (trainers, spares, the rendezvous store) is created until the job's own
policy is there; ReplicaFailure and its Event say why. A job with its network policy turned off is not held.
"""


from ddp_operator import names
from ddp_operator.plan import CREATE, plan
from ddp_operator.status import get_condition

from fake_api import fake_reconciler
from ddp_builders import NOW, job_body, later, make_job, observed, rdzv, trainer

FOREIGN = ("networkpolicy ml/mnist already exists and is not owned by this DDPJob (owned by nothing); "
           "delete or rename it and the operator creates its own")


def _pods_created(p):
    return sorted(a.name for a in p.actions if a.verb == CREATE and a.kind == "Pod")


def _cond(p, type_):
    return get_condition(p.status["conditions"], type_) or {}


def test_a_foreign_policy_holds_every_pod_and_says_why():
    job = make_job(spares=1)
    p = plan(job, {}, observed(service_exists=False, network_policy_exists=False, conflicts={"mnist": FOREIGN}),
             NOW)
    assert _pods_created(p) == []  # no trainer, no spare, no store pod
    cond = _cond(p, names.COND_REPLICA_FAILURE)
    assert (cond["status"], cond["reason"]) == ("True", names.REASON_CHILD_CONFLICT)
    assert "networkpolicy ml/mnist already exists" in cond["message"]
    assert "pods are held back until the job's own NetworkPolicy mnist exists" in cond["message"]
    assert p.status["reason"] == names.REASON_CHILD_CONFLICT and "held back" in p.status["message"]
    assert ("Warning", names.REASON_CHILD_CONFLICT) in [(e.type, e.reason) for e in p.events]
    assert not _cond(p, names.COND_CREATED)  # nothing was created that the condition could name
    # The foreign policy is removed: the next pass that sees the job's own policy creates every pod.
    freed = plan(job, p.status, observed(network_policy_exists=True, network_policy_uid="np"), later(31))
    assert _pods_created(freed) == ["mnist-0", "mnist-1", "mnist-2", "mnist-rdzv"]
    cond = _cond(freed, names.COND_REPLICA_FAILURE)
    assert (cond["status"], cond["reason"]) == ("False", names.REASON_CHILDREN_CREATED)


def test_a_missing_policy_is_created_first_and_pods_follow_once_it_exists():
    job = make_job()
    first = plan(job, {}, observed(service_exists=False, network_policy_exists=False), NOW)
    assert [(a.verb, a.kind) for a in first.actions] == [(CREATE, "NetworkPolicy"), (CREATE, "Service")]
    second = plan(job, first.status, observed(network_policy_exists=True, network_policy_uid="np"), NOW)
    assert _pods_created(second) == ["mnist-0", "mnist-1", "mnist-rdzv"]
    assert _cond(second, names.COND_CREATED)["status"] == "True"


def test_a_refused_policy_holds_the_pods_like_any_refused_create():
    refusal = 'cannot create NetworkPolicy mnist: 403 Forbidden: networkpolicies is forbidden'
    p = plan(make_job(), {}, observed(network_policy_exists=False, refusals={"mnist": refusal}), NOW)
    assert _pods_created(p) == []
    cond = _cond(p, names.COND_REPLICA_FAILURE)
    assert (cond["status"], cond["reason"]) == ("True", names.REASON_CREATE_FAILED)
    assert refusal in cond["message"] and "held back" in cond["message"]


def test_a_deleted_policy_holds_replacements_until_it_is_back():
    job = make_job()
    running = (rdzv(), trainer(0))  # mnist-1 is gone: its replacement waits for the policy
    p = plan(job, {}, observed(*running, network_policy_exists=False), NOW)
    assert [(a.verb, a.kind) for a in p.actions if a.verb == CREATE] == [(CREATE, "NetworkPolicy")]
    back = plan(job, p.status, observed(*running, network_policy_exists=True, network_policy_uid="np"), NOW)
    assert _pods_created(back) == ["mnist-1"]


def test_a_job_without_a_network_policy_is_never_held():
    job = make_job(networkPolicy={"enabled": False})
    p = plan(job, {}, observed(service_exists=False, network_policy_exists=False, conflicts={"mnist": FOREIGN}),
             NOW)
    assert _pods_created(p) == ["mnist-0", "mnist-1", "mnist-rdzv"]
    assert "held back" not in _cond(p, names.COND_REPLICA_FAILURE).get("message", "")


def test_a_held_job_still_fails_at_its_startup_timeout_naming_the_policy():
    job = make_job(failurePolicy={"startupTimeoutSeconds": 60})
    first = plan(job, {}, observed(network_policy_exists=False, conflicts={"mnist": FOREIGN}), NOW)
    late = plan(job, first.status, observed(network_policy_exists=False, conflicts={"mnist": FOREIGN}), later(61))
    assert late.status["phase"] == names.PHASE_FAILED
    assert late.status["reason"] == names.REASON_STARTUP_TIMEOUT and "networkpolicy ml/mnist" in late.status["message"]
    assert _pods_created(late) == []


# --- the shell: what reaches the API server ----------------------------------------------------------------
def _reconciler():
    return fake_reconciler(job_body(), policies=True)


def test_the_operator_creates_no_pod_beside_a_foreign_policy():
    r = _reconciler()
    r.api.conflicts.add("NetworkPolicy")
    r.reconcile("ml", "mnist")
    r.reconcile("ml", "mnist")  # the pass that reports the conflict
    assert [c for c in r.api.creates if c[0] == "Pod"] == []
    status = r.jobs.get(("ml", "mnist")).objects["0b5c-uid"].written
    cond = get_condition(status["conditions"], names.COND_REPLICA_FAILURE)
    assert (cond["status"], cond["reason"]) == ("True", names.REASON_CHILD_CONFLICT)
    assert any(e[2] == names.REASON_CHILD_CONFLICT and "networkpolicy ml/mnist" in e[3] for e in r.api.events)
    # The user deletes the foreign policy; when its conflict is looked at again, the policy and then every pod.
    r.api.conflicts.discard("NetworkPolicy")
    r.jobs.get(("ml", "mnist")).conflicts["mnist"] = (FOREIGN, 0.0)  # the conflict's retry is due
    r.reconcile("ml", "mnist")
    kinds = [c[0] for c in r.api.creates]
    assert "NetworkPolicy" in kinds and kinds.index("NetworkPolicy") < kinds.index("Pod")
    assert sorted(n for k, n in r.api.creates if k == "Pod") == ["mnist-0", "mnist-1", "mnist-rdzv"]


def test_a_fresh_job_gets_its_policy_and_its_pods_in_one_pass():
    """Holding pods for the policy costs no extra pass: the policy is created first, then the pods, in one call."""
    r = _reconciler()
    r.reconcile("ml", "mnist")
    assert r.api.creates[0] == ("NetworkPolicy", "mnist")
    assert sorted(n for k, n in r.api.creates if k == "Pod") == ["mnist-0", "mnist-1", "mnist-rdzv"]
    assert len(r.api.patches) == 1  # one status write for the pass


def test_a_policy_deleted_before_the_watch_showed_it_is_put_back_at_once():
    """The operator remembers a policy it created until the watch shows it (so no pass creates it twice); its DELETED
    event ends that memory, or the next pass would take the deleted policy for one the watch is late with."""
    import copy

    from ddp_operator import handlers

    r = _reconciler()
    r.indexes["network_policies_by_job"] = _LateWatch()  # the create's ADDED event has not arrived yet
    r.reconcile("ml", "mnist")
    assert [n for k, n in r.api.creates if k == "NetworkPolicy"] == ["mnist"]
    memo = type("Memo", (), {"reconciler": r})()
    handlers.on_network_policy(event={"type": "DELETED"}, namespace="ml", name="mnist", uid="pod-uid-1",
                               memo=copy.copy(memo), **r.indexes)
    assert r.event_passes.settle()  # the event's pass runs off kopf's worker
    assert [n for k, n in r.api.creates if k == "NetworkPolicy"] == ["mnist", "mnist"]


class _LateWatch(dict):
    """An index the creates never reach."""

    def setdefault(self, key, default=None):
        return []
