"""leader.LeaderElector against an in-memory Lease store and a fake clock: who leads, when a standby may take
over, and that the leader gives up before that moment, so two leaders never overlap."""

import copy
from datetime import datetime, timedelta, timezone

import pytest

from ddp_operator.leader import LeaderElector


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class FakeApi:
    def __init__(self):
        self.lease = None
        self.version = 0
        self.down = False
        self.timeouts = []

    def read_lease(self, namespace, name, *, timeout):
        self.timeouts.append(timeout)
        if self.down:
            raise ConnectionError("API server unreachable")
        return copy.deepcopy(self.lease)

    def write_lease(self, namespace, body, *, create, timeout):
        self.timeouts.append(timeout)
        if self.down:
            raise ConnectionError("API server unreachable")
        if create and self.lease is not None:
            return False
        if not create and body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            return False
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return True


def _elector(api, identity, clock, wall=None, lost=None, **kw):
    return LeaderElector(api, "ops", "ddp-operator", identity, clock=clock,
                         wall=wall or (lambda: datetime.now(timezone.utc)),
                         on_lost=(lambda: lost.append(clock())) if lost is not None else (lambda: None), **kw)


def test_first_comer_leads_and_renews():
    api, clock = FakeApi(), Clock()
    a = _elector(api, "a", clock)
    assert a.try_acquire()
    assert api.lease["spec"]["holderIdentity"] == "a"
    clock.t += 2
    assert a.renew_step() == a.retry_seconds  # renewal
    assert api.lease["spec"]["leaseTransitions"] == 0


def test_standby_waits_a_full_lease_on_its_own_clock_however_old_the_renew_time_looks():
    api, clock = FakeApi(), Clock()
    a = _elector(api, "a", clock)
    # b's wall clock runs 60 s ahead of a's (clock skew): a's renewTime looks long expired to b.
    b = _elector(api, "b", clock, wall=lambda: datetime.now(timezone.utc) + timedelta(seconds=60))
    assert a.try_acquire()
    api.lease["spec"]["renewTime"] = (datetime.now(timezone.utc) - timedelta(seconds=60)).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ")
    assert not b.try_acquire()  # first sight of this record
    clock.t += a.lease_seconds - 0.5
    assert not b.try_acquire()  # unchanged, but not yet for a full lease on b's clock
    clock.t += 1
    assert b.try_acquire()
    assert api.lease["spec"]["holderIdentity"] == "b" and api.lease["spec"]["leaseTransitions"] == 1


def test_a_renewal_restarts_the_standbys_count():
    api, clock = FakeApi(), Clock()
    a, b = _elector(api, "a", clock), _elector(api, "b", clock)
    assert a.try_acquire() and not b.try_acquire()
    for _ in range(10):  # a keeps renewing every 2 s; b keeps looking
        clock.t += 2
        assert a.renew_step() is not None
        assert not b.try_acquire()
    assert api.lease["spec"]["holderIdentity"] == "a"


def test_leader_gives_up_before_a_standby_can_take_over():
    api, clock, lost = FakeApi(), Clock(), []
    a = _elector(api, "a", clock, lost=lost)
    b = _elector(api, "b", clock)
    assert a.try_acquire()
    b.try_acquire()
    last_renewal = clock()
    api_down_for_a = True
    took_over = None
    # Step both through time in small increments: a cannot reach the API (e.g. a partition), b can.
    wait = a.retry_seconds
    next_a = clock() + wait
    while clock() < last_renewal + 60 and (took_over is None or not lost):
        clock.t = round(clock.t + 0.1, 3)
        if not lost and clock() >= next_a:
            api.down = api_down_for_a
            wait = a.renew_step()
            api.down = False
            if wait is not None:
                next_a = clock() + wait
        if took_over is None and b.try_acquire():
            took_over = clock()
    assert lost, "the leader never gave up"
    assert lost[0] - last_renewal <= a.renew_deadline_seconds + 0.11
    assert took_over is not None and took_over >= last_renewal + a.lease_seconds
    assert lost[0] < took_over


def test_leader_that_sees_another_holder_stops_at_once():
    api, clock, lost = FakeApi(), Clock(), []
    a = _elector(api, "a", clock, lost=lost)
    assert a.try_acquire()
    api.lease["spec"]["holderIdentity"] = "intruder"
    api.lease["metadata"]["resourceVersion"] = "99"
    clock.t += 2
    assert a.renew_step() is None and lost == [clock()]


def test_every_request_has_a_timeout_within_the_renew_deadline():
    api, clock = FakeApi(), Clock()
    a = _elector(api, "a", clock)
    assert a.try_acquire()
    clock.t += 2
    a.renew_step()
    assert api.timeouts and all(0 < t <= a.renew_deadline_seconds for t in api.timeouts)


def test_renew_deadline_must_be_shorter_than_the_lease():
    with pytest.raises(ValueError, match="shorter than the lease"):
        LeaderElector(FakeApi(), "ops", "l", "a", lease_seconds=10, renew_deadline_seconds=10)
