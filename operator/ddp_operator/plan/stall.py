"""Stalls (docs/diagnostics.md; ddp_operator/stall.py reads the diagnostics sidecars' answers).

The shell hands in a finding (Observed.stall) when a job's process group did not form within
failurePolicy.processGroupTimeoutSeconds, when a script that reports no progress stood still for
failurePolicy.hangTimeoutSeconds, and when a job whose condition Stalled is True is seen formed. The finding may
be a pass old, so it is checked again against what is observed now: only while the job is Running (no recovery
under way) with every pod it names a current trainer pod that runs and is not being deleted, and while the spec
still asks for the rule (spec.diagnostics.enabled, the timeout not 0).

- ProcessGroupNeverFormed: condition Stalled=True with the finding's one line, a Warning Event with the same line,
  status.diagnosis written (with the finding's signature and the incarnation it was found in: the pods' UIDs).
  Every current trainer pod is deleted and recorded (attempt reason ProcessGroupNeverFormed, not counted against
  backoffLimit; the job is Restarting). If Stalled is still True with the same diagnosis from an earlier
  incarnation (the pods were restarted once for it), no restart can fix it: the job fails with reason
  ProcessGroupNeverFormed. The same finding handed in again for the same pods (a pass that runs twice) changes
  nothing; a different diagnosis restarts again, counted against backoffLimit (only the first restart is free).
- Hang (a silent hang): the stuck pods deleted as for a hang found by progress (plan/hang.py: attempt reason Hang,
  counted, the short grace period), Stalled=True with reason Hang, status.diagnosis written.
- ProcessGroupFormed: Stalled=False (only if it was True); the last diagnosis stays in status.diagnosis.
"""

from __future__ import annotations

from typing import Any, Mapping

from ddp_operator import names
from ddp_operator import stall as stallmod
from ddp_operator.failure_class import HANG, MAX_MESSAGE, Failure
from ddp_operator.observed import PodState
from ddp_operator.plan.failures import delete_hung, going, incident, over_budget
from ddp_operator.plan.state import Pass
from ddp_operator.status import Event, get_condition


def stall(ctx: Pass) -> bool:
    """Act on the shell's stall finding; False if the job failed."""
    finding = ctx.observed.stall
    if finding is None:
        return True
    if finding.reason == names.REASON_PG_FORMED:
        stalled = get_condition(ctx.conditions, names.COND_STALLED)
        if stalled is not None and stalled.get("status") == "True":
            ctx.cond(names.COND_STALLED, False, names.REASON_PG_FORMED, finding.message)
        return True
    if not _on(ctx, finding.reason):
        return True
    current = _still_stuck(ctx, finding)
    if current is None:
        return True
    if finding.reason == names.REASON_PG_NEVER_FORMED:
        return _never_formed(ctx, finding, current)
    if finding.reason == names.REASON_HANG:
        return _silent_hang(ctx, finding, current)
    return True


def _on(ctx: Pass, reason: str) -> bool:
    """Whether the job's spec (now: it may have changed since the probe) still asks for the rule."""
    fp = ctx.job.spec.failure_policy
    if not ctx.job.spec.diagnostics.enabled:
        return False
    return bool(fp.process_group_timeout_seconds if reason == names.REASON_PG_NEVER_FORMED
                else fp.hang_timeout_seconds)


def _still_stuck(ctx: Pass, finding: stallmod.Finding) -> list[PodState] | None:
    """The current trainer pods, when the finding still holds for them; None when it is another set's or stale."""
    if ctx.phase != names.PHASE_RUNNING or ctx.recovery_start is not None or not finding.stuck:
        return None
    current = [p for p in ctx.trainers if ctx.current(p) and not p.gone]
    by_uid = {p.uid: p for p in current}
    if len(current) < ctx.job.spec.nodes or not all(p.running and not p.deleting for p in current):
        return None
    if any(uid not in by_uid for uid in finding.stuck):
        return None  # the finding is of another set of pods
    return current


def diagnosis(ctx: Pass, reason: str, message: str, ranks: Any, **more: str) -> dict:
    """status.diagnosis: what a stall's diagnosis found, and when."""
    return {"time": ctx.now_s, "reason": reason, "message": message,
            "ranks": [dict(r) for r in list(ranks)[:stallmod.MAX_RANKS]], **more}


def _stalled(ctx: Pass, reason: str, message: str) -> None:
    """Condition Stalled=True, and a Warning Event with the same line unless the condition already said it."""
    prev = get_condition(ctx.conditions, names.COND_STALLED) or {}
    ctx.cond(names.COND_STALLED, True, reason, message)
    if not (prev.get("status") == "True" and prev.get("reason") == reason and prev.get("message") == message):
        ctx.extra_events.append(Event("Warning", reason, message))


def _earlier(ctx: Pass, finding: stallmod.Finding) -> Mapping[str, Any] | None:
    """The diagnosis on record while Stalled is True with the same reason (None once the group formed since)."""
    stalled = get_condition(ctx.conditions, names.COND_STALLED) or {}
    prev = ctx.diagnosis
    if stalled.get("status") != "True" or stalled.get("reason") != finding.reason or not isinstance(prev, Mapping):
        return None
    return prev if prev.get("reason") == finding.reason else None


def _never_formed(ctx: Pass, finding: stallmod.Finding, current: list[PodState]) -> bool:
    incarnation = stallmod.incarnation_id(finding.stuck)
    earlier = _earlier(ctx, finding)
    _stalled(ctx, finding.reason, finding.message)
    ctx.diagnosis = diagnosis(ctx, finding.reason, finding.message, finding.ranks, signature=finding.signature,
                              incarnation=incarnation)
    if earlier is not None and earlier.get("signature") == finding.signature and \
            earlier.get("incarnation") != incarnation:
        ctx.finish(names.PHASE_FAILED, names.REASON_PG_NEVER_FORMED,
                   f"{finding.message}; the same after a restart: fix the script")
        return False
    # The first restart for a group that never formed is free; a further one (the group still not formed after a
    # restart, with another diagnosis: a script that fails differently each time) counts against backoffLimit,
    # so that such a job ends too.
    repeated = earlier is not None and earlier.get("incarnation") != incarnation
    fresh = [p for p in current if not ctx.recorded(p)]
    fail = Failure(HANG, names.REASON_PG_NEVER_FORMED, None, finding.message[:MAX_MESSAGE])
    if fresh:
        incident(ctx, None)
        ctx.incident_reason = names.REASON_PG_NEVER_FORMED
        what = (f"{finding.message}; the process group did not form within "
                f"spec.failurePolicy.processGroupTimeoutSeconds")
        ctx.incident_message = f"{what}: restarting every trainer pod" + ("" if repeated else " (not counted)")
        if repeated and over_budget(ctx, what):
            for p in fresh:
                ctx.record(p, counted=True, reason=names.REASON_PG_NEVER_FORMED, failure=fail, budget="backoffLimit")
            return False
    for p in sorted(current, key=lambda p: p.index or 0):
        if not ctx.recorded(p):
            ctx.record(p, counted=repeated, reason=names.REASON_PG_NEVER_FORMED, failure=fail,
                       budget="backoffLimit" if repeated else "none")
        # Workers blocked in init_process_group cannot act on SIGTERM: no grace period to wait out.
        ctx.delete(p, grace_seconds=names.HANG_DELETE_GRACE_SECONDS)
    going(ctx, [p.uid for p in current])
    return True


def _silent_hang(ctx: Pass, finding: stallmod.Finding, current: list[PodState]) -> bool:
    timeout = ctx.job.spec.failure_policy.hang_timeout_seconds
    _stalled(ctx, finding.reason, finding.message)
    ctx.diagnosis = diagnosis(ctx, finding.reason, finding.message, finding.ranks, signature=finding.signature,
                              incarnation=stallmod.incarnation_id(p.uid for p in current))
    what = (f"{finding.message}; no stack nor CPU time moved for spec.failurePolicy.hangTimeoutSeconds={timeout} "
            f"(the script reports no progress)")
    deleting = delete_hung(ctx, [p for p in current if p.uid in finding.stuck], lambda p: f"pod {p.name}: {what}")
    return deleting is not None
