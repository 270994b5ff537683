"""A large job's passes while its pods start (issue 28): each pod event asked for a pass, and a pass of a 1,000-node
job read and observed all its pods. On the kwok simulation that was ten passes a second for 40 s, 58 ms of each
observing pods: 25 s of the operator's CPU for one job's start. A pass now observes again only the pods whose
resourceVersion moved, and a pass for a child's event starts N x PACE_SECONDS_PER_POD after the job's last one."""

from __future__ import annotations

import time

from ddp_builders import job_body, trainer
from fake_api import fake_reconciler

from ddp_operator import jobs as jobs_module
from ddp_operator.jobs import JobRecord
from ddp_operator.reconciler import PACE_SECONDS_PER_POD


def _versioned(i, version):
    pod = trainer(i)
    pod["metadata"]["resourceVersion"] = str(version)
    return pod


def test_a_pass_observes_again_only_the_pods_that_changed(monkeypatch):
    calls = []
    real = jobs_module.observe_pod
    monkeypatch.setattr(jobs_module, "observe_pod", lambda pod: calls.append(pod["metadata"]["name"]) or real(pod))
    record = JobRecord()
    pods = [_versioned(i, 10 + i) for i in range(3)]
    first = record.observe(pods)
    assert calls == ["mnist-0", "mnist-1", "mnist-2"]
    # The index hands the same pods again (new dicts, same versions): nothing is observed again.
    calls.clear()
    again = record.observe([_versioned(i, 10 + i) for i in range(3)])
    assert calls == [] and again == first and all(a is b for a, b in zip(again, first))
    # One pod changed (its version moved), one is gone, one has no version (always observed again).
    changed = _versioned(1, 99)
    changed["status"]["phase"] = "Failed"
    unversioned = trainer(5)
    states = record.observe([_versioned(0, 10), changed, unversioned])
    assert calls == ["mnist-1", "mnist-5"]
    assert [s.phase for s in states] == ["Running", "Failed", "Running"]
    assert set(record.states) == {pods[0]["metadata"]["uid"], changed["metadata"]["uid"]}


def _after_a_pass(nodes):
    r = fake_reconciler(job_body(nodes=nodes))
    key = ("ml", "mnist")
    r.reconcile(*key)  # creates the pods
    r.reconcile(*key)  # sees them
    return r, key


def test_a_large_jobs_event_pass_waits_its_pace_and_the_events_meanwhile_join_it(monkeypatch):
    r, key = _after_a_pass(1000)
    record = r.jobs.record(key)
    assert len(record.seen) > 900  # the fake API's UIDs repeat a little
    pace = r.jobs.pace_left(key, PACE_SECONDS_PER_POD)
    assert 0.05 < pace <= len(record.seen) * PACE_SECONDS_PER_POD
    passes = []
    real = r.reconcile
    monkeypatch.setattr(r, "reconcile", lambda *k, **kw: passes.append((k, time.monotonic())) or real(*k, **kw))
    t0 = time.monotonic()
    for _ in range(5):  # a burst of pod events: one pass, started once the pace is over
        r.child_changed(*key)
    assert r.event_passes.settle()
    assert [k for k, _ in passes] == [key] and passes[0][1] - t0 >= pace - 0.01
    # Once that long has passed since the last pass, an event's pass starts at once.
    time.sleep(len(record.seen) * PACE_SECONDS_PER_POD)
    assert r.jobs.pace_left(key, PACE_SECONDS_PER_POD) <= 0
    t1 = time.monotonic()
    r.child_changed(*key)
    assert r.event_passes.settle() and len(passes) == 2 and passes[1][1] - t1 < 0.05


def test_a_small_jobs_event_pass_is_not_held():
    r, key = _after_a_pass(2)
    assert r.jobs.pace_left(key, PACE_SECONDS_PER_POD) < 0.001  # 3 pods: 0.3 ms
    assert r.jobs.pace_left(("ml", "unknown"), PACE_SECONDS_PER_POD) == 0.0
