"""A child's event runs its job's pass off kopf's worker: the event handler only asks for the pass.

kopf handles one object's events one after the other, in that object's worker, and updates its indexes from each
event before it calls the handler. A pod event's handler used to run the job's pass itself (Reconciler.child_changed),
so a pod whose event started a pass of a 1,000-node job (seconds) held back that pod's next events, its deletion
among them, while the pass ran. (This alone did not remove the node storm's late replacements in bench-scale-sim:
jobs.force_deleted did.) Here a pass asked for runs in a pool of EVENT_WORKERS threads,
and the handler returns at once; a job has at most one such pass waiting to start (the coalescing of
Reconciler.child_changed), which reads the indexes when it starts and so sees every event that came before. It starts
`pace(key)` seconds from now at the soonest (the Reconciler: 0.1 ms per pod after the job's last pass ended), so a
large job's pod events do not run its O(N) passes back to back while it starts.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

Key = tuple[str, str]
EVENT_WORKERS = 16  # kopf's own executor for sync handlers had as many (handlers.py)


class EventPasses:
    """Runs `run(*key)` for the keys submitted, EVENT_WORKERS at a time; `settle` waits for every one submitted."""

    def __init__(self, run: Callable[[str, str], object], workers: int = EVENT_WORKERS,
                 pace: Callable[[Key], float] = lambda key: 0.0):
        self._run, self._pace = run, pace
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ddp-event")
        self._pending = 0
        self._idle = threading.Condition()

    def submit(self, key: Key) -> None:
        with self._idle:
            self._pending += 1
        try:
            self._pool.submit(self._one, key)
        except RuntimeError:  # the pool is shut down: the operator is stopping
            self._done()

    def _one(self, key: Key) -> None:
        try:
            rest = self._pace(key)
            if rest > 0:  # the events that come meanwhile join this pass (Reconciler.child_changed)
                time.sleep(rest)
            self._run(*key)
        except Exception:  # noqa: BLE001 - logged by the pass, which also asked for a wake-up to try again
            pass
        finally:
            self._done()

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            if not self._pending:
                self._idle.notify_all()

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until every pass submitted so far (and any they led to) ended; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
