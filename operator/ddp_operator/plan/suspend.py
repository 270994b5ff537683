"""Suspended jobs: by the user (spec.runPolicy.suspend) or held by Kueue.

A suspended job has no pods (phase Suspended, condition Suspended); its deadline restarts on resume, as for
batch/v1 Jobs. Kueue (kueue.py states its rules): a job with the label kueue.x-k8s.io/queue-name runs only while
Kueue admits its Workload; until then, and after an eviction, it is held like a suspended job (phase Suspended,
condition Suspended reason Queued or Evicted; an eviction is a disruption). Its pods get the admitted flavors'
node labels and tolerations. A finished job marks its Workload Finished. A job whose queue label was removed while
it has a Workload is gated by that Workload still (its condition says so; one Warning Event QueueLabelRemoved).
"""

from __future__ import annotations

from dataclasses import replace

from ddp_operator import kueue as kueuemod
from ddp_operator import names
from ddp_operator.plan.state import Pass
from ddp_operator.plan.types import CREATE, DELETE, PATCH, PATCH_STATUS, Action
from ddp_operator.status import Event, get_condition


def suspended(ctx: Pass, reason: str = names.REASON_SUSPENDED,
              message: str = "spec.runPolicy.suspend is true: pods deleted") -> None:
    """No pods: suspended by the user (spec.runPolicy.suspend) or held by Kueue (`reason` Queued/Evicted)."""
    for p in ctx.live:
        ctx.delete(p)
    ctx.phase, ctx.reason, ctx.message = names.PHASE_SUSPENDED, reason, message
    ctx.start_time = None  # the deadline restarts on resume, as for batch/v1 Jobs
    ctx.recovery_start = None
    ctx.cond(names.COND_SUSPENDED, True, reason, ctx.message)
    if get_condition(ctx.conditions, names.COND_RUNNING):
        ctx.cond(names.COND_RUNNING, False, reason, ctx.message)
    if get_condition(ctx.conditions, names.COND_RESTARTING):
        ctx.cond(names.COND_RESTARTING, False, reason, ctx.message)


def resumed(ctx: Pass) -> bool:
    """Condition Suspended turns False once spec.runPolicy.suspend is false, and the pods of the suspended run
    are gone (`still_held`). False while the job is held still."""
    before = get_condition(ctx.conditions, names.COND_SUSPENDED) or {}
    if before.get("status") != "True":
        return True
    if still_held(ctx, before.get("reason") or names.REASON_SUSPENDED, "spec.runPolicy.suspend is false"):
        return False
    ctx.cond(names.COND_SUSPENDED, False, names.REASON_RESUMED, "spec.runPolicy.suspend is false")
    return True


def still_held(ctx: Pass, reason: str, message: str) -> bool:
    """A held job released (resumed, or readmitted by Kueue) before the last run's pods were gone: it stays held
    until they are, for they would be taken for failures of the run that starts now (a store pod being deleted
    for the hold is no lost store). Once they are, the ends of those pods are dropped from this pass. True while
    held."""
    if any(p.deleting for p in ctx.live):
        suspended(ctx, reason, f"{message}; waiting for the pods of the last run to stop")
        return True
    ctx.observed = replace(ctx.observed, pods=tuple(p for p in ctx.observed.pods if not p.gone))
    return False


def queued(ctx: Pass) -> bool:
    """Ask Kueue's gate (a job with a queue name) and carry out its writes to the Workload; True when the job is
    held this pass (no pods). With spec.runPolicy.suspend the suspend rule decides (the gate only deactivates
    the Workload)."""
    job, ws = ctx.job, ctx.observed.workload
    if not ctx.observed.kueue:
        suspended(ctx, names.REASON_QUEUE_DISABLED, (
            f"metadata.labels[{names.LABEL_QUEUE_NAME}]={job.queue_name}, but this operator runs without its "
            f"Kueue integration (Helm value kueue.enabled=true, flag --kueue): the job waits"))
        return True
    g = kueuemod.gate(job, ws, group=ctx.group, pods_live=bool(ctx.live), now=ctx.now_s,
                      flavors=ctx.observed.flavors, priority=ctx.observed.priority)
    if g.create is not None:
        ctx.actions.append(Action(CREATE, names.WORKLOAD_KIND, g.create["metadata"]["name"], g.create))
    if ws is not None and g.delete:
        ctx.actions.append(Action(DELETE, names.WORKLOAD_KIND, ws.name, uid=g.delete))
    if ws is not None and g.patch:
        ctx.actions.append(Action(PATCH, names.WORKLOAD_KIND, ws.name, g.patch, uid=ws.uid))
    if ws is not None and g.status:
        ctx.actions.append(Action(PATCH_STATUS, names.WORKLOAD_KIND, ws.name, g.status, uid=ws.uid))
    if job.spec.run_policy.suspend:
        return False
    before = get_condition(ctx.conditions, names.COND_SUSPENDED) or {}
    held_before = before.get("status") == "True"
    if ws is not None and job.queue_label_removed and kueuemod.label_removed(ws) not in (before.get("message") or ""):
        # Once: the condition's message carries it from now on.
        ctx.extra_events.append(Event("Warning", names.REASON_QUEUE_LABEL_REMOVED, kueuemod.label_removed(ws)))
    if g.hold:
        if g.evicted and not (held_before and before.get("reason") == names.REASON_EVICTED):
            # A disruption: never counted against backoffLimit; status.progress stays. The condition's Event
            # (reason Evicted) tells the user; the incident names it, so the recovery after the readmission does
            # (status.lastRecovery.fault, goodput's byFault).
            ctx.disruptions += 1
            ctx.incident_reason = names.REASON_EVICTED
        suspended(ctx, g.reason, g.message)
        return True
    if held_before and still_held(ctx, before.get("reason") or names.REASON_QUEUED, g.message):
        return True
    ctx.placements = g.placements
    if before.get("reason") != names.REASON_ADMITTED:
        ctx.cond(names.COND_SUSPENDED, False, names.REASON_ADMITTED, g.message)
        if not held_before:  # no condition Event for a condition that appears False
            ctx.extra_events.append(Event("Normal", names.REASON_ADMITTED, g.message))
    elif before.get("message") != g.message:  # still admitted, e.g. its queue label was removed: said so
        ctx.cond(names.COND_SUSPENDED, False, names.REASON_ADMITTED, g.message)
    return False


def workload_finished(ctx: Pass) -> None:
    """A finished job marks its Workload Finished: Kueue frees its quota."""
    ws = ctx.observed.workload
    if ctx.job.queue_name and ws is not None and not ws.finished:
        body = kueuemod.finished_patch(ws, ctx.phase == names.PHASE_SUCCEEDED, ctx.message, ctx.now_s)
        ctx.actions.append(Action(PATCH_STATUS, names.WORKLOAD_KIND, ws.name, body, uid=ws.uid))
