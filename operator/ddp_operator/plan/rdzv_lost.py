"""The rendezvous store pod lost: recorded, recreated under the same name, the trainers rejoin it.

Losing the rendezvous-store pod (it ended or is being deleted) is recorded once (reason RendezvousStoreLost, a
Warning Event), is one incident, and the pod is recreated under the same name. The group and the rendezvous id
stay and no trainer pod is touched: the agents fail on the lost store, their containers restart in place and
rejoin the new store. Trainer restarts (and, with restartPolicy Never, trainer pods failing with an exit
code) seen while the store pod is not Ready — after its loss or at start — are recorded and never counted
(failures.py): the trainers cannot run without it, as a trainer pod stuck Pending never fails the job either. The
recovery ends only when the store is Ready and every trainer runs (phase.py).
status.group stays for compatibility: pods of another group are stale (children.py); it no longer changes.
"""

from __future__ import annotations

from ddp_operator import names
from ddp_operator.env import rdzv_id
from ddp_operator.failure_class import INFRASTRUCTURE, Failure
from ddp_operator.plan.failures import describe, failure
from ddp_operator.plan.state import Pass
from ddp_operator.status import Event


def rdzv_lost(ctx: Pass) -> bool:
    """The store pod of the current group ended or is being deleted: record it once (an incident), delete
    what is left of it and let create_missing recreate it. The group stays: the trainer pods keep running,
    their torchrun agents fail on the lost store, the kubelet restarts their containers in place and they
    rejoin the new, empty store under the same rendezvous id, resuming from their /dev/shm snapshots.
    False if the job failed."""
    lost = [p for p in ctx.observed.pods if p.role == names.ROLE_RDZV and p.group == ctx.group
            and (p.terminal or p.deleting) and not ctx.recorded(p)]
    for p in lost:
        what = f"rendezvous store pod {p.name} {describe(p)}"
        counts = failure(ctx, p, what, Failure(INFRASTRUCTURE, names.REASON_RDZV_LOST, None, what),
                         disruption=p.disruption, reason=names.REASON_RDZV_LOST)
        if counts is None:
            return False
        ctx.delete(p)
        ctx.incident_reason = names.REASON_RDZV_LOST
        ctx.incident_message = (f"{what}; recreating it (the trainers restart in place and rejoin rendezvous "
                                f"{rdzv_id(ctx.job, ctx.group)})" + ("" if counts else " (not counted)"))
        ctx.extra_events.append(Event("Warning", names.REASON_RDZV_LOST, ctx.incident_message))
    return True
