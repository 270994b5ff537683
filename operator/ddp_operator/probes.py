"""The operator's own probes: `/readyz` (ready only in the replica that acts) and a standby's `/healthz`.

Readiness routes the metrics Service (and anything else that selects the operator's pods) to the one replica that
holds the jobs: a standby has no jobs in memory and would serve empty per-job series. So a replica is ready when
- it acts: without leader election always, with it only while it holds the Lease (leader.write_fence() > 0: a
  leader that could not renew in time stops being ready before it exits), and
- it is past its start: kopf ran the startup handler (the Reconciler exists, handlers.configure), i.e. kopf.run's
  ready flag is set.
`decide()` is that rule, pure; `serve()` answers it on --readiness-port, from process start to exit, in a thread of
its own (kopf's loop may be busy; a probe never waits on it).

Liveness stays kopf's (`/healthz` on --liveness-port, answered from its event loop once it runs); a standby, which
runs no kopf yet, answers it from `standby_liveness()` until kopf takes the port over.

What leader-only readiness costs the Deployment (docs/operations.md): with N replicas only one is Ready, so the
chart's rolling update must allow every pod unavailable (a surge standby never becomes Ready while the old leader
holds the Lease), and a PodDisruptionBudget that counts Ready pods could never let the leader be evicted.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
from dataclasses import dataclass
from typing import Callable

from ddp_operator import names

log = logging.getLogger(__name__)

READY_LEADING = "Leading"       # holds the Lease and kopf has started: it acts
READY_ALONE = "Started"         # no leader election: the only replica, and kopf has started
NOT_READY_STANDBY = "Standby"   # waits for the Lease (or lost it): another replica acts
NOT_READY_STARTING = "Starting"  # leads (or needs no Lease) but kopf's startup has not finished


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str

    def body(self) -> bytes:
        return json.dumps({"ready": self.ready, "reason": self.reason}).encode()


def decide(*, leader_election: bool, lease_left: float, started: bool) -> Readiness:
    """Whether this replica should receive traffic: `lease_left` is how long its leadership still holds
    (leader.write_fence(), 0 when it holds none); `started`: kopf's startup handlers have run."""
    if leader_election and not lease_left > 0:
        return Readiness(False, NOT_READY_STANDBY)
    if not started:
        return Readiness(False, NOT_READY_STARTING)
    return Readiness(True, READY_LEADING if leader_election else READY_ALONE)


def _server(port: int, routes: dict[str, Callable[[], tuple[int, bytes]]], thread_name: str):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            route = routes.get(self.path.split("?", 1)[0])
            code, body = route() if route is not None else (404, b"")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=thread_name, daemon=True).start()
    return server


def serve(port: int, readiness: Callable[[], Readiness]):
    """`GET /readyz` on `port`: 200 when `readiness()` says ready, else 503; the body says why. None if port is 0."""
    if not port:
        return None

    def readyz() -> tuple[int, bytes]:
        try:
            r = readiness()
        except Exception as e:  # noqa: BLE001 - a probe answers; the reason is in the log
            log.warning("readiness could not be decided: %s", e)
            r = Readiness(False, "Error")
        return (200 if r.ready else 503), r.body()

    return _server(port, {names.READINESS_PATH: readyz}, "readyz")


def standby_liveness(port: int):
    """A standby replica is alive while it waits for the Lease; kopf's own probe starts with leadership (the caller
    shuts this server down first). None if port is 0."""
    if not port:
        return None
    return _server(port, {names.LIVENESS_PATH: lambda: (200, b'{"standby": true}')}, "standby-healthz")
