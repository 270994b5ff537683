"""Deciding what to do: `plan(job, status, observed, now)` -> the next status, the API actions and Events.

Pure and level-based: everything it needs is the job, the status the operator wrote last, the pods it sees
now (plus tombstones of pods it saw deleted) and the clock value it is given. Running it twice on the same
input yields the same output, so an operator restart changes nothing.

Rules (docs/contract.md and the CRD field descriptions say the same to users), one module each, in the order
`run` applies them; each module's docstring states its rule:
- finished.py: a finished job's pods (cleanPodPolicy), its Workload, its TTL.
- suspend.py: spec.runPolicy.suspend and Kueue's hold (kueue.py).
- deadline.py: spec.runPolicy.activeDeadlineSeconds.
- nodes.py: pods stuck Terminating, and node loss.
- success.py: the success rule.
- failures.py: in-place restarts, ended trainer pods, the failure budget, permanent exit codes.
- rdzv_lost.py: the rendezvous store pod lost.
- vanished.py: training pods that ended unseen.
- hang.py: hang detection's verdict.
- stall.py: a process group that never formed, a silent hang (the diagnostics sidecars': docs/diagnostics.md).
- children.py: the children created when missing, stale pods deleted.
- spares.py: hot spares (spec.spares), in the rules above.
- phase.py: the phase of an active job (Running, Restarting, Pending).
- startup.py: children that cannot be created, pods that cannot start, the startup timeout.
- avoid.py: nodes that failed the job twice for reasons of the infrastructure, kept off by its replacement pods.
state.py holds the pass's working state and the helpers every rule uses; types.py what goes in and out (Observed,
the previous status as PrevStatus, Action, Plan).

Besides:
- A trainer pod's outcome is its `trainer` container's: exit 0 is a success and any other exit a failure even
  while a sidecar container keeps the pod Running; such a pod is then stopped like a running one
  (cleanPodPolicy once the job finished, replacement after a failure).
- Events: every phase change carries one (the changed conditions', else one with the new status reason), as
  do a change of spec.nodes (Scaled), a TTL deletion (TTLExpired), a force-deleted pod, every in-place restart
  (TrainerRestarted) and a lost store (RendezvousStoreLost), unless a condition Event already says the same.
  The shell adds FailedCreate when the API server refuses a child.
- status.lastIncident keeps the last incident's reason and time (the first reason within the incident window);
  status.lastRecovery combines it with the trainer's `recovery` report (status.last_recovery).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

from ddp_operator import __version__, names
from ddp_operator import spares as sparesmod
from ddp_operator.env import rdzv_endpoint, rdzv_id
from ddp_operator.labels import selector_string, trainer_selector
from ddp_operator.netpol import NetworkPolicyConfig
from ddp_operator import goodput as goodputmod
from ddp_operator.observed import format_time, parse_time
from ddp_operator.plan.avoid import WINDOW_SECONDS as AVOID_WINDOW_SECONDS, avoided_nodes
from ddp_operator.plan.children import create_missing, scaled, stale
from ddp_operator.plan.deadline import deadline_due, deadline_exceeded
from ddp_operator.plan.failures import in_place_restarts, trainer_failures
from ddp_operator.plan.finished import finished
from ddp_operator.plan.hang import hang
from ddp_operator.plan.nodes import node_lost, node_lost_candidates, stuck, stuck_pods
from ddp_operator.plan.phase import active_phase
from ddp_operator.plan.rdzv_lost import rdzv_lost
from ddp_operator.plan.spares import desired_size
from ddp_operator.plan.stall import stall
from ddp_operator.plan.startup import child_conflicts, create_refusals, startup_problems, startup_timeout
from ddp_operator.plan.state import Pass
from ddp_operator.plan.success import success
from ddp_operator.plan.suspend import queued, resumed, suspended
from ddp_operator.plan.types import (
    CREATE, DELETE, DELETE_JOB, FORCE_DELETE, PATCH, PATCH_STATUS, Action, Observed, Plan, PrevStatus,
)
from ddp_operator.plan.vanished import vanished
from ddp_operator.spec import Job
from ddp_operator.status import (
    Event, condition_events, get_condition, incident_record, last_recovery, set_condition,
)

__all__ = [
    "CREATE", "DELETE", "DELETE_JOB", "FORCE_DELETE", "PATCH", "PATCH_STATUS", "Action", "Observed", "Plan",
    "PrevStatus", "invalid", "node_lost_candidates", "phase_event", "plan", "stuck_pods",
]


def plan(job: Job, status: Mapping[str, Any] | None, observed: Observed, now: datetime,
         network_policy: NetworkPolicyConfig = NetworkPolicyConfig()) -> Plan:
    """The next status, actions and Events for `job`. `status` is the one the operator last wrote;
    `network_policy` what the operator knows about itself for the job's NetworkPolicy."""
    ctx = Pass(job, PrevStatus.parse(status), observed, now, network_policy, (status or {}).get("diagnosis"))
    run(ctx)
    new_status = build_status(ctx)
    if ctx.prev.phase in names.FINISHED_PHASES:  # an upgrade rewrites no finished job's status just to say so
        new_status.pop("operatorVersion")
        if (status or {}).get("operatorVersion"):
            new_status["operatorVersion"] = status["operatorVersion"]
    events = condition_events((status or {}).get("conditions") or [], new_status["conditions"])
    events += phase_event((status or {}).get("phase"), new_status, events)
    events += avoided_events((status or {}).get("avoidedNodes"), new_status.get("avoidedNodes") or [])
    return Plan(
        status=new_status,
        actions=tuple(ctx.actions),
        events=tuple(events) + tuple(e for e in ctx.extra_events if e not in events),
        requeue_after=min(ctx.requeue) if ctx.requeue else None,
        counted_restarts=ctx.counted,
        recovery_seconds=ctx.recovery_seconds,
    )


def run(ctx: Pass) -> None:
    """The rules, in order. A rule that finishes or holds the job ends the pass."""
    job = ctx.job
    if ctx.phase in names.FINISHED_PHASES:
        finished(ctx)
        return
    if job.queue_name and queued(ctx):
        return
    if job.spec.run_policy.suspend:
        suspended(ctx)
        return
    if not resumed(ctx):
        return
    if deadline_exceeded(ctx):
        finished(ctx)
        return
    stuck(ctx)
    node_lost(ctx)
    if success(ctx):
        if ctx.phase in names.FINISHED_PHASES:
            finished(ctx)
        return
    if not (in_place_restarts(ctx) and trainer_failures(ctx) and rdzv_lost(ctx) and vanished(ctx)):
        finished(ctx)
        return
    if not (hang(ctx) and stall(ctx)):
        finished(ctx)
        return
    scaled(ctx)
    stale(ctx)
    desired_size(ctx)
    create_missing(ctx)
    active_phase(ctx)
    child_conflicts(ctx)
    create_refusals(ctx)
    startup_problems(ctx)
    if startup_timeout(ctx):
        finished(ctx)
        return
    deadline_due(ctx)


def build_status(ctx: Pass) -> dict:
    """The status to write: the pass's state, the counts of the current trainer pods, empty fields left out."""
    job = ctx.job
    trainers = [p for p in ctx.trainers if not p.gone and p.group == ctx.group
                and p.index is not None and p.index < job.spec.pods]
    counts, spare_counts = sparesmod.counts(trainers, job.spec.nodes, job.spec.spares)
    status: dict[str, Any] = {
        "phase": ctx.phase,
        "reason": ctx.reason,
        "message": ctx.message,
        "conditions": ctx.conditions,
        "observedGeneration": job.generation,
        "operatorVersion": __version__,
        "restarts": ctx.restarts,
        "infraRestarts": ctx.infra_restarts or None,
        "lastFailure": ctx.last_failure,
        "avoidedNodes": avoided_nodes(ctx.attempts, ctx.now) or None,
        "disruptions": ctx.disruptions,
        "group": ctx.group,
        "nodes": counts,
        "spares": spare_counts,
        "nodesReady": sparesmod.ready_text(counts, spare_counts),
        "selector": selector_string(trainer_selector(job)),
        "rendezvousEndpoint": rdzv_endpoint(job),
        "rendezvousId": rdzv_id(job, ctx.group),
        "startTime": format_time(ctx.start_time) if ctx.start_time else None,
        "completionTime": format_time(ctx.completion_time) if ctx.completion_time else None,
        "lastFailureTime": format_time(ctx.last_incident) if ctx.last_incident else None,
        "recoveryStartTime": format_time(ctx.recovery_start) if ctx.recovery_start else None,
        "podsPendingSince": format_time(ctx.pods_pending_since) if ctx.pods_pending_since and ctx.phase
        not in (*names.FINISHED_PHASES, names.PHASE_SUSPENDED) else None,
        "attempts": ctx.attempts or None,
        "recordedPods": ctx.recorded_pods or None,
        "progress": ctx.progress,
        "lastIncident": last_incident_record(ctx),
        "lastRecovery": last_recovery_record(ctx),
        "goodput": goodput_record(ctx),
        "diagnosis": dict(ctx.diagnosis) if ctx.diagnosis else None,
    }
    return {k: v for k, v in status.items() if v is not None and v != ""}


def last_incident_record(ctx: Pass) -> Mapping[str, Any] | None:
    """The last incident's reason and time: set whenever a pass records one (the first within the window)."""
    prev = ctx.prev.last_incident
    if not ctx.incident_reason:
        return prev
    record = incident_record(prev, ctx.incident_reason, ctx.now, ctx.job.spec.failure_policy.incident_window_seconds)
    return {**record, "budget": ctx.incident_budget} if ctx.incident_budget else record


def last_recovery_record(ctx: Pass) -> Mapping[str, Any] | None:
    """status.lastRecovery as last written (the poller fills it from rank 0's report), or from rank 0's final
    report (termination log) once it exited."""
    current = ctx.prev.last_recovery
    for p in ctx.observed.pods:
        report = p.final_report
        if report and p.role == names.ROLE_TRAINER and p.group == ctx.group and isinstance(report, Mapping) \
                and (report.get("rank") in (None, 0)):
            current = last_recovery(current, last_incident_record(ctx), report, ctx.prev.progress)
    return current


def goodput_record(ctx: Pass) -> Mapping[str, Any] | None:
    """status.goodput (goodput.py), taken further on a recovery, a phase change, the first step and the end."""
    suspended = get_condition(list(ctx.prev.conditions), names.COND_SUSPENDED) or {}
    since = parse_time(suspended.get("lastTransitionTime")) if suspended.get("status") == "True" else None
    finished = ctx.phase in names.FINISHED_PHASES
    return goodputmod.derive(ctx.prev.goodput, created=ctx.job.created, now=ctx.now, phase=ctx.phase,
                             prev_phase=ctx.prev.phase, suspended_since=since,
                             completed=(ctx.completion_time or ctx.now) if finished else None,
                             progress=ctx.progress, prev_progress=ctx.prev.progress,
                             recovery=last_recovery_record(ctx))


def phase_event(old_phase: str | None, new_status: Mapping[str, Any], condition_evts: list[Event]) -> list[Event]:
    """A phase change without a condition Event gets one of its own, with the new status reason."""
    new_phase = new_status.get("phase")
    if new_phase == old_phase or condition_evts:
        return []
    warning = new_phase in (names.PHASE_FAILED, names.PHASE_RESTARTING)
    return [Event("Warning" if warning else "Normal", new_status.get("reason") or names.REASON_PHASE_CHANGED,
                  f"phase {old_phase or 'none'} -> {new_phase}: {new_status.get('message', '')}".rstrip(": "))]


def avoided_events(before: Any, now: list[dict]) -> list[Event]:
    """A Warning for each node newly kept off (plan/avoid.py)."""
    known = {a.get("node") for a in before if isinstance(a, Mapping)} if isinstance(before, list) else set()
    return [Event("Warning", names.REASON_NODE_AVOIDED,
                  f"node {a['node']}: {a['failures']} infrastructure failures of this job within "
                  f"{AVOID_WINDOW_SECONDS // 60} min; replacement pods keep off it until {a['until']}")
            for a in now if a["node"] not in known]


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
