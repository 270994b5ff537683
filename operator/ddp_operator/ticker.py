"""The ticker's passes side by side: a job whose pass takes long never holds back another job's due pass.

The ticker (Reconciler.tick, once a second) runs the passes that are due: wake-ups a pass asked for (a node-loss
timeout, a retry, a backoff) and the slow resync of every job. It ran them one after the other in its own thread, so
one job's pass that wrote hundreds of pods (a 1,000-node job replacing the pods of 50 lost nodes: 20 s) held back
every other job's due pass for as long: a 100-node job that lost pods on the same nodes was acted on 29 s after its
nodes turned NotReady instead of its 10 s nodeLostTimeoutSeconds. Here they run DUE_WORKERS at a time, each in a
thread of its own; a job whose ticked pass still runs is not queued again but woken at the next tick (the running
pass plans its own next wake-up from what it observes).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable

log = logging.getLogger(__name__)

Key = tuple[str, str]
DUE_WORKERS = 8
RESYNC_SECONDS = 300.0  # every job has a pass at least this often, events or not
RESYNCS_PER_TICK = 4  # a thousand jobs resynced in 250 s, never a thousand passes at once beside the due ones


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
