"""reconciler.Reconciler when the API server refuses children (quota, PodSecurity) and when nodes die: per-child
exponential backoff, what the user sees, one Event per distinct refusal, nothing recreated, node reads cached."""

import copy
import json
import time
from datetime import datetime, timezone

from kubernetes.client.exceptions import ApiException

from ddp_operator import backoff, names
from ddp_operator.backoff import create_backoff
from ddp_operator.observed import NodeState
from ddp_operator.reconciler import Reconciler

from ddp_builders import job_body


def _refusal(name, message):
    e = ApiException(status=403, reason="Forbidden")
    e.body = json.dumps({"message": f'pods "{name}" is forbidden: {message}'})
    return e


class QuotaApi:
    """Pods beyond `limit` are refused as a ResourceQuota refuses them; `refuse_kinds` are refused outright."""

    def __init__(self, index, limit=None, refuse_kinds=()):
        self.index, self.limit, self.refuse_kinds = index, limit, set(refuse_kinds)
        self.events, self.creates, self.node_reads = [], [], []
        self.n = 0

    def create(self, body):
        name, kind = body["metadata"]["name"], body["kind"]
        self.creates.append(name)
        pods = sum(len(v) for v in self.index["pods_by_job"].values())
        if kind in self.refuse_kinds or (kind == "Pod" and self.limit is not None and pods >= self.limit):
            raise _refusal(name, f"exceeded quota: q, requested: pods=1, used: pods={pods}, limited: pods={self.limit}")
        self.n += 1
        obj = copy.deepcopy(dict(body))
        obj["metadata"]["uid"] = f"uid-{self.n}"
        key = (obj["metadata"]["namespace"], "mnist")
        if kind == "Pod":
            self.index["pods_by_job"].setdefault(key, []).append(obj)
        elif kind == "Service":
            self.index["services_by_job"].setdefault(key, []).append(True)
        return obj

    def delete_pod(self, namespace, name, uid, force=False, grace_seconds=None):
        pass

    def patch_status(self, namespace, name, status):
        pass

    def post_event(self, job, type_, reason, message, component):
        self.events.append((type_, reason, message))

    def node_ready(self, name):
        return True

    not_ready_since = datetime(2025, 1, 1, tzinfo=timezone.utc)

    def node_state(self, name):
        self.node_reads.append(name)
        return NodeState(ready=False, since=self.not_ready_since)


def _setup(**api_kw):
    index = {"ddpjobs_by_key": {}, "pods_by_job": {}, "services_by_job": {}}
    r = Reconciler(QuotaApi(index, **api_kw))
    r.indexes = index
    body = job_body()
    index["ddpjobs_by_key"][("ml", "mnist")] = [body]
    return r, body


def _retry_due(r):
    """Jump past every child's backoff (instead of sleeping)."""
    refusals = r.jobs.get(("ml", "mnist")).refusals
    for name, refusal in list(refusals.items()):
        refusals[name] = backoff.Refusal(refusal.message, refusal.attempts, 0.0)


def _status(r, body):
    return r.jobs.get(("ml", "mnist")).objects[body["metadata"]["uid"]].written


def _cond(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_backoff_doubles_from_one_second_and_is_capped():
    assert [create_backoff(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert create_backoff(10**6) == backoff.CREATE_BACKOFF_MAX_SECONDS


def test_quota_refusal_backs_off_per_child_reports_once_and_starts_when_the_quota_goes():
    r, body = _setup(limit=1)
    key = ("ml", "mnist")
    r.reconcile(*key)  # the store pod fits; both trainers are refused
    refused = r.jobs.get(key).refusals
    assert sorted(refused) == ["mnist-0", "mnist-1"] and {x.attempts for x in refused.values()} == {1}
    assert r.jobs.get(key).wakeup <= time.monotonic() + 0.1  # reported at once, not after the backoff
    r.reconcile(*key)  # the pass that reports it; the retries are not due: nothing is tried
    status = _status(r, body)
    cond = _cond(status, names.COND_REPLICA_FAILURE)
    assert cond["status"] == "True" and cond["reason"] == names.REASON_CREATE_FAILED
    assert "exceeded quota: q" in cond["message"] and "exceeded quota: q" in status["message"]
    assert status["reason"] == names.REASON_CREATE_FAILED
    assert r.api.creates.count("mnist-0") == 1
    # Retries: each one doubles that child's delay; no Event after the first.
    for attempt in range(2, 6):
        _retry_due(r)
        r.reconcile(*key)
        assert r.jobs.get(key).refusals["mnist-0"].attempts == attempt
        left = r.jobs.get(key).refusals["mnist-0"].retry_at - time.monotonic()
        assert create_backoff(attempt) - 1 < left <= create_backoff(attempt)
    assert r.api.creates.count("mnist-0") == 5
    assert len([e for e in r.api.events if e[1] == names.REASON_CREATE_FAILED]) == 1, r.api.events
    # The quota is deleted: the next retry creates both, the backoff is forgotten, the condition turns False,
    # and the job itself was never recreated (same status object, same store pod).
    r.api.limit = None
    _retry_due(r)
    r.reconcile(*key)
    assert not r.jobs.get(key).refusals
    r.reconcile(*key)
    cond = _cond(_status(r, body), names.COND_REPLICA_FAILURE)
    assert cond["status"] == "False" and cond["reason"] == names.REASON_CHILDREN_CREATED
    assert sorted(p["metadata"]["name"] for p in r.indexes["pods_by_job"][key]) == ["mnist-0", "mnist-1",
                                                                                   "mnist-rdzv"]
    assert r.api.creates.count("mnist-rdzv") == 1


def test_a_refused_network_policy_holds_back_the_pods():
    r, body = _setup(refuse_kinds={"NetworkPolicy"})
    r.indexes["network_policies_by_job"] = {}
    r.reconcile("ml", "mnist")
    assert "mnist" in r.jobs.get(("ml", "mnist")).refusals
    assert not r.indexes["pods_by_job"]  # no pod without the policy that protects it
    r.reconcile("ml", "mnist")
    assert "NetworkPolicy mnist" in _cond(_status(r, body), names.COND_REPLICA_FAILURE)["message"]


def test_node_states_are_read_once_per_node_and_cache_period():
    r, body = _setup()
    # NotReady just now: within nodeLostTimeoutSeconds its pods are not force-deleted (passes would not see them)
    r.api.not_ready_since = datetime.now(timezone.utc)
    key = ("ml", "mnist")
    r.reconcile(*key)
    for p in r.indexes["pods_by_job"][key]:  # Running on node-2, not Ready: the node controller's mark
        p["spec"]["nodeName"] = "node-2"
        p["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}
    r.reconcile(*key)
    r.reconcile(*key)
    assert r.api.node_reads == ["node-2"]
    r.nodes.reads.entries["node-2"] = (r.nodes.reads.entries["node-2"][0], 0.0)  # the cache period is over
    r.reconcile(*key)
    assert r.api.node_reads == ["node-2", "node-2"]
