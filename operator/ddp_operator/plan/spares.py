"""Hot spares (spec.spares; ddp_operator/spares.py says how they work): the planner's part.

The job keeps spec.nodes + spec.spares identical trainer pods; the rendezvous (of exactly spec.nodes, backend
ddpjob-c10d) decides which ones train. Running needs spec.nodes running pods; status.nodes counts the first
spec.nodes, status.spares the rest (NODES `2/2 +1`). A spare pod that fails, vanishes or restarts in place is
handled like any trainer (recorded, counted, recreated); one whose termination message's last line starts
with names.SPARE_RELEASED_MARKER (its rendezvous was closed by a finishing participant) is recorded with reason
SpareReleased, never counted and no incident. Once a trainer exited 0 the running pods that are not members
(rank 0's final report, else status.progress.members; without either, all of them once spec.nodes trainers
exited 0) are stopped at once. The hang rule judges members only (from the hang reports, else status.progress;
without either, only pods that answered). spec.spares needs minNodes == maxNodes == nodes (admission refuses it;
spec.py checks again).

The desired size (`desired_size`, not only for spares): every live current trainer pod of a job whose rendezvous
follows spec.nodes (env.follows_desired_size: spares, or an elastic range, on ddpjob-c10d) carries spec.nodes in
its annotation (names.NODES_ANNOTATION, patched with a UID precondition before any create), which its rendezvous
backend follows (pod.py): a round closes at that size, and `kubectl scale` re-forms the group at the new one.
"""

from __future__ import annotations

from typing import Any, Mapping

from ddp_operator import names
from ddp_operator import spares as sparesmod
from ddp_operator.env import follows_desired_size
from ddp_operator.observed import PodState
from ddp_operator.plan.state import Pass
from ddp_operator.plan.types import PATCH, Action
from ddp_operator.pod import nodes_annotation


def spare_released(ctx: Pass, p: PodState, restart: int | None = None) -> None:
    """A spare whose torchrun ended because a participant closed the rendezvous (spares.py): the training
    ended, the operator just has not seen it yet. On record, never counted, not an incident."""
    ctx.record(p, counted=False, reason=names.REASON_SPARE_RELEASED, restart=restart)


def spares_left(ctx: Pass, current: list[PodState], running: list[PodState]) -> list[PodState]:
    """Of the pods still running after a trainer exited 0, the spares: those not among the members rank 0
    last reported (its final report, else status.progress); without a report naming them, every one once
    spec.nodes trainers exited 0 (the whole world finished)."""
    finals = sorted((p.final_report for p in current if p.succeeded and p.final_report),
                    key=lambda r: r.get("rank") not in (None, 0))
    known = sparesmod.members([*finals, ctx.progress])
    if known is not None:
        return [p for p in running if p.index not in known]
    return list(running) if sum(1 for p in current if p.succeeded) >= ctx.job.spec.nodes else []


def hang_candidates(ctx: Pass, pods: list[PodState],
                    reports: Mapping[str, Mapping[str, Any] | None]) -> list[PodState]:
    """With spares only the training members can be hung: a spare runs no worker and never answers. The
    members come from the reports (keyed by pod UID; rank 0's first), else status.progress; when nothing names them, only pods
    that answered are judged (a silent pod may be a spare)."""
    ordered = sorted(reports.values(), key=lambda r: not isinstance(r, Mapping) or r.get("rank") not in (None, 0))
    known = sparesmod.members([*ordered, ctx.progress])
    if known is not None:
        return [p for p in pods if p.index in known]
    answered = [p for p in pods if reports.get(p.uid) is not None]
    return answered if len(answered) >= ctx.job.spec.nodes else []


def desired_size(ctx: Pass) -> None:
    """Jobs whose rendezvous follows spec.nodes (spares, elastic ranges): every live current trainer pod's annotation
    says spec.nodes (pod.py), so a round closes at that size and `kubectl scale` re-forms the group at the new one;
    patched before new pods are created (a pod beyond a smaller size is deleted, not patched: children.stale)."""
    if not follows_desired_size(ctx.job):
        return
    wanted = nodes_annotation(ctx.job)
    for p in ctx.live:
        if ctx.current(p) and not p.deleting and not p.terminal and \
                p.nodes_annotation != wanted[names.NODES_ANNOTATION]:
            ctx.actions.append(Action(PATCH, "Pod", p.name, {"metadata": {"annotations": wanted}}, uid=p.uid))
