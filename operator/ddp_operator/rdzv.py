"""The dedicated rendezvous-store pod `<job>-rdzv`.

torchrun's c10d store normally lives inside one training agent, so losing that pod breaks every survivor's
rendezvous. A tiny pod that only holds a TCPStore makes every trainer (rank 0 included) expendable; losing
the store itself triggers a whole-group restart (plan.py).
"""

from __future__ import annotations

from ddp_operator import names
from ddp_operator.labels import child_metadata, pod_labels
from ddp_operator.spec import Job

# SIGTERM handler: as PID 1 the interpreter would otherwise ignore it and wait out the grace period.
STORE_SCRIPT = """\
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
from torch.distributed import TCPStore
port = int(os.environ["DDPJOB_RDZV_PORT"])
store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)
print(f"rendezvous store listening on :{port}", flush=True)
while True:
    time.sleep(3600)
"""

# Scheduling-related fields copied from the training template so the store lands where trainers can reach it
# and can pull the same image.
_COPIED_POD_FIELDS = ("imagePullSecrets", "nodeSelector", "tolerations", "priorityClassName", "schedulerName",
                      "securityContext", "serviceAccountName", "dnsPolicy", "dnsConfig")


def rdzv_pod_name(job: Job) -> str:
    return f"{job.name}-{names.RDZV_POD_SUFFIX}"


def render_rdzv_pod(job: Job, group: int) -> dict:
    template_spec = job.spec.template["spec"]
    trainer = job.spec.trainer_container
    port = job.spec.torchrun.rdzv_port
    container = {
        "name": names.RDZV_CONTAINER,
        "image": trainer.get("image"),
        "command": ["python3", "-c", STORE_SCRIPT],
        "env": [{"name": names.ENV_RDZV_PORT, "value": str(port)},
                {"name": names.ENV_PYTHONUNBUFFERED, "value": "1"}],
        "ports": [{"name": "rdzv", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if trainer.get("imagePullPolicy"):
        container["imagePullPolicy"] = trainer["imagePullPolicy"]
    if trainer.get("securityContext"):
        container["securityContext"] = trainer["securityContext"]
    name = rdzv_pod_name(job)
    spec = {k: template_spec[k] for k in _COPIED_POD_FIELDS if k in template_spec}
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
