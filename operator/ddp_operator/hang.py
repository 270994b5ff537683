"""Hang detection (spec.failurePolicy.hangTimeoutSeconds): when is a job hung, and which pod is stuck. Pure.

A DDP job hangs when one worker stops making progress inside (or before) a collective: every other rank
waits in its all-reduce, nothing fails, and torch's default collective timeout is 30 minutes. The operator
sees it in the progress channel: global rank 0's step stops changing. The shell (poller.py) probes rank 0
every `poll_interval`, keeps a `Watch` of the last (step, workerRestarts) it saw and since when, and once
`due` asks every trainer pod (each pod's local rank 0 answers for itself, docs/contract.md) and hands the
answers to the planner, which deletes the pods `stuck_pods` names. Deleting one pod breaks the blocked
collective; the others restore from peer snapshots.

The clock only runs once the trainer has reported after the last (re)start (the set of running trainer pods,
the *incarnation*, changed): a pod that is still starting, or a script that reports nothing, is never hung.
A rank-0 probe that fails does not move the clock ("not advanced").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# Rank 0 is probed at least this often while hang detection is on (and never more often than every
# MIN_POLL_SECONDS), so a hang is acted on within hangTimeoutSeconds + MAX_POLL_SECONDS + two probe deadlines.
MAX_POLL_SECONDS = 5.0
MIN_POLL_SECONDS = 1.0


def poll_interval(period: float | None, hang_timeout: float | None) -> float | None:
    """Seconds between probes of rank 0: spec.progressPeriodSeconds, shorter when hang detection needs it
    (a tenth of the timeout, within 1..5 s). None: no polling (progressPeriodSeconds 0 turns both off)."""
    if not period:
        return None
    if not hang_timeout:
        return float(period)
    return min(float(period), max(MIN_POLL_SECONDS, min(MAX_POLL_SECONDS, hang_timeout / 10.0)))


@dataclass(frozen=True)
class Watch:
    """What rank 0 last reported in this incarnation, and since when (monotonic seconds)."""

    incarnation: tuple[str, ...]
    key: tuple[Any, Any]
    since: float


def incarnation(pods: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The (re)start the job is in: the UIDs of its running trainer pods (any replacement changes it)."""
    return tuple(sorted(p["metadata"]["uid"] for p in pods))


def watch(prev: Watch | None, current: tuple[str, ...], report: Mapping[str, Any] | None, now: float) -> Watch | None:
    """The watch after a probe of rank 0 (`report` None: it did not answer, which changes nothing)."""
    if prev is not None and prev.incarnation != current:
        prev = None  # (re)started: the clock waits for the first report
    if report is None:
        return prev
    key = (report.get("step"), report.get("workerRestarts"))
    if prev is None or prev.key != key:
        return Watch(current, key, now)
    return prev


def due_in(w: Watch | None, current: tuple[str, ...], timeout: float | None, now: float) -> float | None:
    """Seconds until the job counts as hung (<= 0: now); None when it cannot be (off, no report yet)."""
    if not timeout or w is None or w.incarnation != current:
        return None
    return w.since + timeout - now


def _step(report: Mapping[str, Any] | None) -> float | None:
    value = (report or {}).get("step")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def stuck_pods(pods: Iterable[tuple[str, int, Mapping[str, Any] | None]]) -> list[str]:
    """Which of the (name, index, report or None) trainer pods to delete for a hang.

    The pods whose progress endpoint did not answer; else those reporting the lowest step; a tie (every pod at
    the same step: all blocked in the same collective) takes the highest index alone. Non-answering pods only
    count when some pod answered with a `rank` (every pod serves its own report): a trainer from before that
    serves on global rank 0 alone, and the others' silence says nothing, so it is handled as a tie.
    """
    pods = sorted(pods, key=lambda p: p[1])
    if not pods:
        return []
    per_pod = any(isinstance(r, Mapping) and "rank" in r for _, _, r in pods)
    if not per_pod:
        return [pods[-1][0]]
    silent = [name for name, _, r in pods if _step(r) is None]
    if silent:
        return silent
    lowest = min(_step(r) for _, _, r in pods)  # type: ignore[type-var]
    at_lowest = [name for name, _, r in pods if _step(r) == lowest]
    return at_lowest if len(at_lowest) < len(pods) else [pods[-1][0]]
