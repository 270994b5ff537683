"""The Service and NetworkPolicy a pass created are remembered until the watch shows them (reconciler._just_created):
a pass that runs before the watch caught up creates neither again (each extra create is a write, and an
AlreadyExists answer); a DELETED event ends the memory, so a child deleted before the watch ever showed it is put
back at once."""

from __future__ import annotations

import copy

from ddp_operator import handlers

from fake_api import fake_reconciler
from ddp_builders import job_body


class _LateWatch(dict):
    """An index the creates never reach (the ADDED events have not arrived)."""

    def setdefault(self, key, default=None):
        return []


def _reconciler():
    r = fake_reconciler(job_body(), policies=True)
    r.indexes["services_by_job"] = _LateWatch()
    r.indexes["network_policies_by_job"] = _LateWatch()
    return r


def _created(r, kind):
    return [n for k, n in r.api.creates if k == kind]


def test_a_pass_before_the_watch_caught_up_creates_no_child_twice():
    r = _reconciler()
    r.reconcile("ml", "mnist")
    r.reconcile("ml", "mnist")  # e.g. woken by its pods' events, the Service's and policy's still on their way
    assert _created(r, "Service") == ["mnist"] and _created(r, "NetworkPolicy") == ["mnist"]


def test_a_service_deleted_before_the_watch_showed_it_is_put_back_at_once():
    r = _reconciler()
    r.reconcile("ml", "mnist")
    uid = next(u for u, (kind, name) in zip(_uids(r), r.api.creates) if kind == "Service")
    memo = type("Memo", (), {"reconciler": r})()
    handlers.on_service(event={"type": "DELETED"}, namespace="ml", name="mnist", uid=uid, memo=copy.copy(memo),
                        **r.indexes)
    assert r.event_passes.settle()  # the event's pass runs off kopf's worker
    assert _created(r, "Service") == ["mnist", "mnist"]
    handlers.on_service(event={"type": "MODIFIED"}, namespace="ml", name="mnist", uid=uid, memo=copy.copy(memo),
                        **r.indexes)
    assert r.event_passes.settle()
    assert _created(r, "Service") == ["mnist", "mnist"]  # only a deletion brings a pass


def _uids(r):
    """The UIDs FakeApi gave its creates, in order."""
    return [f"pod-uid-{i + 1}" for i in range(len(r.api.creates))]
