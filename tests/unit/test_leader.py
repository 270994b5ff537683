"""leader.LeaderElector against an in-memory Lease store."""

import copy
from datetime import datetime, timedelta, timezone

from ddp_operator.leader import LeaderElector


class FakeApi:
    def __init__(self):
        self.lease = None
        self.version = 0

    def read_lease(self, namespace, name):
        return copy.deepcopy(self.lease)

    def write_lease(self, namespace, body, *, create):
        if create and self.lease is not None:
            return False
        if not create and body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            return False
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return True


def test_first_comer_leads_and_renews():
    api = FakeApi()
    a = LeaderElector(api, "ops", "ddp-operator", "a")
    assert a._try()
    assert api.lease["spec"]["holderIdentity"] == "a"
    assert a._try()  # renewal
    assert api.lease["spec"]["leaseTransitions"] == 0


def test_standby_waits_until_the_lease_expires():
    api = FakeApi()
    a = LeaderElector(api, "ops", "ddp-operator", "a")
    b = LeaderElector(api, "ops", "ddp-operator", "b")
    assert a._try() and not b._try()
    stale = datetime.now(timezone.utc) - timedelta(seconds=60)
    api.lease["spec"]["renewTime"] = stale.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert b._try()
    assert api.lease["spec"]["holderIdentity"] == "b" and api.lease["spec"]["leaseTransitions"] == 1
