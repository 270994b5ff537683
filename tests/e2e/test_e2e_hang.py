"""A hung pod the kubelet cannot kill, on a real cluster: hangTimeoutSeconds finds it, stuckTerminatingTimeoutSeconds
gets it out of the way, and the job finishes.

The embedded cluster's containers are processes of this host, in cgroup v1 hierarchies: the test freezes pod 1's
whole cgroup (freezer.state FROZEN: its agent, its workers, its pause container). Nothing fails: pod 0 waits in its
all-reduce and only the progress channel shows that global rank 0's step stopped. The operator must delete pod 1
within hangTimeout + 10 s (plus the probes' deadlines) and record an attempt with reason Hang. A frozen process
cannot die, so the pod stays Terminating on a Ready node (the issue: no progress for minutes, until thawed by hand);
the operator must force-delete it its grace period plus stuckTerminatingTimeoutSeconds later, say so (Warning Event
StuckPodForceDeleted, the Hang attempt's message), replace it while the old pod is still frozen, and the job must
finish, resumed from pod 0's peer snapshot. The test always thaws the pod in the end (its processes then die).
"""

from __future__ import annotations

import glob
import time
from pathlib import Path

import pytest

from tests.e2e import harness as h

HANG_TIMEOUT = 20
STUCK_TIMEOUT = 5
# hang.py: rank 0 polled every hangTimeout/10 (2 s here), then two probe deadlines (2 s each) and a pass
ACT_WITHIN = HANG_TIMEOUT + 10 + 5
# the hang deletion's grace period (names.HANG_DELETE_GRACE_SECONDS, 1 s) + the timeout, a pass and the API's delay
FORCE_WITHIN = 1 + STUCK_TIMEOUT + 10
STOP_AT_STEP = 15
STEP_DELAY = 0.15
# 20 steps an epoch: ~55 s of training, so the pod is still there to freeze once status.progress shows it trains
# (on kind a 6-epoch job, 32 s from creation to Succeeded, ended before the test found its worker)
EPOCHS = 18
SUCCEED_TIMEOUT = 400
FREEZER = "/sys/fs/cgroup/freezer"


def _hang_attempt(st: dict) -> dict | None:
    return next((a for a in st.get("attempts") or [] if a.get("reason") == "Hang"), None)


def _pod_freezer(uid: str) -> Path | None:
    """The pod's cgroup v1 freezer directory: kubepods[/<qos>]/pod<uid> (cgroupfs driver) or
    kubepods.slice/…/kubepods-<qos>-pod<uid with _>.slice (systemd driver); None where there is none."""
    patterns = (f"{FREEZER}/kubepods*/pod{uid}", f"{FREEZER}/kubepods*/*/pod{uid}",
                f"{FREEZER}/kubepods*/**/*pod{uid.replace('-', '_')}.slice")
    found = [p for pattern in patterns for p in glob.glob(pattern, recursive=True)]
    return Path(found[0]) if found else None


def _freezer_state(cgroup: Path) -> str | None:
    try:
        return (cgroup / "freezer.state").read_text().strip()
    except OSError:
        return None  # the cgroup is gone with the pod


def _set_freezer(cgroup: Path, state: str) -> None:
    try:
        (cgroup / "freezer.state").write_text(state)
    except OSError:
        pass  # gone with the pod


def _uid(kubectl, ns: str, pod: str) -> str | None:
    p = kubectl("get", "pod", "-n", ns, pod, "-o", "jsonpath={.metadata.uid}", check=False)
    return p.stdout.strip() or None if p.returncode == 0 else None


def test_frozen_pod_is_detected_as_a_hang_force_deleted_and_replaced(kubectl, ns, cluster):
    if not cluster.host_processes or not Path(FREEZER).is_dir():
        pytest.skip("needs a cluster whose containers run on this host in cgroup v1 with the freezer controller "
                    "(the embedded cluster): the test freezes a pod's cgroup from the host")
    name = "hang"
    h.apply(kubectl, ns, h.digits_job(name, nodes=2, step_delay=STEP_DELAY, epochs=EPOCHS, spec={
        "failurePolicy": {"hangTimeoutSeconds": HANG_TIMEOUT, "stuckTerminatingTimeoutSeconds": STUCK_TIMEOUT}}))
    # The hang clock runs once the operator has had a report from rank 0 (hang.py), and the report comes from the
    # worker that is about to be frozen: freeze only after the operator recorded progress (CI stopped it 2.7 s
    # into training, before any probe landed, and no hang could be seen).
    h.wait_for(lambda: ((h.status(kubectl, ns, name).get("progress") or {}).get("step") or 0) >= STOP_AT_STEP, 240,
               f"status.progress at step {STOP_AT_STEP} or later")
    pod = f"{name}-1"
    frozen_uid = _uid(kubectl, ns, pod)
    assert frozen_uid, f"pod {pod} not found"
    cgroup = _pod_freezer(frozen_uid)
    if cgroup is None:
        pytest.skip(f"no freezer cgroup for pod {pod} ({frozen_uid}) under {FREEZER}")
    frozen_at = time.time()
    try:
        _set_freezer(cgroup, "FROZEN")
        h.wait_for(lambda: _freezer_state(cgroup) == "FROZEN", 30, f"{cgroup} FROZEN")
        st = h.wait_for(lambda: (lambda s: s if _hang_attempt(s) else None)(h.status(kubectl, ns, name)),
                        ACT_WITHIN + 30, "an attempt with reason Hang")
        detected_s = time.time() - frozen_at
        attempt = _hang_attempt(st)
        print(f"hang detected {detected_s:.1f} s after the freeze (timeout {HANG_TIMEOUT} s): {attempt}")
        assert attempt["pod"] == pod, attempt
        assert detected_s <= ACT_WITHIN, f"acted after {detected_s:.1f} s, more than {ACT_WITHIN} s"
        assert st.get("lastIncident", {}).get("reason") == "Hang", st
        # Why, and the budget it spent: a hang is the user's budget's (backoffLimit).
        failure = st.get("lastFailure") or {}
        assert (failure.get("class"), failure.get("pod"), failure.get("budget")) == ("Hang", pod, "backoffLimit"), st
        deleted_at = time.time()

        # Every process of the pod is frozen: the kubelet cannot kill it, the operator force-deletes it and
        # creates its replacement while the old pod is still frozen on the (Ready) node.
        replaced = h.wait_for(lambda: (lambda u: u if u and u != frozen_uid else None)(_uid(kubectl, ns, pod)),
                              FORCE_WITHIN + 30, f"{pod} force-deleted and replaced")
        replaced_s = time.time() - deleted_at
        print(f"{pod} replaced ({replaced}) {replaced_s:.1f} s after the hang deletion "
              f"(stuckTerminatingTimeoutSeconds {STUCK_TIMEOUT})")
        assert _freezer_state(cgroup) == "FROZEN", "the old pod was thawed before its replacement came"
        assert replaced_s <= FORCE_WITHIN, f"replaced after {replaced_s:.1f} s, more than {FORCE_WITHIN} s"
        events = [e for e in kubectl.json("get", "events", "-n", ns, "--field-selector",
                                          "reason=StuckPodForceDeleted")["items"]]
        assert any(pod in e.get("message", "") for e in events), events
        final = h.wait_phase(kubectl, ns, name, "Succeeded", SUCCEED_TIMEOUT)
    finally:
        _set_freezer(cgroup, "THAWED")  # never leave a frozen pod behind: its processes die as they thaw
    attempt = _hang_attempt(final)
    assert attempt["pod"] == pod and "force-deleted" in attempt.get("message", ""), attempt
    rec = final.get("lastRecovery")
    print(f"status.lastRecovery: {rec}; restarts {final.get('restarts')}")
    assert rec is not None, final
    assert rec["fault"] == "Hang" and rec["resumedFrom"] == "peer", rec
    assert rec["stepsLost"] <= 1, rec
    assert rec.get("restoredFromPod") == f"{name}-0", rec
    conditions = {c["type"]: c for c in final.get("conditions", [])}
    assert conditions["Succeeded"]["status"] == "True", final
