"""A job's NetworkPolicy, enforced for real: outsiders cannot reach the rendezvous store or the trainers.

One digits job starts with `spec.networkPolicy.enabled: false`, so the probes first show that the ports are
open and the probe works; then the policy is switched on and the very same probes must fail, while the job
keeps training, survives a killed pod and Succeeds. Probes are plain TCP connects from small pods in the
trainer image: one in another namespace, one (not part of the job) in the job's own namespace.

The way in around the policy is closed too (one small job): a NetworkPolicy `<job>` made by hand holds every pod
of the job back (ChildConflict, in `kubectl describe`) until it is deleted, and the chart's admission policy
refuses a pod that an ordinary user labels as the job's, at creation or afterwards (docs/security.md).

This needs a CNI that enforces NetworkPolicies (the embedded cluster runs kube-router's firewall for it);
on a cluster without one the test fails, it does not skip.
"""

from __future__ import annotations

import json

from tests.e2e import harness as h

JOB = "np"
STEP_DELAY = 0.3  # s per step: training lasts through the probes, the switch and a kill
EPOCHS = 12  # 20 steps an epoch: ~70 s of training, enough for an enforcer that takes tens of seconds (kind)
ENFORCE_TIMEOUT = 60  # the enforcer applies a new policy within a sync (seconds here)
PROBE = """
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    ip, port = target.rsplit(":", 1)
    try:
        socket.create_connection((ip, int(port)), timeout=2).close()
        out[target] = "open"
    except OSError as e:
        out[target] = f"blocked ({type(e).__name__}: {e})"
print(json.dumps(out))
"""


def _probe_pod(kubectl, namespace: str, name: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "netpol-probe"}},
           "spec": {"terminationGracePeriodSeconds": 0, "restartPolicy": "Never",
                    "containers": [{"name": "probe", "image": h.TRAINER_IMAGE, "imagePullPolicy": "IfNotPresent",
                                    "command": ["python3", "-c", "import time; time.sleep(3600)"],
                                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}}}]}}
    h.apply(kubectl, namespace, pod)


def _reach(kubectl, namespace: str, pod: str, targets: list[str]) -> dict[str, str]:
    p = kubectl("exec", "-n", namespace, pod, "--", "python3", "-c", PROBE, *targets, timeout=60)
    return json.loads(p.stdout.strip().splitlines()[-1])


def _ip(kubectl, namespace: str, pod: str) -> str:
    ip = kubectl.pod(namespace, pod)["status"].get("podIP")
    assert ip, f"{pod} has no IP yet"
    return ip


def test_policy_keeps_outsiders_out_while_the_job_trains_and_recovers(kubectl, ns, operator):
    outside = h.new_namespace(kubectl, "netpol-outsider")
    try:
        job = h.digits_job(JOB, nodes=2, step_delay=STEP_DELAY, epochs=EPOCHS, env={"DIGITS_PATIENCE": "0"},
                           spec={"networkPolicy": {"enabled": False}})
        h.apply(kubectl, ns, job)
        _probe_pod(kubectl, ns, "insider")
        _probe_pod(kubectl, outside, "outsider")
        rank0, prog = h.wait_rank0_step(kubectl, ns, JOB, 3, 240)
        for namespace, pod in ((ns, "insider"), (outside, "outsider")):
            kubectl.wait_pod_phase(namespace, pod, "Running", 120)
        targets = [f"{_ip(kubectl, ns, JOB + '-rdzv')}:29400", f"{_ip(kubectl, ns, rank0)}:{h.PROGRESS_PORT}"]
        probes = {"same namespace": (ns, "insider"), "other namespace": (outside, "outsider")}

        # Without a policy the ports are open to anyone: the probe works and the enforcer has something to do.
        assert kubectl("get", "networkpolicy", JOB, "-n", ns, check=False).returncode != 0, "policy while disabled"
        for where, (namespace, pod) in probes.items():
            reach = _reach(kubectl, namespace, pod, targets)
            assert all(v == "open" for v in reach.values()), f"without a policy, from the {where}: {reach}"

        # The operator creates the policy, owned by the job, once it is enabled.
        kubectl("patch", "ddpj", JOB, "-n", ns, "--type=merge", "-p", '{"spec":{"networkPolicy":{"enabled":true}}}')
        policy = h.wait_for(lambda: kubectl.json("get", "networkpolicy", JOB, "-n", ns), 60,
                            f"NetworkPolicy {JOB} created by the operator")
        owner = policy["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("DDPJob", JOB, h.job(kubectl, ns, JOB)["metadata"]["uid"])

        # Both outsiders are now refused on the rendezvous store and on rank 0's progress port.
        def all_blocked():
            results = {where: _reach(kubectl, namespace, pod, targets) for where, (namespace, pod) in probes.items()}
            return results if all(v != "open" for r in results.values() for v in r.values()) else None
        try:
            blocked = h.wait_for(all_blocked, ENFORCE_TIMEOUT, "both probes refused")
        except AssertionError as e:
            raise AssertionError(f"a job's NetworkPolicy is not enforced: is a NetworkPolicy enforcer running "
                                 f"(the embedded cluster's kube-router)? {e}") from None
        print(f"with the policy: {blocked}")

        # The job's own pods still train: rank 0 keeps stepping, and progress still reaches the status.
        _, prog = h.wait_rank0_step(kubectl, ns, JOB, prog["step"] + 5, 120)
        h.wait_for(lambda: (h.status(kubectl, ns, JOB).get("progress") or {}).get("step", 0) >= prog["step"], 60,
                   "status.progress to follow training through the policy")

        # A killed trainer is replaced and the job recovers and Succeeds with the policy in place.
        rank0, prog = h.wait_rank0_step(kubectl, ns, JOB, prog["step"] + 1, 60)
        victim = next(p["metadata"]["name"] for p in h.trainer_pods(kubectl, ns, JOB)
                      if p["metadata"]["name"] != rank0)
        killed_at = h.kill_pod(kubectl, ns, victim)
        rec = h.recovery_after(kubectl, ns, JOB, killed_at, prog["step"], 180)
        assert rec.resumed_from > 0, f"training started over instead of resuming: {rec}"
        # Still closed to outsiders after the recovery.
        reach = _reach(kubectl, outside, "outsider", targets[:1])
        assert all(v != "open" for v in reach.values()), reach
        st = h.wait_phase(kubectl, ns, JOB, "Succeeded", 400)
        assert (st.get("infraRestarts"), st.get("restarts", 0)) == (1, 0), st  # a killed pod: infraBackoffLimit
        acc = h.final_accuracy(kubectl, ns, JOB)
        assert acc is not None and acc >= 0.9, f"test accuracy {acc}"
        print(f"kill at step {prog['step']}: {rec}")
    finally:
        h.delete_namespace(kubectl, outside)


# An ordinary user who may create pods in the test namespace (ClusterRole edit), as the tests impersonate them.
INTRUDER = "ddp-e2e-intruder"
HELD = "held"


def _intruder_pod(name: str, labels: dict[str, str]) -> dict:
    """A pod that never runs (no node matches), compliant with the restricted Pod Security profile."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"nodeSelector": {"ddp.dev/test-node": "nowhere"},
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [{"name": "c", "image": h.TRAINER_IMAGE, "command": ["sleep", "3600"],
                                     "securityContext": {"allowPrivilegeEscalation": False,
                                                         "capabilities": {"drop": ["ALL"]}}}]}}


def _replica_failure(kubectl, ns: str) -> dict | None:
    conds = h.status(kubectl, ns, HELD).get("conditions") or []
    return next((c for c in conds if c["type"] == "ReplicaFailure" and c["status"] == "True"), None)


def test_a_foreign_policy_holds_the_pods_and_only_the_operator_labels_pods(kubectl, ns, operator):
    # A policy named like the job, made by hand before it, that admits everyone: the job must not run under it.
    h.apply(kubectl, ns, {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": HELD},
                          "spec": {"podSelector": {}, "ingress": [{}]}})
    h.apply(kubectl, ns, h.digits_job(HELD, nodes=1, epochs=1))
    cond = h.wait_for(lambda: _replica_failure(kubectl, ns), 60, "ReplicaFailure=True for the foreign policy")
    assert cond["reason"] == "ChildConflict" and f"networkpolicy {ns}/{HELD} already exists" in cond["message"], cond
    assert "held back" in cond["message"], cond
    assert kubectl.json("get", "pods", "-n", ns, "-l", f"{h.LABEL_JOB}={HELD}")["items"] == []
    described = kubectl("describe", "ddpj", HELD, "-n", ns).stdout
    assert "ChildConflict" in described and "held back" in described, described

    # While it waits: an ordinary user cannot make a pod of the job, neither at creation nor by relabelling.
    if operator.mode != "subprocess":  # the chart's admission policy (a subprocess operator comes without it)
        policies = [p["metadata"]["name"] for p in kubectl.json(
            "get", "validatingadmissionpolicies", "-l", "app.kubernetes.io/name=ddp-operator")["items"]]
        assert policies, "the chart installed no ValidatingAdmissionPolicy"
        kubectl("create", "rolebinding", "intruder-edit", "--clusterrole=edit", f"--user={INTRUDER}", "-n", ns)
        labels = {h.LABEL_JOB: HELD, h.LABEL_ROLE: "rdzv"}
        refused = kubectl("create", "-n", ns, "--as", INTRUDER, "-f", "-", check=False,
                          input=json.dumps(_intruder_pod(f"{HELD}-rdzv", labels)))
        assert refused.returncode != 0, refused.stdout
        assert any(f"ValidatingAdmissionPolicy '{p}'" in refused.stderr for p in policies), refused.stderr
        assert "ddp.dev/job-name" in refused.stderr and INTRUDER in refused.stderr, refused.stderr
        kubectl("create", "-n", ns, "--as", INTRUDER, "-f", "-", input=json.dumps(_intruder_pod("plain", {})))
        relabel = kubectl("label", "pod", "plain", "-n", ns, "--as", INTRUDER, f"{h.LABEL_JOB}={HELD}", check=False)
        assert relabel.returncode != 0 and "denied request" in relabel.stderr, relabel.stderr
        assert h.LABEL_JOB not in kubectl.pod(ns, "plain")["metadata"].get("labels", {})

    # The foreign policy goes: the operator's own policy and its pods follow, and the job runs.
    kubectl("delete", "networkpolicy", HELD, "-n", ns)
    h.wait_for_or_raise(lambda: h.status(kubectl, ns, HELD).get("phase") in ("Running", "Succeeded"), 150,
                        f"{HELD} running after the foreign policy went", h.PhaseError)
    policy = kubectl.json("get", "networkpolicy", HELD, "-n", ns)
    assert policy["metadata"]["ownerReferences"][0]["uid"] == h.job(kubectl, ns, HELD)["metadata"]["uid"]
    assert _replica_failure(kubectl, ns) is None
