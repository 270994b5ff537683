"""The dedicated rendezvous-store pod `<job>-rdzv`.

torchrun's c10d store normally lives inside one training agent, so losing that pod breaks every survivor's
rendezvous. A tiny pod that only holds the store makes every trainer (rank 0 included) expendable. It runs the store
image (store/Dockerfile: `python -m ddp_store`, torch's TCPStore protocol in the standard library, no torch), with its
own entrypoint, the port in DDPJOB_RDZV_PORT and the requests and limits of spec.rendezvous (rdzv_spec.py). Losing the
store itself is survived without a whole-group restart (plan/rdzv_lost.py): the operator recreates this pod, the
trainers' torchrun agents fail on the lost store (torch's TCPStore client never reconnects), the kubelet restarts
their containers in place (restartPolicy OnFailure) and they rejoin the new, empty store under the same
rendezvous id, resuming from the snapshots in their own /dev/shm.
"""

from __future__ import annotations

import copy

from ddp_operator import names
from ddp_operator.labels import child_metadata, pod_labels
from ddp_operator.rdzv_spec import STORE_PULL_POLICY
from ddp_operator.spec import Job

# Fields copied from the training template: scheduling ones so the store lands where trainers can reach it and
# can pull from the same registries, and isolation ones so a hardened template (PodSecurity "restricted", gVisor, user
# namespaces) yields a store pod at least as hardened (store_security_context hardens it further, whatever the
# template says).
_COPIED_POD_FIELDS = ("imagePullSecrets", "nodeSelector", "tolerations", "priorityClassName", "schedulerName",
                      "securityContext", "serviceAccountName", "dnsPolicy", "dnsConfig", "runtimeClassName",
                      "hostUsers")


# Container securityContext keys that only restrict; what grants (privileged, capabilities.add, procMount) is
# for the trainer's devices and is not copied to the store, which needs nothing but a TCP port.
_RESTRICTING_KEYS = ("runAsUser", "runAsGroup", "readOnlyRootFilesystem", "seccompProfile", "appArmorProfile",
                     "seLinuxOptions")
# The store's user when the template names no non-root one: the store image's own (store/Dockerfile, USER
# 1000:1000). Numeric, so the kubelet can check runAsNonRoot, and it works with any image whose Python is
# world-readable (the store writes nothing: its root filesystem is read-only): an image that runs as root still runs
# the store as 1000.
STORE_RUN_AS_USER = 1000
_CONFINING_SECCOMP = ("RuntimeDefault", "Localhost")


def store_security_context(trainer_security: dict | None, pod_security: dict | None = None) -> dict:
    """The store container's securityContext: the trainer container's restricting parts, hardened whatever the
    template says (PodSecurity "restricted"): no capabilities, no privilege escalation, a read-only root filesystem,
    a non-root user (the template's, else STORE_RUN_AS_USER), seccomp RuntimeDefault unless the template's effective
    profile is RuntimeDefault or Localhost already (a pod-level one is inherited)."""
    trainer_security, pod_security = trainer_security or {}, pod_security or {}
    out = {k: trainer_security[k] for k in _RESTRICTING_KEYS if k in trainer_security}
    out["allowPrivilegeEscalation"] = False
    out["capabilities"] = {"drop": ["ALL"]}
    out["readOnlyRootFilesystem"] = True
    out["runAsNonRoot"] = True
    if not out.get("runAsUser") and (out.get("runAsUser") == 0 or not pod_security.get("runAsUser")):
        out["runAsUser"] = STORE_RUN_AS_USER
    seccomp = out.get("seccompProfile") or pod_security.get("seccompProfile") or {}
    if seccomp.get("type") not in _CONFINING_SECCOMP:
        out["seccompProfile"] = {"type": "RuntimeDefault"}
    return dict(sorted(out.items()))


def rdzv_pod_name(job: Job) -> str:
    return f"{job.name}-{names.RDZV_POD_SUFFIX}"


def render_rdzv_pod(job: Job, group: int) -> dict:
    template_spec = job.spec.template["spec"]
    trainer = job.spec.trainer_container
    port = job.spec.torchrun.rdzv_port
    rendezvous = job.spec.rendezvous
    container = {
        "name": names.RDZV_CONTAINER,
        "image": rendezvous.store_image,  # its entrypoint serves the store: no command
        "imagePullPolicy": STORE_PULL_POLICY,
        "env": [{"name": names.ENV_RDZV_PORT, "value": str(port)},
                {"name": names.ENV_PYTHONUNBUFFERED, "value": "1"}],
        "ports": [{"name": "rdzv", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2},
        "resources": copy.deepcopy({k: dict(v) for k, v in rendezvous.resources.items()}),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    container["securityContext"] = store_security_context(trainer.get("securityContext"),
                                                          template_spec.get("securityContext"))
    name = rdzv_pod_name(job)
    spec = {k: template_spec[k] for k in _COPIED_POD_FIELDS if k in template_spec}
    spec["automountServiceAccountToken"] = False  # the store never calls the API, whatever the trainers need
    spec.update({
        "hostname": name,
        "subdomain": job.name,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    })
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(job, name, pod_labels(job, names.ROLE_RDZV, group)),
        "spec": dict(sorted(spec.items())),
    }
