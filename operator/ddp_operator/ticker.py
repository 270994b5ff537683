"""The ticker: every job's wake-ups at their time, and due passes side by side.

`run_ticker` runs Reconciler.tick once a second (the slow resync, the progress polls, the sweep) and each wake-up a
pass asked for (a node-loss timeout, a hang deadline, a retry, a backoff) at its own time in between: with wake-ups
served at the tick only, each timed rule acted up to a second late.

The due passes ran one after the other in the ticker's thread, so one job's pass that wrote hundreds of pods (a
1,000-node job replacing the pods of 50 lost nodes: 20 s) held back every other job's due pass for as long: a
100-node job that lost pods on the same nodes was acted on 29 s after its nodes turned NotReady instead of its 10 s
nodeLostTimeoutSeconds. Here (`DuePasses`) they run DUE_WORKERS at a time, each in a thread of its own; a job whose
ticked pass still runs is not queued again but woken at the next tick (the running pass plans its own next wake-up
from what it observes).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable

log = logging.getLogger(__name__)

Key = tuple[str, str]
DUE_WORKERS = 8
DUE_GAP_SECONDS = 0.05  # wake-ups between ticks are served at most this often
RESYNC_SECONDS = 300.0  # every job has a pass at least this often, events or not
RESYNCS_PER_TICK = 4  # a thousand jobs resynced in 250 s, never a thousand passes at once beside the due ones


def run_ticker(stop: threading.Event, jobs: Any, tick: Callable[..., None], due: "DuePasses",
               tick_seconds: float) -> None:
    """`tick` every `tick_seconds`, and each wake-up at its own time in between (wake-ups that fall due within
    DUE_GAP_SECONDS of the last run wait for the next: a thousand jobs' wake-ups cost at most 1/DUE_GAP_SECONDS
    runs a second). `jobs` is the JobRegistry: an earlier wake-up asked for ends its wait."""
    next_tick, last_due = time.monotonic() + tick_seconds, -math.inf
    while not stop.is_set():
        wakeup = jobs.next_wakeup()
        now = time.monotonic()
        until = next_tick if wakeup is None else min(next_tick, max(wakeup, last_due + DUE_GAP_SECONDS))
        if until > now:
            jobs.wait_for_wakeup(until, now)
            continue
        try:
            if now >= next_tick:
                next_tick = now + tick_seconds
                tick(wait=False)
            else:
                last_due = now
                due.run(sorted(jobs.take_due(now)), wait_for_them=False)
        except Exception:
            log.exception("ticker pass failed")


class DuePasses:
    """Runs `reconcile(*key)` for due jobs, DUE_WORKERS at a time, at most one ticked pass per job in flight."""

    def __init__(self, reconcile: Callable[..., object], wake: Callable[[Key, float], None], retry_seconds: float,
                 again_seconds: float, workers: int = DUE_WORKERS):
        self._reconcile, self._wake = reconcile, wake
        self._retry, self._again = retry_seconds, again_seconds
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ddp-due")
        self._running: set[Key] = set()
        self._guard = threading.Lock()

    def run(self, keys: list[Key], wait_for_them: bool) -> None:
        """A pass for each of `keys`; with `wait_for_them`, return once those passes ended (tests, one-shot ticks)."""
        started: list[Future] = []
        for key in keys:
            with self._guard:
                busy = key in self._running
                if not busy:
                    self._running.add(key)
            if busy:
                self._wake(key, self._again)  # its pass still runs: due again at the next tick
                continue
            started.append(self._pool.submit(self._one, key))
        if wait_for_them:
            wait(started)

    def _one(self, key: Key) -> None:
        try:
            self._reconcile(*key)
        except Exception:  # noqa: BLE001 - logged by reconcile; this job alone is retried
            self._wake(key, self._retry)
        finally:
            with self._guard:
                self._running.discard(key)

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
