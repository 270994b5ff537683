"""Deciding what to do: `plan(job, status, observed, now)` -> the next status, the API actions and Events.

Pure and level-based: everything it needs is the job, the status the operator wrote last, the pods it sees
now (plus tombstones of pods it saw deleted) and the clock value it is given. Running it twice on the same
input yields the same output, so an operator restart changes nothing.

Rules (docs/contract.md and the CRD field descriptions say the same to users):
- A failed, deleted or evicted training pod is recorded once (by UID, in status.recordedPods, with its details in
  the bounded status.attempts history), deleted, and recreated under the same name once the old one is gone.
- A failure counts against failurePolicy.backoffLimit unless it is a disruption (eviction, preemption, node
  loss) and countDisruptions is false, or it falls within incidentWindowSeconds of the incident that came
  before (survivors crashing because a peer died). Exceeding the budget fails the job.
- Exit codes listed as permanent (or not listed as retryable) fail the job at once.
- Losing the rendezvous-store pod restarts the whole group: group += 1 (new rendezvous id), every trainer pod
  is deleted and recreated. That is one incident.
- Succeeded: some trainer exited 0 and no trainer is still running. Failures after a success are not replaced;
  trainers still running SUCCESS_GRACE_SECONDS after the first success are stopped.
- A trainer pod's outcome is its `trainer` container's: exit 0 is a success and any other exit a failure even
  while a sidecar container keeps the pod Running; such a pod is then stopped like a running one
  (cleanPodPolicy once the job finished, replacement after a failure).
- Events: every phase change carries one (the changed conditions', else one with the new status reason), as
  do a change of spec.nodes (Scaled), a TTL deletion (TTLExpired) and a force-deleted pod. The shell adds
  FailedCreate when the API server refuses a child.
- The job's NetworkPolicy (netpol.py) exists while the job is active exactly when it is wanted
  (spec.networkPolicy.enabled, else the operator's default): created before any pod, deleted when disabled.
- Pods of an older group (or with a group label that is not a number), or with an index >= spec.nodes (scale
  down), are deleted and never counted.
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
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Mapping

from ddp_operator import hang as hangmod
from ddp_operator import names
from ddp_operator.env import rdzv_endpoint, rdzv_id
from ddp_operator.labels import selector_string, trainer_selector
from ddp_operator.netpol import NetworkPolicyConfig, render_network_policy, wanted
from ddp_operator.observed import PodState, format_time, parse_time
from ddp_operator.pod import render_trainer_pod
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.service import render_service
from ddp_operator.spec import Job
from ddp_operator.status import (
    Event, append_attempt, attempt, condition_events, get_condition, incident_record, last_recovery, newer_progress,
    pod_counts, progress_status, record_pod, set_condition,
)

CREATE = "create"
DELETE = "delete"
FORCE_DELETE = "force-delete"
DELETE_JOB = "delete-job"


@dataclass(frozen=True)
class Action:
    verb: str            # create | delete | force-delete | delete-job
    kind: str            # Pod | Service | NetworkPolicy | DDPJob
    name: str
    body: Mapping[str, Any] | None = None
    uid: str | None = None  # precondition for deletes: never delete a newer pod of the same name


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

    # --- helpers ----------------------------------------------------------------------------------
    def cond(self, type_: str, status: bool, reason: str, message: str) -> None:
        self.conditions = set_condition(self.conditions, type_, status, reason, message, self.now_s,
                                        self.job.generation)

    def due_in(self, when: datetime) -> None:
        self.requeue.append(max(0.0, (when - self.now).total_seconds()))

    def delete(self, pod: PodState) -> None:
        if not pod.gone and not pod.deleting:
            self.actions.append(Action(DELETE, "Pod", pod.name, uid=pod.uid))

    @property
    def live(self) -> list[PodState]:
        # Tombstones are out, whatever their last phase: a gracefully deleted pod's tombstone is usually
        # Failed, and counting it as present would hold back its replacement until some later wake-up.
        return [p for p in self.observed.pods if not p.gone]

    @property
    def trainers(self) -> list[PodState]:
        return [p for p in self.observed.pods if p.role == names.ROLE_TRAINER]

    def current(self, p: PodState) -> bool:
        """A trainer pod of the current group within the desired index range."""
        return (p.role == names.ROLE_TRAINER and p.group == self.group and p.index is not None
                and p.index < self.job.spec.nodes)

    def recorded(self, p: PodState) -> bool:
        return p.uid in self.recorded_pods or any(a.get("uid") == p.uid for a in self.attempts)

    def record(self, p: PodState, *, counted: bool, reason: str | None = None) -> None:
        """Put an ended pod on record: its UID for as long as it exists, its details in the bounded history."""
        self.attempts = append_attempt(self.attempts, attempt(p, counted=counted, now=self.now_s, reason=reason))
        self.recorded_pods = record_pod(self.recorded_pods, p.uid, (q.uid for q in self.observed.pods))

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

    def suspended(self) -> None:
        for p in self.live:
            self.delete(p)
        self.phase, self.reason = names.PHASE_SUSPENDED, names.REASON_SUSPENDED
        self.message = "spec.runPolicy.suspend is true: pods deleted"
        self.start_time = None  # the deadline restarts on resume, as for batch/v1 Jobs
        self.recovery_start = None
        self.cond(names.COND_SUSPENDED, True, names.REASON_SUSPENDED, self.message)
        if get_condition(self.conditions, names.COND_RUNNING):
            self.cond(names.COND_RUNNING, False, names.REASON_SUSPENDED, self.message)
        if get_condition(self.conditions, names.COND_RESTARTING):
            self.cond(names.COND_RESTARTING, False, names.REASON_SUSPENDED, self.message)

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

    def incident(self, pod: PodState) -> bool:
        """Record a pod loss; True if it counts against the budget. Updates the incident window."""
        fp = self.job.spec.failure_policy
        window = timedelta(seconds=fp.incident_window_seconds)
        same_incident = self.last_incident is not None and self.now - self.last_incident < window
        if pod.disruption:
            self.disruptions += 1
        counts = not same_incident and (pod.disruption is None or fp.count_disruptions)
        if not same_incident:
            self.last_incident = self.now
        if self.recovery_start is None:
            self.recovery_start = self.now
        return counts

    def over_budget(self, pod: PodState, what: str) -> bool:
        limit = self.job.spec.failure_policy.backoff_limit
        if self.restarts + 1 > limit:
            self.finish(names.PHASE_FAILED, names.REASON_BACKOFF_LIMIT,
                        f"{self.restarts + 1} failures exceed spec.failurePolicy.backoffLimit={limit}; last: {what}")
            return True
        self.restarts += 1
        self.counted += 1
        return False

    def trainer_failures(self) -> bool:
        """Handle ended trainer pods of the current group; False if the job failed."""
        fp = self.job.spec.failure_policy
        ended = sorted((p for p in self.trainers if self.current(p) and p.terminal and not p.succeeded
                        and not self.recorded(p)), key=lambda p: (p.index, p.name))
        for p in ended:
            codes = p.exit_codes
            what = f"pod {p.name} {describe(p)}"
            if p.disruption is None and fp.is_permanent(codes):
                self.record(p, counted=True)
                field_name = ("spec.failurePolicy.permanentExitCodes" if fp.retryable_exit_codes is None
                              else "spec.failurePolicy.retryableExitCodes")
                self.finish(names.PHASE_FAILED, names.REASON_PERMANENT_EXIT,
                            f"{what}: a permanent failure per {field_name}")
                return False
            counts = self.incident(p)
            if counts and self.over_budget(p, what):
                self.record(p, counted=True)
                return False
            self.record(p, counted=counts)
            self.incident_reason = names.REASON_NODE_DISRUPTED if p.disruption else names.REASON_NODE_FAILED
            self.incident_message = f"{what}; replacing it" + ("" if counts else " (not counted)")
            self.delete(p)
        return True

    def rdzv_lost(self) -> bool:
        """Whole-group restart when the store pod of the current group ended or was deleted; False if failed."""
        lost = [p for p in self.observed.pods if p.role == names.ROLE_RDZV and p.group == self.group
                and (p.terminal or p.deleting) and not self.recorded(p)]
        if not lost:
            return True
        p = lost[0]
        what = f"rendezvous store pod {p.name} {describe(p)}"
        counts = self.incident(p)
        if counts and self.over_budget(p, what):
            self.record(p, counted=True, reason=names.REASON_RDZV_LOST)
            return False
        self.record(p, counted=counts, reason=names.REASON_RDZV_LOST)
        self.group += 1
        self.incident_reason = names.REASON_RDZV_LOST
        self.incident_message = f"{what}; restarting the whole group as rendezvous {rdzv_id(self.job, self.group)}"
        return True

    def stale(self) -> None:
        """Delete pods of an older group and trainers beyond spec.nodes (scale down); never counted."""
        for p in self.live:
            if p.group != self.group or (p.role == names.ROLE_TRAINER and
                                         (p.index is None or p.index >= self.job.spec.nodes)):
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
    def network_policy(self) -> None:
        """Create the NetworkPolicy before any pod when wanted; delete our own when it no longer is."""
        obs = self.observed
        if wanted(self.job, self.network_policy_config):
            if not obs.network_policy_exists:
                self.actions.append(Action(CREATE, "NetworkPolicy", self.job.name,
                                           render_network_policy(self.job, self.network_policy_config)))
        elif obs.network_policy_exists and obs.network_policy_uid:
            self.actions.append(Action(DELETE, "NetworkPolicy", self.job.name, uid=obs.network_policy_uid))

    def create_missing(self) -> None:
        job = self.job
        self.network_policy()
        if not self.observed.service_exists:
            self.actions.append(Action(CREATE, "Service", job.name, render_service(job)))
        occupied = {p.name for p in self.live}
        rdzv = render_rdzv_pod(job, self.group)
        if rdzv["metadata"]["name"] not in occupied:
            self.actions.append(Action(CREATE, "Pod", rdzv["metadata"]["name"], rdzv))
        # Only a job that was training can lose a pod unseen (after suspend or at start, pods are just missing).
        was_complete = self.prev.get("phase") in (names.PHASE_RUNNING, names.PHASE_RESTARTING)
        prev_desired = int((self.prev.get("nodes") or {}).get("desired") or 0)
        for index in range(job.spec.nodes):
            pod = render_trainer_pod(job, index, self.group)
            if pod["metadata"]["name"] in occupied:
                continue
            self.actions.append(Action(CREATE, "Pod", pod["metadata"]["name"], pod))
            if was_complete and index < prev_desired and self.recovery_start is None:
                # A pod vanished without us seeing its end (e.g. while the operator was down).
                self.recovery_start = self.now
                self.incident_reason = names.REASON_NODE_MISSING
                self.incident_message = f"pod {pod['metadata']['name']} is missing; recreating it"
        if self.start_time is None:
            self.start_time = self.now
        if not get_condition(self.conditions, names.COND_CREATED):
            self.cond(names.COND_CREATED, True, names.REASON_CREATED,
                      f"created the headless Service, the rendezvous store and {job.spec.nodes} training pods")

    def active_phase(self) -> None:
        job = self.job
        current = [p for p in self.trainers if self.current(p) and not p.gone]
        running = sum(1 for p in current if p.running)
        ever_running = get_condition(self.conditions, names.COND_RUNNING) is not None
        was_training = self.prev.get("phase") in (names.PHASE_RUNNING, names.PHASE_RESTARTING)
        if running >= job.spec.nodes:
            if self.recovery_start is not None:
                self.recovery_seconds = (self.now - self.recovery_start).total_seconds()
                self.recovery_start = None
            self.phase, self.reason = names.PHASE_RUNNING, names.REASON_RUNNING
            self.message = f"{running}/{job.spec.nodes} training pods running"
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
        elif (get_condition(self.conditions, names.COND_REPLICA_FAILURE) or {}).get("status") == "True":
            self.cond(names.COND_REPLICA_FAILURE, False, names.REASON_CHILDREN_CREATED,
                      "every child was created")

    def success(self) -> bool:
        """Apply the success rule; True if the job succeeded or is finishing successfully."""
        current = [p for p in self.trainers if p.role == names.ROLE_TRAINER and p.group == self.group]
        if not any(p.succeeded for p in current):
            return False
        for p in self.observed.pods:
            if p.final_report:
                self.progress = newer_progress(self.progress, progress_status(p.final_report))
        still_running = [p for p in current if p.phase == "Running" and not p.deleting]
        for p in current:
            if p.phase == "Pending" and not p.deleting:
                self.delete(p)  # never started: it cannot join a finished training
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

    # --- the pass ---------------------------------------------------------------------------------
    def run(self) -> None:
        job = self.job
        if self.phase in names.FINISHED_PHASES:
            self.finished()
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
        if self.success():
            if self.phase in names.FINISHED_PHASES:
                self.finished()
            return
        if not self.trainer_failures() or not self.rdzv_lost():
            self.finished()
            return
        if not self.hang():
            self.finished()
            return
        self.scaled()
        self.stale()
        self.create_missing()
        self.active_phase()
        self.child_conflicts()
        # The deadline clock starts with the first pods.
        if job.spec.run_policy.active_deadline_seconds and self.start_time:
            self.due_in(self.start_time + timedelta(seconds=job.spec.run_policy.active_deadline_seconds))

    def status(self) -> dict:
        job = self.job
        trainers = [p for p in self.trainers if not p.gone and p.group == self.group
                    and p.index is not None and p.index < job.spec.nodes]
        counts = pod_counts(trainers, job.spec.nodes)
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
            "nodesReady": f"{counts['ready']}/{job.spec.nodes}",
            "selector": selector_string(trainer_selector(job)),
            "rendezvousEndpoint": rdzv_endpoint(job),
            "rendezvousId": rdzv_id(job, self.group),
            "startTime": format_time(self.start_time) if self.start_time else None,
            "completionTime": format_time(self.completion_time) if self.completion_time else None,
            "lastFailureTime": format_time(self.last_incident) if self.last_incident else None,
            "recoveryStartTime": format_time(self.recovery_start) if self.recovery_start else None,
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
            counts = self.incident(p)
            if counts and self.over_budget(p, what):
                self.record(p, counted=True, reason=names.REASON_HANG)
                return False
            self.record(p, counted=counts, reason=names.REASON_HANG)
            self.incident_reason = names.REASON_HANG
            self.incident_message = f"{what}; deleting it" + ("" if counts else " (not counted)")
            self.delete(p)
            deleting.append(p.uid)
        if deleting:
            # The pods are going as of this pass: the phase below is Restarting, not Running.
            self.observed = replace(self.observed, pods=tuple(
                replace(p, deleting=True) if p.uid in deleting else p for p in self.observed.pods))
        return True

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
        events=tuple(events) + tuple(p.extra_events),
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
