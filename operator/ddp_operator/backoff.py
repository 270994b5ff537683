"""Children that could not be created, and when to try them again.

A child the API server refuses (quota, PodSecurity, a webhook, an invalid field) is retried with a per-child
exponential backoff (CREATE_BACKOFF_INITIAL_SECONDS doubling up to CREATE_BACKOFF_MAX_SECONDS, reset by a success)
while the rest of the pass goes on; the refusals are handed to the plan (Observed.refusals), which reports them
(condition ReplicaFailure, reason FailedCreate, one Event per distinct refusal). A foreign object holding a child's
name (k8s.ChildConflict) is reported the same way and looked at again every CONFLICT_RETRY_SECONDS, so removing it
is all a user has to do.

Both are kept in the job's record (jobs.py). A retry that falls due is a pass of the job, asked for through the
`wake` callable, never a sleep.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from kubernetes.client.exceptions import ApiException

from ddp_operator.jobs import JobRegistry, Key
from ddp_operator.k8s import describe_error

log = logging.getLogger("ddp_operator")

# A foreign object holding a child's name is looked at again this often (one create, one read).
CONFLICT_RETRY_SECONDS = 30.0
# A refused create is retried after 1 s, 2 s, 4 s, ... per child, at most this far apart; a success resets it.
CREATE_BACKOFF_INITIAL_SECONDS = 1.0
CREATE_BACKOFF_MAX_SECONDS = 60.0


@dataclass(frozen=True)
class Refusal:
    """The last refusal of a child's create: what the API server said, how many in a row, when to retry."""
    message: str
    attempts: int
    retry_at: float  # time.monotonic()


def create_backoff(attempts: int) -> float:
    """Seconds before the next try after `attempts` refusals in a row: 1, 2, 4, ... capped."""
    return min(CREATE_BACKOFF_MAX_SECONDS, CREATE_BACKOFF_INITIAL_SECONDS * 2 ** min(attempts - 1, 30))


class CreateBackoff:
    """The refused and conflicting creates of every job, in their records; `wake(key, after)` asks for a pass."""

    def __init__(self, jobs: JobRegistry, wake: Callable[[Key, float], None]):
        self.jobs = jobs
        self.wake = wake

    def observed(self, key: Key) -> tuple[dict[str, str], dict[str, str]]:
        """What the plan is told (Observed.conflicts, Observed.refusals): child name -> why it is not there."""
        record = self.jobs.record(key)
        with self.jobs.guard:
            return ({name: why for name, (why, _) in record.conflicts.items()},
                    {name: r.message for name, r in record.refusals.items()})

    def conflicting(self, key: Key, name: str) -> bool:
        """True while a conflict on `name` was seen less than CONFLICT_RETRY_SECONDS ago (its retry stays armed):
        looked at again when that retry is due, not on every pass (two requests each)."""
        record = self.jobs.record(key)
        with self.jobs.guard:
            known = record.conflicts.get(name)
        return self._not_due(key, known[1] + CONFLICT_RETRY_SECONDS if known else None)

    def backing_off(self, key: Key, name: str) -> bool:
        """True while a refused child's retry is not due yet (its wake-up stays armed)."""
        record = self.jobs.record(key)
        with self.jobs.guard:
            refused = record.refusals.get(name)
        return self._not_due(key, refused.retry_at if refused else None)

    def _not_due(self, key: Key, due: float | None) -> bool:
        """True while a retry due at monotonic time `due` is still ahead; its wake-up is (re-)armed."""
        if due is None:
            return False
        left = due - time.monotonic()
        if left <= 0:
            return False
        self.wake(key, left)
        return True

    def created(self, key: Key, action: Any) -> None:
        """A child was created (or found to be the job's own): its refusal backoff and its conflict end."""
        record = self.jobs.record(key)
        with self.jobs.guard:
            refused = record.refusals.pop(action.name, None)
            resolved = record.conflicts.pop(action.name, None) is not None
        if refused is not None:
            log.info("[%s/%s] created %s %s after %d refusal(s)", *key, action.kind, action.name, refused.attempts)
        if refused is not None or resolved:
            self.wake(key, 0.0)

    def conflict(self, key: Key, name: str, message: str) -> None:
        """A foreign object holds a child's name: the next pass reports it (condition + Event)."""
        record = self.jobs.record(key)
        with self.jobs.guard:
            new = (record.conflicts.get(name) or ("", 0.0))[0] != message
            record.conflicts[name] = (message, time.monotonic())
        if new:
            log.warning("[%s/%s] %s", *key, message)
        self.wake(key, 0.0 if new else CONFLICT_RETRY_SECONDS)

    def refused(self, key: Key, action: Any, error: ApiException) -> None:
        """The API server refused a child: retry it after the next backoff step; a refusal that differs from the
        last one is reported at once (a pass right away hands it to the plan), a repeated one only retried."""
        message = f"cannot create {action.kind} {action.name}: {describe_error(error)}"
        record = self.jobs.record(key)
        with self.jobs.guard:
            known = record.refusals.get(action.name)
            attempts = known.attempts + 1 if known else 1
            delay = create_backoff(attempts)
            record.refusals[action.name] = Refusal(message, attempts, time.monotonic() + delay)
        new = known is None or known.message != message
        if new:
            log.warning("[%s/%s] %s; retrying in %.0fs", *key, message, delay)
        else:
            log.debug("[%s/%s] %s (refusal %d); retrying in %.0fs", *key, message, attempts, delay)
        self.wake(key, 0.0 if new else delay)

    def forget_stale(self, key: Key, wanted: set[str]) -> None:
        """Drop the refusals of children the plan no longer creates (scaled down, the job finished)."""
        record = self.jobs.record(key)
        with self.jobs.guard:
            stale = [name for name in record.refusals if name not in wanted]
            for name in stale:
                del record.refusals[name]
        if stale:
            self.wake(key, 0.0)
