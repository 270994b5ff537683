"""Goodput: the share of a job's wall time in which it made new progress, and where the rest went (status.goodput).

The definition (docs/recovery.md, "Goodput"), once for every reader (the status, `kubectl get`, the metrics):

    wall        = from the job's creation to now, or to its completion
    queued      = time Suspended (spec.runPolicy.suspend, or held or evicted by Kueue)
    starting    = from the creation to the first step the trainer reported, less the time queued before it
    recovering  = for each recovery, from the fault to the first step after the resume (status.lastRecovery.seconds;
                  the operator's estimate when the trainer could not measure it: status.last_recovery)
    redone      = for each recovery, the steps lost x the step time (the steps done again; the step time from two
                  consecutive progress reports of one run, never two around a recovery)
    productive  = wall - queued - starting - recovering - redone (never below 0)
    ratio       = productive / wall

Level-based: the accumulators live in status.goodput itself (`counted` names the last recovery taken in, so the
same record is never counted twice, and the closed suspended periods are added in the pass that ends them), so an
operator restart derives the same figures again. `derive` is pure and is called by the pass (on a recovery, a phase
change, the first step, the end) and by the progress poller (on every progress write, which refreshes the ratio at
no extra API request); with nothing new it returns the previous value unchanged, so a healthy job's status is not
rewritten for it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

from ddp_operator import names
from ddp_operator.observed import format_time, parse_time
from ddp_operator.report import MAX_UNIX_TIME, real

CAUSES = ("starting", "queued", "recovering", "redone")
MAX_FAULTS = 16
_MAX_SECONDS = 10 * 366 * 86400.0


_num = real  # a finite number, else None (report.real: bools, NaN, ints no float holds)


def _secs(value: Any) -> float:
    v = _num(value)
    return min(max(v, 0.0), _MAX_SECONDS) if v is not None else 0.0


def _unix(value: float) -> datetime:
    return datetime.fromtimestamp(value, tz=timezone.utc)


def recovery_key(recovery: Mapping[str, Any] | None) -> str | None:
    """What identifies one recovery record: its start and its fault (None for no complete record)."""
    if not isinstance(recovery, Mapping) or not recovery.get("startedAt"):
        return None
    if _num(recovery.get("seconds")) is None and _num(recovery.get("at")) is None:
        return None  # not finished: the first resumed step is still to come
    return f"{recovery.get('startedAt')}/{recovery.get('fault') or names.FAULT_UNKNOWN}"


def _recovery_seconds(recovery: Mapping[str, Any]) -> float:
    seconds = _num(recovery.get("seconds"))
    if seconds is not None:
        return _secs(seconds)
    started, at = parse_time(recovery.get("startedAt")), _num(recovery.get("at"))
    if started is None or at is None:
        return 0.0
    return _secs(at - started.timestamp())


def derive(prev: Mapping[str, Any] | None, *, created: datetime | None, now: datetime, phase: str,
           prev_phase: str | None = None, suspended_since: datetime | None = None,
           completed: datetime | None = None, progress: Mapping[str, Any] | None = None,
           prev_progress: Mapping[str, Any] | None = None, recovery: Mapping[str, Any] | None = None,
           refresh: bool = False) -> dict | None:
    """status.goodput after this pass or progress write (None before the job has a creation time)."""
    g: dict[str, Any] = {k: v for k, v in (prev or {}).items()} if isinstance(prev, Mapping) else {}
    since = parse_time(g.get("since")) or created
    if since is None:
        return dict(prev) if isinstance(prev, Mapping) else None
    changed = refresh or not g
    g["since"] = format_time(since)
    # The step time, from two consecutive reports of the same run (what a lost step costs to do again).
    p, q = progress or {}, prev_progress or {}
    # Times within what a datetime holds: status is only as trustworthy as whoever may write it.
    t1, t0 = real(p.get("time"), 0.0, MAX_UNIX_TIME), real(q.get("time"), 0.0, MAX_UNIX_TIME)
    s1, s0 = _num(p.get("step")), _num(q.get("step"))
    # Two reports around a recovery are of two runs: the time between them is the recovery's, not the steps'.
    fault = parse_time(recovery.get("startedAt")) if isinstance(recovery, Mapping) else None
    across = fault is not None and None not in (t0, t1) and t0 < fault.timestamp() < t1
    if None not in (t1, s1, t0, s0) and s1 > s0 and t1 > t0 and not across:
        g["stepSeconds"] = round((t1 - t0) / (s1 - s0), 6)
    if not g.get("firstStepAt") and s1 is not None and s1 >= 1 and t1 is not None:
        g["firstStepAt"] = format_time(_unix(t1))
        g["queuedAtFirstStep"] = _secs(g.get("queuedClosed"))
        changed = True
    # A suspended period ends in this pass: added once (the next pass's prev_phase is no longer Suspended).
    if prev_phase == names.PHASE_SUSPENDED and phase != names.PHASE_SUSPENDED and suspended_since is not None:
        period = _secs((now - suspended_since).total_seconds())
        g["queuedClosed"] = round(_secs(g.get("queuedClosed")) + period, 3)
        g["lastQueued"] = {"end": format_time(now), "seconds": round(period, 3)}
        changed = True
    key = recovery_key(recovery)
    if key is not None and key != g.get("counted"):
        changed = True
        g["counted"] = key
        seconds = _recovery_seconds(recovery)
        last_queued = g.get("lastQueued") if isinstance(g.get("lastQueued"), Mapping) else {}
        started, ended = parse_time(recovery.get("startedAt")), parse_time(last_queued.get("end"))
        if started is not None and ended is not None and ended >= started:
            # Preempted, queued, readmitted: the queued part of this recovery is already seconds.queued.
            seconds = max(0.0, seconds - _secs(last_queued.get("seconds")))
        lost = recovery.get("stepsLost")
        lost = lost if isinstance(lost, int) and not isinstance(lost, bool) and lost > 0 else 0
        redone = lost * _secs(g.get("stepSeconds"))
        g["recoveringTotal"] = round(_secs(g.get("recoveringTotal")) + seconds, 3)
        g["redoneTotal"] = round(_secs(g.get("redoneTotal")) + redone, 3)
        g["recoveries"] = int(_secs(g.get("recoveries"))) + 1
        g["stepsLost"] = int(_secs(g.get("stepsLost"))) + lost
        by_fault = dict(g.get("byFault") or {}) if isinstance(g.get("byFault"), Mapping) else {}
        fault = str(recovery.get("fault") or names.FAULT_UNKNOWN)[:63]
        if fault in by_fault or len(by_fault) < MAX_FAULTS:
            f = by_fault.get(fault) if isinstance(by_fault.get(fault), Mapping) else {}
            by_fault[fault] = {"recoveries": int(_secs(f.get("recoveries"))) + 1,
                               "seconds": round(_secs(f.get("seconds")) + seconds + redone, 3),
                               "stepsLost": int(_secs(f.get("stepsLost"))) + lost}
        g["byFault"] = by_fault
    if completed is not None and g.get("asOf") != format_time(completed):
        changed = True
    if not changed and prev_phase == phase:
        return dict(prev) if isinstance(prev, Mapping) else g
    end = completed or now
    queued = _secs(g.get("queuedClosed"))
    if phase == names.PHASE_SUSPENDED and suspended_since is not None and completed is None:
        queued += _secs((end - suspended_since).total_seconds())  # the open period, counted when it closes
    first = parse_time(g.get("firstStepAt"))
    wall = _secs((end - since).total_seconds())
    starting = (_secs((min(first, end) - since).total_seconds()) - _secs(g.get("queuedAtFirstStep"))
                if first is not None else wall - queued)
    seconds = {"starting": max(starting, 0.0), "queued": queued, "recovering": _secs(g.get("recoveringTotal")),
               "redone": _secs(g.get("redoneTotal"))}
    productive = max(0.0, wall - sum(seconds.values()))
    g["seconds"] = {"productive": round(productive, 1), **{k: round(v, 1) for k, v in seconds.items()}}
    g["wallSeconds"] = round(wall, 1)
    g["ratio"] = round(productive / wall, 4) if wall > 0 else 0.0
    g["asOf"] = format_time(end)
    g["recoveries"] = int(_secs(g.get("recoveries")))
    g["stepsLost"] = int(_secs(g.get("stepsLost")))
    return g
