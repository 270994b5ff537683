"""What a job's pods may do, against the real API server: a namespace that enforces PodSecurity `restricted`
admits every pod of a job with a restricted-compliant template (trainers and the rendezvous store), pods carry
no API token, what the operator owns stays rejectable only where it is owned, and a refused pod is a Warning
Event on the job."""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

from ddp_cluster import wait_for

PODS = {"job-0", "job-1", "job-rdzv"}
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}
HARDENED_POD = {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
HARDENED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _enforce_restricted(k) -> None:
    """Label the namespace and wait until the API server's PodSecurity admission enforces it (it reads the
    namespace from a cache): a privileged pod must be refused before the test means anything."""
    k.core.patch_namespace(k.ns, {"metadata": {"labels": RESTRICTED}})
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
             "spec": {"containers": [{"name": "c", "image": "x", "securityContext": {"privileged": True}}]}}

    def refused():
        try:
            k.core.create_namespaced_pod(k.ns, probe, dry_run="All")
        except ApiException as e:
            return e.status == 403 and "violates PodSecurity" in (e.body or "")
        return False
    wait_for(refused, 30, what="PodSecurity restricted enforced")


def _hardened(k):
    body = k.job_manifest()
    pod = body["spec"]["template"]["spec"]
    pod["securityContext"] = dict(HARDENED_POD)
    pod["containers"][0]["securityContext"] = dict(HARDENED_CONTAINER)
    return body


def test_restricted_namespace_admits_every_pod_of_a_hardened_job(k):
    _enforce_restricted(k)
    k.custom.create_namespaced_custom_object("ddp.dev", "v1alpha1", k.ns, "ddpjobs", _hardened(k))
    pods = k.wait_pods(PODS, timeout=60)
    for name, p in pods.items():
        assert p.spec.automount_service_account_token is False, name
        assert p.spec.security_context.run_as_non_root is True, name
        assert p.spec.security_context.seccomp_profile.type == "RuntimeDefault", name
        sc = p.spec.containers[0].security_context
        assert sc.allow_privilege_escalation is False and sc.capabilities.drop == ["ALL"], name
    assert not [e for e in k.events() if e.type == "Warning"], [(e.reason, e.message) for e in k.events()]


def test_refused_pod_is_a_failed_create_warning_on_the_job(k):
    _enforce_restricted(k)
    k.create_job()  # an ordinary template: not restricted-compliant
    refused = wait_for(lambda: [e for e in k.events() if e.reason == "FailedCreate"], 60,
                       what="FailedCreate Event")
    assert refused[0].type == "Warning" and "violates PodSecurity" in refused[0].message, refused[0].message
    assert refused[0].involved_object.kind == "DDPJob"
    # the store pod is hardened whatever the template says (rdzv.py), so only the trainers are refused
    assert set(k.pods()) == {"job-rdzv"}


def test_what_the_operator_does_not_own_is_admitted(k):
    body = k.job_manifest(torchrun={"extraArgs": ["--log_dir=/tmp/l", "--redirects=3"]})
    pod = body["spec"]["template"]["spec"]
    pod["containers"][0]["env"] = [{"name": "PET_LOG_DIR", "value": "/tmp/x"}, {"name": "HF_HOME", "value": "/c"}]
    pod["containers"].append({"name": "sidecar", "image": "x", "env": [{"name": "PET_NNODES", "value": "1"}]})
    pod["volumes"] = [{"name": "data", "emptyDir": {}}]
    k.custom.create_namespaced_custom_object("ddp.dev", "v1alpha1", k.ns, "ddpjobs", body)
    pods = k.wait_pods(PODS, timeout=60)
    env = {e.name: e.value for e in pods["job-0"].spec.containers[0].env}
    assert env["PET_NNODES"] == "2:2" and env["HF_HOME"] == "/c"
    assert [v.name for v in pods["job-0"].spec.volumes] == ["data", "dshm", "ddp-diagnostics"]
