"""A DDPJob behind Kueue: the job as one Kueue Workload, and what Kueue's answer means for its pods.

Pure: `gate(...)` reads the job, the Workload the operator sees and the ResourceFlavors its admission names, and
says whether the job may run now, how its pods are placed, and what to write to the Workload. plan/suspend.py
applies it; the shell (reconciler.py) does the reads and writes. docs/kueue.md says the same to users.

Rules (the contract of Kueue's external job integrations, as its own job framework keeps it):
- A DDPJob with the label `kueue.x-k8s.io/queue-name` is represented to Kueue by one Workload
  `ddpjob-<job>-<hash of the job's UID>`, owned (controller) by the job, so deleting the job deletes it. Its pod
  sets: `trainer` (spec.nodes + spec.spares pods, the pod the operator renders for index 0) and `rdzv` (the
  rendezvous store pod). Kueue sums each pod's requests; pods without requests need no quota.
  The label `kueue.x-k8s.io/priority-class` names a WorkloadPriorityClass: the Workload gets its name and value.
- Until Kueue admits the Workload (condition Admitted) the job is held: no pods, phase Suspended, condition
  Suspended=True with reason Queued and Kueue's own message (e.g. which quota is short).
- On admission the pods are created with each pod set's ResourceFlavors applied: the flavors' nodeLabels are
  added to the pod's nodeSelector and their tolerations to its tolerations (on the pods, never on the stored
  template). Condition Suspended turns False with reason Admitted, naming the ClusterQueue.
- Kueue evicts an admitted Workload (preemption, deactivation, a timeout: condition Evicted=True): the job's pods
  are deleted (reason Evicted; a disruption, never counted against backoffLimit; status.progress is kept), and
  once none is left the admission is released (QuotaReserved=False reason Pending, admission cleared, Requeued
  as Kueue's job framework does), so Kueue can queue it again. Readmission starts the pods again; the trainers
  resume from their disk checkpoint (spec.checkpoint) when they have one.
- A job is queued (a Workload created, or an evicted one's quota released) only once no pod of its last run is
  left, so a readmitted job never meets its own terminating pods.
- Pod sets of a Workload cannot change (Kueue's API). spec.nodes (kubectl scale) within what was admitted keeps
  the admission (quota for the admitted count stays reserved, so the job can scale back up without queueing);
  beyond it, the Workload is deleted and a new one of the new size is queued: the job is held until Kueue
  admits that (Kueue's rule for jobs whose pod sets change). A changed queue label moves a Workload that holds
  no quota to the new LocalQueue; an admitted one keeps its queue.
- spec.runPolicy.suspend=true deactivates the Workload (spec.active=false: Kueue releases its quota; the
  annotation ddp.dev/suspended says the operator did it); false activates it again and it is queued. A Workload
  deactivated by anyone else stays inactive: the job waits, saying so.
- When the job Succeeds or Fails the Workload is marked Finished (reason Succeeded/Failed): Kueue frees its
  quota. A deleted Workload of a job that has not finished is created again (the job is held meanwhile).
- A job that has a Workload stays gated by it whatever its labels say now: removing the queue label neither starts
  a queued job nor frees an admitted one from eviction (`kept_queue`; the condition and a Warning Event
  QueueLabelRemoved say so). Deleting the Workload takes such a job out of Kueue. A Workload being deleted
  (deletionTimestamp set) is never the job's Workload (`indexed_workload`).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ddp_operator import names
from ddp_operator.labels import child_metadata, job_labels
from ddp_operator.pod import render_trainer_pod
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.spec import Job
from ddp_operator.status import get_condition, set_condition

# The Workload's name: `ddpjob-<job>-<5 hex of the UID>`, the job part cut so the whole stays a DNS label.
_NAME_PREFIX = "ddpjob-"
_HASH_LENGTH = 5
_MAX_NAME = 63


@dataclass(frozen=True)
class Placement:
    """What an admission adds to a pod set's pods: the flavors' node labels and tolerations."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class WorkloadState:
    """The job's Workload as the operator sees it (observe_workload)."""
    name: str
    uid: str
    resource_version: str
    generation: int
    active: bool
    queue_name: str
    counts: Mapping[str, int]                   # spec.podSets: name -> count
    deactivated_by_suspend: bool                # the operator set spec.active=false for spec.runPolicy.suspend
    conditions: tuple[Mapping[str, Any], ...]
    admission: Mapping[str, Any] | None

    def condition(self, type_: str) -> Mapping[str, Any] | None:
        return get_condition(self.conditions, type_)

    def _true(self, type_: str) -> bool:
        return (self.condition(type_) or {}).get("status") == "True"

    @property
    def quota_reserved(self) -> bool:
        return self._true(names.WL_QUOTA_RESERVED) and self.admission is not None

    @property
    def admitted(self) -> bool:
        return self._true(names.WL_ADMITTED) and self.admission is not None

    @property
    def evicted(self) -> bool:
        return self._true(names.WL_EVICTED)

    @property
    def finished(self) -> bool:
        return self._true(names.WL_FINISHED)

    @property
    def cluster_queue(self) -> str:
        return str((self.admission or {}).get("clusterQueue") or "")

    def admitted_counts(self) -> dict[str, int]:
        """Pods per pod set that the admission covers (count, else the pod set's own count)."""
        return {a.get("name"): int(a["count"]) if a.get("count") is not None else self.counts.get(a.get("name"), 0)
                for a in (self.admission or {}).get("podSetAssignments") or []}

    def flavor_names(self) -> list[str]:
        """The ResourceFlavors the admission assigns (the shell reads them for their node labels)."""
        found = {f for a in (self.admission or {}).get("podSetAssignments") or []
                 for f in (a.get("flavors") or {}).values()}
        return sorted(found)


@dataclass(frozen=True)
class Gate:
    """Kueue's answer for one pass. `hold`: no pods may run (reason/message say why). The writes to the Workload:
    `create` (a body), `delete` (its UID), `patch` (a merge patch of spec), `status` (a merge patch of status,
    with the resourceVersion it was computed from)."""
    hold: bool
    reason: str = ""
    message: str = ""
    placements: Mapping[str, Placement] = field(default_factory=dict)
    cluster_queue: str = ""
    create: Mapping[str, Any] | None = None
    delete: str | None = None
    patch: Mapping[str, Any] | None = None
    status: Mapping[str, Any] | None = None
    evicted: bool = False


def workload_name(job: Job) -> str:
    digest = hashlib.sha256(job.uid.encode()).hexdigest()[:_HASH_LENGTH]
    room = _MAX_NAME - len(_NAME_PREFIX) - 1 - _HASH_LENGTH
    return f"{_NAME_PREFIX}{job.name[:room].rstrip('-')}-{digest}"


def _template(pod: Mapping[str, Any]) -> dict:
    """A pod as a pod set's template: its labels and spec (Kueue reads requests, node selectors, tolerations)."""
    return {"metadata": {"labels": dict(pod["metadata"].get("labels") or {})}, "spec": copy.deepcopy(pod["spec"])}


def render_workload(job: Job, group: int, priority: tuple[str, int] | None) -> dict:
    """The Workload for `job`: `priority` is its WorkloadPriorityClass (name, value), if it names one."""
    spec: dict[str, Any] = {
        "queueName": job.queue_name,
        "active": not job.spec.run_policy.suspend,
        "podSets": [
            {"name": names.POD_SET_TRAINER, "count": job.spec.pods,
             "template": _template(render_trainer_pod(job, 0, group))},
            {"name": names.POD_SET_RDZV, "count": 1, "template": _template(render_rdzv_pod(job, group))},
        ],
    }
    if priority is not None:
        spec["priorityClassRef"] = {"group": names.KUEUE_GROUP, "kind": names.WORKLOAD_PRIORITY_CLASS_KIND,
                                    "name": priority[0]}
        spec["priority"] = priority[1]
    labels = {**job_labels(job), names.LABEL_KUEUE_JOB_UID: job.uid}
    return {"apiVersion": names.KUEUE_API_VERSION, "kind": names.WORKLOAD_KIND,
            "metadata": child_metadata(job, workload_name(job), labels), "spec": spec}


def observe_workload(body: Mapping[str, Any]) -> WorkloadState:
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    return WorkloadState(
        name=meta.get("name") or "",
        uid=meta.get("uid") or "",
        resource_version=str(meta.get("resourceVersion") or ""),
        generation=int(meta.get("generation") or 0),
        active=spec.get("active", True) is not False,
        queue_name=spec.get("queueName") or "",
        counts={p.get("name"): int(p.get("count") or 0) for p in spec.get("podSets") or []},
        deactivated_by_suspend=(meta.get("annotations") or {}).get(names.WORKLOAD_SUSPENDED_ANNOTATION) == "true",
        conditions=tuple(dict(c) for c in status.get("conditions") or []),
        admission=status.get("admission") or None,
    )


def indexed_workload(body: Mapping[str, Any]) -> dict | None:
    """What the operator keeps of a Workload it watches: what observe_workload and the owner check read (not the
    pod templates, not managedFields); None for one being deleted, which gates nothing any more."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    if meta.get("deletionTimestamp"):
        return None
    suspended = (meta.get("annotations") or {}).get(names.WORKLOAD_SUSPENDED_ANNOTATION)
    kept_meta = {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "generation", "labels",
                                      "ownerReferences") if k in meta}
    if suspended is not None:
        kept_meta["annotations"] = {names.WORKLOAD_SUSPENDED_ANNOTATION: suspended}
    kept_spec = {k: spec[k] for k in ("active", "queueName") if k in spec}
    kept_spec["podSets"] = [{k: p[k] for k in ("name", "count") if k in p}
                            for p in spec.get("podSets") or [] if isinstance(p, Mapping)]
    status = body.get("status") or {}
    return {"metadata": kept_meta, "spec": kept_spec,
            "status": {k: copy.deepcopy(status[k]) for k in ("conditions", "admission") if k in status}}


def label_removed(ws: WorkloadState) -> str:
    return (f"metadata.labels[{names.LABEL_QUEUE_NAME}] was removed, but the job keeps its Kueue workload {ws.name} "
            f"(LocalQueue {ws.queue_name}): Kueue still decides when it runs; delete the workload to take the job "
            f"out of Kueue")


def kept_queue(job: Job, ws: WorkloadState) -> Job:
    """A job without the queue label that still has a Workload: gated by it, in the Workload's queue."""
    if job.queue_name:
        return job
    return replace(job, queue_name=ws.queue_name or ws.name, queue_label_removed=True)


def placements(ws: WorkloadState, flavors: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Placement] | str:
    """Each pod set's Placement from its assigned flavors (`flavors`: name -> ResourceFlavor spec, None if not
    found); a message naming the first flavor that is missing."""
    out: dict[str, Placement] = {}
    for assignment in (ws.admission or {}).get("podSetAssignments") or []:
        selector: dict[str, str] = {}
        tolerations: list[Mapping[str, Any]] = []
        for flavor in sorted(set((assignment.get("flavors") or {}).values())):
            spec = flavors.get(flavor)
            if spec is None:
                return f"ResourceFlavor {flavor} (assigned by ClusterQueue {ws.cluster_queue}) was not found"
            selector.update(spec.get("nodeLabels") or {})
            tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
        out[assignment.get("name")] = Placement(selector, tuple(tolerations))
    return out


def place(pod: dict, placement: Placement | None) -> dict:
    """The pod with its pod set's placement added (its own nodeSelector keys win, tolerations are merged)."""
    if placement is None or (not placement.node_selector and not placement.tolerations):
        return pod
    spec = pod["spec"]
    if placement.node_selector:
        spec["nodeSelector"] = {**placement.node_selector, **(spec.get("nodeSelector") or {})}
    if placement.tolerations:
        own = list(spec.get("tolerations") or [])
        spec["tolerations"] = own + [dict(t) for t in placement.tolerations if t not in own]
    return pod


def _with_conditions(ws: WorkloadState, conditions: list[dict], **status: Any) -> dict:
    """A status merge patch: the whole condition list (a merge patch replaces lists) and the resourceVersion it
    was computed from, so a concurrent write by Kueue makes it fail (409) instead of being overwritten."""
    return {"metadata": {"resourceVersion": ws.resource_version}, "status": {"conditions": conditions, **status}}


def _set(conditions: list[dict], ws: WorkloadState, type_: str, status: bool, reason: str, message: str,
         now: str) -> list[dict]:
    """Like status.set_condition, but keeping Kueue's order of conditions and the Workload's generation."""
    updated = set_condition(conditions, type_, status, reason, message[:32768], now, ws.generation)
    new = next(c for c in updated if c["type"] == type_)
    out = [new if c.get("type") == type_ else c for c in conditions]
    return out if any(c.get("type") == type_ for c in conditions) else out + [new]


def finished_patch(ws: WorkloadState, succeeded: bool, message: str, now: str) -> dict:
    reason = names.WL_REASON_SUCCEEDED if succeeded else names.WL_REASON_FAILED
    return _with_conditions(ws, _set([dict(c) for c in ws.conditions], ws, names.WL_FINISHED, True, reason,
                                     message, now))


def released_patch(ws: WorkloadState, now: str) -> dict:
    """After an eviction, once the job's pods are gone: the quota reservation and admission are given back."""
    evicted = ws.condition(names.WL_EVICTED) or {}
    message = evicted.get("message") or "evicted"
    conditions = [dict(c) for c in ws.conditions]
    conditions = _set(conditions, ws, names.WL_REQUEUED, evicted.get("reason") in names.WL_REQUEUED_EVICTIONS,
                      evicted.get("reason") or names.WL_EVICTED, message, now)
    conditions = _set(conditions, ws, names.WL_QUOTA_RESERVED, False, names.WL_REASON_PENDING, message, now)
    conditions = _set(conditions, ws, names.WL_ADMITTED, False, names.WL_REASON_NO_RESERVATION,
                      "The workload has no reservation", now)
    return _with_conditions(ws, conditions, admission=None)


def _queued_message(ws: WorkloadState) -> str:
    where = f"LocalQueue {ws.queue_name}"
    if not ws.active:
        return f"Kueue workload {ws.name} is inactive (spec.active=false)"
    if ws.quota_reserved:
        return (f"quota reserved in ClusterQueue {ws.cluster_queue}; waiting for the workload's admission checks "
                f"(workload {ws.name})")
    said = (ws.condition(names.WL_QUOTA_RESERVED) or {}).get("message") or ""
    return f"waiting in {where} for Kueue to admit workload {ws.name}" + (f": {said}" if said else "")


def _resized(job: Job, ws: WorkloadState) -> str | None:
    """Why the Workload no longer stands for the job (its pod sets cannot change), or None."""
    want = {names.POD_SET_TRAINER: job.spec.pods, names.POD_SET_RDZV: 1}
    if dict(ws.counts) == want:
        return None
    if ws.admitted:
        covered = ws.admitted_counts()
        if all(covered.get(k, 0) >= n for k, n in want.items()):
            return None  # scaled down within the admission: it keeps its quota
        return (f"spec.nodes={job.spec.nodes} needs {job.spec.pods} trainer pods, more than the "
                f"{covered.get(names.POD_SET_TRAINER, 0)} Kueue admitted; Kueue cannot grow an admitted workload, so "
                f"the job is queued again at the new size")
    return (f"spec.nodes={job.spec.nodes} changed the pod sets; the job is queued again as a workload of "
            f"{job.spec.pods} trainer pods")


def gate(job: Job, ws: WorkloadState | None, *, group: int, pods_live: bool, now: str,
         flavors: Mapping[str, Mapping[str, Any] | None], priority: tuple[str, int] | None | str) -> Gate:
    """Kueue's answer for a job with a queue name. `priority`: the (name, value) of the job's WorkloadPriorityClass,
    None without one, or a message when it cannot be read; `pods_live`: any pod of the job still exists."""
    if ws is None:
        if isinstance(priority, str):
            return Gate(hold=True, reason=names.REASON_QUEUED, message=priority)
        if pods_live:  # its Workload went (resized, deleted): queued again once the pods of the last run are gone
            return Gate(hold=True, reason=names.REASON_QUEUED,
                        message="waiting for the job's pods to stop before queueing it again")
        return Gate(hold=True, reason=names.REASON_QUEUED,
                    message=f"waiting in LocalQueue {job.queue_name} for Kueue to admit workload {workload_name(job)}",
                    create=render_workload(job, group, priority))
    g = _gate(job, ws, pods_live=pods_live, now=now, flavors=flavors)
    if not job.queue_label_removed:
        return g
    return replace(g, message=f"{g.message}; {label_removed(ws)}")


def _gate(job: Job, ws: WorkloadState, *, pods_live: bool, now: str,
          flavors: Mapping[str, Mapping[str, Any] | None]) -> Gate:
    """gate() for a job that has a Workload."""
    resized = _resized(job, ws)
    if resized is not None and job.queue_label_removed:  # a new Workload could not be queued: the old one stays
        return Gate(hold=True, reason=names.REASON_QUEUED,
                    message=f"{resized}, but without the label no new workload can be queued: put the label back")
    if resized is not None:
        return Gate(hold=True, reason=names.REASON_QUEUED, message=resized, delete=ws.uid)
    patch: dict[str, Any] = {}
    annotations: dict[str, Any] = {}
    if job.spec.run_policy.suspend and ws.active:
        patch["active"] = False
        annotations[names.WORKLOAD_SUSPENDED_ANNOTATION] = "true"
    elif not job.spec.run_policy.suspend and not ws.active and ws.deactivated_by_suspend:
        # Only what the suspend did is undone: a Workload deactivated by Kueue or a user stays inactive.
        patch["active"] = True
        annotations[names.WORKLOAD_SUSPENDED_ANNOTATION] = None
    if ws.queue_name != job.queue_name and not ws.quota_reserved:
        patch["queueName"] = job.queue_name
    spec_patch = ({"spec": patch, **({"metadata": {"annotations": annotations}} if annotations else {})}
                  if patch else None)
    if ws.evicted and ws.quota_reserved:
        said = (ws.condition(names.WL_EVICTED) or {}).get("message") or "evicted by Kueue"
        return Gate(hold=True, reason=names.REASON_EVICTED, message=f"Kueue evicted workload {ws.name}: {said}",
                    patch=spec_patch, status=None if pods_live else released_patch(ws, now), evicted=True)
    if not ws.admitted or patch:
        return Gate(hold=True, reason=names.REASON_QUEUED, message=_queued_message(ws), patch=spec_patch)
    placed = placements(ws, flavors)
    if isinstance(placed, str):
        return Gate(hold=True, reason=names.REASON_QUEUED, message=placed)
    return Gate(hold=False, reason=names.REASON_ADMITTED,
                message=f"admitted by Kueue ClusterQueue {ws.cluster_queue} (workload {ws.name})",
                placements=placed, cluster_queue=ws.cluster_queue)
