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


class _Clock:
    """time.monotonic and the ticker's waits: a wait moves the clock instead of sleeping; `until` s in, it stops."""

    def __init__(self, until: float):
        self.now, self.waits, self._end = 1_000.0, [], 1_000.0 + until

    def monotonic(self) -> float:
        return self.now

    def wait(self, timeout: float) -> bool:
        self.waits.append(round(timeout, 3))
        self.now += timeout
        return self.is_set()

    def is_set(self) -> bool:  # as the stop event
        return self.now >= self._end

    def set(self) -> None:  # as the wake-up event
        pass

    clear = set

    def wait_for_wakeup(self, until: float, now: float) -> None:  # as the JobRegistry's wait
        self.wait(until - now)


def test_a_wake_up_runs_at_its_time_not_at_the_next_tick(monkeypatch):
    """A pass asked for 0.25 s from now (a node-loss timeout, a hang deadline) ran at the next tick, up to a second
    later: on average half a second added to every timed rule. The ticker now waits for the earliest wake-up."""
    from ddp_operator import reconciler as rmod
    from ddp_operator.jobs import JobRegistry
    clock = _Clock(until=2.5)
    monkeypatch.setattr(rmod.time, "monotonic", clock.monotonic)
    monkeypatch.setattr("ddp_operator.jobs.time.monotonic", clock.monotonic)
    r = rmod.Reconciler.__new__(rmod.Reconciler)
    r.jobs, r._stop = JobRegistry(), clock
    r.jobs.woken = clock
    r.jobs.wait_for_wakeup = clock.wait_for_wakeup
    ran, ticks = [], []
    r.due = type("D", (), {"run": lambda self, ks, wait_for_them: ran.extend((k, clock.now) for k in ks)})()
    r.tick = lambda wait=True: ticks.append(clock.now)
    r.jobs.wake(("ns", "lost-node"), 0.25)
    r.run_ticker()
    assert ran == [(("ns", "lost-node"), 1_000.25)]
    assert ticks == [1_001.0, 1_002.0]  # the ticks keep their second
    assert clock.waits == [0.25, 0.75, 1.0, 1.0]


def test_an_earlier_wake_up_ends_the_tickers_wait_and_a_later_one_does_not():
    from ddp_operator.jobs import JobRegistry
    jobs = JobRegistry()
    assert jobs.next_wakeup() is None
    ended = threading.Event()

    def waiter():
        now = time.monotonic()
        jobs.wait_for_wakeup(now + 30, now)
        ended.set()

    threading.Thread(target=waiter, daemon=True).start()
    deadline = time.monotonic() + 10
    while jobs._wait_end == float("inf") and time.monotonic() < deadline:  # the waiter is in its wait
        time.sleep(0.01)
    jobs.wake(("ns", "later"), 60)  # after the wait's end: the ticker has no reason to look again
    assert not ended.wait(0.3)
    jobs.wake(("ns", "sooner"), 1)
    assert ended.wait(5)
    assert jobs.next_wakeup() == jobs.get(("ns", "sooner")).wakeup
