"""The rendezvous-store pod is hardened whatever the template says: it only holds a TCPStore, so it drops every
capability, cannot escalate privileges, runs under RuntimeDefault seccomp (or the template's stricter Localhost
profile) as a non-root user on a read-only root filesystem, and gets no service-account token."""

from ddp_operator.rdzv import STORE_RUN_AS_USER, render_rdzv_pod
from ddp_operator.spec import parse_job

from ddp_builders import job_body, make_job

HARDENED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "runAsUser": STORE_RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}}


def _store(body):
    pod = render_rdzv_pod(parse_job(body), 0)
    return pod["spec"], pod["spec"]["containers"][0].get("securityContext")


def test_a_plain_template_yields_a_hardened_store():
    spec, security = _store(job_body())
    assert security == HARDENED
    assert spec["automountServiceAccountToken"] is False
    assert STORE_RUN_AS_USER != 0


def test_a_permissive_template_does_not_loosen_the_store():
    """A trainer that needs root, devices and a token (an RDMA NIC, a GPU driver check) gets them; the store does
    not."""
    body = job_body()
    spec = body["spec"]["template"]["spec"]
    spec.update(automountServiceAccountToken=True,
                securityContext={"runAsUser": 0, "seccompProfile": {"type": "Unconfined"}})
    spec["containers"][0]["securityContext"] = {
        "privileged": True, "allowPrivilegeEscalation": True, "runAsUser": 0, "runAsNonRoot": False,
        "capabilities": {"add": ["SYS_ADMIN", "IPC_LOCK"]}, "seccompProfile": {"type": "Unconfined"}}
    store_spec, security = _store(body)
    assert security == HARDENED
    assert store_spec["automountServiceAccountToken"] is False


def test_a_stricter_template_is_kept():
    """The template's own non-root user and Localhost seccomp profile stay (inherited or copied)."""
    body = job_body()
    spec = body["spec"]["template"]["spec"]
    spec["securityContext"] = {"runAsUser": 2000, "runAsGroup": 2000, "fsGroup": 2000}
    spec["containers"][0]["securityContext"] = {
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/ddp.json"},
        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL", "NET_RAW"]}}
    store_spec, security = _store(body)
    assert store_spec["securityContext"] == spec["securityContext"]  # the pod's user: 2000
    assert security == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                        "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/ddp.json"}}


def test_the_store_pod_and_the_trainer_pods_differ_only_where_meant():
    """make_job's store container: the hardening is the store's own, not copied from a trainer that has none."""
    job = make_job()
    assert "securityContext" not in job.spec.trainer_container
    assert render_rdzv_pod(job, 0)["spec"]["containers"][0]["securityContext"] == HARDENED
