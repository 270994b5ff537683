"""A hung worker on a real cluster: failurePolicy.hangTimeoutSeconds finds the stuck pod and replaces it.

The embedded cluster's containers (and kind's, on a local Docker engine) are processes of this host, so the test
freezes pod 1's torchrun *worker* (not the agent) with SIGSTOP: nothing fails, pod 0 waits in its all-reduce, and
only the progress channel shows that global rank 0's step stopped. The operator must delete pod 1 within
hangTimeout + 10 s (plus the probes' deadlines), record an attempt with reason Hang, and the job must finish,
resumed from pod 0's peer snapshot.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e import harness as h

HANG_TIMEOUT = 20
# hang.py: rank 0 polled every hangTimeout/10 (2 s here), then two probe deadlines (2 s each) and a pass
ACT_WITHIN = HANG_TIMEOUT + 10 + 5
STOP_AT_STEP = 15
STEP_DELAY = 0.15
# 20 steps an epoch: ~55 s of training, so the worker is still there to stop once status.progress shows it trains
# (on kind a 6-epoch job, 32 s from creation to Succeeded, ended before the test found its worker)
EPOCHS = 18
SUCCEED_TIMEOUT = 400


def _hang_attempt(st: dict) -> dict | None:
    return next((a for a in st.get("attempts") or [] if a.get("reason") == "Hang"), None)


def test_stopped_worker_is_detected_as_a_hang_and_replaced(kubectl, ns, cluster):
    if not cluster.host_processes:
        pytest.skip("needs a cluster whose containers run on this host (embedded, or kind on a local Docker "
                    "engine): the test stops a container's process from the host")
    name = "hang"
    h.apply(kubectl, ns, h.digits_job(name, nodes=2, step_delay=STEP_DELAY, epochs=EPOCHS,
                                      spec={"failurePolicy": {"hangTimeoutSeconds": HANG_TIMEOUT}}))
    # The hang clock runs once the operator has had a report from rank 0 (hang.py), and the report comes from the
    # worker that is about to be stopped: stop it only after the operator recorded progress (CI stopped it 2.7 s
    # into training, before any probe landed, and no hang could be seen).
    h.wait_for(lambda: ((h.status(kubectl, ns, name).get("progress") or {}).get("step") or 0) >= STOP_AT_STEP, 240,
               f"status.progress at step {STOP_AT_STEP} or later")
    pids = h.wait_for(lambda: h.pod_processes(ns, name, 1)["workers"], 30, f"the worker process of {name}-1")
    stopped_at = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        st = h.wait_for(lambda: (lambda s: s if _hang_attempt(s) else None)(h.status(kubectl, ns, name)),
                        ACT_WITHIN + 30, "an attempt with reason Hang")
        detected_s = time.time() - stopped_at
        attempt = _hang_attempt(st)
        print(f"hang detected {detected_s:.1f} s after SIGSTOP (timeout {HANG_TIMEOUT} s): {attempt}")
        assert attempt["pod"] == f"{name}-1", attempt
        assert detected_s <= ACT_WITHIN, f"acted after {detected_s:.1f} s, more than {ACT_WITHIN} s"
        assert st.get("lastIncident", {}).get("reason") == "Hang", st
        final = h.wait_phase(kubectl, ns, name, "Succeeded", SUCCEED_TIMEOUT)
    finally:
        for pid in pids:  # normally gone with its pod; never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    rec = final.get("lastRecovery")
    print(f"status.lastRecovery: {rec}; restarts {final.get('restarts')}")
    assert rec is not None, final
    assert rec["fault"] == "Hang" and rec["resumedFrom"] == "peer", rec
    assert rec["stepsLost"] <= 1, rec
    assert rec.get("restoredFromPod") == f"{name}-0", rec
    conditions = {c["type"]: c for c in final.get("conditions", [])}
    assert conditions["Succeeded"]["status"] == "True", final
