"""Training pods that vanished unseen.

A pod missing while the job was training, whose end nobody saw (deleted while the operator was down) and that is
not already on record within the recovery under way, is recorded (reason NodeMissing, no UID, in status.attempts)
and counted like a deleted pod (failures.py).
"""

from __future__ import annotations

from ddp_operator import names
from ddp_operator.failure_class import INFRASTRUCTURE, Failure
from ddp_operator.observed import parse_time
from ddp_operator.plan.failures import incident, over_budget
from ddp_operator.plan.state import Pass
from ddp_operator.pod import trainer_pod_name
from ddp_operator.status import append_attempt, last_failure, missing_attempt


def vanished(ctx: Pass) -> bool:
    """Record each training pod that is missing although the job was training and its end is not on record:
    it ended unseen (e.g. deleted while the operator was down). Counted like a deleted pod. False if that
    failed the job."""
    # Only pods that existed can vanish: the last status written showed every desired pod running (after
    # suspend, at start, after a scale-up or a refused create, pods are just not there yet).
    prev_desired = ctx.prev.nodes.desired
    if ctx.prev.phase != names.PHASE_RUNNING or ctx.prev.nodes.running < prev_desired:
        return True
    # Spare pods count only when every one of them was running too.
    spares = ctx.prev.spares.desired
    if ctx.prev.spares.running < spares:
        spares = 0
    occupied = {p.name for p in ctx.live}
    for index in range(min(prev_desired + spares, ctx.job.spec.pods)):
        name = trainer_pod_name(ctx.job, index)
        if name in occupied or end_recorded(ctx, name):
            continue
        what = f"pod {name} is missing (it ended while the operator was not watching)"
        counts = incident(ctx, None)
        over = counts and over_budget(ctx, what, infra=True)
        entry = {**missing_attempt(name, index, counted=counts, now=ctx.now_s), "class": INFRASTRUCTURE,
                 "cause": names.REASON_NODE_MISSING}
        ctx.attempts = append_attempt(ctx.attempts, entry)
        ctx.last_failure = last_failure(entry, Failure(INFRASTRUCTURE, names.REASON_NODE_MISSING, None, what),
                                        "infraBackoffLimit" if counts else "none")
        if over:
            return False
        ctx.incident_reason = names.REASON_NODE_MISSING
        ctx.incident_message = f"{what}; recreating it" + ("" if counts else " (not counted)")
    return True


def end_recorded(ctx: Pass, name: str) -> bool:
    """Whether the end of the last pod named `name` is already on record: a recovery is under way and a pod
    of that name ended since it started (recorded, then deleted, its replacement not created yet)."""
    if ctx.recovery_start is None:
        return False
    # Attempt times are whole seconds (status.py): an attempt of this very pass is earlier than the exact start.
    start = ctx.recovery_start.replace(microsecond=0)
    since = [a for a in ctx.attempts if (parse_time(a.get("time")) or ctx.now) >= start]
    if len(since) >= names.ATTEMPTS_HISTORY:
        return True  # the bounded history may have dropped it: never count a pod twice
    return any(a.get("pod") == name and not a.get("restartCount") for a in since)
