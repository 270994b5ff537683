"""Hang (failurePolicy.hangTimeoutSeconds; ddp_operator/hang.py finds the stuck pods).

When the shell found the training's step unchanged for the timeout and hands in every trainer pod's report
(Observed.hang_reports, keyed by pod UID: a pod replaced under the same name since the probe is another pod, and
the reports are then of another set of pods), the stuck pod(s) are recorded with reason Hang, deleted and
replaced; the job is Restarting with reason Hang. When the shell also hands in the pods' diagnoses
(Observed.hang_diagnoses, from the diagnostics sidecars: docs/diagnostics.md), the message names the frame each
stuck pod stands in and status.diagnosis records every rank's phase and frames.
"""

from __future__ import annotations

from ddp_operator import hang as hangmod
from ddp_operator import names
from ddp_operator import stall as stallmod
from ddp_operator.plan.failures import delete_hung
from ddp_operator.plan.spares import hang_candidates
from ddp_operator.plan.stall import diagnosis
from ddp_operator.plan.state import Pass


def hang(ctx: Pass) -> bool:
    """Delete the stuck pod(s) of a hung job (the shell hands in every pod's report); False if it failed.

    Only while the job is Running with every current trainer pod running: the shell's finding may be a pass
    old, so it is checked again against what is observed now."""
    reports = ctx.observed.hang_reports
    if reports is None or not ctx.job.spec.failure_policy.hang_timeout_seconds:
        return True
    if ctx.phase != names.PHASE_RUNNING or ctx.recovery_start is not None:
        return True
    current = [p for p in ctx.trainers if ctx.current(p) and not p.gone]
    if ctx.job.spec.spares:
        current = hang_candidates(ctx, current, reports)
    if len(current) < ctx.job.spec.nodes or not all(p.running for p in current):
        return True
    if any(p.uid not in reports for p in current):
        return True  # the reports are of another set of pods
    stuck = set(hangmod.stuck_pods((p.uid, p.index or 0, reports[p.uid]) for p in current))
    timeout = ctx.job.spec.failure_policy.hang_timeout_seconds
    diagnoses = ctx.observed.hang_diagnoses
    frames = {d.uid: stallmod.frame_of(d.diagnosis) for d in diagnoses or ()}
    found: dict[str, str] = {}

    def what_of(p) -> str:
        answer = reports[p.uid]
        why = ("its progress endpoint did not answer" if answer is None
               else f"it reports step {answer.get('step')}")
        found[p.uid] = (f"pod {p.name}: global rank 0's step did not change for spec.failurePolicy."
                        f"hangTimeoutSeconds={timeout}; {why}") + \
            (f"; it stands in {frames[p.uid]}" if frames.get(p.uid) else "")
        return found[p.uid]
    deleting = delete_hung(ctx, [p for p in current if p.uid in stuck], what_of)
    if deleting is None:
        return False
    if deleting and diagnoses is not None:
        ctx.diagnosis = diagnosis(ctx, names.REASON_HANG, stallmod.cut("; ".join(found[u] for u in deleting)),
                                  stallmod.describe(diagnoses))
    return True
