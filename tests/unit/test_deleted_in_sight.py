"""A pod deleted while the operator watches is recorded once, as deleted (PodDeleted): in the pass that sees its
tombstone, at any fraction of a second, and in a pass that runs between kopf dropping it from the index and on_pod
keeping its tombstone. Only a pod this process never saw can have vanished unseen (NodeMissing). CI failed the
user-image e2e test with lastFailure NodeMissing (budget none): the tombstone's own pass had recorded the pod twice."""

from datetime import datetime, timezone

import pytest

from ddp_operator import names, reconciler

from ddp_operator.reconciler import Reconciler

from fake_api import FakeApi, fake_reconciler, running_job


def _running(r, name="user"):
    key, body, _ = running_job(r, name)
    return key, body


def _drop_from_index(r, key, name):
    """What kopf does with a DELETED event before any handler runs: the pod leaves the index."""
    pods = r.indexes["pods_by_job"][key]
    gone = next(p for p in pods if p["metadata"]["name"] == name)
    pods.remove(gone)
    return gone


@pytest.fixture(autouse=True)
def half_past(monkeypatch):
    """Passes at x.5 s: an attempt's time (whole seconds) is earlier than the exact start of its recovery."""
    monkeypatch.setattr(reconciler, "_now", lambda: datetime.now(timezone.utc).replace(microsecond=500_000))


def test_the_tombstones_pass_records_the_deleted_pod_once():
    r = fake_reconciler()
    key, body = _running(r)
    r.jobs.tombstone(key, _drop_from_index(r, key, "user-0"))
    r.reconcile(*key)
    st = body["status"]
    assert [(a["pod"], a["cause"], a["counted"]) for a in st["attempts"]] == [("user-0", "PodDeleted", True)]
    assert (st["lastFailure"]["reason"], st["lastFailure"]["budget"], st["infraRestarts"]) == \
        ("PodDeleted", "infraBackoffLimit", 1), st["lastFailure"]


def test_a_pass_between_the_index_and_the_tombstone_records_the_pod_as_deleted():
    r = fake_reconciler()
    key, body = _running(r)
    gone = _drop_from_index(r, key, "user-0")
    r.reconcile(*key)  # the pass of another event, before on_pod kept the tombstone
    st = body["status"]
    assert (st["lastFailure"]["reason"], st["lastFailure"]["pod"]) == ("PodDeleted", "user-0"), st["lastFailure"]
    assert gone["metadata"]["uid"] in st["recordedPods"]
    assert st["infraRestarts"] == 1

    r.jobs.tombstone(key, gone)  # the DELETED event's handler, late: nothing is counted twice
    r.reconcile(*key)
    assert (body["status"]["infraRestarts"], body["status"]["lastFailure"]["reason"]) == (1, "PodDeleted")
    assert [n for k, n in r.api.creates if k == "Pod"].count("user-0") == 2  # replaced once


def test_a_pod_this_process_never_saw_has_vanished_unseen():
    r = fake_reconciler()
    key, body = _running(r)
    _drop_from_index(r, key, "user-0")
    restarted = Reconciler(FakeApi(r.indexes))  # a new operator: the same cluster, nothing seen yet
    restarted.indexes = r.indexes
    restarted.reconcile(*key)
    assert body["status"]["lastFailure"]["reason"] == names.REASON_NODE_MISSING, body["status"]["lastFailure"]
