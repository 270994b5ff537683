"""probes.py: /readyz says ready only in the replica that acts (the leader, once kopf started), and answers from a
thread of its own."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from ddp_operator import probes
from ddp_trainer.testing import free_port


@pytest.mark.parametrize("leader_election, lease_left, started, ready, reason", [
    (True, 0.0, False, False, probes.NOT_READY_STANDBY),    # waiting for the Lease
    (True, 0.0, True, False, probes.NOT_READY_STANDBY),     # led, could not renew in time: about to exit
    (True, -1.0, True, False, probes.NOT_READY_STANDBY),
    (True, 7.5, False, False, probes.NOT_READY_STARTING),   # won the Lease, kopf's startup still running
    (True, 7.5, True, True, probes.READY_LEADING),
    (False, 0.0, False, False, probes.NOT_READY_STARTING),  # the only replica, starting
    (False, 0.0, True, True, probes.READY_ALONE),           # no Lease to hold
])
def test_only_the_started_leader_is_ready(leader_election, lease_left, started, ready, reason):
    r = probes.decide(leader_election=leader_election, lease_left=lease_left, started=started)
    assert (r.ready, r.reason) == (ready, reason)


def _get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_readyz_answers_what_the_decision_says_now():
    state = {"lease": 0.0, "started": False}
    port = free_port()
    server = probes.serve(port, lambda: probes.decide(leader_election=True, lease_left=state["lease"],
                                                      started=state["started"]))
    try:
        assert _get(port, "/readyz") == (503, {"ready": False, "reason": "Standby"})
        state.update(lease=9.0, started=True)
        assert _get(port, "/readyz") == (200, {"ready": True, "reason": "Leading"})
        assert _get(port, "/readyz?verbose=1")[0] == 200
        assert _get(port, "/metrics")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_a_decision_that_fails_reads_not_ready():
    def broken() -> probes.Readiness:
        raise RuntimeError("no lease state")
    port = free_port()
    server = probes.serve(port, broken)
    try:
        assert _get(port, "/readyz") == (503, {"ready": False, "reason": "Error"})
    finally:
        server.shutdown()
        server.server_close()


def test_standby_liveness_and_disabled_ports():
    assert probes.serve(0, lambda: probes.Readiness(True, "x")) is None
    assert probes.standby_liveness(0) is None
    port = free_port()
    server = probes.standby_liveness(port)
    try:
        assert _get(port, "/healthz") == (200, {"standby": True})
        assert _get(port, "/readyz")[0] == 404  # readiness has a port of its own
    finally:
        server.shutdown()
        server.server_close()
