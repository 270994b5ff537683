"""An in-memory stand-in for ddp_operator.k8s.Api, and a Reconciler wired to it and to in-memory indexes: what the
shell's tests (test_handlers, test_poller) drive passes through. It records what a pass writes; a name in
`conflicts` meets a foreign object (k8s.ChildConflict)."""

import copy

from ddp_operator import names
from ddp_operator.k8s import ChildConflict
from ddp_operator.reconciler import Reconciler


class FakeApi:
    def __init__(self, index):
        self.index = index
        self.patches, self.events, self.deleted = [], [], []
        self.conflicts = set()
        self.n = 0

    def create(self, body):
        name = body["metadata"]["name"]
        if name in self.conflicts:
            raise ChildConflict(body["kind"], body["metadata"]["namespace"], name, [])
        self.n += 1
        obj = copy.deepcopy(dict(body))
        obj["metadata"]["uid"] = f"pod-uid-{self.n}"
        key = (obj["metadata"]["namespace"], obj["metadata"]["labels"].get(names.LABEL_JOB_NAME, name))
        if body["kind"] == "Pod":
            self.index["pods_by_job"].setdefault(key, []).append(obj)
        else:
            self.index["services_by_job"].setdefault(key, []).append(True)
        return obj

    def delete_pod(self, namespace, name, uid, force=False, grace_seconds=None):
        self.deleted.append(name)

    def delete_job(self, namespace, name, uid):
        pass

    def patch_status(self, namespace, name, status):
        self.patches.append(((namespace, name), copy.deepcopy(dict(status))))
        for body in self.index["ddpjobs_by_key"].get((namespace, name), []):
            body.setdefault("status", {}).update(copy.deepcopy(dict(status)))

    def post_event(self, job, type_, reason, message, component):
        self.events.append((job["metadata"]["name"], type_, reason, message))

    def node_ready(self, name):
        return True


def fake_reconciler() -> Reconciler:
    """A Reconciler on a FakeApi; `r.indexes` are the kopf indexes it reads, `r.api` the fake."""
    index = {"ddpjobs_by_key": {}, "pods_by_job": {}, "services_by_job": {}}
    r = Reconciler(FakeApi(index))
    r.indexes = index
    return r
