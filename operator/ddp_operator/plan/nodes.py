"""Pods on lost nodes: pods stuck Terminating, and node loss (failurePolicy.nodeLostTimeoutSeconds).

- A pod Terminating past failurePolicy.stuckTerminatingTimeoutSeconds on a node known to be NotReady is
  force-deleted (a Warning Event); the shell reads the nodes of the pods `stuck_pods` names.
- Node loss: a live current trainer or store pod on a node NotReady (Ready False or Unknown) for
  failurePolicy.nodeLostTimeoutSeconds, or on a node that no longer exists, is force-deleted and handled as a
  disruption (reason NodeLost) by the ordinary failure rules; nodes of unknown state (no RBAC) are left alone. The
  shell reads the nodes of the pods `node_lost_candidates` names.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

from ddp_operator import names
from ddp_operator.observed import PodState, format_time
from ddp_operator.plan.state import Pass
from ddp_operator.plan.types import FORCE_DELETE, Action
from ddp_operator.spec import Job
from ddp_operator.status import Event


def stuck_pods(job: Job, pods: tuple[PodState, ...], now: datetime) -> list[PodState]:
    """Pods Terminating longer than stuckTerminatingTimeoutSeconds: the shell looks up their nodes."""
    timeout = timedelta(seconds=job.spec.failure_policy.stuck_terminating_timeout_seconds)
    return [p for p in pods if not p.gone and p.deleting and p.node and p.deletion_time
            and now >= p.deletion_time + timeout]


def node_lost_candidates(pods: tuple[PodState, ...]) -> list[PodState]:
    """Pods whose node the shell looks up for the node-loss rule: live, not ended nor deleting, on a node, and not
    Ready (the node controller marks the pods of a NotReady node not Ready, so healthy pods cost no reads)."""
    return [p for p in pods if not p.gone and not p.terminal and not p.deleting and p.node and not p.ready]


def stuck(ctx: Pass) -> None:
    """Force-delete a pod Terminating past the timeout only on a node known to be NotReady or gone.

    On a Ready node (or one whose state is unknown) the kubelet finishes the deletion and the pod's DELETED
    event triggers the pass that recreates it: nothing to do. The one wake-up kept, at the timeout, is for
    looking at the node then; recreation never waits for it.
    """
    timeout = timedelta(seconds=ctx.job.spec.failure_policy.stuck_terminating_timeout_seconds)
    for p in ctx.live:
        if not (p.deleting and p.node and p.deletion_time):
            continue
        due = p.deletion_time + timeout
        if ctx.now < due:
            ctx.due_in(due)
        elif ctx.observed.node_ready.get(p.node) is False:
            ctx.actions.append(Action(FORCE_DELETE, "Pod", p.name, uid=p.uid))
            ctx.extra_events.append(Event("Warning", names.REASON_FORCE_DELETED,
                                          f"pod {p.name} stuck Terminating on NotReady node {p.node}; "
                                          f"force-deleted"))


def node_lost(ctx: Pass) -> None:
    """Force-delete current pods on a node NotReady past the timeout (or gone); the failure rules then see
    them as ended disruptions (reason NodeLost): recorded, counted per countDisruptions, recreated once the
    object is gone (a store pod as the store-loss rule says). Nodes of unknown state are left alone."""
    timeout = ctx.job.spec.failure_policy.node_lost_timeout_seconds
    if not timeout or not ctx.observed.nodes:
        return
    pods = []
    for p in ctx.observed.pods:
        node = ctx.observed.nodes.get(p.node) if p.node else None
        if (p not in node_lost_candidates((p,)) or p.group != ctx.group or node is None or node.ready
                or (node.since is None and not node.gone)):
            pods.append(p)
            continue
        due = node.since + timedelta(seconds=timeout) if node.since else ctx.now
        if ctx.now < due:
            ctx.due_in(due)
            pods.append(p)
            continue
        state = "no longer exists" if node.gone else f"has been NotReady since {format_time(node.since)}"
        message = f"node {p.node} {state} (spec.failurePolicy.nodeLostTimeoutSeconds={timeout})"
        ctx.actions.append(Action(FORCE_DELETE, "Pod", p.name, uid=p.uid))
        if not ctx.recorded(p):  # a repeated pass (the DELETED event not seen yet) posts nothing again
            ctx.extra_events.append(Event("Warning", names.REASON_NODE_LOST,
                                          f"pod {p.name}: {message}; force-deleted, to be recreated"))
        pods.append(replace(p, phase="Failed", deleting=True, disruption=names.REASON_NODE_LOST,
                            reason=names.REASON_NODE_LOST, message=message))
    ctx.observed = replace(ctx.observed, pods=tuple(pods))
