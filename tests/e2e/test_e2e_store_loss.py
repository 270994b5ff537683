"""Losing the rendezvous-store pod on a real cluster: the operator recreates `<job>-rdzv` and nothing else.

The trainers' torchrun agents fail on the lost store (torch's TCPStore client never reconnects), the kubelet
restarts their containers in place (restartPolicy OnFailure: same pod, same /dev/shm), they rejoin the new
store under the same rendezvous id and resume from their own snapshots. No group bump, no trainer pod
recreated, at most the step in flight lost.
"""

from __future__ import annotations

from tests.e2e import harness as h

SUCCEED_TIMEOUT = 300
STEP_DELAY = 0.15  # s per step, as in test_e2e_training.py: seconds of training before and after the kill
KILL_AT_STEP = 20


def _pod_uids(kubectl, ns, job):
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in h.trainer_pods(kubectl, ns, job)}


def _restarts(kubectl, ns, job):
    return {p["metadata"]["name"]: sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or []
                                       if c["name"] == "trainer")
            for p in h.trainer_pods(kubectl, ns, job)}


def test_store_pod_loss_keeps_the_trainer_pods_and_their_snapshots(kubectl, ns):
    h.apply(kubectl, ns, h.digits_job("sl", nodes=2, step_delay=STEP_DELAY))
    _, prog = h.wait_rank0_step(kubectl, ns, "sl", KILL_AT_STEP, 240)
    before = _pod_uids(kubectl, ns, "sl")
    group = h.status(kubectl, ns, "sl").get("group", 0)
    store_uid = kubectl.json("get", "pod", "sl-rdzv", "-n", ns)["metadata"]["uid"]
    killed_at = h.kill_pod(kubectl, ns, "sl-rdzv")

    # A new store pod under the same name.
    h.wait_for(lambda: (lambda p: p["metadata"]["uid"] != store_uid)(kubectl.json("get", "pod", "sl-rdzv", "-n", ns)),
               60, "a new sl-rdzv")
    rec = h.recovery_after(kubectl, ns, "sl", killed_at, prog["step"], 180, previous=True)
    assert rec.source in ("local", "peer"), f"not resumed from a snapshot: {rec}"
    assert rec.resumed_from > 0, f"training started over instead of resuming: {rec}"
    assert rec.steps_lost is not None and rec.steps_lost <= 1, rec

    st = h.wait_phase(kubectl, ns, "sl", "Succeeded", SUCCEED_TIMEOUT)
    assert st.get("group", 0) == group, f"status.group changed: {st}"
    assert _pod_uids(kubectl, ns, "sl") == before, "a trainer pod was recreated"
    restarts = _restarts(kubectl, ns, "sl")
    assert all(n >= 1 for n in restarts.values()), f"trainer containers not restarted in place: {restarts}"
    attempts = st.get("attempts") or []
    assert [a["reason"] for a in attempts if a.get("reason") == "RendezvousStoreLost"] == ["RendezvousStoreLost"], st
    assert (st.get("infraRestarts"), st.get("restarts", 0)) == (1, 0), \
        f"the store loss and the restarts it caused are one incident, the infrastructure's: {st}"
    assert (st.get("lastRecovery") or {}).get("fault") == "RendezvousStoreLost", f"the user is not told why: {st}"
    reasons = [e.get("reason") for e in kubectl.json("get", "events", "-n", ns,
                                                     "--field-selector", "involvedObject.kind=DDPJob")["items"]]
    assert "RendezvousStoreLost" in reasons, reasons
    print(f"store kill at step {prog['step']}: {rec}; container restarts {restarts}")
