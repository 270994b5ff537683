"""spec.runPolicy.activeDeadlineSeconds: a job running longer, counted from its first pods (startTime), fails
(reason DeadlineExceeded)."""

from __future__ import annotations

from datetime import timedelta

from ddp_operator import names
from ddp_operator.plan.state import Pass


def deadline_exceeded(ctx: Pass) -> bool:
    deadline = ctx.job.spec.run_policy.active_deadline_seconds
    if deadline is None or ctx.start_time is None:
        return False
    due = ctx.start_time + timedelta(seconds=deadline)
    if ctx.now >= due:
        ctx.finish(names.PHASE_FAILED, names.REASON_DEADLINE,
                   f"the job ran longer than spec.runPolicy.activeDeadlineSeconds={deadline}")
        return True
    ctx.due_in(due)
    return False


def deadline_due(ctx: Pass) -> None:
    """A wake-up at the deadline. The deadline clock starts with the first pods."""
    if ctx.job.spec.run_policy.active_deadline_seconds and ctx.start_time:
        ctx.due_in(ctx.start_time + timedelta(seconds=ctx.job.spec.run_policy.active_deadline_seconds))
