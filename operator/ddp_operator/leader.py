"""Leader election over a coordination.k8s.io Lease, so two operator replicas never reconcile at once.

The rules (the client-go approach; no clock is compared across machines):
- A standby takes the Lease only after it has seen the same record (holder, renewTime, resourceVersion)
  unchanged for a full leaseDurationSeconds on its own monotonic clock. A renewTime that merely looks old
  (clock skew between machines) proves nothing.
- The leader renews every `retry_seconds`, each request with a timeout that ends at its renew deadline. If it
  has not renewed within `renew_deadline_seconds` (strictly shorter than the lease) of the start of its last
  successful renewal, or it sees another holder, it stops leading: the process exits (a restarted pod rejoins
  as a standby).

- Every write of the operator is fenced by the Lease (k8s.Api(fence=write_fence())): refused once the renew
  deadline of the last successful renewal has passed or another holder was seen, and given at most the time left,
  so a paused or partitioned leader writes nothing in the moment before its renewer notices and exits.

Why they never overlap: a renewal that started at t0 is written after t0, so a standby sees that record at
t0 or later and takes over at t0 + lease at the earliest, while the leader has exited by t0 + renew deadline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

log = logging.getLogger(__name__)

LEASE_SECONDS = 15
RENEW_DEADLINE_SECONDS = 10.0
RETRY_SECONDS = 2.0


# The elector that made this process the leader (acquire()): a process holds one Lease, and the operator's API
# client, made after leadership is won (handlers.configure), fences its writes with it (write_fence).
_LEADER: LeaderElector | None = None


def write_fence() -> Callable[[], float] | None:
    """The fence for this process's writes (k8s.Api(fence=...)): None without leader election."""
    return _LEADER.valid_for if _LEADER is not None else None


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _fmt(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _exit() -> None:
    log.error("could not renew the leader lease in time; exiting so that a standby takes over")
    logging.shutdown()
    os._exit(1)


class LeaderElector:
    def __init__(self, api: Any, namespace: str, name: str, identity: str, *, lease_seconds: int = LEASE_SECONDS,
                 renew_deadline_seconds: float = RENEW_DEADLINE_SECONDS, retry_seconds: float = RETRY_SECONDS,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], datetime] = _now,
                 on_lost: Callable[[], None] = _exit):
        if not 0 < renew_deadline_seconds < lease_seconds:
            raise ValueError(f"the renew deadline ({renew_deadline_seconds}s) must be shorter than the lease "
                             f"({lease_seconds}s), or two leaders could overlap")
        if not 0 < retry_seconds < renew_deadline_seconds:
            raise ValueError("retry_seconds must be shorter than the renew deadline")
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.lease_seconds, self.renew_deadline_seconds = lease_seconds, renew_deadline_seconds
        self.retry_seconds = retry_seconds
        self.clock, self.wall, self.on_lost = clock, wall, on_lost
        self._observed: tuple | None = None   # the lease record last seen ...
        self._observed_at = 0.0               # ... and when (our clock) it was first seen
        self._renewed_at: float | None = None  # start (our clock) of the last successful acquire/renewal
        self._lost_to: str | None = None
        self._stop = threading.Event()

    @property
    def leading(self) -> bool:
        return self._renewed_at is not None and self._lost_to is None

    def valid_for(self) -> float:
        """Seconds this replica's leadership still holds: until the renew deadline of its last successful renewal
        (before a standby could take over), 0 once it is past or another holder was seen. The writes' fence
        (k8s.Api): a replica that could not renew in time -- paused, partitioned -- writes nothing, even in the
        moment before the renewer notices and exits."""
        renewed = self._renewed_at
        if renewed is None or self._lost_to is not None:
            return 0.0
        return max(0.0, renewed + self.renew_deadline_seconds - self.clock())

    def _try(self, timeout: float) -> bool:
        """One acquire/renew attempt whose requests end within `timeout` seconds; True if we hold the Lease."""
        end = self.clock() + timeout

        def left() -> float:
            return max(0.001, end - self.clock())

        lease = self.api.read_lease(self.namespace, self.name, timeout=left())
        now = self.wall()
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_seconds,
                "renewTime": _fmt(now)}
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {**spec, "acquireTime": _fmt(now), "leaseTransitions": 0}}
            return self.api.write_lease(self.namespace, body, create=True, timeout=left())
        current = lease.get("spec") or {}
        holder = current.get("holderIdentity")
        record = (holder, current.get("renewTime"), (lease.get("metadata") or {}).get("resourceVersion"))
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        duration = current.get("leaseDurationSeconds") or self.lease_seconds
        if holder not in (None, "", self.identity):
            if self._renewed_at is not None:
                self._lost_to = holder  # we led, and someone else holds it now
            if self.clock() < self._observed_at + duration:
                return False
        new_spec = {**current, **spec}
        if holder != self.identity:
            new_spec["acquireTime"] = _fmt(now)
            new_spec["leaseTransitions"] = int(current.get("leaseTransitions") or 0) + 1
        lease["spec"] = new_spec
        return self.api.write_lease(self.namespace, lease, create=False, timeout=left())

    def try_acquire(self) -> bool:
        started = self.clock()
        try:
            ok = self._try(self.renew_deadline_seconds)
        except Exception as e:  # noqa: BLE001 - the API may be briefly unreachable; keep trying
            log.warning("leader election attempt failed: %s", e)
            return False
        if ok:
            self._renewed_at, self._lost_to = started, None
        return ok

    def acquire(self) -> None:
        log.info("waiting to lead via Lease %s/%s as %s", self.namespace, self.name, self.identity)
        while not self._stop.is_set():
            if self.try_acquire():
                log.info("became the leader")
                global _LEADER
                _LEADER = self
                threading.Thread(target=self._renew, name="lease-renewer", daemon=True).start()
                return
            self._stop.wait(self.retry_seconds)

    def renew_step(self) -> float | None:
        """One renewal; the seconds to wait before the next, or None once leadership is given up (on_lost)."""
        assert self._renewed_at is not None, "renew_step() before acquiring"
        started = self.clock()
        deadline = self._renewed_at + self.renew_deadline_seconds
        ok = False
        if started < deadline and self._lost_to is None:
            try:
                ok = self._try(deadline - started)
            except Exception as e:  # noqa: BLE001
                log.warning("lease renewal failed: %s", e)
        if ok:
            self._renewed_at = started
            return self.retry_seconds
        if self._lost_to is not None or self.clock() >= deadline:
            if self._lost_to is not None:
                log.error("the leader lease is held by %s now", self._lost_to)
            self._renewed_at = None
            self.on_lost()
            return None
        # Try again, at the latest exactly at the deadline (so the give-up is never late).
        return max(0.0, min(self.retry_seconds, deadline - self.clock()))

    def _renew(self) -> None:
        wait = self.retry_seconds
        while not self._stop.wait(wait):
            wait = self.renew_step()
            if wait is None:
                return

    def stop(self) -> None:
        self._stop.set()
