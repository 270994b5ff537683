"""Deciding what to do: `plan(job, status, observed, now)` -> the next status, the API actions and Events.

Pure and level-based: everything it needs is the job, the status the operator wrote last, the pods it sees
now (plus tombstones of pods it saw deleted) and the clock value it is given. Running it twice on the same
input yields the same output, so an operator restart changes nothing.

Rules (docs/contract.md and the CRD field descriptions say the same to users):
- Training pods run with restartPolicy OnFailure (pod.py). A trainer container that exits non-zero is restarted
  by the kubelet in the same pod (same IP, hostname and /dev/shm): each such restart is recorded once (key
  `<uid>/<restartCount>` in status.recordedPods, details with `restartCount` in status.attempts; restarts the
  operator did not see, e.g. while it was down, are recorded together with the newest) and is an incident like a
  failed pod. The pod is left alone: the kubelet restarts the container (CrashLoopBackOff from the second
  restart on), the trainer resumes from its own snapshot.
- A failed, deleted or evicted training pod is recorded once (by UID, in status.recordedPods, with its details in
  the bounded status.attempts history), deleted, and recreated under the same name once the old one is gone
  (so there is never more than one pod per index). A pod missing while the job was training, whose end nobody
  saw (deleted while the operator was down) and that is not already on record within the recovery under way, is
  recorded too (reason NodeMissing, no UID) and counted like a deleted pod.
- A failure counts against failurePolicy.backoffLimit unless it is a disruption (eviction, preemption, node
  loss) and countDisruptions is false, or it falls within incidentWindowSeconds of the incident that came
  before (survivors crashing because a peer died). Exceeding the budget fails the job and stops the pods.
- Exit codes listed as permanent (or not listed as retryable) fail the job at once, on a pod that ended as on an
  in-place restart (the trainer container's exit code and its workers' from torchrun's summary).
- Losing the rendezvous-store pod (it ended or is being deleted) is recorded once (reason RendezvousStoreLost, a
  Warning Event), is one incident, and the pod is recreated under the same name. The group and the rendezvous id
  stay and no trainer pod is touched: the agents fail on the lost store, their containers restart in place and
  rejoin the new store. Trainer restarts (and, with restartPolicy Never, trainer pods failing with an exit
  code) seen while the store pod is not Ready — after its loss or at start — are recorded and never counted:
  the trainers cannot run without it, as a trainer pod stuck Pending never fails the job either. The
  recovery ends only when the store is Ready and every trainer runs.
  status.group stays for compatibility: pods of another group are stale (below); it no longer changes.
- Succeeded: some trainer exited 0 and no trainer is still running. Failures after a success are not replaced
  nor counted, a trainer container restarting in place then is stopped at once; trainers still running
  SUCCESS_GRACE_SECONDS after the first success are stopped (spares at once, below).
- A trainer pod's outcome is its `trainer` container's: exit 0 is a success and any other exit a failure even
  while a sidecar container keeps the pod Running; such a pod is then stopped like a running one
  (cleanPodPolicy once the job finished, replacement after a failure).
- Events: every phase change carries one (the changed conditions', else one with the new status reason), as
  do a change of spec.nodes (Scaled), a TTL deletion (TTLExpired), a force-deleted pod, every in-place restart
  (TrainerRestarted) and a lost store (RendezvousStoreLost), unless a condition Event already says the same.
  The shell adds FailedCreate when the API server refuses a child.
- The job's NetworkPolicy (netpol.py) exists while the job is active exactly when it is wanted
  (spec.networkPolicy.enabled, else the operator's default): created before any pod, deleted when disabled.
- Pods of an older group (or with a group label that is not a number), or with an index >= spec.nodes +
  spec.spares (scale down), are deleted and never counted.
- Hot spares (spec.spares, spares.py): the job keeps spec.nodes + spec.spares identical trainer pods; the
  rendezvous (of exactly spec.nodes, backend ddpjob-c10d) decides which ones train. Running needs spec.nodes
  running pods; status.nodes counts the first spec.nodes, status.spares the rest (NODES `2/2 +1`). A spare pod
  that fails, vanishes or restarts in place is handled like any trainer (recorded, counted, recreated); one whose
  termination message ends with names.SPARE_RELEASED_MARKER (its rendezvous was closed by a finishing participant)
  is recorded with reason SpareReleased, never counted and no incident. Once a trainer exited 0 the running pods
  that are not members (rank 0's final report, else status.progress.members; without either, all of them once
  spec.nodes trainers exited 0) are stopped at once. The hang rule judges members only (from the hang reports,
  else status.progress; without either, only pods that answered). spec.spares needs minNodes == maxNodes == nodes
  (admission refuses it; spec.py checks again). spec.nodes may change: every live current trainer pod of a job
  with spares carries spec.nodes in its annotation (names.NODES_ANNOTATION, patched with a UID precondition
  before any create), which its rendezvous backend follows (pod.py).
- A child name held by an object the job does not own (a foreign `<job>-0` pod or `<job>` Service) sets
  condition ReplicaFailure=True, reason ChildConflict, naming the object; the job waits (its create is retried)
  until the object is removed, then the condition turns False.
- status.progress never goes back: a report (polled, or the final one) from a step before the one shown is not
  taken (status.newer_progress).
- Hang (failurePolicy.hangTimeoutSeconds, hang.py): when the shell found rank 0's step unchanged for the timeout
  and hands in every trainer pod's report (Observed.hang_reports), the stuck pod(s) are recorded with reason Hang,
  deleted and replaced; the job is Restarting with reason Hang.
- status.lastIncident keeps the last incident's reason and time (the first reason within the incident window);
  status.lastRecovery combines it with the trainer's `recovery` report (status.last_recovery).
- Pods that cannot start (the section "pods that cannot start"): a current pod the kubelet cannot start
  (image pull, container config) sets condition PodsNotStarting=True with the kubelet's reason and message (an
  Unschedulable pod does not: an autoscaler may add room; the startup timeout's message names it); a child the
  API server refuses (Observed.refusals, the shell backs off its retries) sets ReplicaFailure=True, reason
  FailedCreate, with the refusal (one Event per distinct refusal). Both show in status.reason/message and turn False once the cause is gone. While fewer than minNodes trainers
  or no store pod run, status.podsPendingSince says since when; failurePolicy.startupTimeoutSeconds after it the
  job fails (StartupTimeoutExceeded) with the blocking reason.
- Node loss (the section "node loss"): a live current trainer or store pod on a node NotReady (Ready False or
  Unknown) for failurePolicy.nodeLostTimeoutSeconds, or on a node that no longer exists, is force-deleted and
  handled as a disruption (reason NodeLost) by the ordinary failure rules; nodes of unknown state (no RBAC) are
  left alone. The shell reads the nodes of the pods `node_lost_candidates` names.
- Kueue (kueue.py states its rules): a job with the label kueue.x-k8s.io/queue-name runs only while Kueue admits
  its Workload; until then, and after an eviction, it is held like a suspended job (phase Suspended, condition
  Suspended reason Queued or Evicted; an eviction is a disruption). Its pods get the admitted flavors' node
  labels and tolerations. A finished job marks its Workload Finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Mapping

from ddp_operator import hang as hangmod
from ddp_operator import kueue as kueuemod
from ddp_operator import names
from ddp_operator import spares as sparesmod
from ddp_operator.env import rdzv_endpoint, rdzv_id
from ddp_operator.labels import selector_string, trainer_selector
from ddp_operator.netpol import NetworkPolicyConfig, render_network_policy, wanted
from ddp_operator.observed import NodeState, PodState, format_time, parse_time
from ddp_operator.pod import nodes_annotation, render_trainer_pod, trainer_pod_name
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.service import render_service
from ddp_operator.spec import Job
from ddp_operator.status import (
    Event, append_attempt, attempt, condition_events, get_condition, incident_record, last_recovery, missing_attempt,
    newer_progress, progress_status, record_pod, restart_key, restart_number, set_condition,
)

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
    # Children whose create met an object this job does not own: name -> what is in the way (k8s.ChildConflict).
    conflicts: Mapping[str, str] = field(default_factory=dict)
    # Hang detection: every current trainer pod's own progress report (None: it did not answer), handed in only
    # when the shell found rank 0's step unchanged for failurePolicy.hangTimeoutSeconds (hang.py).
    hang_reports: Mapping[str, Mapping[str, Any] | None] | None = None
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


def stuck_pods(job: Job, pods: tuple[PodState, ...], now: datetime) -> list[PodState]:
    """Pods Terminating longer than stuckTerminatingTimeoutSeconds: the shell looks up their nodes."""
    timeout = timedelta(seconds=job.spec.failure_policy.stuck_terminating_timeout_seconds)
    return [p for p in pods if not p.gone and p.deleting and p.node and p.deletion_time
            and now >= p.deletion_time + timeout]


def node_lost_candidates(pods: tuple[PodState, ...]) -> list[PodState]:
    """Pods whose node the shell looks up for the node-loss rule: live, not ended nor deleting, on a node, and not
    Ready (the node controller marks the pods of a NotReady node not Ready, so healthy pods cost no reads)."""
    return [p for p in pods if not p.gone and not p.terminal and not p.deleting and p.node and not p.ready]


# At most this many refused children are named in the ReplicaFailure condition (and get an Event each).
REFUSALS_SHOWN = 3


class _Pass:
    """The working state of one planning pass."""

    def __init__(self, job: Job, prev: Mapping[str, Any], observed: Observed, now: datetime,
                 network_policy: NetworkPolicyConfig = NetworkPolicyConfig()):
        self.job, self.observed, self.now = job, observed, now
        self.network_policy_config = network_policy
        self.now_s = format_time(now)
        self.prev = dict(prev or {})
        self.conditions: list[dict] = [dict(c) for c in self.prev.get("conditions") or []]
        self.restarts = int(self.prev.get("restarts") or 0)
        self.disruptions = int(self.prev.get("disruptions") or 0)
        self.group = int(self.prev.get("group") or 0)
        self.attempts: list[dict] = list(self.prev.get("attempts") or [])
        self.recorded_pods: list[str] = list(self.prev.get("recordedPods") or [])
        self.start_time = parse_time(self.prev.get("startTime"))
        self.completion_time = parse_time(self.prev.get("completionTime"))
        self.last_incident = parse_time(self.prev.get("lastFailureTime"))
        self.recovery_start = parse_time(self.prev.get("recoveryStartTime"))
        self.phase = self.prev.get("phase") or names.PHASE_PENDING
        self.reason = self.prev.get("reason") or ""
        self.message = self.prev.get("message") or ""
        self.progress = self.prev.get("progress")
        self.actions: list[Action] = []
        self.extra_events: list[Event] = []
        self.requeue: list[float] = []
        self.counted = 0
        self.recovery_seconds: float | None = None
        self.incident_reason = ""
        self.incident_message = ""
        self.pods_pending_since = parse_time(self.prev.get("podsPendingSince"))
        self.placements: Mapping[str, kueuemod.Placement] = {}  # Kueue's admission, per pod set

    # --- helpers ----------------------------------------------------------------------------------
    def cond(self, type_: str, status: bool, reason: str, message: str) -> None:
        self.conditions = set_condition(self.conditions, type_, status, reason, message, self.now_s,
                                        self.job.generation)

    def due_in(self, when: datetime) -> None:
        self.requeue.append(max(0.0, (when - self.now).total_seconds()))

    def delete(self, pod: PodState, grace_seconds: int | None = None) -> None:
        if not pod.gone and not pod.deleting:
            self.actions.append(Action(DELETE, "Pod", pod.name, uid=pod.uid, grace_seconds=grace_seconds))

    @property
    def live(self) -> list[PodState]:
        # Tombstones are out, whatever their last phase: a gracefully deleted pod's tombstone is usually
        # Failed, and counting it as present would hold back its replacement until some later wake-up.
        return [p for p in self.observed.pods if not p.gone]

    @property
    def trainers(self) -> list[PodState]:
        return [p for p in self.observed.pods if p.role == names.ROLE_TRAINER]

    def current(self, p: PodState) -> bool:
        """A trainer pod of the current group within the desired index range (training nodes and spares)."""
        return (p.role == names.ROLE_TRAINER and p.group == self.group and p.index is not None
                and p.index < self.job.spec.pods)

    def recorded(self, p: PodState) -> bool:
        """Whether the end of pod p is on record (its in-place restarts are recorded apart, `restarts_recorded`)."""
        return p.uid in self.recorded_pods or any(a.get("uid") == p.uid and not a.get("restartCount")
                                                  for a in self.attempts)

    def restarts_recorded(self, p: PodState) -> int:
        """How many in-place restarts of pod p's trainer container are on record (keys `<uid>/<restartCount>`)."""
        seen = [restart_number(key, p.uid) for key in self.recorded_pods]
        seen += [int(a["restartCount"]) for a in self.attempts if a.get("uid") == p.uid and a.get("restartCount")]
        return max(seen, default=0)

    def record(self, p: PodState, *, counted: bool, reason: str | None = None, restart: int | None = None) -> None:
        """Put an ended pod (or, with `restart`, an in-place restart of its trainer container) on record: its key
        for as long as the pod exists, its details in the bounded history."""
        self.attempts = append_attempt(self.attempts, attempt(p, counted=counted, now=self.now_s, reason=reason,
                                                              restart=restart))
        key = p.uid if restart is None else restart_key(p.uid, restart)
        self.recorded_pods = record_pod(self.recorded_pods, key, (q.uid for q in self.observed.pods))

    def store_up(self) -> bool:
        """The rendezvous store pod of the current group is Ready (listening)."""
        return any(p.role == names.ROLE_RDZV and p.group == self.group and p.ready and not p.deleting
                   and not p.gone for p in self.observed.pods)

    def finish(self, phase: str, reason: str, message: str) -> None:
        self.phase, self.reason, self.message = phase, reason, message
        self.completion_time = self.now
        self.recovery_start = None
        if phase == names.PHASE_SUCCEEDED:
            self.cond(names.COND_SUCCEEDED, True, reason, message)
        else:
            self.cond(names.COND_FAILED, True, reason, message)
        if get_condition(self.conditions, names.COND_RUNNING):
            self.cond(names.COND_RUNNING, False, reason, message)
        if get_condition(self.conditions, names.COND_RESTARTING):
            self.cond(names.COND_RESTARTING, False, reason, message)

    # --- the rules --------------------------------------------------------------------------------
    def finished(self) -> None:
        """Clean up after Succeeded/Failed and delete the job when its TTL is up."""
        self.workload_finished()
        rp = self.job.spec.run_policy
        for p in self.live:
            running = not p.terminal or p.lingering
            if rp.clean_pod_policy == "All" or (running and (
                    rp.clean_pod_policy == "Running" or self.phase == names.PHASE_FAILED)):
                self.delete(p)
        if rp.ttl_seconds_after_finished is not None and self.completion_time:
            expiry = self.completion_time + timedelta(seconds=rp.ttl_seconds_after_finished)
            if self.now >= expiry:
                self.actions.append(Action(DELETE_JOB, names.KIND, self.job.name))
                self.extra_events.append(Event(
                    "Normal", names.REASON_TTL_EXPIRED,
                    f"spec.runPolicy.ttlSecondsAfterFinished={rp.ttl_seconds_after_finished} passed since the job "
                    f"finished; deleting it"))
            else:
                self.due_in(expiry)

    def suspended(self, reason: str = names.REASON_SUSPENDED,
                  message: str = "spec.runPolicy.suspend is true: pods deleted") -> None:
        """No pods: suspended by the user (spec.runPolicy.suspend) or held by Kueue (`reason` Queued/Evicted)."""
        for p in self.live:
            self.delete(p)
        self.phase, self.reason, self.message = names.PHASE_SUSPENDED, reason, message
        self.start_time = None  # the deadline restarts on resume, as for batch/v1 Jobs
        self.recovery_start = None
        self.cond(names.COND_SUSPENDED, True, reason, self.message)
        if get_condition(self.conditions, names.COND_RUNNING):
            self.cond(names.COND_RUNNING, False, reason, self.message)
        if get_condition(self.conditions, names.COND_RESTARTING):
            self.cond(names.COND_RESTARTING, False, reason, self.message)

    # --- Kueue (kueue.py) -------------------------------------------------------------------------
    def queued(self) -> bool:
        """Ask Kueue's gate (a job with a queue name) and carry out its writes to the Workload; True when the job is
        held this pass (no pods). With spec.runPolicy.suspend the suspend rule decides (the gate only deactivates
        the Workload)."""
        job, ws = self.job, self.observed.workload
        if not self.observed.kueue:
            self.suspended(names.REASON_QUEUE_DISABLED, (
                f"metadata.labels[{names.LABEL_QUEUE_NAME}]={job.queue_name}, but this operator runs without its "
                f"Kueue integration (Helm value kueue.enabled=true, flag --kueue): the job waits"))
            return True
        g = kueuemod.gate(job, ws, group=self.group, pods_live=bool(self.live), now=self.now_s,
                          flavors=self.observed.flavors, priority=self.observed.priority)
        if g.create is not None:
            self.actions.append(Action(CREATE, names.WORKLOAD_KIND, g.create["metadata"]["name"], g.create))
        if ws is not None and g.delete:
            self.actions.append(Action(DELETE, names.WORKLOAD_KIND, ws.name, uid=g.delete))
        if ws is not None and g.patch:
            self.actions.append(Action(PATCH, names.WORKLOAD_KIND, ws.name, g.patch, uid=ws.uid))
        if ws is not None and g.status:
            self.actions.append(Action(PATCH_STATUS, names.WORKLOAD_KIND, ws.name, g.status, uid=ws.uid))
        if job.spec.run_policy.suspend:
            return False
        before = get_condition(self.conditions, names.COND_SUSPENDED) or {}
        held_before = before.get("status") == "True"
        if g.hold:
            if g.evicted and not (held_before and before.get("reason") == names.REASON_EVICTED):
                # A disruption: never counted against backoffLimit; status.progress stays. The condition's Event
                # (reason Evicted) tells the user.
                self.disruptions += 1
            self.suspended(g.reason, g.message)
            return True
        if held_before and any(p.deleting for p in self.live):
            # Readmitted before the last run's pods were gone: they would be taken for failures of this run.
            self.suspended(before.get("reason") or names.REASON_QUEUED,
                           f"{g.message}; waiting for the pods of the last run to stop")
            return True
        if held_before:  # the ends of pods deleted for the hold are no failures of the run that starts now
            self.observed = replace(self.observed, pods=tuple(p for p in self.observed.pods if not p.gone))
        self.placements = g.placements
        if before.get("reason") != names.REASON_ADMITTED:
            self.cond(names.COND_SUSPENDED, False, names.REASON_ADMITTED, g.message)
            if not held_before:  # no condition Event for a condition that appears False
                self.extra_events.append(Event("Normal", names.REASON_ADMITTED, g.message))
        return False

    def workload_finished(self) -> None:
        """A finished job marks its Workload Finished: Kueue frees its quota."""
        ws = self.observed.workload
        if self.job.queue_name and ws is not None and not ws.finished:
            body = kueuemod.finished_patch(ws, self.phase == names.PHASE_SUCCEEDED, self.message, self.now_s)
            self.actions.append(Action(PATCH_STATUS, names.WORKLOAD_KIND, ws.name, body, uid=ws.uid))

    def deadline_exceeded(self) -> bool:
        deadline = self.job.spec.run_policy.active_deadline_seconds
        if deadline is None or self.start_time is None:
            return False
        due = self.start_time + timedelta(seconds=deadline)
        if self.now >= due:
            self.finish(names.PHASE_FAILED, names.REASON_DEADLINE,
                        f"the job ran longer than spec.runPolicy.activeDeadlineSeconds={deadline}")
            return True
        self.due_in(due)
        return False

    def incident(self, disruption: str | None, *, caused: bool = False) -> bool:
        """Record a failure; True if it counts against the budget. Updates the incident window. `caused`: a
        consequence of an incident already on record (never counted, and never opens a new window)."""
        fp = self.job.spec.failure_policy
        window = timedelta(seconds=fp.incident_window_seconds)
        same_incident = caused or (self.last_incident is not None and self.now - self.last_incident < window)
        if disruption:
            self.disruptions += 1
        counts = not same_incident and (disruption is None or fp.count_disruptions)
        if not same_incident:
            self.last_incident = self.now
        if self.recovery_start is None:
            self.recovery_start = self.now
        return counts

    def failure(self, p: PodState, what: str, *, disruption: str | None = None, caused: bool = False,
                **record: Any) -> bool | None:
        """Put a failure of `p` (an ended pod, an in-place restart, a hang) on record as an incident: whether it
        counted, or None when it exceeded backoffLimit (the job failed; `what` is in its message)."""
        counts = self.incident(disruption, caused=caused)
        if counts and self.over_budget(what):
            self.record(p, counted=True, **record)
            return None
        self.record(p, counted=counts, **record)
        return counts

    def over_budget(self, what: str) -> bool:
        limit = self.job.spec.failure_policy.backoff_limit
        if self.restarts + 1 > limit:
            self.finish(names.PHASE_FAILED, names.REASON_BACKOFF_LIMIT,
                        f"{self.restarts + 1} failures exceed spec.failurePolicy.backoffLimit={limit}; last: {what}")
            return True
        self.restarts += 1
        self.counted += 1
        return False

    def permanent(self, what: str) -> None:
        fp = self.job.spec.failure_policy
        field_name = ("spec.failurePolicy.permanentExitCodes" if fp.retryable_exit_codes is None
                      else "spec.failurePolicy.retryableExitCodes")
        self.finish(names.PHASE_FAILED, names.REASON_PERMANENT_EXIT, f"{what}: a permanent failure per {field_name}")

    def in_place_restarts(self) -> bool:
        """Record each in-place restart of a current trainer's container once; False if the job failed.

        An incident under the same rules as a failed pod, except that restarts seen while the rendezvous store
        is not up are consequences of its loss (or of its slow start): recorded, never counted. The pod is
        left alone: the kubelet has restarted (or is restarting) the container in the same pod."""
        store_down = not self.store_up()
        for p in sorted((p for p in self.trainers if self.current(p) and p.restarts > self.restarts_recorded(p)),
                        key=lambda p: (p.index, p.name)):
            if sparesmod.released(p.restart_message):
                self.spare_released(p, restart=p.restarts)
                continue
            missed = p.restarts - self.restarts_recorded(p) - 1
            what = f"trainer container of pod {p.name} {describe_restart(p)}" + (
                f" ({missed} earlier restart(s) not observed)" if missed > 0 else "")
            if self.job.spec.failure_policy.is_permanent(p.restart_exit_codes):
                self.record(p, counted=True, restart=p.restarts)
                self.permanent(what)
                return False
            counts = self.failure(p, what, caused=store_down, restart=p.restarts)
            if counts is None:
                return False
            self.incident_reason = names.REASON_RESTARTED_IN_PLACE
            self.incident_message = what + ("" if counts else (
                " (not counted: the rendezvous store was not up)" if store_down else " (not counted)"))
            self.extra_events.append(Event("Warning", names.REASON_RESTARTED_IN_PLACE, self.incident_message))
        return True

    def trainer_failures(self) -> bool:
        """Handle ended trainer pods of the current group; False if the job failed. A trainer that failed on
        its own (an exit code, no disruption, not deleted) while the store is not up is not counted (a template
        with restartPolicy Never: the store's loss ends every trainer pod)."""
        fp = self.job.spec.failure_policy
        store_down = not self.store_up()
        ended = sorted((p for p in self.trainers if self.current(p) and p.terminal and not p.succeeded
                        and not self.recorded(p)), key=lambda p: (p.index, p.name))
        for p in ended:
            if sparesmod.released(p.message):
                self.spare_released(p)
                self.delete(p)
                continue
            codes = p.exit_codes
            what = f"pod {p.name} {describe(p)}"
            if p.disruption is None and fp.is_permanent(codes):
                self.record(p, counted=True)
                self.permanent(what)
                return False
            caused = store_down and p.disruption is None and not p.gone and p.exit_code is not None
            counts = self.failure(p, what, disruption=p.disruption, caused=caused)
            if counts is None:
                return False
            self.incident_reason = (names.REASON_NODE_LOST if p.disruption == names.REASON_NODE_LOST
                                    else names.REASON_NODE_DISRUPTED if p.disruption else names.REASON_NODE_FAILED)
            self.incident_message = f"{what}; replacing it" + ("" if counts else " (not counted)")
            self.delete(p)
        return True

    def spare_released(self, p: PodState, restart: int | None = None) -> None:
        """A spare whose torchrun ended because a participant closed the rendezvous (spares.py): the training
        ended, the operator just has not seen it yet. On record, never counted, not an incident."""
        self.record(p, counted=False, reason=names.REASON_SPARE_RELEASED, restart=restart)

    def rdzv_lost(self) -> bool:
        """The store pod of the current group ended or is being deleted: record it once (an incident), delete
        what is left of it and let create_missing recreate it. The group stays: the trainer pods keep running,
        their torchrun agents fail on the lost store, the kubelet restarts their containers in place and they
        rejoin the new, empty store under the same rendezvous id, resuming from their /dev/shm snapshots.
        False if the job failed."""
        lost = [p for p in self.observed.pods if p.role == names.ROLE_RDZV and p.group == self.group
                and (p.terminal or p.deleting) and not self.recorded(p)]
        for p in lost:
            what = f"rendezvous store pod {p.name} {describe(p)}"
            counts = self.failure(p, what, disruption=p.disruption, reason=names.REASON_RDZV_LOST)
            if counts is None:
                return False
            self.delete(p)
            self.incident_reason = names.REASON_RDZV_LOST
            self.incident_message = (f"{what}; recreating it (the trainers restart in place and rejoin rendezvous "
                                     f"{rdzv_id(self.job, self.group)})" + ("" if counts else " (not counted)"))
            self.extra_events.append(Event("Warning", names.REASON_RDZV_LOST, self.incident_message))
        return True

    def stale(self) -> None:
        """Delete pods of an older group and trainers beyond spec.nodes + spec.spares (scale down); never
        counted."""
        for p in self.live:
            if p.group != self.group or (p.role == names.ROLE_TRAINER and
                                         (p.index is None or p.index >= self.job.spec.pods)):
                self.delete(p)

    def stuck(self) -> None:
        """Force-delete a pod Terminating past the timeout only on a node known to be NotReady or gone.

        On a Ready node (or one whose state is unknown) the kubelet finishes the deletion and the pod's DELETED
        event triggers the pass that recreates it: nothing to do. The one wake-up kept, at the timeout, is for
        looking at the node then; recreation never waits for it.
        """
        timeout = timedelta(seconds=self.job.spec.failure_policy.stuck_terminating_timeout_seconds)
        for p in self.live:
            if not (p.deleting and p.node and p.deletion_time):
                continue
            due = p.deletion_time + timeout
            if self.now < due:
                self.due_in(due)
            elif self.observed.node_ready.get(p.node) is False:
                self.actions.append(Action(FORCE_DELETE, "Pod", p.name, uid=p.uid))
                self.extra_events.append(Event("Warning", names.REASON_FORCE_DELETED,
                                               f"pod {p.name} stuck Terminating on NotReady node {p.node}; "
                                               f"force-deleted"))

    def scaled(self) -> None:
        """An Event when spec.nodes differs from the node count the last pass worked towards."""
        before = int((self.prev.get("nodes") or {}).get("desired") or 0)
        after = self.job.spec.nodes
        if before and before != after:
            self.extra_events.append(Event("Normal", names.REASON_SCALED,
                                           f"spec.nodes changed from {before} to {after}; "
                                           f"{'adding' if after > before else 'removing'} training pods"))

    def resized(self) -> None:
        """Jobs with spares: every live current trainer pod's annotation says spec.nodes (the rendezvous follows it,
        pod.py), so `kubectl scale` re-forms the group at the new size; patched before new pods are created."""
        if not self.job.spec.spares:
            return
        wanted = nodes_annotation(self.job)
        for p in self.live:
            if self.current(p) and not p.deleting and not p.terminal and \
                    p.nodes_annotation != wanted[names.NODES_ANNOTATION]:
                self.actions.append(Action(PATCH, "Pod", p.name, {"metadata": {"annotations": wanted}}, uid=p.uid))

    def network_policy(self) -> None:
        """Create the NetworkPolicy before any pod when wanted; delete our own when it no longer is."""
        obs = self.observed
        if wanted(self.job, self.network_policy_config):
            if not obs.network_policy_exists:
                self.actions.append(Action(CREATE, "NetworkPolicy", self.job.name,
                                           render_network_policy(self.job, self.network_policy_config)))
        elif obs.network_policy_exists and obs.network_policy_uid:
            self.actions.append(Action(DELETE, "NetworkPolicy", self.job.name, uid=obs.network_policy_uid))

    def end_recorded(self, name: str) -> bool:
        """Whether the end of the last pod named `name` is already on record: a recovery is under way and a pod
        of that name ended since it started (recorded, then deleted, its replacement not created yet)."""
        if self.recovery_start is None:
            return False
        since = [a for a in self.attempts if (parse_time(a.get("time")) or self.now) >= self.recovery_start]
        if len(since) >= names.ATTEMPTS_HISTORY:
            return True  # the bounded history may have dropped it: never count a pod twice
        return any(a.get("pod") == name and not a.get("restartCount") for a in since)

    def vanished(self) -> bool:
        """Record each training pod that is missing although the job was training and its end is not on record:
        it ended unseen (e.g. deleted while the operator was down). Counted like a deleted pod. False if that
        failed the job."""
        # Only pods that existed can vanish: the last status written showed every desired pod running (after
        # suspend, at start, after a scale-up or a refused create, pods are just not there yet).
        prev_nodes = self.prev.get("nodes") or {}
        prev_desired = int(prev_nodes.get("desired") or 0)
        if self.prev.get("phase") != names.PHASE_RUNNING or int(prev_nodes.get("running") or 0) < prev_desired:
            return True
        # Spare pods count only when every one of them was running too.
        prev_spares = self.prev.get("spares") or {}
        spares = int(prev_spares.get("desired") or 0)
        if int(prev_spares.get("running") or 0) < spares:
            spares = 0
        occupied = {p.name for p in self.live}
        for index in range(min(prev_desired + spares, self.job.spec.pods)):
            name = trainer_pod_name(self.job, index)
            if name in occupied or self.end_recorded(name):
                continue
            what = f"pod {name} is missing (it ended while the operator was not watching)"
            counts = self.incident(None)
            over = counts and self.over_budget(what)
            self.attempts = append_attempt(self.attempts, missing_attempt(name, index, counted=counts,
                                                                          now=self.now_s))
            if over:
                return False
            self.incident_reason = names.REASON_NODE_MISSING
            self.incident_message = f"{what}; recreating it" + ("" if counts else " (not counted)")
        return True

    def create_missing(self) -> None:
        job = self.job
        self.network_policy()
        if not self.observed.service_exists:
            self.actions.append(Action(CREATE, "Service", job.name, render_service(job)))
        occupied = {p.name for p in self.live}
        rdzv = render_rdzv_pod(job, self.group)
        if rdzv["metadata"]["name"] not in occupied:
            rdzv = kueuemod.place(rdzv, self.placements.get(names.POD_SET_RDZV))
            self.actions.append(Action(CREATE, "Pod", rdzv["metadata"]["name"], rdzv))
        for index in range(job.spec.pods):
            pod = render_trainer_pod(job, index, self.group)
            if pod["metadata"]["name"] in occupied:
                continue
            pod = kueuemod.place(pod, self.placements.get(names.POD_SET_TRAINER))
            self.actions.append(Action(CREATE, "Pod", pod["metadata"]["name"], pod))
        if self.start_time is None:
            self.start_time = self.now
        if not get_condition(self.conditions, names.COND_CREATED):
            spares = f" and {job.spec.spares} spare(s)" if job.spec.spares else ""
            self.cond(names.COND_CREATED, True, names.REASON_CREATED,
                      f"created the headless Service, the rendezvous store and {job.spec.nodes} training pods"
                      + spares)

    def active_phase(self) -> None:
        job = self.job
        current = [p for p in self.trainers if self.current(p) and not p.gone]
        running = sum(1 for p in current if p.running)
        ever_running = get_condition(self.conditions, names.COND_RUNNING) is not None
        was_training = self.prev.get("phase") in (names.PHASE_RUNNING, names.PHASE_RESTARTING)
        if running >= job.spec.nodes and (self.recovery_start is None or self.store_up()):
            if self.recovery_start is not None:
                self.recovery_seconds = (self.now - self.recovery_start).total_seconds()
                self.recovery_start = None
            self.phase, self.reason = names.PHASE_RUNNING, names.REASON_RUNNING
            self.message = f"{min(running, job.spec.nodes)}/{job.spec.nodes} training pods running" + (
                f" (+{running - job.spec.nodes}/{job.spec.spares} spares)" if job.spec.spares else "")
            self.cond(names.COND_RUNNING, True, self.reason, self.message)
            if get_condition(self.conditions, names.COND_RESTARTING):
                self.cond(names.COND_RESTARTING, False, names.REASON_RUNNING, "recovered: " + self.message)
        elif self.recovery_start is not None:
            prev_restarting = get_condition(self.conditions, names.COND_RESTARTING)
            reason = self.incident_reason or (prev_restarting or {}).get("reason") or names.REASON_NODE_FAILED
            message = self.incident_message or (prev_restarting or {}).get("message") or ""
            self.phase, self.reason = names.PHASE_RESTARTING, reason
            self.message = f"{running}/{job.spec.nodes} training pods running; {message}".rstrip("; ")
            self.cond(names.COND_RESTARTING, True, reason, message or self.message)
            if ever_running:
                self.cond(names.COND_RUNNING, False, reason, self.message)
        elif was_training:
            # Scaling up (or a slow pod start) without a failure: training goes on with the others.
            self.phase, self.reason = names.PHASE_RUNNING, names.REASON_WAITING
            self.message = f"{running}/{job.spec.nodes} training pods running"
        else:
            self.phase, self.reason = names.PHASE_PENDING, names.REASON_WAITING
            self.message = f"{running}/{job.spec.nodes} training pods running"

    def child_conflicts(self) -> None:
        """Report children that cannot be created because a foreign object holds their name."""
        conflicts = self.observed.conflicts
        if conflicts:
            message = "; ".join(conflicts[name] for name in sorted(conflicts))
            self.cond(names.COND_REPLICA_FAILURE, True, names.REASON_CHILD_CONFLICT, message)
            self.reason, self.message = names.REASON_CHILD_CONFLICT, f"{self.message}; {message}"
        elif not self.observed.refusals and \
                (get_condition(self.conditions, names.COND_REPLICA_FAILURE) or {}).get("status") == "True":
            self.cond(names.COND_REPLICA_FAILURE, False, names.REASON_CHILDREN_CREATED,
                      "every child was created")

    # --- pods that cannot start (failurePolicy.startupTimeoutSeconds) --------------------------------
    def create_refusals(self) -> None:
        """ReplicaFailure=True, reason FailedCreate, while the API server refuses a child (child_conflicts owns the
        condition while a foreign object holds a child's name). The condition's Event reports the first refusals;
        a refusal not yet named in the condition gets an Event of its own, so retries post nothing."""
        if self.observed.conflicts:
            return
        refusals = self.observed.refusals
        prev = get_condition(self.conditions, names.COND_REPLICA_FAILURE) or {}
        was_refused = prev.get("status") == "True" and prev.get("reason") == names.REASON_CREATE_FAILED
        if refusals:
            shown = sorted(refusals)[:REFUSALS_SHOWN]
            text = "; ".join(refusals[n] for n in shown)
            if len(refusals) > len(shown):
                text += f"; and {len(refusals) - len(shown)} more"
            if was_refused:
                self.extra_events += [Event("Warning", names.REASON_CREATE_FAILED, refusals[n]) for n in shown
                                      if refusals[n] not in (prev.get("message") or "")]
            self.cond(names.COND_REPLICA_FAILURE, True, names.REASON_CREATE_FAILED, text)
            self.reason, self.message = names.REASON_CREATE_FAILED, f"{self.message}; {text}"
        elif was_refused:
            self.cond(names.COND_REPLICA_FAILURE, False, names.REASON_CHILDREN_CREATED, "every child was created")

    def blocked(self, *, unschedulable: bool) -> list[PodState]:
        """Current pods that cannot start (PodState.startup_error), by name; Unschedulable ones only if asked."""
        return sorted((p for p in self.live if p.startup_error and not p.deleting and p.group == self.group
                       and (p.role == names.ROLE_RDZV or self.current(p))
                       and (unschedulable or p.startup_error[0] != names.REASON_UNSCHEDULABLE)),
                      key=lambda p: p.name)

    def startup_problems(self) -> None:
        """PodsNotStarting=True while a current pod cannot start, with the kubelet's reason. A pod waiting for room
        (Unschedulable) is not one: a cluster autoscaler may be adding a node; the startup timeout names it."""
        blocked = self.blocked(unschedulable=False)
        prev = get_condition(self.conditions, names.COND_PODS_NOT_STARTING) or {}
        if blocked:
            first = blocked[0]
            reason, detail = first.startup_error
            text = f"{reason}: pod {first.name}" + (f", {detail}" if detail else "")
            if len(blocked) > 1:
                text += f" (and {len(blocked) - 1} more pod{'s' if len(blocked) > 2 else ''})"
            # The kubelet alternates ErrImagePull and ImagePullBackOff while it retries: one Event, not one a flip.
            kept = prev.get("reason") if prev.get("status") == "True" else None
            cond_reason = kept if kept in names.IMAGE_PULL_REASONS and reason in names.IMAGE_PULL_REASONS else reason
            self.cond(names.COND_PODS_NOT_STARTING, True, cond_reason, text)
            self.reason, self.message = reason, f"{self.message}; {text}"
        elif prev.get("status") == "True":
            self.cond(names.COND_PODS_NOT_STARTING, False, names.REASON_PODS_STARTED, "no pod is blocked from starting")

    def startup_timeout(self) -> bool:
        """Track since when the job cannot train (fewer than minNodes trainers or no store pod running); True if
        that lasted failurePolicy.startupTimeoutSeconds and the job failed."""
        job = self.job
        trainers = sum(1 for p in self.live if self.current(p) and p.running)
        store = any(p.role == names.ROLE_RDZV and p.group == self.group and p.running for p in self.live)
        if trainers >= job.spec.min_nodes and store:
            self.pods_pending_since = None
            return False
        if self.pods_pending_since is None:
            self.pods_pending_since = self.now
        timeout = job.spec.failure_policy.startup_timeout_seconds
        if not timeout:
            return False
        due = self.pods_pending_since + timedelta(seconds=timeout)
        if self.now < due:
            self.due_in(due)
            return False
        why = [c["message"] for c in self.conditions if c.get("status") == "True" and c.get("message")
               and c["type"] in (names.COND_PODS_NOT_STARTING, names.COND_REPLICA_FAILURE)]
        waiting = self.blocked(unschedulable=True)
        if not why and waiting:
            why = [f"{waiting[0].startup_error[0]}: pod {waiting[0].name}, {waiting[0].startup_error[1]}"]
        self.actions = [a for a in self.actions if a.verb != CREATE]  # nothing more is started for a failed job
        self.finish(names.PHASE_FAILED, names.REASON_STARTUP_TIMEOUT,
                    f"{trainers}/{job.spec.nodes} training pods (at least {job.spec.min_nodes} needed) and "
                    f"{'the' if store else 'no'} rendezvous store running for "
                    f"spec.failurePolicy.startupTimeoutSeconds={timeout}"
                    + (": " + "; ".join(why) if why else ""))
        return True

    # --- node loss (failurePolicy.nodeLostTimeoutSeconds) -------------------------------------------
    def node_lost(self) -> None:
        """Force-delete current pods on a node NotReady past the timeout (or gone); the failure rules then see
        them as ended disruptions (reason NodeLost): recorded, counted per countDisruptions, recreated once the
        object is gone (a store pod as the store-loss rule says). Nodes of unknown state are left alone."""
        timeout = self.job.spec.failure_policy.node_lost_timeout_seconds
        if not timeout or not self.observed.nodes:
            return
        pods = []
        for p in self.observed.pods:
            node = self.observed.nodes.get(p.node) if p.node else None
            if (p not in node_lost_candidates((p,)) or p.group != self.group or node is None or node.ready
                    or (node.since is None and not node.gone)):
                pods.append(p)
                continue
            due = node.since + timedelta(seconds=timeout) if node.since else self.now
            if self.now < due:
                self.due_in(due)
                pods.append(p)
                continue
            state = "no longer exists" if node.gone else f"has been NotReady since {format_time(node.since)}"
            message = f"node {p.node} {state} (spec.failurePolicy.nodeLostTimeoutSeconds={timeout})"
            self.actions.append(Action(FORCE_DELETE, "Pod", p.name, uid=p.uid))
            if not self.recorded(p):  # a repeated pass (the DELETED event not seen yet) posts nothing again
                self.extra_events.append(Event("Warning", names.REASON_NODE_LOST,
                                               f"pod {p.name}: {message}; force-deleted, to be recreated"))
            pods.append(replace(p, phase="Failed", deleting=True, disruption=names.REASON_NODE_LOST,
                                reason=names.REASON_NODE_LOST, message=message))
        self.observed = replace(self.observed, pods=tuple(pods))

    def success(self) -> bool:
        """Apply the success rule; True if the job succeeded or is finishing successfully."""
        current = [p for p in self.trainers if p.role == names.ROLE_TRAINER and p.group == self.group]
        if not any(p.succeeded for p in current):
            return False
        for p in self.observed.pods:
            if p.final_report:
                self.progress = newer_progress(self.progress, progress_status(p.final_report))
        still_running = [p for p in current if p.phase == "Running" and not p.deleting and not p.restarting]
        if self.job.spec.spares:
            # The training is complete: spares have nothing to wait for (spares.py). Stopped at once, not counted.
            left = self.spares_left(current, still_running)
            for p in left:
                self.delete(p)
            still_running = [p for p in still_running if p not in left]
        for p in current:
            if (p.phase == "Pending" or p.restarting) and not p.deleting:
                self.delete(p)  # never started, or restarting in place: it cannot join a finished training
        finished = [p.finished_at for p in current if p.succeeded and p.finished_at]
        if still_running and finished:
            # torchrun exits 0 only after every worker finished, so a peer still running well after that is
            # an agent retrying a rendezvous nobody will join (e.g. its worker crashed in teardown): stop it
            # instead of waiting out its join timeout.
            give_up = min(finished) + timedelta(seconds=names.SUCCESS_GRACE_SECONDS)
            if self.now >= give_up:
                for p in still_running:
                    self.delete(p)
                still_running = []
            else:
                self.due_in(give_up)
        if still_running:
            self.phase, self.reason = names.PHASE_RUNNING, names.REASON_SUCCEEDED
            self.message = (f"a trainer exited 0; waiting for {len(still_running)} still running "
                            f"({', '.join(p.name for p in still_running)})")
            return True
        done = next(p for p in current if p.succeeded)
        self.finish(names.PHASE_SUCCEEDED, names.REASON_SUCCEEDED, f"training completed ({done.name} exited 0)")
        return True

    def spares_left(self, current: list[PodState], running: list[PodState]) -> list[PodState]:
        """Of the pods still running after a trainer exited 0, the spares: those not among the members rank 0
        last reported (its final report, else status.progress); without a report naming them, every one once
        spec.nodes trainers exited 0 (the whole world finished)."""
        finals = sorted((p.final_report for p in current if p.succeeded and p.final_report),
                        key=lambda r: r.get("rank") not in (None, 0))
        known = sparesmod.members([*finals, self.progress])
        if known is not None:
            return [p for p in running if p.index not in known]
        return list(running) if sum(1 for p in current if p.succeeded) >= self.job.spec.nodes else []

    # --- the pass ---------------------------------------------------------------------------------
    def run(self) -> None:
        job = self.job
        if self.phase in names.FINISHED_PHASES:
            self.finished()
            return
        if job.queue_name and self.queued():
            return
        if job.spec.run_policy.suspend:
            self.suspended()
            return
        if self.phase == names.PHASE_SUSPENDED or get_condition(self.conditions, names.COND_SUSPENDED):
            if (get_condition(self.conditions, names.COND_SUSPENDED) or {}).get("status") == "True":
                self.cond(names.COND_SUSPENDED, False, names.REASON_RESUMED, "spec.runPolicy.suspend is false")
        if self.deadline_exceeded():
            self.finished()
            return
        self.stuck()
        self.node_lost()
        if self.success():
            if self.phase in names.FINISHED_PHASES:
                self.finished()
            return
        if not (self.in_place_restarts() and self.trainer_failures() and self.rdzv_lost() and self.vanished()):
            self.finished()
            return
        if not self.hang():
            self.finished()
            return
        self.scaled()
        self.stale()
        self.resized()
        self.create_missing()
        self.active_phase()
        self.child_conflicts()
        self.create_refusals()
        self.startup_problems()
        if self.startup_timeout():
            self.finished()
            return
        # The deadline clock starts with the first pods.
        if job.spec.run_policy.active_deadline_seconds and self.start_time:
            self.due_in(self.start_time + timedelta(seconds=job.spec.run_policy.active_deadline_seconds))

    def status(self) -> dict:
        job = self.job
        trainers = [p for p in self.trainers if not p.gone and p.group == self.group
                    and p.index is not None and p.index < job.spec.pods]
        counts, spare_counts = sparesmod.counts(trainers, job.spec.nodes, job.spec.spares)
        status: dict[str, Any] = {
            "phase": self.phase,
            "reason": self.reason,
            "message": self.message,
            "conditions": self.conditions,
            "observedGeneration": job.generation,
            "restarts": self.restarts,
            "disruptions": self.disruptions,
            "group": self.group,
            "nodes": counts,
            "spares": spare_counts,
            "nodesReady": sparesmod.ready_text(counts, spare_counts),
            "selector": selector_string(trainer_selector(job)),
            "rendezvousEndpoint": rdzv_endpoint(job),
            "rendezvousId": rdzv_id(job, self.group),
            "startTime": format_time(self.start_time) if self.start_time else None,
            "completionTime": format_time(self.completion_time) if self.completion_time else None,
            "lastFailureTime": format_time(self.last_incident) if self.last_incident else None,
            "recoveryStartTime": format_time(self.recovery_start) if self.recovery_start else None,
            "podsPendingSince": format_time(self.pods_pending_since) if self.pods_pending_since and self.phase
            not in (*names.FINISHED_PHASES, names.PHASE_SUSPENDED) else None,
            "attempts": self.attempts or None,
            "recordedPods": self.recorded_pods or None,
            "progress": self.progress,
            "lastIncident": self.last_incident_record(),
            "lastRecovery": self.last_recovery(),
        }
        return {k: v for k, v in status.items() if v is not None and v != ""}

    # --- hang detection (failurePolicy.hangTimeoutSeconds) ------------------------------------------
    def hang(self) -> bool:
        """Delete the stuck pod(s) of a hung job (the shell hands in every pod's report); False if it failed.

        Only while the job is Running with every current trainer pod running: the shell's finding may be a pass
        old, so it is checked again against what is observed now."""
        reports = self.observed.hang_reports
        if reports is None or not self.job.spec.failure_policy.hang_timeout_seconds:
            return True
        if self.phase != names.PHASE_RUNNING or self.recovery_start is not None:
            return True
        current = [p for p in self.trainers if self.current(p) and not p.gone]
        if self.job.spec.spares:
            current = self.hang_candidates(current, reports)
        if len(current) < self.job.spec.nodes or not all(p.running for p in current):
            return True
        if any(p.name not in reports for p in current):
            return True  # the reports are of another set of pods
        stuck = set(hangmod.stuck_pods((p.name, p.index or 0, reports[p.name]) for p in current))
        timeout = self.job.spec.failure_policy.hang_timeout_seconds
        deleting = []
        for p in sorted((p for p in current if p.name in stuck), key=lambda p: p.index or 0):
            answer = reports[p.name]
            why = ("its progress endpoint did not answer" if answer is None
                   else f"it reports step {answer.get('step')}")
            what = (f"pod {p.name}: global rank 0's step did not change for spec.failurePolicy.hangTimeoutSeconds="
                    f"{timeout}; {why}")
            counts = self.failure(p, what, reason=names.REASON_HANG)
            if counts is None:
                return False
            self.incident_reason = names.REASON_HANG
            self.incident_message = f"{what}; deleting it" + ("" if counts else " (not counted)")
            # A stopped or stuck process cannot act on SIGTERM: waiting out the pod's grace period would only
            # delay the recovery (measured: ~30 s), so the kubelet kills it at once.
            self.delete(p, grace_seconds=names.HANG_DELETE_GRACE_SECONDS)
            deleting.append(p.uid)
        if deleting:
            # The pods are going as of this pass: the phase below is Restarting, not Running.
            self.observed = replace(self.observed, pods=tuple(
                replace(p, deleting=True) if p.uid in deleting else p for p in self.observed.pods))
        return True

    def hang_candidates(self, pods: list[PodState], reports: Mapping[str, Mapping[str, Any] | None]) -> list[PodState]:
        """With spares only the training members can be hung: a spare runs no worker and never answers. The
        members come from the reports (rank 0's first), else status.progress; when nothing names them, only pods
        that answered are judged (a silent pod may be a spare)."""
        ordered = sorted(reports.values(), key=lambda r: not isinstance(r, Mapping) or r.get("rank") not in (None, 0))
        known = sparesmod.members([*ordered, self.progress])
        if known is not None:
            return [p for p in pods if p.index in known]
        answered = [p for p in pods if reports.get(p.name) is not None]
        return answered if len(answered) >= self.job.spec.nodes else []

    # --- status.lastIncident / status.lastRecovery --------------------------------------------------
    def last_incident_record(self) -> Mapping[str, Any] | None:
        """The last incident's reason and time: set whenever a pass records one (the first within the window)."""
        prev = self.prev.get("lastIncident")
        if not self.incident_reason:
            return prev
        return incident_record(prev, self.incident_reason, self.now,
                               self.job.spec.failure_policy.incident_window_seconds)

    def last_recovery(self) -> Mapping[str, Any] | None:
        """status.lastRecovery as last written (the poller fills it from rank 0's report), or from rank 0's final
        report (termination log) once it exited."""
        current = self.prev.get("lastRecovery")
        for p in self.observed.pods:
            report = p.final_report
            if report and p.role == names.ROLE_TRAINER and p.group == self.group and isinstance(report, Mapping) \
                    and (report.get("rank") in (None, 0)):
                current = last_recovery(current, self.last_incident_record(), report)
        return current


def describe_restart(p: PodState) -> str:
    """'exited 137 (OOMKilled) and was restarted in place (restart 2)', for messages."""
    details = []
    workers = [c for c in p.restart_worker_exit_codes if c != p.restart_exit_code]
    if workers:
        details.append("worker exit codes " + ",".join(str(c) for c in workers))
    if p.restart_reason and p.restart_reason not in ("Error",):
        details.append(p.restart_reason)
    code = f"exited {p.restart_exit_code}" if p.restart_exit_code is not None else "failed"
    where = f" on node {p.node}" if p.node else ""
    return (f"{code}{' (' + ', '.join(details) + ')' if details else ''} and was restarted in place"
            f"{where} (restart {p.restarts})")


def describe(p: PodState) -> str:
    """'failed (exit code 3, OOMKilled) on node n1' and the like, for messages."""
    details = []
    if p.exit_code is not None:
        details.append(f"exit code {p.exit_code}")
    workers = [c for c in p.worker_exit_codes if c != p.exit_code]
    if workers:
        details.append("worker exit codes " + ",".join(str(c) for c in workers))
    if p.disruption:
        details.append(p.disruption)
    elif p.reason and p.reason not in ("Error",):
        details.append(p.reason)
    verb = "was deleted" if p.phase == "Gone" or (p.deleting and not p.terminal) else "failed"
    where = f" on node {p.node}" if p.node else ""
    return f"{verb}{' (' + ', '.join(details) + ')' if details else ''}{where}"


def phase_event(old_phase: str | None, new_status: Mapping[str, Any], condition_evts: list[Event]) -> list[Event]:
    """A phase change without a condition Event gets one of its own, with the new status reason."""
    new_phase = new_status.get("phase")
    if new_phase == old_phase or condition_evts:
        return []
    warning = new_phase in (names.PHASE_FAILED, names.PHASE_RESTARTING)
    return [Event("Warning" if warning else "Normal", new_status.get("reason") or names.REASON_PHASE_CHANGED,
                  f"phase {old_phase or 'none'} -> {new_phase}: {new_status.get('message', '')}".rstrip(": "))]


def plan(job: Job, status: Mapping[str, Any] | None, observed: Observed, now: datetime,
         network_policy: NetworkPolicyConfig = NetworkPolicyConfig()) -> Plan:
    """The next status, actions and Events for `job`. `status` is the one the operator last wrote;
    `network_policy` what the operator knows about itself for the job's NetworkPolicy."""
    p = _Pass(job, status or {}, observed, now, network_policy)
    p.run()
    new_status = p.status()
    events = condition_events((status or {}).get("conditions") or [], new_status["conditions"])
    events += phase_event((status or {}).get("phase"), new_status, events)
    return Plan(
        status=new_status,
        actions=tuple(p.actions),
        events=tuple(events) + tuple(e for e in p.extra_events if e not in events),
        requeue_after=min(p.requeue) if p.requeue else None,
        counted_restarts=p.counted,
        recovery_seconds=p.recovery_seconds,
    )


def invalid(job_generation: int, status: Mapping[str, Any] | None, error: str, now: datetime) -> Plan:
    """The plan for a DDPJob that does not parse: Failed with reason InvalidSpec, nothing created."""
    prev = dict(status or {})
    conditions = set_condition(list(prev.get("conditions") or []), names.COND_FAILED, True,
                               names.REASON_INVALID_SPEC, error, format_time(now), job_generation)
    new_status = {**prev, "phase": names.PHASE_FAILED, "reason": names.REASON_INVALID_SPEC, "message": error,
                  "conditions": conditions, "observedGeneration": job_generation}
    new_status.setdefault("completionTime", format_time(now))
    events = condition_events(prev.get("conditions") or [], conditions)
    return Plan(status=new_status, actions=(), events=tuple(events), requeue_after=None)
