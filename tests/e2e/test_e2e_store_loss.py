"""Losing the rendezvous-store pod on a real cluster: the operator recreates `<job>-rdzv` and nothing else.

The trainers' torchrun agents fail on the lost store (torch's TCPStore client never reconnects), the kubelet
restarts their containers in place (restartPolicy OnFailure: same pod, same /dev/shm), they rejoin the new
store under the same rendezvous id and resume from their own snapshots. No group bump, no trainer pod
recreated, at most the step in flight lost.

The job runs in a namespace whose ResourceQuota requires limits.cpu and limits.memory of every container and whose
LimitRange caps them (QUOTA): the store pod runs the store image (localhost/ddp-store, its own entrypoint) with the
requests and limits of spec.rendezvous, so the quota admits it, and its replacement too; the store pod of before,
without limits, is refused there. The trainers have
limits of their own (the digits sample's); the diagnostics sidecar, which has no CPU limit, is off.
"""

from __future__ import annotations

from tests.e2e import harness as h

SUCCEED_TIMEOUT = 300
STEP_DELAY = 0.15  # s per step, as in test_e2e_training.py: seconds of training before and after the kill
KILL_AT_STEP = 20


def _pod_uids(kubectl, ns, job):
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in h.trainer_pods(kubectl, ns, job)}


# Limits required, and room for the two trainers' (1 CPU, 2Gi each) and a store's of spec.rendezvous' defaults (1 CPU,
# 256Mi), not for a store without limits of its own: the LimitRange gives such a container its max (a max without a
# default is the default), 2 CPUs and 4Gi, past the quota.
QUOTA = [
    {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "limits-required"},
     "spec": {"hard": {"limits.cpu": "3500m", "limits.memory": "5Gi", "requests.cpu": "2", "requests.memory": "4Gi"}}},
    {"apiVersion": "v1", "kind": "LimitRange", "metadata": {"name": "container-max"},
     "spec": {"limits": [{"type": "Container", "max": {"cpu": "2", "memory": "4Gi"}}]}},
]


def _store_pod(kubectl, ns, job, not_uid=None):
    """The store pod once it is ready (another than `not_uid`): it runs the store image with limits."""
    def ready():
        pod = kubectl.json("get", "pod", f"{job}-rdzv", "-n", ns)  # not there yet: wait_for tries again
        ok = pod and pod["metadata"]["uid"] != not_uid and any(
            c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or [])
        return pod if ok else None
    pod = h.wait_for(ready, 120, f"a ready {job}-rdzv")
    (store,) = pod["spec"]["containers"]
    assert store["image"] == h.STORE_IMAGE and "command" not in store, store
    assert store["resources"]["limits"] == {"cpu": "1", "memory": "256Mi"}, store["resources"]
    assert store["resources"]["requests"] == {"cpu": "10m", "memory": "64Mi"}, store["resources"]
    assert store["securityContext"]["readOnlyRootFilesystem"] is True
    log = kubectl("logs", "-n", ns, f"{job}-rdzv").stdout
    assert " ddp_store event=listening port=29400" in log, log
    return pod


def _restarts(kubectl, ns, job):
    return {p["metadata"]["name"]: sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or []
                                       if c["name"] == "trainer")
            for p in h.trainer_pods(kubectl, ns, job)}


def test_store_pod_loss_keeps_the_trainer_pods_and_their_snapshots(kubectl, ns):
    h.apply(kubectl, ns, QUOTA)
    h.apply(kubectl, ns, h.digits_job("sl", nodes=2, step_delay=STEP_DELAY, spec={"diagnostics": {"enabled": False}}))
    store_uid = _store_pod(kubectl, ns, "sl")["metadata"]["uid"]
    _, prog = h.wait_rank0_step(kubectl, ns, "sl", KILL_AT_STEP, 240)
    before = _pod_uids(kubectl, ns, "sl")
    group = h.status(kubectl, ns, "sl").get("group", 0)
    logged = h.job_events(kubectl, ns, "sl")  # the trainers restart in place: their logs, kept (recovery_after)
    killed_at = h.kill_pod(kubectl, ns, "sl-rdzv")

    # A new store pod under the same name, admitted by the quota as the first was.
    _store_pod(kubectl, ns, "sl", not_uid=store_uid)
    rec = h.recovery_after(kubectl, ns, "sl", killed_at, prog["step"], 180, previous=True, before=logged)
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
