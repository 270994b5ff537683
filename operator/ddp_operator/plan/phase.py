"""The phase of a job that is neither finished nor held: Running once spec.nodes trainers run (and, in a
recovery, the rendezvous store is up: the recovery ends then), Restarting while a recovery is under way, else
Pending (Running, reason WaitingForNodes, for a job that was training)."""

from __future__ import annotations

from ddp_operator import names
from ddp_operator.plan.state import Pass
from ddp_operator.status import get_condition


def active_phase(ctx: Pass) -> None:
    job = ctx.job
    current = [p for p in ctx.trainers if ctx.current(p) and not p.gone]
    running = sum(1 for p in current if p.running)
    ever_running = get_condition(ctx.conditions, names.COND_RUNNING) is not None
    was_training = ctx.prev.phase in (names.PHASE_RUNNING, names.PHASE_RESTARTING)
    if running >= job.spec.nodes and (ctx.recovery_start is None or ctx.store_up()):
        if ctx.recovery_start is not None:
            ctx.recovery_seconds = (ctx.now - ctx.recovery_start).total_seconds()
            ctx.recovery_start = None
        ctx.phase, ctx.reason = names.PHASE_RUNNING, names.REASON_RUNNING
        ctx.message = f"{min(running, job.spec.nodes)}/{job.spec.nodes} training pods running" + (
            f" (+{running - job.spec.nodes}/{job.spec.spares} spares)" if job.spec.spares else "")
        ctx.cond(names.COND_RUNNING, True, ctx.reason, ctx.message)
        if get_condition(ctx.conditions, names.COND_RESTARTING):
            ctx.cond(names.COND_RESTARTING, False, names.REASON_RUNNING, "recovered: " + ctx.message)
    elif ctx.recovery_start is not None:
        prev_restarting = get_condition(ctx.conditions, names.COND_RESTARTING)
        reason = ctx.incident_reason or (prev_restarting or {}).get("reason") or names.REASON_NODE_FAILED
        message = ctx.incident_message or (prev_restarting or {}).get("message") or ""
        ctx.phase, ctx.reason = names.PHASE_RESTARTING, reason
        ctx.message = f"{running}/{job.spec.nodes} training pods running; {message}".rstrip("; ")
        ctx.cond(names.COND_RESTARTING, True, reason, message or ctx.message)
        if ever_running:
            ctx.cond(names.COND_RUNNING, False, reason, ctx.message)
    elif was_training:
        # Scaling up (or a slow pod start) without a failure: training goes on with the others.
        ctx.phase, ctx.reason = names.PHASE_RUNNING, names.REASON_WAITING
        ctx.message = f"{running}/{job.spec.nodes} training pods running"
    else:
        ctx.phase, ctx.reason = names.PHASE_PENDING, names.REASON_WAITING
        ctx.message = f"{running}/{job.spec.nodes} training pods running"
