"""The job's children: which are created when missing, which are deleted as stale.

- The job's NetworkPolicy (netpol.py) exists while the job is active exactly when it is wanted
  (spec.networkPolicy.enabled, else the operator's default): created before any pod, deleted when disabled, its
  owned fields patched back whenever they differ from what the job needs (netpol.drifted).
  While it is wanted and the job's own policy is not there (not created yet, refused, or a foreign policy holds
  its name), no pod is created: a pod without it would be open to anyone (startup.py says why in ReplicaFailure).
- The headless Service, the rendezvous store pod and spec.nodes + spec.spares trainer pods are created when
  missing, placed as Kueue admitted them (kueue.py).
- Pods of an older group (or with a group label that is not a number), or with an index >= spec.nodes +
  spec.spares (scale down), are deleted and never counted. A change of spec.nodes posts an Event (Scaled).
"""

from __future__ import annotations

from ddp_operator import kueue as kueuemod
from ddp_operator import names
from ddp_operator.netpol import drifted, render_network_policy, restoring_patch, wanted
from ddp_operator.plan.state import Pass
from ddp_operator.plan.types import CREATE, DELETE, PATCH, Action
from ddp_operator.plan.avoid import avoided_nodes, kept_off
from ddp_operator.pod import render_trainer_pod, trainer_pod_name
from ddp_operator.pod_hash import with_template_hash
from ddp_operator.rdzv import rdzv_pod_name, render_rdzv_pod
from ddp_operator.service import render_service
from ddp_operator.status import Event, get_condition


def scaled(ctx: Pass) -> None:
    """An Event when spec.nodes differs from the node count the last pass worked towards."""
    before = ctx.prev.nodes.desired
    after = ctx.job.spec.nodes
    if before and before != after:
        ctx.extra_events.append(Event("Normal", names.REASON_SCALED,
                                      f"spec.nodes changed from {before} to {after}; "
                                      f"{'adding' if after > before else 'removing'} training pods"))


def stale(ctx: Pass) -> None:
    """Delete pods of an older group and trainers beyond spec.nodes + spec.spares (scale down); never
    counted."""
    for p in ctx.live:
        if p.group != ctx.group or (p.role == names.ROLE_TRAINER and
                                    (p.index is None or p.index >= ctx.job.spec.pods)):
            ctx.delete(p)


def network_policy(ctx: Pass) -> None:
    """Create the NetworkPolicy before any pod when wanted, and put its fields back when they drifted (edited, or the
    operator's identity changed); delete our own when it is no longer wanted."""
    obs = ctx.observed
    if wanted(ctx.job, ctx.network_policy_config):
        desired = render_network_policy(ctx.job, ctx.network_policy_config)
        if not obs.network_policy_exists:
            ctx.actions.append(Action(CREATE, "NetworkPolicy", ctx.job.name, desired))
        elif obs.network_policy_uid and obs.network_policy_spec is not None and \
                drifted(desired["spec"], obs.network_policy_spec):
            ctx.actions.append(Action(PATCH, "NetworkPolicy", ctx.job.name, restoring_patch(desired),
                                      uid=obs.network_policy_uid))
    elif obs.network_policy_exists and obs.network_policy_uid:
        ctx.actions.append(Action(DELETE, "NetworkPolicy", ctx.job.name, uid=obs.network_policy_uid))


def policy_missing(ctx: Pass) -> bool:
    """True while the job wants a NetworkPolicy and its own is not there: its pods are held back."""
    return wanted(ctx.job, ctx.network_policy_config) and not ctx.observed.network_policy_exists


def create_missing(ctx: Pass) -> None:
    job = ctx.job
    network_policy(ctx)
    if not ctx.observed.service_exists:
        ctx.actions.append(Action(CREATE, "Service", job.name, render_service(job)))
    if ctx.start_time is None:
        ctx.start_time = ctx.now
    if policy_missing(ctx):
        return
    occupied = {p.name for p in ctx.live}
    avoid = [a["node"] for a in avoided_nodes(ctx.attempts, ctx.now)]
    # Only a missing child is rendered (a template copy each): a pass over a whole job of N pods renders none.
    if rdzv_pod_name(job) not in occupied:
        rdzv = kueuemod.place(with_template_hash(render_rdzv_pod(job, ctx.group)),
                              ctx.placements.get(names.POD_SET_RDZV))
        ctx.actions.append(Action(CREATE, "Pod", rdzv["metadata"]["name"], rdzv))
    for index in range(job.spec.pods):
        if trainer_pod_name(job, index) in occupied:
            continue
        # Hashed as rendered: Kueue's placement and the avoided nodes are where this one pod goes (pod_hash.py).
        pod = with_template_hash(render_trainer_pod(job, index, ctx.group))
        pod = kept_off(kueuemod.place(pod, ctx.placements.get(names.POD_SET_TRAINER)), avoid)
        ctx.actions.append(Action(CREATE, "Pod", pod["metadata"]["name"], pod))
    if not get_condition(ctx.conditions, names.COND_CREATED):
        spares = f" and {job.spec.spares} spare(s)" if job.spec.spares else ""
        ctx.cond(names.COND_CREATED, True, names.REASON_CREATED,
                 f"created the headless Service, the rendezvous store and {job.spec.nodes} training pods"
                 + spares)
