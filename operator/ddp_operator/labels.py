"""Labels, selectors and owner references shared by every child of a DDPJob."""

from __future__ import annotations

from ddp_operator import names
from ddp_operator.spec import Job


def job_labels(job: Job) -> dict[str, str]:
    """The Service selector: every pod of the job (trainers and the rendezvous store)."""
    return {names.LABEL_JOB_NAME: job.name}


def trainer_selector(job: Job) -> dict[str, str]:
    return {names.LABEL_JOB_NAME: job.name, names.LABEL_ROLE: names.ROLE_TRAINER}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def pod_labels(job: Job, role: str, group: int, index: int | None = None) -> dict[str, str]:
    labels = {
        **job_labels(job),
        names.LABEL_ROLE: role,
        names.LABEL_GROUP: str(group),
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
    }
    if index is not None:
        labels[names.LABEL_NODE_INDEX] = str(index)
    return labels


def owner_reference(job: Job) -> dict:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(job: Job, name: str, labels: dict[str, str], annotations: dict | None = None) -> dict:
    """metadata of every child: in the job's namespace, labelled, controlled by the job."""
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": labels,
        **({"annotations": dict(annotations)} if annotations else {}),
        "ownerReferences": [owner_reference(job)],
    }
