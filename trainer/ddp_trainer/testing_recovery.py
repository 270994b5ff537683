"""What a recovery of a ``LocalCluster`` job cost, measured from its logs: :func:`steps_lost` (the one definition
every benchmark and test uses) and :func:`recovery_after_kill` (times and steps lost after a kill).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .testing_cluster import Event, LocalCluster


class StepsLostError(AssertionError):
    """A recovery restored a step that no rank had completed: never clamped away, always a bug."""


def steps_lost(completed: Iterable[tuple[float, int]], restored_step: int, restored_at: float, *,
               since: float = float("-inf"), held: Iterable[int] = ()) -> int | None:
    """Steps lost by one recovery: the one definition every benchmark and test uses.

    ``completed`` are (log time, step) of the ``event=step`` lines the trainer writes once per completed
    optimizer step (rank 0, and the first local rank of every other node, so a line survives in some
    pod's log or agent output whichever node was killed); ``restored_step``/``restored_at`` come from
    the resumed run's ``event=resume`` line (0 for ``event=start``, a fresh start). The result is the
    highest step any rank completed in ``[since, restored_at)`` -- before the group re-formed, so a step
    a survivor finished just after the kill counts as lost work -- minus the restored step. The step
    line is written before the step's snapshot or checkpoint, so a restore can never be ahead of the
    lines: a negative value is a bug and raises :class:`StepsLostError` instead of being clamped.
    ``held`` are the steps the ranks held themselves when the group restored (``event=rank_restored``'s
    ``held``, :func:`held_steps`): each was completed before the restore by the rank that held it, and
    a local rank other than 0 writes no step line, so the step it completed alone (its peers failed in
    that step's later collectives) is known only from there. ``None`` when no step line was logged in
    the window and nothing was held (nothing to measure from).
    """
    before = [step for t, step in completed if since <= t < restored_at]
    before += [step for step in held if step >= 0]
    if not before:
        return None
    lost = max(before) - restored_step
    if lost < 0:
        raise StepsLostError(
            f"restored step {restored_step} is ahead of the highest completed step {max(before)}: a bug"
        )
    return lost


def held_steps(events: Iterable[Any], after: float, until: float) -> list[int]:
    """The steps the ranks held when they restored (``held`` of the ``event=rank_restored`` lines logged in
    ``[after, until]``: from the kill to the first step after the restore, which no rank completes before every
    rank logged its line), for :func:`steps_lost`. Lines without a whole ``held`` are skipped."""
    out = []
    for e in events:
        fields = e.fields
        if fields.get("event") == "rank_restored" and after <= e.time <= until:
            try:
                out.append(int(fields["held"]))
            except (KeyError, ValueError):
                continue
    return out


def restore_after(cluster: LocalCluster, after: float, *, timeout: float) -> Event:
    """The first ``resume`` (or ``start``: a fresh start) event logged at or after ``after``."""
    return cluster.wait_for(
        lambda e: e.time >= after and e.name in ("resume", "start"), timeout=timeout, what="resume after the kill"
    )


def recovery_after_kill(
    cluster: LocalCluster, killed_at: float, *, timeout: float = 180, since: float = float("-inf")
) -> dict[str, Any]:
    """Wait for the first step after a kill that follows a resume (or a fresh start); measure time and
    :func:`steps_lost` (``since``: the previous recovery's resume, when one job is killed several times).
    """
    resume = restore_after(cluster, killed_at, timeout=timeout)
    restored = resume.int("step") if resume.name == "resume" else 0
    first = cluster.wait_for(
        lambda e: e.time >= resume.time and e.int("step") > restored,
        timeout=timeout,
        what="first resumed step",
        name="step",
    )
    evs = cluster.events()  # every node's log read once for the steps, the restores' held steps and the sessions
    steps = [e for e in evs if e.name == "step"]
    lost = steps_lost(((e.time, e.int("step")) for e in steps), restored, resume.time, since=since,
                      held=held_steps(evs, killed_at, first.time))
    sessions = [e for e in evs if e.name == "session" and killed_at <= e.time <= resume.time]
    joined = sessions[-1].time if sessions else resume.time
    return {
        "recovery_s": round(first.time - killed_at, 3),
        # where the time went: agents noticing + rendezvous + worker start-up to a joined process group,
        # then the worker's own set-up (data, model, DDP) and restore, then the first step
        "until_process_group_s": round(joined - killed_at, 3),
        "until_restored_s": round(resume.time - joined, 3),
        "first_step_s": round(first.time - resume.time, 3),
        "resumed_from": restored,
        "source": resume.get("source", "fresh"),
        "last_step_before_kill": max((e.int("step") for e in steps if since <= e.time <= killed_at), default=None),
        "steps_lost": lost,
        # the snapshot interval K in force when the restored snapshot was written: steps lost <= K
        "snapshot_every": int(resume["snapshot_every"]) if resume.get("snapshot_every") else None,
        "restored_at": resume.time,
    }
