"""Success: some trainer exited 0 and no trainer is still running.

- Failures after a success are not replaced nor counted, a trainer container restarting in place then is stopped
  at once; trainers still running SUCCESS_GRACE_SECONDS after the first success are stopped (spares at once,
  spares.py).
- status.progress never goes back: a report (polled, or the final one) from a step before the one shown is not
  taken (status.newer_progress).
- A final report (termination message) with invalid fields (report.valid_report: they were dropped, the rest
  used) gets an InvalidReport Warning Event, once: in the pass that finishes the job.
"""

from __future__ import annotations

from datetime import timedelta

from ddp_operator import names
from ddp_operator.plan.spares import spares_left
from ddp_operator.plan.state import Pass
from ddp_operator.status import invalid_report_event, newer_progress, progress_status


def success(ctx: Pass) -> bool:
    """Apply the success rule; True if the job succeeded or is finishing successfully."""
    current = [p for p in ctx.trainers if p.role == names.ROLE_TRAINER and p.group == ctx.group]
    if not any(p.succeeded for p in current):
        return False
    for p in ctx.observed.pods:
        if p.final_report:
            ctx.progress = newer_progress(ctx.progress, progress_status(p.final_report))
    still_running = [p for p in current if p.phase == "Running" and not p.deleting and not p.restarting]
    if ctx.job.spec.spares:
        # The training is complete: spares have nothing to wait for (spares.py). Stopped at once, not counted.
        left = spares_left(ctx, current, still_running)
        for p in left:
            ctx.delete(p)
        still_running = [p for p in still_running if p not in left]
    for p in current:
        if (p.phase == "Pending" or p.restarting) and not p.deleting:
            ctx.delete(p)  # never started, or restarting in place: it cannot join a finished training
    finished = [p.finished_at for p in current if p.succeeded and p.finished_at]
    if still_running and finished:
        # torchrun exits 0 only after every worker finished, so a peer still running well after that is
        # an agent retrying a rendezvous nobody will join (e.g. its worker crashed in teardown): stop it
        # instead of waiting out its join timeout.
        give_up = min(finished) + timedelta(seconds=names.SUCCESS_GRACE_SECONDS)
        if ctx.now >= give_up:
            for p in still_running:
                ctx.delete(p)
            still_running = []
        else:
            ctx.due_in(give_up)
    if still_running:
        ctx.phase, ctx.reason = names.PHASE_RUNNING, names.REASON_SUCCEEDED
        ctx.message = (f"a trainer exited 0; waiting for {len(still_running)} still running "
                       f"({', '.join(p.name for p in still_running)})")
        return True
    done = next(p for p in current if p.succeeded)
    ctx.extra_events.extend(invalid_report_event(p.name, p.report_invalid, "termination message")
                            for p in current if p.report_invalid)
    ctx.finish(names.PHASE_SUCCEEDED, names.REASON_SUCCEEDED, f"training completed ({done.name} exited 0)")
    return True
