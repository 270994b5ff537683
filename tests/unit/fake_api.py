"""An in-memory stand-in for ddp_operator.k8s.Api, and a Reconciler wired to it and to in-memory indexes: what the
shell's tests (test_handlers, test_poller, test_plan_policy_hold, test_spec_template) drive passes through. It records
what a pass writes (`creates`: (kind, name); `patches`: ((namespace, name), status); `events`: (job name, type,
reason, message); `config_maps`: (namespace, name) -> ConfigMap, with a resourceVersion checked on replace); a name
or a kind in `conflicts` meets a foreign object (k8s.ChildConflict)."""

import copy

from ddp_operator import names
from ddp_operator.k8s import ChildConflict
from ddp_operator.observed import NodeState
from ddp_operator.reconciler import Reconciler

from ddp_builders import job_body


class FakeApi:
    def __init__(self, index):
        self.index = index
        self.patches, self.events, self.deleted, self.creates = [], [], [], []
        self.conflicts = set()
        self.policy_patches = []
        self.config_maps = {}
        self.n = 0

    def create(self, body):
        kind, name = body["kind"], body["metadata"]["name"]
        if name in self.conflicts or kind in self.conflicts:
            raise ChildConflict(kind, body["metadata"]["namespace"], name, [])
        self.creates.append((kind, name))
        self.n += 1
        obj = copy.deepcopy(dict(body))
        obj["metadata"]["uid"] = f"pod-uid-{self.n}"
        key = (obj["metadata"]["namespace"], obj["metadata"]["labels"].get(names.LABEL_JOB_NAME, name))
        if kind == "Pod":
            self.index["pods_by_job"].setdefault(key, []).append(obj)
        elif kind == "Service":
            self.index["services_by_job"].setdefault(key, []).append(True)
        elif "network_policies_by_job" in self.index:
            self.index["network_policies_by_job"].setdefault(key, []).append(
                (obj["metadata"]["uid"], tuple(o["uid"] for o in obj["metadata"]["ownerReferences"]), obj["spec"]))
        return obj

    def delete_pod(self, namespace, name, uid, force=False, grace_seconds=None):
        self.deleted.append(name)

    def delete_job(self, namespace, name, uid):
        pass

    def patch_status(self, namespace, name, status):
        self.patches.append(((namespace, name), copy.deepcopy(dict(status))))
        for body in self.index["ddpjobs_by_key"].get((namespace, name), []):
            body.setdefault("status", {}).update(copy.deepcopy(dict(status)))

    def read_config_map(self, namespace, name):
        found = self.config_maps.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def write_config_map(self, body, *, replace):
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        current = self.config_maps.get(key)
        if (current is None) == replace or (
                replace and body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]):
            return False
        self.n += 1
        obj = copy.deepcopy(dict(body))
        obj["metadata"]["resourceVersion"] = str(self.n)
        self.config_maps[key] = obj
        return True

    def patch_network_policy(self, namespace, name, uid, patch):
        self.policy_patches.append((name, uid, copy.deepcopy(dict(patch))))
        policies = self.index["network_policies_by_job"].get((namespace, name), [])
        self.index["network_policies_by_job"][(namespace, name)] = [
            (u, owners, {**spec, **copy.deepcopy(patch["spec"])} if u == uid else spec) for u, owners, spec in policies]

    def post_event(self, job, type_, reason, message, component):
        self.events.append((job["metadata"]["name"], type_, reason, message))

    def node_state(self, name):
        return NodeState(ready=True)


def fake_reconciler(*jobs: dict, policies: bool = False) -> Reconciler:
    """A Reconciler on a FakeApi that knows `jobs`; `r.indexes` are the kopf indexes it reads (the NetworkPolicies'
    too with `policies`), `r.api` the fake."""
    index = {"ddpjobs_by_key": {(j["metadata"]["namespace"], j["metadata"]["name"]): [j] for j in jobs},
             "pods_by_job": {}, "services_by_job": {}, **({"network_policies_by_job": {}} if policies else {})}
    r = Reconciler(FakeApi(index))
    r.indexes = index
    return r


def running_job(r, name, **spec):
    """A job whose trainer pod i runs on 127.0.0.<i + 2>."""
    body = job_body(name=name, **spec)
    body["metadata"]["uid"] = f"uid-{name}"
    key = ("ml", name)
    r.indexes["ddpjobs_by_key"][key] = [body]
    r.reconcile(*key)
    trainers = sorted((p for p in r.indexes["pods_by_job"][key]
                       if p["metadata"]["labels"][names.LABEL_ROLE] == names.ROLE_TRAINER),
                      key=lambda p: p["metadata"]["name"])
    for p in r.indexes["pods_by_job"][key]:
        p["status"] = {"phase": "Running", "podIP": "127.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]}
    for i, p in enumerate(trainers):
        p["status"]["podIP"] = f"127.0.0.{i + 2}"
    r.reconcile(*key)
    obj = r.jobs.get(key).objects[body["metadata"]["uid"]]
    assert obj.written["phase"] == names.PHASE_RUNNING
    return key, body, obj
