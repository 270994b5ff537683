"""poller.ProgressPoller with real HTTP servers on loopback: every pod is probed at once (each with its own
deadline), a newer step from any pod resets the hang clock, a malformed report is an Event once, and one job's
failure to schedule never stops the others' probes."""

import dataclasses
import threading
import time

from ddp_operator import names, progress
from ddp_trainer.testing import free_port

from fake_api import fake_reconciler, running_job
from ddp_builders import ProgressServer, Silent, job_body


def _reconciler():
    return fake_reconciler()


def _timed_poll(r, key, servers):
    """One poll of `key` while `servers` stand in for its pods (closed after); returns the poll's seconds."""
    try:
        started = time.monotonic()
        r.poller.poll(key)
        return time.monotonic() - started
    finally:
        for s in servers:
            s.close()


def test_an_unreachable_rank0_is_not_hung_while_another_pod_reports_a_newer_step(monkeypatch):
    port = free_port()
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    r = _reconciler()
    key, body, obj = running_job(r, "hung", failurePolicy={"hangTimeoutSeconds": 20})
    servers = [ProgressServer("127.0.0.2", port, {"rank": 0, "step": 40}),
               ProgressServer("127.0.0.3", port, {"rank": 1, "step": 40})]
    try:
        r.poller.poll(key)
    finally:
        for s in servers:
            s.close()
    w = obj.hang_watch
    assert w is not None and w.key == (40, None)
    # the timeout is up; rank 0 no longer answers the operator (accepts and hangs), pod 1 trained on
    obj.hang_watch = dataclasses.replace(w, since=time.monotonic() - 21)
    assert r.poller.hang_check_due(key, body, time.monotonic())
    servers = [Silent("127.0.0.2", port), ProgressServer("127.0.0.3", port, {"rank": 1, "step": 41})]
    took = _timed_poll(r, key, servers)
    assert r.api.deleted == [], "a healthy rank 0 was deleted as hung"
    assert not r.poller.hang_check_due(key, body, time.monotonic())  # the newer step reset the clock
    # the pods were asked at once, each with its own deadline: one deadline, not one after the other
    assert took < progress.DEADLINE_SECONDS + 0.75, took


def test_the_pods_are_probed_at_once_and_a_silent_one_costs_one_deadline(monkeypatch):
    port = free_port()
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    r = _reconciler()
    key, body, obj = running_job(r, "wide", nodes=3, failurePolicy={"hangTimeoutSeconds": 20})
    # pods 0 and 1 stopped, pod 2 answers as global rank 0 (after a re-rendezvous ranks need not follow indices)
    servers = [Silent("127.0.0.2", port), Silent("127.0.0.3", port),
               ProgressServer("127.0.0.4", port, {"rank": 0, "step": 12})]
    took = _timed_poll(r, key, servers)
    assert obj.written["progress"]["step"] == 12
    assert took < progress.DEADLINE_SECONDS + 0.75, took


def test_a_malformed_report_is_one_event_and_its_valid_fields_are_kept(monkeypatch):
    port = free_port()
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    r = _reconciler()
    key, body, obj = running_job(r, "odd", progressPeriodSeconds=1)
    report = {"rank": 0, "step": 7, "metrics": [1], "recovery": {"at": 1e300, "resumedFrom": "peer"}}
    server = ProgressServer("127.0.0.2", port, report)
    try:
        for _ in range(3):
            obj.progress_at = 0.0
            r.poller.poll(key)
    finally:
        server.close()
    assert obj.written["progress"]["step"] == 7 and "metrics" not in obj.written["progress"]
    events = [e for e in r.api.events if e[2] == names.REASON_INVALID_REPORT]
    assert len(events) == 1 and events[0][1] == "Warning"
    assert "odd-0" in events[0][3] and "metrics" in events[0][3] and "recovery.at" in events[0][3]


def test_one_job_that_cannot_be_scheduled_never_stops_the_others_probes(monkeypatch, caplog):
    r = _reconciler()
    a, _, _ = running_job(r, "a", progressPeriodSeconds=1)
    b, _, _ = running_job(r, "b", progressPeriodSeconds=1)
    polled = threading.Event()
    real_due = r.poller.due

    def due(key):
        if key == a:
            raise ValueError("a job the poller cannot read")
        return real_due(key)
    monkeypatch.setattr(r.poller, "due", due)
    monkeypatch.setattr(r.poller, "poll", lambda key: polled.set() if key == b else None)
    r.tick()  # must not raise
    assert polled.wait(5), "job b's probe was never scheduled"
    assert "cannot read" in caplog.text
    r.stop()


def test_the_pollers_events_come_from_the_same_component_as_the_passes():
    from ddp_operator import poller, reconciler
    assert poller.COMPONENT == reconciler.COMPONENT
