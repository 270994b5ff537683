"""Pods on lost nodes: pods stuck Terminating, and node loss (failurePolicy.nodeLostTimeoutSeconds).

- A pod still Terminating failurePolicy.stuckTerminatingTimeoutSeconds after its grace period (deletionTimestamp,
  which includes it) is force-deleted on any node, Ready or not: a pod the kubelet cannot kill (every process frozen,
  or in uninterruptible sleep on a hung mount) stays Terminating on a Ready node forever, and the job with it. A
  Warning Event says so once; a pod nobody recorded yet is recorded as ended (reason StuckPodForceDeleted) and
  replaced by the failure rules, a recorded one (e.g. deleted by the hang rule) gets the force deletion added to its
  attempt's message. The shell reads the nodes of the pods `stuck_pods` names, for the message only. The replacement
  (same name and DDPJOB_POD_INDEX) never trains beside the old pod's agent, should that one wake: its agent takes
  every older agent of its pod out of the rendezvous in the very write that enters it, and an agent taken out can
  neither join again nor go on training: its next look at the rendezvous stops it (ddp_trainer.rendezvous, rule 4).
  On a Ready node the kubelet also keeps killing the old containers: frozen processes die as they thaw.
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
from ddp_operator.status import Event, listed


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
    """Force-delete a pod Terminating past its grace period plus the timeout, on whatever node (module doc).

    Before that the kubelet is given its chance: a wake-up is kept for the due time."""
    timeout = ctx.job.spec.failure_policy.stuck_terminating_timeout_seconds
    pods = []
    for p in ctx.observed.pods:
        if p.gone or not (p.deleting and p.node and p.deletion_time):
            pods.append(p)
            continue
        due = p.deletion_time + timedelta(seconds=timeout)
        if ctx.now < due:
            ctx.due_in(due)
            pods.append(p)
            continue
        ctx.actions.append(Action(FORCE_DELETE, "Pod", p.name, uid=p.uid))
        node = {True: "Ready node", False: "NotReady node"}.get(ctx.observed.node_ready.get(p.node), "node")
        message = (f"still Terminating on {node} {p.node} {timeout} s after its grace period "
                   f"(spec.failurePolicy.stuckTerminatingTimeoutSeconds={timeout}): {_FORCE_DELETED}")
        if ctx.current(p) and not ctx.recorded(p):
            # ended as of this pass: the failure rules record it (once) and replace it; a store pod is the
            # store-loss rule's (recreated once gone), a stale one is only deleted
            ctx.extra_events.append(Event("Warning", names.REASON_FORCE_DELETED, f"pod {p.name} {message}"))
            pods.append(replace(p, phase="Failed", reason=names.REASON_FORCE_DELETED, message=message))
            continue
        if _note_forced(ctx, p, message):
            ctx.extra_events.append(Event("Warning", names.REASON_FORCE_DELETED, f"pod {p.name} {message}"))
        pods.append(p)
    ctx.observed = replace(ctx.observed, pods=tuple(pods))


# The words that mark an attempt as having force-deleted its pod.
_FORCE_DELETED = "force-deleted, to be replaced"
MESSAGE_TAIL = 200  # what status.attempt keeps of a message


def _note_forced(ctx: Pass, p: PodState, message: str) -> bool:
    """Add the force deletion to the message of `p`'s attempt, if it has one without it; True unless it was there
    already (a repeated pass: the DELETED event not seen yet), so that the Event is posted once."""
    for i in range(len(ctx.attempts) - 1, -1, -1):
        a = ctx.attempts[i]
        if a.get("uid") != p.uid or a.get("restartCount"):
            continue
        if _FORCE_DELETED in a.get("message", ""):
            return False
        amended = f"{a['message']}; {message}" if a.get("message") else message
        ctx.attempts[i] = {**a, "message": amended[-MESSAGE_TAIL:]}
        return True
    return True


def node_lost(ctx: Pass) -> None:
    """Force-delete current pods on a node NotReady past the timeout (or gone); the failure rules then see
    them as ended disruptions (reason NodeLost): recorded, counted per countDisruptions, recreated once the
    object is gone (a store pod as the store-loss rule says). Nodes of unknown state are left alone."""
    timeout = ctx.job.spec.failure_policy.node_lost_timeout_seconds
    if not timeout or not ctx.observed.nodes:
        return
    pods: list[PodState] = []
    lost: dict[str, tuple[str, list[str]]] = {}  # node -> (its message, its pods force-deleted for the first time)
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
            lost.setdefault(p.node, (message, []))[1].append(p.name)
        pods.append(replace(p, phase="Failed", deleting=True, disruption=names.REASON_NODE_LOST,
                            reason=names.REASON_NODE_LOST, message=message))
    ctx.observed = replace(ctx.observed, pods=tuple(pods))
    for message, lost_pods in lost.values():  # one Event a node: 50 lost nodes are 50 Events, not one per pod
        ctx.extra_events.append(Event("Warning", names.REASON_NODE_LOST,
                                      f"{message}: {_named(lost_pods)} force-deleted, to be recreated"))


def _named(pods: list[str]) -> str:
    """'pod a', 'pods a, b', or the first 8 and how many more (an Event's message stays short)."""
    return f"pod{'s' if len(pods) > 1 else ''} {listed(pods, 8)}"
