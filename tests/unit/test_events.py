"""Every transition a user would look for in `kubectl describe ddpjob` carries an Event with a stable reason from
names.py: phase changes, scaling, TTL deletion, force-deleted pods, and children the API server refuses."""

import json

import pytest
from kubernetes.client.exceptions import ApiException

from ddp_operator import names
from ddp_operator.reconciler import Reconciler
from ddp_operator.plan import DELETE_JOB, plan
from ddp_operator.status import Event

from ddp_builders import job_body, later, make_job, observed, rdzv, trainer

REASONS = {v for k, v in vars(names).items() if k.startswith("REASON_")}


def _running(**kw):
    job = make_job(**kw)
    first = plan(job, {}, observed(service_exists=False), later(0))
    return job, plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), later(0)).status


def _scenarios():
    """(name, job, previous status, observed, now) for each phase change the planner makes."""
    job, running = _running()
    fresh = plan(job, {}, observed(service_exists=False), later(0)).status
    failed = plan(job, running, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1)), later(1))
    suspended_job = make_job(runPolicy={"suspend": True})
    suspended = plan(suspended_job, running, observed(rdzv(), trainer(0), trainer(1)), later(1)).status
    deadline_job, deadline_running = _running(runPolicy={"activeDeadlineSeconds": 10})
    return [
        ("none->Pending", job, {}, observed(service_exists=False), later(0)),
        ("Pending->Running", job, fresh, observed(rdzv(), trainer(0), trainer(1)), later(1)),
        ("Running->Restarting", job, running,
         observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1)), later(1)),
        ("Restarting->Running", job, failed.status, observed(rdzv(), trainer(0), trainer(1, uid="n")), later(5)),
        ("Running->Succeeded", job, running,
         observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0), trainer(1, phase="Succeeded", exit_code=0)),
         later(1)),
        ("Running->Failed", deadline_job, deadline_running, observed(rdzv(), trainer(0), trainer(1)), later(10)),
        ("Running->Suspended", suspended_job, running, observed(rdzv(), trainer(0), trainer(1)), later(1)),
        ("Suspended->Pending", job, suspended, observed(), later(2)),
    ]


@pytest.mark.parametrize("case", _scenarios(), ids=lambda c: c[0])
def test_every_phase_change_carries_an_event_with_a_stable_reason(case):
    _, job, prev, obs, now = case
    p = plan(job, prev, obs, now)
    assert p.status["phase"] != prev.get("phase")
    assert p.events, "a phase change without an Event"
    assert {e.reason for e in p.events} <= REASONS
    assert p.status["reason"] in {e.reason for e in p.events} | {names.REASON_WAITING}


def test_a_phase_change_without_a_condition_change_gets_its_own_event():
    from ddp_operator.plan import phase_event
    status = {"phase": names.PHASE_RUNNING, "reason": names.REASON_WAITING, "message": "1/2 training pods running"}
    (event,) = phase_event(names.PHASE_RESTARTING, status, [])
    assert event.reason == names.REASON_WAITING and "Restarting -> Running" in event.message
    assert phase_event(names.PHASE_RUNNING, status, []) == []
    assert phase_event(names.PHASE_PENDING, status, [Event("Normal", names.REASON_RUNNING, "")]) == []


def test_scaling_carries_an_event_once():
    job, status = _running(nodes=2, minNodes=1, maxNodes=4)
    up = make_job(nodes=3, minNodes=1, maxNodes=4)
    p = plan(up, status, observed(rdzv(), trainer(0), trainer(1)), later(1))
    (scaled,) = [e for e in p.events if e.reason == names.REASON_SCALED]
    assert "from 2 to 3" in scaled.message
    again = plan(up, p.status, observed(rdzv(), trainer(0), trainer(1), trainer(2)), later(2))
    assert not [e for e in again.events if e.reason == names.REASON_SCALED]


def test_ttl_deletion_carries_an_event():
    job, status = _running(runPolicy={"ttlSecondsAfterFinished": 30, "cleanPodPolicy": "None"})
    done = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0),
                                      trainer(1, phase="Succeeded", exit_code=0)), later(10))
    expired = plan(job, done.status, observed(), later(40))
    assert [a.verb for a in expired.actions] == [DELETE_JOB]
    assert [e.reason for e in expired.events] == [names.REASON_TTL_EXPIRED]


class _RefusingApi:
    """An Api whose pod creates the API server refuses (as PodSecurity admission does)."""

    def __init__(self):
        self.events, self.created = [], []

    def create(self, body):
        if body["kind"] == "Pod":
            e = ApiException(status=403, reason="Forbidden")
            e.body = json.dumps({"message": f'pods "{body["metadata"]["name"]}" is forbidden: violates PodSecurity'})
            raise e
        self.created.append(body["metadata"]["name"])
        return body

    def patch_status(self, *_):
        pass

    def post_event(self, job, type_, reason, message, component):
        self.events.append((type_, reason, message))


def test_refused_pod_create_is_a_warning_event_posted_once():
    api = _RefusingApi()
    r = Reconciler(api)
    body = job_body()
    for _ in range(3):  # the refusal, the pass that reports it, a pass while the retries back off
        r.reconcile("ml", "mnist", body)
    refused = [e for e in api.events if e[1] == names.REASON_CREATE_FAILED]
    assert len(refused) == 1, api.events
    assert refused[0][0] == "Warning" and "violates PodSecurity" in refused[0][2] and "mnist-rdzv" in refused[0][2]
    # The pass's own Events are posted although its creates were refused.
    assert (names.REASON_CREATED in {e[1] for e in api.events})
