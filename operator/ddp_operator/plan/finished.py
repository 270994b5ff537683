"""A finished job (Succeeded or Failed): its pods stopped per spec.runPolicy.cleanPodPolicy, its Workload marked
Finished, the job deleted spec.runPolicy.ttlSecondsAfterFinished after it finished (an Event, TTLExpired)."""

from __future__ import annotations

from datetime import timedelta

from ddp_operator import names
from ddp_operator.plan.state import Pass
from ddp_operator.plan.suspend import workload_finished
from ddp_operator.plan.types import DELETE_JOB, Action
from ddp_operator.status import Event


def finished(ctx: Pass) -> None:
    """Clean up after Succeeded/Failed and delete the job when its TTL is up."""
    workload_finished(ctx)
    rp = ctx.job.spec.run_policy
    for p in ctx.live:
        running = not p.terminal or p.lingering
        if rp.clean_pod_policy == "All" or (running and (
                rp.clean_pod_policy == "Running" or ctx.phase == names.PHASE_FAILED)):
            ctx.delete(p)
    if rp.ttl_seconds_after_finished is not None and ctx.completion_time:
        expiry = ctx.completion_time + timedelta(seconds=rp.ttl_seconds_after_finished)
        if ctx.now >= expiry:
            ctx.actions.append(Action(DELETE_JOB, names.KIND, ctx.job.name))
            ctx.extra_events.append(Event(
                "Normal", names.REASON_TTL_EXPIRED,
                f"spec.runPolicy.ttlSecondsAfterFinished={rp.ttl_seconds_after_finished} passed since the job "
                f"finished; deleting it"))
        else:
            ctx.due_in(expiry)
