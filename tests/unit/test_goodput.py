"""Goodput (goodput.py, status.goodput): the definition on recorded histories, every recovery counted once whatever
re-derives it (another pass, the poller, a restarted operator), suspended time closed once, the figures frozen at
the end, and a healthy job's status left alone between refreshes."""

from datetime import datetime, timedelta, timezone

import pytest

from ddp_operator import goodput, names
from ddp_operator.observed import format_time

T0 = datetime(2026, 12, 5, 12, 0, 0, tzinfo=timezone.utc)


def at(seconds):
    return T0 + timedelta(seconds=seconds)


def progress(step, seconds):
    return {"step": step, "time": at(seconds).timestamp()}


def recovery(started, seconds, lost, fault="NodeFailed"):
    return {"fault": fault, "startedAt": format_time(at(started)), "seconds": seconds, "stepsLost": lost}


def test_the_definition_on_a_recorded_history():
    g = goodput.derive(None, created=T0, now=at(0), phase="Pending")
    # First step at 20 s, one step a second.
    g = goodput.derive(g, created=T0, now=at(21), phase="Running", progress=progress(1, 20), refresh=True)
    g = goodput.derive(g, created=T0, now=at(60), phase="Running", progress=progress(40, 59),
                       prev_progress=progress(1, 20), refresh=True)
    assert g["stepSeconds"] == 1.0
    # A recovery of 8 s that lost 3 steps (3 s to redo), then the end at 100 s.
    g = goodput.derive(g, created=T0, now=at(70), phase="Running", recovery=recovery(61, 8.0, 3), refresh=True)
    g = goodput.derive(g, created=T0, now=at(100), phase=names.PHASE_SUCCEEDED, prev_phase="Running",
                       completed=at(100))
    assert g["seconds"] == {"productive": 69.0, "starting": 20.0, "queued": 0.0, "recovering": 8.0, "redone": 3.0}
    assert (g["wallSeconds"], g["ratio"], g["recoveries"], g["stepsLost"]) == (100.0, 0.69, 1, 3)
    assert g["byFault"] == {"NodeFailed": {"recoveries": 1, "seconds": 11.0, "stepsLost": 3}}
    # Frozen at the end: later passes change nothing.
    assert goodput.derive(g, created=T0, now=at(500), phase=names.PHASE_SUCCEEDED,
                          prev_phase=names.PHASE_SUCCEEDED, completed=at(100)) == g


def test_a_recovery_is_counted_once_whoever_derives_it_again():
    g = goodput.derive(None, created=T0, now=at(30), phase="Running", progress=progress(5, 25))
    rec = recovery(40, 5.0, 0, fault="Hang")
    once = goodput.derive(g, created=T0, now=at(50), phase="Running", recovery=rec, refresh=True)
    # The pass, the poller and a restarted operator all see the same record in status.
    for _ in range(3):
        again = goodput.derive(once, created=T0, now=at(60), phase="Running", recovery=rec, refresh=True)
        assert (again["recoveries"], again["seconds"]["recovering"]) == (1, 5.0)
    # An unfinished record (no seconds, no at) is not counted yet.
    assert goodput.recovery_key({"startedAt": "x", "fault": "NodeFailed"}) is None
    # Without seconds the trainer's `at` closes it.
    rec2 = {"fault": "NodeFailed", "startedAt": format_time(at(100)), "at": at(112).timestamp(), "stepsLost": 0}
    two = goodput.derive(again, created=T0, now=at(120), phase="Running", recovery=rec2, refresh=True)
    assert (two["recoveries"], two["seconds"]["recovering"]) == (2, 17.0)
    assert set(two["byFault"]) == {"Hang", "NodeFailed"}


def test_suspended_time_is_queued_and_closed_once():
    g = goodput.derive(None, created=T0, now=at(0), phase=names.PHASE_SUSPENDED)
    live = goodput.derive(g, created=T0, now=at(30), phase=names.PHASE_SUSPENDED, refresh=True,
                          prev_phase=names.PHASE_SUSPENDED, suspended_since=T0)
    assert live["seconds"]["queued"] == 30.0 and live["ratio"] == 0.0
    resumed = goodput.derive(g, created=T0, now=at(40), phase="Pending", prev_phase=names.PHASE_SUSPENDED,
                             suspended_since=T0)
    assert resumed["queuedClosed"] == 40.0
    after = goodput.derive(resumed, created=T0, now=at(41), phase="Pending", prev_phase="Pending", refresh=True)
    assert after["queuedClosed"] == 40.0 and after["seconds"]["queued"] == 40.0
    # The first step at 50 s: starting is 10 s (the queued 40 s are the queue's, not the start's).
    first = goodput.derive(after, created=T0, now=at(51), phase="Running", progress=progress(1, 50), refresh=True)
    assert first["seconds"]["starting"] == 10.0 and first["seconds"]["productive"] == 1.0


def test_nothing_new_leaves_the_status_alone_and_hostile_fields_read_as_zero():
    g = goodput.derive(None, created=T0, now=at(10), phase="Running")
    assert goodput.derive(g, created=T0, now=at(99), phase="Running", prev_phase="Running") == g
    junk = {"since": "yesterday", "queuedClosed": "x", "recoveringTotal": float("nan"), "recoveries": -5,
            "byFault": [], "stepSeconds": 1e300, "firstStepAt": 7}
    out = goodput.derive(junk, created=T0, now=at(10), phase="Running", refresh=True,
                         recovery=recovery(1, 2.0, True))
    assert 0.0 <= out["ratio"] <= 1.0 and out["recoveries"] == 1 and out["stepsLost"] == 0
    unfinished = goodput.derive(junk, created=T0, now=at(10), phase="Running", refresh=True,
                                recovery=recovery(1, float("inf"), 1))
    assert unfinished["recoveries"] == 0
    assert goodput.derive(None, created=None, now=at(1), phase="Running") is None
    # Numbers no float holds, and times no datetime holds, are nothing (never an exception in a pass).
    huge = goodput.derive(None, created=T0, now=at(5), phase="Running", refresh=True,
                          progress={"step": 10 ** 400, "time": 1e300}, prev_progress={"step": 1, "time": 10 ** 400})
    assert "firstStepAt" not in huge and "stepSeconds" not in huge


@pytest.mark.parametrize("faults", [20])
def test_faults_are_bounded(faults):
    g = goodput.derive(None, created=T0, now=at(0), phase="Running")
    for i in range(faults):
        g = goodput.derive(g, created=T0, now=at(i + 1), phase="Running", recovery=recovery(i, 1.0, 0, f"F{i}"),
                           refresh=True)
    assert len(g["byFault"]) == goodput.MAX_FAULTS and g["recoveries"] == faults


def test_a_preemption_is_queued_time_not_recovering_time():
    """Evicted by Kueue at 40 s, queued until 100 s, the first step after the resume at 110 s: the trainer's
    recovery record spans 70 s, of which 60 s are queued; recovering keeps the other 10 s."""
    g = goodput.derive(None, created=T0, now=at(10), phase="Running", progress=progress(1, 10))
    g = goodput.derive(g, created=T0, now=at(100), phase="Pending", prev_phase=names.PHASE_SUSPENDED,
                       suspended_since=at(40))
    g = goodput.derive(g, created=T0, now=at(111), phase="Running", refresh=True,
                       recovery=recovery(40, 70.0, 0, fault="Evicted"))
    assert (g["seconds"]["queued"], g["seconds"]["recovering"]) == (60.0, 10.0)
    assert g["byFault"]["Evicted"]["seconds"] == 10.0


def test_a_start_over_the_trainer_could_not_measure_counts_its_redone_steps():
    """Every pod lost, no checkpoint volume: the run starts over from step 0 and its recovery report has neither
    seconds nor stepsLost. The operator's estimate (status.last_recovery: the last step it showed before the fault,
    and the time from its incident) is counted: recovering and redone, once, the step time left as it was learned."""
    from ddp_operator.status import last_recovery

    # One step a second: step 1 at 20 s, step 300 at 319 s (the last progress written before the fault).
    g = goodput.derive(None, created=T0, now=at(21), phase="Running", progress=progress(1, 20), refresh=True)
    g = goodput.derive(g, created=T0, now=at(320), phase="Running", progress=progress(300, 319),
                       prev_progress=progress(1, 20), refresh=True)
    assert g["stepSeconds"] == 1.0 and g["ratio"] > 0.9
    # The incident at 325 s; the new run's first step at 380 s: the poller writes the record with its progress.
    incident = {"reason": names.REASON_NODE_FAILED, "time": format_time(at(325))}
    report = {"rank": 0, "step": 1, "time": at(380).timestamp(),
              "recovery": {"resumedFrom": "start", "step": 0, "at": at(380).timestamp()}}
    rec = last_recovery(None, incident, report, progress(300, 319))
    assert (rec["stepsLost"], rec["seconds"], rec["estimated"]) == (300, 55.0, ["seconds", "stepsLost"])
    g = goodput.derive(g, created=T0, now=at(381), phase="Running", progress=progress(1, 380),
                       prev_progress=progress(300, 319), recovery=rec, refresh=True)
    assert (g["recoveries"], g["stepsLost"], g["seconds"]["recovering"], g["seconds"]["redone"]) == (1, 300, 55.0,
                                                                                                     300.0)
    # Later polls: the new run at step 20 (status.progress still shows 300), then past it at 310: the record is
    # the same, counted once, and the two reports around the recovery teach no step time.
    for step, t in ((20, 399), (310, 689)):
        rec = last_recovery(rec, incident, {**report, "step": step}, progress(300, 319))
        g = goodput.derive(g, created=T0, now=at(t + 1), phase="Running", progress=progress(step, t),
                           prev_progress=progress(300, 319), recovery=rec, refresh=True)
        assert (g["recoveries"], g["stepsLost"], g["stepSeconds"]) == (1, 300, 1.0)
    g = goodput.derive(g, created=T0, now=at(1000), phase=names.PHASE_SUCCEEDED, prev_phase="Running",
                       completed=at(1000), recovery=rec)
    assert g["seconds"] == {"productive": 625.0, "starting": 20.0, "queued": 0.0, "recovering": 55.0, "redone": 300.0}
    assert g["ratio"] == 0.625 and g["byFault"] == {"NodeFailed": {"recoveries": 1, "seconds": 355.0, "stepsLost": 300}}
