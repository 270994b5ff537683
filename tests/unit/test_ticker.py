"""ticker.DuePasses: a job whose due pass takes long never holds back another job's (a 1,000-node job replacing the
pods of 50 lost nodes held a 100-node job's node-loss pass back 19 s when the ticker ran them one after the other)."""

from __future__ import annotations

import threading
import time

from ddp_operator.ticker import DuePasses


def _passes(block: set, calls: list, woken: list, fail: set = frozenset()):
    release = threading.Event()

    def reconcile(ns, name):
        calls.append((ns, name))
        if name in block:
            release.wait(10)
        if name in fail:
            raise RuntimeError("boom")

    return DuePasses(reconcile, lambda key, delay: woken.append((key, delay)), retry_seconds=5, again_seconds=1), release


def test_a_slow_pass_does_not_hold_back_another_jobs_due_pass():
    calls, woken = [], []
    due, release = _passes({"big"}, calls, woken)
    try:
        due.run([("ns", "big")], wait_for_them=False)
        t0 = time.monotonic()
        due.run([("ns", "small")], wait_for_them=True)
        assert ("ns", "small") in calls and time.monotonic() - t0 < 2
    finally:
        release.set()
        due.stop()


def test_a_job_whose_pass_still_runs_is_woken_at_the_next_tick_not_queued_twice():
    calls, woken = [], []
    due, release = _passes({"big"}, calls, woken)
    try:
        due.run([("ns", "big")], wait_for_them=False)
        time.sleep(0.2)
        due.run([("ns", "big")], wait_for_them=False)
        assert calls.count(("ns", "big")) == 1 and woken == [(("ns", "big"), 1)]
        release.set()
        time.sleep(0.2)
        due.run([("ns", "big")], wait_for_them=True)  # ended: it runs again
        assert calls.count(("ns", "big")) == 2
    finally:
        release.set()
        due.stop()


def test_a_failing_pass_is_retried_and_the_others_still_run():
    calls, woken = [], []
    due, _ = _passes(set(), calls, woken, fail={"bad"})
    try:
        due.run([("ns", "bad"), ("ns", "good")], wait_for_them=True)
        assert set(calls) == {("ns", "bad"), ("ns", "good")} and woken == [(("ns", "bad"), 5)]
    finally:
        due.stop()


def test_the_resync_takes_a_few_of_the_oldest_jobs_per_tick(monkeypatch):
    """A restarted operator (or 300 s after it) found every job due for its resync at once: a thousand passes in one
    tick, beside kopf's own first passes. Now RESYNCS_PER_TICK a tick, the oldest first."""
    from ddp_operator import reconciler as rmod, ticker
    r = rmod.Reconciler.__new__(rmod.Reconciler)
    ran = []
    keys = [("ns", f"j{i}") for i in range(10)]
    records = {k: type("R", (), {"last_pass": float(i)})() for i, k in enumerate(keys)}
    r.jobs = type("J", (), {"take_due": lambda self, now: [], "keys": lambda self: list(keys),
                            "get": lambda self, k: records[k], "wake": lambda self, k, d: None})()
    r.poller = type("P", (), {"schedule": lambda self, k: None})()
    r._swept_at = float("inf")
    r.due = type("D", (), {"run": lambda self, ks, wait_for_them: ran.extend(ks)})()
    monkeypatch.setattr(rmod.time, "monotonic", lambda: 10_000.0)
    r.tick()
    assert ran == keys[:ticker.RESYNCS_PER_TICK]
