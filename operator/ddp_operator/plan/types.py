"""What the planner takes and gives: the observed world (Observed), the status written last (PrevStatus, parsed
here once), the API actions (Action) and the result of a pass (Plan)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping

from ddp_operator import kueue as kueuemod
from ddp_operator import names
from ddp_operator import stall as stallmod
from ddp_operator.observed import NodeState, PodState, parse_time
from ddp_operator.status import Event

CREATE = "create"
DELETE = "delete"
FORCE_DELETE = "force-delete"
DELETE_JOB = "delete-job"
PATCH = "patch"
PATCH_STATUS = "patch-status"


@dataclass(frozen=True)
class Action:
    verb: str            # create | delete | force-delete | delete-job | patch | patch-status
    kind: str            # Pod | Service | NetworkPolicy | DDPJob | Workload
    name: str
    body: Mapping[str, Any] | None = None  # the object to create, or the merge patch
    uid: str | None = None  # precondition for deletes and patches: never touch a newer pod of the same name
    grace_seconds: int | None = None  # a delete's grace period; None: the pod's own


@dataclass(frozen=True)
class Observed:
    pods: tuple[PodState, ...]               # live pods and tombstones (`gone`) of this job
    service_exists: bool = True
    # For nodes of pods stuck Terminating: True/False, or None when unknown (no permission to read Nodes).
    node_ready: Mapping[str, bool | None] = field(default_factory=dict)
    # The job's own NetworkPolicy <job>; its UID is the precondition of a delete (never a foreign policy).
    network_policy_exists: bool = True
    network_policy_uid: str | None = None
    # Its spec as the watch shows it (None: not known, e.g. just created): put back when it drifts (netpol.drifted).
    network_policy_spec: Mapping[str, Any] | None = None
    # Children whose create met an object this job does not own: name -> what is in the way (k8s.ChildConflict).
    conflicts: Mapping[str, str] = field(default_factory=dict)
    # Hang detection: every current trainer pod's own progress report keyed by pod UID (None: it did not answer),
    # handed in only when the shell found no newer step from any pod for failurePolicy.hangTimeoutSeconds (hang.py).
    hang_reports: Mapping[str, Mapping[str, Any] | None] | None = None
    # With hang_reports, when the pods carry the diagnostics sidecar: every current trainer pod's diagnosis (asked with
    # ?log=Hang), for status.diagnosis and the frame in the message (plan/hang.py).
    hang_diagnoses: tuple[stallmod.PodDiagnosis, ...] | None = None
    # A stall the shell found in the diagnostics sidecars' answers (docs/diagnostics.md, plan/stall.py): the process
    # group did not form within processGroupTimeoutSeconds, a script that reports no progress stood still for
    # hangTimeoutSeconds, or a job whose condition Stalled is True formed (reason ProcessGroupFormed).
    stall: stallmod.Finding | None = None
    # Children whose create the API server refused (quota, PodSecurity, a webhook, an invalid field):
    # name -> "cannot create Pod <name>: <code> <reason>: <message>". The shell retries them with a backoff.
    refusals: Mapping[str, str] = field(default_factory=dict)
    # Nodes of node_lost_candidates: their state, or None when unknown (no permission to read Nodes).
    nodes: Mapping[str, NodeState | None] = field(default_factory=dict)
    # Kueue (kueue.py), for jobs with a queue name: whether the operator runs its Kueue integration, the job's
    # Workload, the ResourceFlavors its admission names (name -> spec, None: not found) and the job's
    # WorkloadPriorityClass (name, value), None without one, or why it cannot be read.
    kueue: bool = False
    workload: kueuemod.WorkloadState | None = None
    flavors: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    priority: tuple[str, int] | str | None = None


@dataclass(frozen=True)
class Plan:
    status: dict
    actions: tuple[Action, ...]
    events: tuple[Event, ...]
    requeue_after: float | None              # seconds until a time-based rule (deadline, TTL, stuck pod) is due
    counted_restarts: int = 0                # for metrics
    recovery_seconds: float | None = None    # set when a recovery completed in this pass


@dataclass(frozen=True)
class Counts:
    """status.nodes or status.spares as written last. Only the rules of an active job read the counts, so they are
    read when asked."""
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def desired(self) -> int:
        return int(self.raw.get("desired") or 0)

    @property
    def running(self) -> int:
        return int(self.raw.get("running") or 0)


@dataclass(frozen=True)
class PrevStatus:
    """The status the operator wrote last, as the pass reads it. A missing or empty field reads as its default."""
    phase: str = names.PHASE_PENDING
    reason: str = ""
    message: str = ""
    conditions: tuple[dict, ...] = ()
    restarts: int = 0
    infra_restarts: int = 0
    disruptions: int = 0
    # status.group: the rendezvous generation (PET_RDZV_ID `<uid>-<group>`, pod label ddp.dev/group). Carried
    # over unchanged (0 for new jobs) since a lost store no longer bumps it; kept because a job started by an
    # operator that did still runs pods under its group > 0: dropping it would delete those pods as stale and
    # move their rendezvous id. It is also in the CRD's status, read by kubectl users and the e2e tests.
    group: int = 0
    attempts: tuple[dict, ...] = ()
    recorded_pods: tuple[str, ...] = ()
    start_time: datetime | None = None
    completion_time: datetime | None = None
    last_failure_time: datetime | None = None            # status.lastFailureTime: the last incident
    recovery_start_time: datetime | None = None
    pods_pending_since: datetime | None = None
    progress: Mapping[str, Any] | None = None
    # Handed on as written: status.incident_record and status.last_recovery read them.
    last_incident: Mapping[str, Any] | None = None
    last_recovery: Mapping[str, Any] | None = None
    last_failure: Mapping[str, Any] | None = None
    goodput: Mapping[str, Any] | None = None
    nodes: Counts = Counts()
    spares: Counts = Counts()

    @classmethod
    def parse(cls, status: Mapping[str, Any] | None) -> PrevStatus:
        """The one place the pass reads the status dict the operator wrote."""
        prev = dict(status or {})
        return cls(
            conditions=tuple(dict(c) for c in prev.get("conditions") or []),
            restarts=int(prev.get("restarts") or 0),
            infra_restarts=int(prev.get("infraRestarts") or 0),
            disruptions=int(prev.get("disruptions") or 0),
            group=int(prev.get("group") or 0),
            attempts=tuple(prev.get("attempts") or []),
            recorded_pods=tuple(prev.get("recordedPods") or []),
            start_time=parse_time(prev.get("startTime")),
            completion_time=parse_time(prev.get("completionTime")),
            last_failure_time=parse_time(prev.get("lastFailureTime")),
            recovery_start_time=parse_time(prev.get("recoveryStartTime")),
            phase=prev.get("phase") or names.PHASE_PENDING,
            reason=prev.get("reason") or "",
            message=prev.get("message") or "",
            progress=prev.get("progress"),
            pods_pending_since=parse_time(prev.get("podsPendingSince")),
            last_incident=prev.get("lastIncident"),
            last_recovery=prev.get("lastRecovery"),
            last_failure=prev.get("lastFailure"),
            goodput=prev.get("goodput") if isinstance(prev.get("goodput"), Mapping) else None,
            nodes=Counts(prev.get("nodes") or {}),
            spares=Counts(prev.get("spares") or {}),
        )
