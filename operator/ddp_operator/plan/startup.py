"""Children that cannot be created and pods that cannot start (failurePolicy.startupTimeoutSeconds).

- A child name held by an object the job does not own (a foreign `<job>-0` pod, `<job>` Service or `<job>`
  NetworkPolicy) sets condition ReplicaFailure=True, reason ChildConflict, naming the object; the job waits (its
  create is retried) until the object is removed, then the condition turns False. While the job's own
  NetworkPolicy is missing (foreign, refused) its pods are held back (children.py), and the message says so.
- A current pod the kubelet cannot start (image pull, container config) sets condition PodsNotStarting=True with
  the kubelet's reason and message (an Unschedulable pod does not: an autoscaler may add room; the startup
  timeout's message names it); a child the API server refuses (Observed.refusals, the shell backs off its
  retries) sets ReplicaFailure=True, reason FailedCreate, with the refusal (one Event per distinct refusal).
  Both show in status.reason/message and turn False once the cause is gone. A current pod whose image cannot be
  pulled or run is also status.lastFailure (Infrastructure, ImagePull, the kubelet's reason and message), as soon
  as it is seen: it spends no failure budget (the pod never ran, nothing is replaced; the startup timeout bounds
  it) and is written once per pod, kept while that pod stays blocked by its image (the kubelet's retries flip
  ErrImagePull and ImagePullBackOff), so an operator restart or the next pass rewrites nothing. While fewer than
  minNodes trainers or no store pod run, status.podsPendingSince says since when; failurePolicy.startupTimeoutSeconds
  after it the job fails (StartupTimeoutExceeded) with the blocking reason.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping

from ddp_operator import failure_class, names
from ddp_operator.observed import PodState
from ddp_operator.plan.children import policy_missing
from ddp_operator.plan.state import Pass
from ddp_operator.plan.types import CREATE
from ddp_operator.status import Event, get_condition, last_failure

# At most this many refused children are named in the ReplicaFailure condition (and get an Event each).
REFUSALS_SHOWN = 3


def held(ctx: Pass, text: str) -> str:
    """`text`, plus why no pod exists while the job's own NetworkPolicy is missing."""
    if not policy_missing(ctx):
        return text
    return f"{text}; the job's pods are held back until the job's own NetworkPolicy {ctx.job.name} exists"


def child_conflicts(ctx: Pass) -> None:
    """Report children that cannot be created because a foreign object holds their name."""
    conflicts = ctx.observed.conflicts
    if conflicts:
        message = held(ctx, "; ".join(conflicts[name] for name in sorted(conflicts)))
        ctx.cond(names.COND_REPLICA_FAILURE, True, names.REASON_CHILD_CONFLICT, message)
        ctx.reason, ctx.message = names.REASON_CHILD_CONFLICT, f"{ctx.message}; {message}"
    elif not ctx.observed.refusals and \
            (get_condition(ctx.conditions, names.COND_REPLICA_FAILURE) or {}).get("status") == "True":
        ctx.cond(names.COND_REPLICA_FAILURE, False, names.REASON_CHILDREN_CREATED,
                 "every child was created")


def create_refusals(ctx: Pass) -> None:
    """ReplicaFailure=True, reason FailedCreate, while the API server refuses a child (child_conflicts owns the
    condition while a foreign object holds a child's name). The condition's Event reports the first refusals;
    a refusal not yet named in the condition gets an Event of its own, so retries post nothing."""
    if ctx.observed.conflicts:
        return
    refusals = ctx.observed.refusals
    prev = get_condition(ctx.conditions, names.COND_REPLICA_FAILURE) or {}
    was_refused = prev.get("status") == "True" and prev.get("reason") == names.REASON_CREATE_FAILED
    if refusals:
        shown = sorted(refusals)[:REFUSALS_SHOWN]
        text = "; ".join(refusals[n] for n in shown)
        if len(refusals) > len(shown):
            text += f"; and {len(refusals) - len(shown)} more"
        text = held(ctx, text)
        if was_refused:
            ctx.extra_events += [Event("Warning", names.REASON_CREATE_FAILED, refusals[n]) for n in shown
                                 if refusals[n] not in (prev.get("message") or "")]
        ctx.cond(names.COND_REPLICA_FAILURE, True, names.REASON_CREATE_FAILED, text)
        ctx.reason, ctx.message = names.REASON_CREATE_FAILED, f"{ctx.message}; {text}"
    elif was_refused:
        ctx.cond(names.COND_REPLICA_FAILURE, False, names.REASON_CHILDREN_CREATED, "every child was created")


def _starting(ctx: Pass, p: PodState) -> bool:
    """A pod of this run that the job waits for: not being deleted, the store pod or a current trainer."""
    return not p.deleting and p.group == ctx.group and (p.role == names.ROLE_RDZV or ctx.current(p))


def blocked(ctx: Pass, *, unschedulable: bool) -> list[PodState]:
    """Current pods that cannot start (PodState.startup_error), by name; Unschedulable ones only if asked."""
    return sorted((p for p in ctx.live if p.startup_error and _starting(ctx, p)
                   and (unschedulable or p.startup_error[0] != names.REASON_UNSCHEDULABLE)),
                  key=lambda p: p.name)


def startup_problems(ctx: Pass) -> None:
    """PodsNotStarting=True while a current pod cannot start, with the kubelet's reason. A pod waiting for room
    (Unschedulable) is not one: a cluster autoscaler may be adding a node; the startup timeout names it."""
    blocked_pods = blocked(ctx, unschedulable=False)
    prev = get_condition(ctx.conditions, names.COND_PODS_NOT_STARTING) or {}
    if blocked_pods:
        first = blocked_pods[0]
        reason, detail = first.startup_error
        text = f"{reason}: pod {first.name}" + (f", {detail}" if detail else "")
        if len(blocked_pods) > 1:
            text += f" (and {len(blocked_pods) - 1} more pod{'s' if len(blocked_pods) > 2 else ''})"
        # The kubelet alternates ErrImagePull and ImagePullBackOff while it retries: one Event, not one a flip.
        kept = prev.get("reason") if prev.get("status") == "True" else None
        cond_reason = kept if kept in names.IMAGE_PULL_REASONS and reason in names.IMAGE_PULL_REASONS else reason
        ctx.cond(names.COND_PODS_NOT_STARTING, True, cond_reason, text)
        ctx.reason, ctx.message = reason, f"{ctx.message}; {text}"
        image_pull_failure(ctx, blocked_pods)
    elif prev.get("status") == "True":
        ctx.cond(names.COND_PODS_NOT_STARTING, False, names.REASON_PODS_STARTED, "no pod is blocked from starting")


def image_pull_failure(ctx: Pass, blocked_pods: list[PodState]) -> None:
    """status.lastFailure for the first of `blocked_pods` whose image cannot be pulled or run, unless it already
    names one of them (the module docstring: once per pod, no budget spent)."""
    pulls = [(p, f) for p in blocked_pods if (f := failure_class.image_pull(*p.startup_error)) is not None]
    if not pulls:
        return
    prev = ctx.last_failure if isinstance(ctx.last_failure, Mapping) else {}
    if prev.get("reason") == failure_class.REASON_IMAGE_PULL and prev.get("pod") in {p.name for p, _ in pulls}:
        return
    pod, failure = pulls[0]
    ctx.last_failure = last_failure({"pod": pod.name, "node": pod.node, "time": ctx.now_s}, failure, "none")


def not_started(ctx: Pass) -> list[str]:
    """Where the first pod that is not running stands when nothing says why (the kubelet posts a pull error
    only after its first retry, often seconds after the pull failed): its container's waiting reason, or that
    it has no node yet. Trainers first, then the store pod; [] when every pod runs or none exists."""
    pods = sorted((p for p in ctx.live if not p.running and _starting(ctx, p)),
                  key=lambda p: (p.role == names.ROLE_RDZV, p.name))
    if not pods:
        return []
    first = pods[0]
    where = f"waiting in {first.waiting}" if first.waiting else "not scheduled to a node yet" if not first.node \
        else f"{first.phase} on node {first.node}"
    more = f" (and {len(pods) - 1} more pod{'s' if len(pods) > 2 else ''} not running)" if len(pods) > 1 else ""
    return [f"pod {first.name} is {where}, with no error reported by the kubelet yet{more}"]


def startup_timeout(ctx: Pass) -> bool:
    """Track since when the job cannot train (fewer than minNodes trainers or no store pod running); True if
    that lasted failurePolicy.startupTimeoutSeconds and the job failed."""
    job = ctx.job
    trainers = sum(1 for p in ctx.live if ctx.current(p) and p.running)
    store = any(p.role == names.ROLE_RDZV and p.group == ctx.group and p.running for p in ctx.live)
    if trainers >= job.spec.min_nodes and store:
        ctx.pods_pending_since = None
        return False
    if ctx.pods_pending_since is None:
        ctx.pods_pending_since = ctx.now
    timeout = job.spec.failure_policy.startup_timeout_seconds
    if not timeout:
        return False
    due = ctx.pods_pending_since + timedelta(seconds=timeout)
    if ctx.now < due:
        ctx.due_in(due)
        return False
    why = [c["message"] for c in ctx.conditions if c.get("status") == "True" and c.get("message")
           and c["type"] in (names.COND_PODS_NOT_STARTING, names.COND_REPLICA_FAILURE)]
    waiting = blocked(ctx, unschedulable=True)
    if not why and waiting:
        why = [f"{waiting[0].startup_error[0]}: pod {waiting[0].name}, {waiting[0].startup_error[1]}"]
    if not why:
        why = not_started(ctx)
    ctx.actions = [a for a in ctx.actions if a.verb != CREATE]  # nothing more is started for a failed job
    ctx.finish(names.PHASE_FAILED, names.REASON_STARTUP_TIMEOUT,
               f"{trainers}/{job.spec.nodes} training pods (at least {job.spec.min_nodes} needed) and "
               f"{'the' if store else 'no'} rendezvous store running for "
               f"spec.failurePolicy.startupTimeoutSeconds={timeout}"
               + (": " + "; ".join(why) if why else ""))
    return True
