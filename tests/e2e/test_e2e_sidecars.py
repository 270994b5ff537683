"""Sidecars on real pods: completion is decided by the `trainer` container, so a digits job whose pods also run
a never-ending sidecar still reaches Succeeded, with a classic sidecar (a second container, which keeps the pod
Running after the trainer exited) and with a native one (an init container with restartPolicy Always, which the
kubelet stops itself). The leftover pods are then stopped per cleanPodPolicy (Running, the default)."""

from __future__ import annotations

from tests.e2e import harness as h

SUCCEED_TIMEOUT = 300
# Runs until stopped; exits at once on SIGTERM so stopping the pod does not wait out the grace period.
SIDECAR_SCRIPT = ("import signal, sys, time\n"
                  "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
                  "print('sidecar up', flush=True)\n"
                  "while True:\n    time.sleep(3600)\n")


def _sidecar(native: bool) -> dict:
    c = {"name": "log-shipper", "image": h.TRAINER_IMAGE, "imagePullPolicy": "IfNotPresent",
         "command": ["python3", "-c", SIDECAR_SCRIPT], "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}}}
    if native:
        c["restartPolicy"] = "Always"
    return c


def test_jobs_with_a_classic_and_a_native_sidecar_succeed(kubectl, ns):
    """Both kinds side by side, one job each (they mostly wait on their pods: one test's time, not two)."""
    jobs = {"classic": False, "native": True}
    for name, native in jobs.items():
        job = h.digits_job(name, nodes=2, epochs=2)
        pod = job["spec"]["template"]["spec"]
        pod.setdefault("initContainers" if native else "containers", []).append(_sidecar(native))
        h.apply(kubectl, ns, job)
    for name in jobs:
        st = h.wait_phase(kubectl, ns, name, "Succeeded", SUCCEED_TIMEOUT)
        assert st.get("restarts", 0) == 0, st
        assert {c["type"]: c["status"] for c in st["conditions"]}.get("Succeeded") == "True", st
    # The sidecar really ran beside the trainer (so the pods were kept up by it, not by nothing).
    events = kubectl.json("get", "events", "-n", ns)["items"]
    started = {e["involvedObject"]["name"] for e in events
               if e["reason"] == "Started" and "log-shipper" in (e["involvedObject"].get("fieldPath") or "")}
    assert {f"{name}-{i}" for name in jobs for i in (0, 1)} <= started, started
    # cleanPodPolicy Running: nothing of either job keeps running once it Succeeded.
    for name in jobs:
        h.wait_for(lambda: not [p for p in h.trainer_pods(kubectl, ns, name)
                                if p["status"].get("phase") in ("Pending", "Running")],
                   60, what=f"{name}: the job's trainer pods stopped")
