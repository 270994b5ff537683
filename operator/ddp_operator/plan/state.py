"""The working state of one planning pass (Pass) and the helpers every rule uses: conditions, wake-ups, pod
deletes, which pods count, what is on record, finishing the job."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

from ddp_operator import kueue as kueuemod
from ddp_operator import names
from ddp_operator.netpol import NetworkPolicyConfig
from ddp_operator.observed import PodState, format_time
from ddp_operator.plan.types import DELETE, Action, Observed, PrevStatus
from ddp_operator.spec import Job
from ddp_operator.failure_class import Failure
from ddp_operator.status import (
    Event, append_attempt, attempt, get_condition, last_failure, record_pod, restart_key, restart_number,
    set_condition,
)


class Pass:
    """The working state of one planning pass: the status being built from `prev`, the actions and Events."""

    def __init__(self, job: Job, prev: PrevStatus, observed: Observed, now: datetime,
                 network_policy: NetworkPolicyConfig = NetworkPolicyConfig(),
                 diagnosis: Mapping[str, Any] | None = None):
        self.job, self.observed, self.now = job, observed, now
        self.network_policy_config = network_policy
        self.now_s = format_time(now)
        self.prev = prev
        self.conditions: list[dict] = [dict(c) for c in prev.conditions]
        self.restarts = prev.restarts
        self.infra_restarts = prev.infra_restarts
        self.last_failure: Mapping[str, Any] | None = prev.last_failure
        self.disruptions = prev.disruptions
        self.group = prev.group
        self.attempts: list[dict] = list(prev.attempts)
        self.recorded_pods: list[str] = list(prev.recorded_pods)
        self.start_time = prev.start_time
        self.completion_time = prev.completion_time
        self.last_incident = prev.last_failure_time
        self.recovery_start = prev.recovery_start_time
        self.phase = prev.phase
        self.reason = prev.reason
        self.message = prev.message
        self.progress = prev.progress
        self.actions: list[Action] = []
        self.extra_events: list[Event] = []
        self.requeue: list[float] = []
        self.counted = 0
        self.recovery_seconds: float | None = None
        self.incident_reason = ""
        self.incident_budget: str | None = None  # the budget this pass's incident spent (status.lastIncident)
        self.incident_message = ""
        self.pods_pending_since = prev.pods_pending_since
        self.placements: Mapping[str, kueuemod.Placement] = {}  # Kueue's admission, per pod set
        # status.diagnosis: the last stall's diagnosis (plan/stall.py, plan/hang.py), kept until another replaces it.
        self.diagnosis: Mapping[str, Any] | None = diagnosis if isinstance(diagnosis, Mapping) else None

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

    def record(self, p: PodState, *, counted: bool, reason: str | None = None, restart: int | None = None,
               failure: Failure | None = None, budget: str = "none") -> None:
        """Put an ended pod (or, with `restart`, an in-place restart of its trainer container) on record: its key
        for as long as the pod exists, its details in the bounded history; with `failure` (its class and why), also
        as status.lastFailure, naming the `budget` it spent."""
        entry = attempt(p, counted=counted, now=self.now_s, reason=reason, restart=restart)
        if failure is not None:
            entry = {**entry, "class": failure.cls, "cause": failure.reason,
                     **({"rank": failure.rank} if failure.rank is not None else {})}
            self.last_failure = last_failure(entry, failure, budget)
        self.attempts = append_attempt(self.attempts, entry)
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
