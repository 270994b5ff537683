"""The headless Service `<job>` that gives every pod of the job a stable DNS name."""

from __future__ import annotations

from ddp_operator import names
from ddp_operator.labels import child_metadata, job_labels
from ddp_operator.spec import Job


def render_service(job: Job) -> dict:
    """Headless, publishing not-ready addresses: pods resolve as <pod>.<job>.<ns>.svc before they are Ready,
    which torchrun needs at rendezvous time."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(job, job.name, job_labels(job)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": job_labels(job),
            "ports": [
                {"name": "rdzv", "port": job.spec.torchrun.rdzv_port, "targetPort": job.spec.torchrun.rdzv_port,
                 "protocol": "TCP"},
                {"name": "progress", "port": names.PROGRESS_PORT, "targetPort": names.PROGRESS_PORT,
                 "protocol": "TCP"},
            ],
        },
    }
