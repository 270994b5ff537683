"""Leader election over a coordination.k8s.io Lease, so two operator replicas never reconcile at once.

The standby blocks in `acquire()`; the leader renews in a thread and exits the process if it cannot renew
within the lease duration (a restarted pod rejoins as a standby), the usual client-go behaviour.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import datetime, timedelta, timezone

from ddp_operator.k8s import Api

log = logging.getLogger(__name__)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _fmt(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(s: str | None) -> datetime | None:
    if not s:
        return None
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


class LeaderElector:
    def __init__(self, api: Api, namespace: str, name: str, identity: str, *, lease_seconds: int = 15,
                 renew_seconds: float = 5.0):
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.lease_seconds, self.renew_seconds = lease_seconds, renew_seconds
        self._stop = threading.Event()

    def _try(self) -> bool:
        lease = self.api.read_lease(self.namespace, self.name)
        now = _now()
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_seconds,
                "renewTime": _fmt(now)}
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {**spec, "acquireTime": _fmt(now), "leaseTransitions": 0}}
            return self.api.write_lease(self.namespace, body, create=True)
        current = lease.get("spec") or {}
        renewed = _parse(current.get("renewTime")) or datetime.min.replace(tzinfo=timezone.utc)
        expired = now > renewed + timedelta(seconds=current.get("leaseDurationSeconds") or self.lease_seconds)
        holder = current.get("holderIdentity")
        if holder not in (None, "", self.identity) and not expired:
            return False
        new_spec = {**current, **spec}
        if holder != self.identity:
            new_spec["acquireTime"] = _fmt(now)
            new_spec["leaseTransitions"] = int(current.get("leaseTransitions") or 0) + 1
        lease["spec"] = new_spec
        return self.api.write_lease(self.namespace, lease, create=False)

    def acquire(self) -> None:
        log.info("waiting to lead via Lease %s/%s as %s", self.namespace, self.name, self.identity)
        while not self._stop.is_set():
            try:
                if self._try():
                    log.info("became the leader")
                    threading.Thread(target=self._renew, name="lease-renewer", daemon=True).start()
                    return
            except Exception as e:  # the API may be briefly unreachable; keep trying
                log.warning("leader election attempt failed: %s", e)
            self._stop.wait(self.renew_seconds)

    def _renew(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.renew_seconds):
            try:
                if self._try():
                    last = time.monotonic()
                    continue
            except Exception as e:
                log.warning("lease renewal failed: %s", e)
            if time.monotonic() - last > self.lease_seconds:
                log.error("lost the leader lease; exiting so a standby takes over")
                os._exit(1)

    def stop(self) -> None:
        self._stop.set()
