"""Hang detection (spec.failurePolicy.hangTimeoutSeconds): when is a job hung, and which pod is stuck. Pure.

A DDP job hangs when one worker stops making progress inside (or before) a collective: every other rank
waits in its all-reduce, nothing fails, and torch's default collective timeout is 30 minutes. The operator
sees it in the progress channel: the training's step stops changing. The shell (poller.py) asks every trainer
pod at once every `poll_interval` (each pod's local rank 0 answers for itself, docs/contract.md; each probe has
its own deadline), keeps a `Watch` of rank 0's last (step, workerRestarts), the newest (workerRestarts, step) any
pod reported and since when, and once `due` hands the pods' answers to the planner (keyed by pod UID: a
replacement under the same name is another pod), which deletes the pods `stuck_pods` names. Deleting one pod
breaks the blocked collective; the others restore from peer snapshots.

The clock only runs once the trainer has reported after the last (re)start (the set of running trainer pods,
the *incarnation*, changed): a pod that is still starting, or a script that reports nothing, is never hung.
It is reset by a change of rank 0's report and by a newer step (or worker restart) reported by ANY pod: rank 0
the operator cannot reach while its peers train on is not hung. A probe that fails, a step already seen or an
older one (a pod that flaps between answering and not) does not move it.
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
    """What rank 0 last reported in this incarnation (`key`: its step and workerRestarts), the newest progress
    any pod reported (`newest`: (workerRestarts, step)), and since when either last moved (monotonic seconds)."""

    incarnation: tuple[str, ...]
    key: tuple[Any, Any]
    since: float
    newest: tuple[int, float] | None = None


def incarnation(pods: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The (re)start the job is in: the UIDs of its running trainer pods (any replacement changes it)."""
    return tuple(sorted(p["metadata"]["uid"] for p in pods))


def _progress(report: Mapping[str, Any] | None) -> tuple[int, float] | None:
    """How far a pod's report says training got: (workerRestarts, step); None without a valid step."""
    step = _step(report)
    if step is None:
        return None
    restarts = (report or {}).get("workerRestarts")
    ok = isinstance(restarts, int) and not isinstance(restarts, bool) and 0 <= restarts < 2 ** 31
    return (restarts if ok else 0, step)


def watch(prev: Watch | None, current: tuple[str, ...], report: Mapping[str, Any] | None, now: float,
          others: Iterable[Mapping[str, Any] | None] = ()) -> Watch | None:
    """The watch after a probe: `report` is rank 0's (None: it did not answer), `others` the other pods'.

    The clock restarts when rank 0's (step, workerRestarts) changed, or when any pod reports progress newer than
    any seen in this incarnation (a later step, or a later worker restart); nothing answering changes nothing."""
    if prev is not None and prev.incarnation != current:
        prev = None  # (re)started: the clock waits for the first report
    seen = [m for m in map(_progress, (report, *others)) if m is not None]
    top = max(seen, default=None)
    if report is None and top is None:
        return prev
    key = (report.get("step"), report.get("workerRestarts")) if report is not None else \
        (prev.key if prev is not None else (None, None))
    if prev is None or prev.key != key:
        return Watch(current, key, now, top if prev is None or top is not None else prev.newest)
    if top is not None and prev.newest is None:
        return Watch(current, key, prev.since, top)  # the first progress known besides rank 0's key: a baseline
    if top is not None and top > prev.newest:  # type: ignore[operator]
        return Watch(current, key, now, top)
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
    """Which of the (pod id, index, report or None) trainer pods to delete for a hang (their ids).

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
