"""Rendering of the training pods `<job>-<index>` (their diagnostics sidecar: diagnostics.py)."""

from __future__ import annotations

import copy

from ddp_operator import names
from ddp_operator.diagnostics import add_sidecar
from ddp_operator.env import follows_desired_size, merge_env, trainer_env
from ddp_operator.labels import child_metadata, pod_labels
from ddp_operator.placement import spread_across_nodes
from ddp_operator.spec import Job

# Keeps the scheduler honest on small machines without reserving a core per pod.
DEFAULT_CPU_REQUEST = "10m"


def trainer_pod_name(job: Job, index: int) -> str:
    return f"{job.name}-{index}"


def _has_mount(container: dict, path: str) -> bool:
    return any(m.get("mountPath") == path for m in container.get("volumeMounts") or [])


def _trainer_container(job: Job, container: dict, index: int, group: int) -> dict:
    c = container
    c["env"] = merge_env(trainer_env(job, index, group), c.get("env"))
    mounts = list(c.get("volumeMounts") or [])
    if not _has_mount(c, names.SHM_PATH):
        mounts.append({"name": names.SHM_VOLUME, "mountPath": names.SHM_PATH})
    if job.spec.checkpoint and not _has_mount(c, job.spec.checkpoint.mount_path):
        mounts.append({"name": names.CHECKPOINT_VOLUME, "mountPath": job.spec.checkpoint.mount_path})
    if follows_desired_size(job):
        mounts.append({"name": names.NODES_VOLUME, "mountPath": names.NODES_DIR, "readOnly": True})
    if mounts:
        c["volumeMounts"] = mounts
    # The trainer's final JSON goes to /dev/termination-log; a crash leaves the log tail instead, which is
    # where torchrun prints the failing workers' exit codes.
    c.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    ports = list(c.get("ports") or [])
    if not any(p.get("containerPort") == names.PROGRESS_PORT for p in ports):
        ports.append({"name": "progress", "containerPort": names.PROGRESS_PORT, "protocol": "TCP"})
    c["ports"] = ports
    resources = c.setdefault("resources", {})
    if "cpu" not in (resources.get("requests") or {}) and "cpu" not in (resources.get("limits") or {}):
        resources.setdefault("requests", {})["cpu"] = DEFAULT_CPU_REQUEST
    return c


def render_trainer_pod(job: Job, index: int, group: int) -> dict:
    """Pod `<job>-<index>` (label `group`: kept for compatibility, always the job's status.group).

    restartPolicy OnFailure: a trainer container that exits non-zero (a worker failed, the rendezvous store was
    lost, the agent was killed) is restarted by the kubelet inside the same pod, keeping its IP, hostname and
    /dev/shm, so the trainer resumes from its own snapshot; the operator records and counts each restart
    (plan/failures.py). A pod that ends (deleted, evicted, node lost) is replaced under the same name by the operator. A
    template that says restartPolicy Never keeps the older behaviour: every container failure replaces the pod."""
    template = copy.deepcopy(dict(job.spec.template))
    meta = template.get("metadata") or {}
    spec = template["spec"]
    name = trainer_pod_name(job, index)
    spec["hostname"] = name
    spec["subdomain"] = job.name
    spec["restartPolicy"] = spec.get("restartPolicy") or names.TRAINER_RESTART_POLICY
    # Training needs no API credentials; a template that does can say so.
    spec.setdefault("automountServiceAccountToken", False)
    spec["containers"] = [
        _trainer_container(job, c, index, group) if c.get("name") == names.TRAINER_CONTAINER else c
        for c in spec["containers"]
    ]
    trainer = next(c for c in spec["containers"] if c["name"] == names.TRAINER_CONTAINER)
    volumes = list(spec.get("volumes") or [])
    if any(m["name"] == names.SHM_VOLUME for m in trainer.get("volumeMounts", [])) and \
            not any(v.get("name") == names.SHM_VOLUME for v in volumes):
        empty_dir = {"medium": job.spec.shm.medium}
        if job.spec.shm.size_limit is not None:
            empty_dir["sizeLimit"] = job.spec.shm.size_limit
        volumes.append({"name": names.SHM_VOLUME, "emptyDir": empty_dir})
    if job.spec.checkpoint:  # spec.py rejects a template volume of the same name
        volumes.append({"name": names.CHECKPOINT_VOLUME, **copy.deepcopy(dict(job.spec.checkpoint.volume))})
    annotations = dict(meta.get("annotations") or {})
    if follows_desired_size(job):
        # The kubelet rewrites the file when the annotation changes (plan/spares.py keeps it equal to spec.nodes).
        annotations.update(nodes_annotation(job))
        volumes.append({"name": names.NODES_VOLUME, "downwardAPI": {"items": [{
            "path": names.NODES_FILE,
            "fieldRef": {"fieldPath": f"metadata.annotations['{names.NODES_ANNOTATION}']"}}]}})
    if volumes:
        spec["volumes"] = volumes
    add_sidecar(job.spec.diagnostics, spec, annotations)  # spec.diagnostics: py-spy beside the trainer
    spread_across_nodes(job, spec, meta.get("annotations") or {})  # unless the template places the pods itself
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(
            job, name, {**(meta.get("labels") or {}), **pod_labels(job, names.ROLE_TRAINER, group, index)},
            annotations),
        "spec": spec,
    }


def nodes_annotation(job: Job) -> dict[str, str]:
    """The annotation that tells a pod how many nodes train, the desired size its rendezvous follows
    (env.follows_desired_size: jobs with spares or an elastic range; ddp_trainer.rendezvous, rule 3)."""
    return {names.NODES_ANNOTATION: str(job.spec.nodes)}
