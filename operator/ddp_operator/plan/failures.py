"""Failures of trainer pods: in-place restarts, ended pods, the failure budget and permanent exit codes.

- Training pods run with restartPolicy OnFailure (pod.py). A trainer container that exits non-zero is restarted
  by the kubelet in the same pod (same IP, hostname and /dev/shm): each such restart is recorded once (key
  `<uid>/<restartCount>` in status.recordedPods, details with `restartCount` in status.attempts; restarts the
  operator did not see, e.g. while it was down, are recorded together with the newest) and is an incident like a
  failed pod. The pod is left alone: the kubelet restarts the container (CrashLoopBackOff from the second
  restart on), the trainer resumes from its own snapshot.
- A failed, deleted or evicted training pod is recorded once (by UID, in status.recordedPods, with its details in
  the bounded status.attempts history), deleted, and recreated under the same name once the old one is gone
  (so there is never more than one pod per index). A pod missing unseen: vanished.py.
- Every failure is classified (failure_class.py: the user's code, the infrastructure, a hang) and recorded with its
  class in status.attempts and status.lastFailure. The user's code and hangs count against
  failurePolicy.backoffLimit, the infrastructure against failurePolicy.infraBackoffLimit; a disruption (eviction,
  preemption, node loss) counts only with countDisruptions (against backoffLimit), and nothing counts within
  incidentWindowSeconds of the incident that came before (survivors crashing because a peer died). Exceeding a
  budget fails the job and stops the pods.
- Exit codes listed as permanent (or not listed as retryable) fail the job at once, on a pod that ended as on an
  in-place restart (the trainer container's exit code and its workers' from torchrun's summary).
- So does a trainer that cannot start in its image, whatever the failure policy, as its last log line says: an image
  without ddp_trainer asked for the ddpjob-c10d backend (observed.rdzv_backend_missing; reason
  RendezvousBackendMissing), or ddp_trainer refusing the image's torch, outside the range it is tested with
  (observed.torch_unsupported, exit code 78; reason UnsupportedTorch): a message that says how to fix it; no restart
  could help.
"""

from __future__ import annotations

from datetime import timedelta
from dataclasses import replace
from typing import Any, Callable

from ddp_operator import names
from ddp_operator import spares as sparesmod
from ddp_operator.failure_class import (
    HANG, INFRASTRUCTURE, MAX_MESSAGE, REASON_EXIT_CODE, USER_CODE, Failure, classify,
)
from ddp_operator.observed import PodState, rdzv_backend_missing, torch_unsupported
from ddp_operator.plan.rdzv_closed import closed, reopen
from ddp_operator.plan.spares import spare_released
from ddp_operator.plan.state import Pass
from ddp_operator.status import Event, invalid_report_event

USER_BUDGET, INFRA_BUDGET = "backoffLimit", "infraBackoffLimit"


# --- the failure budget (failurePolicy.backoffLimit, incidentWindowSeconds) -------------------------
def incident(ctx: Pass, disruption: str | None, *, caused: bool = False) -> bool:
    """Record a failure; True if it counts against the budget. Updates the incident window. `caused`: a
    consequence of an incident already on record (never counted, and never opens a new window)."""
    fp = ctx.job.spec.failure_policy
    window = timedelta(seconds=fp.incident_window_seconds)
    same_incident = caused or (ctx.last_incident is not None and ctx.now - ctx.last_incident < window)
    if disruption:
        ctx.disruptions += 1
    counts = not same_incident and (disruption is None or fp.count_disruptions)
    if not same_incident:
        ctx.last_incident = ctx.now
    if ctx.recovery_start is None:
        ctx.recovery_start = ctx.now
    return counts


def failure(ctx: Pass, p: PodState, what: str, fail: Failure, *, disruption: str | None = None,
            caused: bool = False, **record: Any) -> bool | None:
    """Put a failure of `p` (an ended pod, an in-place restart, a hang), classified as `fail`, on record as an
    incident: whether it counted, or None when it exceeded its budget (the job failed; `what` is in its message).
    An infrastructure failure spends infraBackoffLimit; the user's code, a hang and a disruption counted by
    countDisruptions spend backoffLimit."""
    counts = incident(ctx, disruption, caused=caused)
    infra = fail.cls == INFRASTRUCTURE and disruption is None
    if (not counts and not caused and disruption is None and fail.cls == USER_CODE and fail.reason != REASON_EXIT_CODE
            and ctx.infra_restarts > 0 and incident_budget(ctx) == INFRA_BUDGET):
        # The incident was put down to the infrastructure (a survivor's network error seen first, say), but a Python
        # exception of the user's code is in it too: it is the user's, so that a crash loop still spends
        # backoffLimit. (A bare exit code is no such evidence: survivors' agents exit too.)
        ctx.infra_restarts -= 1
        counts = True
    budget = (INFRA_BUDGET if infra else USER_BUDGET) if counts else "none"
    if counts:
        ctx.incident_budget = budget
    if counts and over_budget(ctx, what, infra=infra):
        ctx.record(p, counted=True, failure=fail, budget=budget, **record)
        return None
    ctx.record(p, counted=counts, failure=fail, budget=budget, **record)
    return counts


def incident_budget(ctx: Pass) -> str | None:
    """The budget the current incident spent: this pass's, else the one status.lastIncident recorded."""
    return ctx.incident_budget or (ctx.prev.last_incident or {}).get("budget")


def over_budget(ctx: Pass, what: str, *, infra: bool = False) -> bool:
    if infra:
        limit = ctx.job.spec.failure_policy.infra_backoff_limit
        if ctx.infra_restarts + 1 > limit:
            ctx.finish(names.PHASE_FAILED, names.REASON_INFRA_BACKOFF_LIMIT,
                       f"{ctx.infra_restarts + 1} infrastructure failures exceed "
                       f"spec.failurePolicy.infraBackoffLimit={limit}; last: {what}")
            return True
        ctx.infra_restarts += 1
        return False
    limit = ctx.job.spec.failure_policy.backoff_limit
    if ctx.restarts + 1 > limit:
        ctx.finish(names.PHASE_FAILED, names.REASON_BACKOFF_LIMIT,
                   f"{ctx.restarts + 1} failures exceed spec.failurePolicy.backoffLimit={limit}; last: {what}")
        return True
    ctx.restarts += 1
    ctx.counted += 1
    return False


def unfit_image(ctx: Pass, p: PodState, message: str, restart: int | None = None) -> bool:
    """A trainer that cannot start in its image, as its last log line says: torchrun found no ddpjob-c10d backend
    (no ddp_trainer), or ddp_trainer refused the image's torch. The job fails at once, counted, with what to do,
    instead of a crash loop. False when the message says something else."""
    if rdzv_backend_missing(message):
        reason = names.REASON_RDZV_BACKEND_MISSING
        why = (f"the trainer image has no ddp_trainer (the {names.RDZV_BACKEND_SPARES} rendezvous backend, which "
               f"spec.torchrun.rdzvBackend auto picks for jobs with spares or minNodes < maxNodes): install the "
               f"ddp-trainer package in the image (pip install ./trainer, or build FROM the ddp-trainer image; "
               f"docs/your-script.md) or set spec.torchrun.rdzvBackend: c10d")
    elif torch_unsupported(message):
        reason, why = names.REASON_TORCH_UNSUPPORTED, message.strip().splitlines()[-1][:MAX_MESSAGE]
    else:
        return False
    ctx.record(p, counted=True, restart=restart, budget="none", failure=Failure(
        USER_CODE, reason, None, message.strip().splitlines()[-1][:MAX_MESSAGE]))
    ctx.finish(names.PHASE_FAILED, reason, f"pod {p.name}: {why}")
    return True


def permanent(ctx: Pass, what: str) -> None:
    fp = ctx.job.spec.failure_policy
    field_name = ("spec.failurePolicy.permanentExitCodes" if fp.retryable_exit_codes is None
                  else "spec.failurePolicy.retryableExitCodes")
    ctx.finish(names.PHASE_FAILED, names.REASON_PERMANENT_EXIT, f"{what}: a permanent failure per {field_name}")


# --- the rules -----------------------------------------------------------------------------------
def in_place_restarts(ctx: Pass) -> bool:
    """Record each in-place restart of a current trainer's container once; False if the job failed.

    An incident under the same rules as a failed pod, except that restarts seen while the rendezvous store
    is not up are consequences of its loss (or of its slow start): recorded, never counted. The pod is
    left alone: the kubelet has restarted (or is restarting) the container in the same pod."""
    store_down = not ctx.store_up()
    for p in sorted((p for p in ctx.trainers if ctx.current(p) and p.restarts > ctx.restarts_recorded(p)),
                    key=lambda p: (p.index, p.name)):
        if sparesmod.released(p.restart_message, spares=ctx.job.spec.spares):
            spare_released(ctx, p, restart=p.restarts)
            continue
        if closed(ctx, p.restart_message):
            reopen(ctx, p, restart=p.restarts)
            continue
        if unfit_image(ctx, p, p.restart_message, restart=p.restarts):
            return False
        missed = p.restarts - ctx.restarts_recorded(p) - 1
        what = f"trainer container of pod {p.name} {describe_restart(p)}" + (
            f" ({missed} earlier restart(s) not observed)" if missed > 0 else "")
        fail = classify(exit_code=p.restart_exit_code, reason=p.restart_reason, message=p.restart_message,
                        disruption=None)
        if ctx.job.spec.failure_policy.is_permanent(p.restart_exit_codes):
            ctx.record(p, counted=True, restart=p.restarts, failure=fail, budget="permanentExitCodes")
            permanent(ctx, what)
            return False
        counts = failure(ctx, p, what, fail, caused=store_down, restart=p.restarts)
        if counts is None:
            return False
        ctx.incident_reason = names.REASON_RESTARTED_IN_PLACE
        ctx.incident_message = what + ("" if counts else (
            " (not counted: the rendezvous store was not up)" if store_down else " (not counted)"))
        ctx.extra_events.append(Event("Warning", names.REASON_RESTARTED_IN_PLACE, ctx.incident_message))
    return True


def trainer_failures(ctx: Pass) -> bool:
    """Handle ended trainer pods of the current group; False if the job failed. A trainer that failed on
    its own (an exit code, no disruption, not deleted) while the store is not up is not counted (a template
    with restartPolicy Never: the store's loss ends every trainer pod)."""
    fp = ctx.job.spec.failure_policy
    store_down = not ctx.store_up()
    ended = sorted((p for p in ctx.trainers if ctx.current(p) and p.terminal and not p.succeeded
                    and not ctx.recorded(p)), key=lambda p: (p.index, p.name))
    for p in ended:
        if sparesmod.released(p.message, spares=ctx.job.spec.spares):
            spare_released(ctx, p)
            ctx.delete(p)
            continue
        if p.disruption is None and not (p.gone or p.deleting) and closed(ctx, p.message):
            reopen(ctx, p)
            ctx.delete(p)
            continue
        if p.disruption is None and unfit_image(ctx, p, p.message):
            return False
        codes = p.exit_codes
        what = f"pod {p.name} {describe(p)}"
        fail = classify(exit_code=p.exit_code, reason=p.reason, message=p.message, disruption=p.disruption,
                        deleted=p.gone or p.deleting)
        if p.disruption is None and fp.is_permanent(codes):
            ctx.record(p, counted=True, failure=fail, budget="permanentExitCodes")
            permanent(ctx, what)
            return False
        caused = store_down and p.disruption is None and not p.gone and p.exit_code is not None
        counts = failure(ctx, p, what, fail, disruption=p.disruption, caused=caused)
        if counts is None:
            return False
        ctx.incident_reason = (names.REASON_NODE_LOST if p.disruption == names.REASON_NODE_LOST
                               else names.REASON_NODE_DISRUPTED if p.disruption else names.REASON_NODE_FAILED)
        ctx.incident_message = f"{what}; replacing it" + ("" if counts else " (not counted)")
        if p.report_invalid:  # once: the pod's end is on record now
            ctx.extra_events.append(invalid_report_event(p.name, p.report_invalid, "termination message"))
        ctx.delete(p)
    return True


# --- messages ------------------------------------------------------------------------------------
def describe_restart(p: PodState) -> str:
    """'exited 137 (OOMKilled) and was restarted in place (restart 2)', for messages."""
    details = []
    workers = [c for c in p.restart_worker_exit_codes if c != p.restart_exit_code]
    if workers:
        details.append("worker exit codes " + ",".join(str(c) for c in workers))
    if p.restart_reason and p.restart_reason not in ("Error",):
        details.append(p.restart_reason)
    code = f"exited {p.restart_exit_code}" if p.restart_exit_code is not None else "failed"
    where = f" on node {p.node}" if p.node else ""
    return (f"{code}{' (' + ', '.join(details) + ')' if details else ''} and was restarted in place"
            f"{where} (restart {p.restarts})")


def describe(p: PodState) -> str:
    """'failed (exit code 3, OOMKilled) on node n1' and the like, for messages."""
    details = []
    if p.exit_code is not None:
        details.append(f"exit code {p.exit_code}")
    workers = [c for c in p.worker_exit_codes if c != p.exit_code]
    if workers:
        details.append("worker exit codes " + ",".join(str(c) for c in workers))
    if p.disruption:
        details.append(p.disruption)
    elif p.reason and p.reason not in ("Error",):
        details.append(p.reason)
    verb = "was deleted" if p.phase == "Gone" or (p.deleting and not p.terminal) else "failed"
    where = f" on node {p.node}" if p.node else ""
    return f"{verb}{' (' + ', '.join(details) + ')' if details else ''}{where}"


def going(ctx: Pass, uids: list[str]) -> None:
    """The pods are going as of this pass: the phase (phase.py) is Restarting, not Running."""
    if uids:
        ctx.observed = replace(ctx.observed, pods=tuple(
            replace(p, deleting=True) if p.uid in uids else p for p in ctx.observed.pods))


def delete_hung(ctx: Pass, stuck: list[PodState], what_of: Callable[[PodState], str]) -> list[str] | None:
    """A hang's stuck pods, each put on record as a failure (reason Hang, `what_of(pod)` its message) and deleted at
    once; the UIDs deleted, or None when a failure exceeded backoffLimit (the job failed)."""
    deleting = []
    for p in sorted(stuck, key=lambda p: p.index or 0):
        what = what_of(p)
        if not ctx.recorded(p):
            counts = failure(ctx, p, what, Failure(HANG, names.REASON_HANG, None, what[:MAX_MESSAGE]),
                             reason=names.REASON_HANG)
            if counts is None:
                return None
            ctx.incident_reason = names.REASON_HANG
            ctx.incident_message = f"{what}; deleting it" + ("" if counts else " (not counted)")
        # A stopped or stuck process cannot act on SIGTERM: waiting out the pod's grace period would only
        # delay the recovery (measured: ~30 s), so the kubelet kills it at once.
        ctx.delete(p, grace_seconds=names.HANG_DELETE_GRACE_SECONDS)
        deleting.append(p.uid)
    going(ctx, deleting)
    return deleting
