"""Status bookkeeping: conditions (lastTransitionTime kept while unchanged), Events on condition changes,
pod counts, the bounded attempts history, the set of recorded pod UIDs and the progress summary. Pure functions
of their arguments.

Progress reports come from the job's own pods, so nothing in them is trusted: only their valid fields are used
(report.valid_report), and a report never replaces a newer one already shown (see `newer_progress`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping, Sequence

from ddp_operator import names
from ddp_operator.observed import PodState, format_time, parse_time
from ddp_operator.report import MAX_COUNT, MAX_UNIX_TIME
from ddp_operator.report import real, shown, valid_members, valid_report  # noqa: F401 (valid_members: spares.py)

WARNING_CONDITIONS = {names.COND_FAILED, names.COND_RESTARTING, names.COND_REPLICA_FAILURE,
                      names.COND_PODS_NOT_STARTING, names.COND_STALLED}


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def get_condition(conditions: Iterable[Mapping], type_: str) -> Mapping | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def set_condition(conditions: list[dict], type_: str, status: bool, reason: str, message: str, now: str,
                  generation: int) -> list[dict]:
    """A new list with condition `type_` set; lastTransitionTime only moves when the status flips."""
    value = "True" if status else "False"
    old = get_condition(conditions, type_)
    new = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == value else now,
        "observedGeneration": generation,
    }
    out = [c for c in conditions if c.get("type") != type_]
    out.append(new)
    return sorted(out, key=lambda c: names.CONDITION_TYPES.index(c["type"])
                  if c["type"] in names.CONDITION_TYPES else len(names.CONDITION_TYPES))


def condition_events(old: Iterable[Mapping], new: Iterable[Mapping]) -> list[Event]:
    """One Event per condition that appeared or whose status or reason changed."""
    events = []
    for cond in new:
        before = get_condition(old, cond["type"])
        if before and before.get("status") == cond["status"] and before.get("reason") == cond.get("reason"):
            continue
        if not before and cond["status"] != "True":
            continue
        warning = cond["type"] in WARNING_CONDITIONS and cond["status"] == "True"
        events.append(Event("Warning" if warning else "Normal", cond.get("reason", cond["type"]),
                            cond.get("message", "")))
    return events


def pod_counts(trainers: Iterable[PodState], desired: int) -> dict[str, int]:
    trainers = list(trainers)
    return {
        "desired": desired,
        "active": sum(1 for p in trainers if p.active),
        "running": sum(1 for p in trainers if p.running),
        "ready": sum(1 for p in trainers if p.ready and not p.deleting),
        "succeeded": sum(1 for p in trainers if p.succeeded and not p.gone),
        "failed": sum(1 for p in trainers if p.terminal and not p.succeeded and not p.gone),
    }


def attempt(pod: PodState, *, counted: bool, now: str, reason: str | None = None,
            restart: int | None = None) -> dict:
    """The attempts entry of an ended pod, or with `restart` of an in-place restart of its trainer container
    (the container's restartCount after it; the pod kept running)."""
    if restart is None:
        exit_code, why, message = pod.exit_code, reason or pod.disruption or pod.reason or pod.phase, pod.message
    else:
        exit_code, why, message = pod.restart_exit_code, reason or pod.restart_reason or "Error", pod.restart_message
    record: dict[str, Any] = {
        "pod": pod.name,
        "uid": pod.uid,
        "index": pod.index,
        "node": pod.node,
        "exitCode": exit_code,
        "reason": why,
        "message": message[-200:],
        "counted": counted,
        "disruption": pod.disruption is not None and restart is None,
        "restartCount": restart,
        "time": now,
    }
    return {k: v for k, v in record.items() if v is not None and v != ""}


def last_failure(entry: Mapping[str, Any], failure: Any, budget: str) -> dict:
    """status.lastFailure from an attempts entry and its classification (failure_class.Failure)."""
    record = {"class": failure.cls, "reason": failure.reason, "pod": entry.get("pod"), "node": entry.get("node"),
              "rank": failure.rank, "exitCode": entry.get("exitCode"), "message": failure.message or None,
              "time": entry.get("time"), "budget": budget}
    return {k: v for k, v in record.items() if v is not None and v != ""}


def missing_attempt(name: str, index: int, *, counted: bool, now: str) -> dict:
    """The attempts entry of a training pod that vanished unseen (no UID, no exit code known)."""
    return {"pod": name, "index": index, "reason": names.REASON_NODE_MISSING,
            "message": "the pod no longer existed and its end was not seen (e.g. deleted while the operator was "
                       "down)", "counted": counted, "disruption": False, "time": now}


def append_attempt(attempts: list[dict], record: dict) -> list[dict]:
    return (list(attempts) + [record])[-names.ATTEMPTS_HISTORY:]


def restart_key(uid: str, restart: int) -> str:
    """status.recordedPods key of an in-place restart: `<pod uid>/<restartCount after it>`."""
    return f"{uid}/{restart}"


def restart_number(key: str, uid: str) -> int:
    """The restart count a recordedPods key holds for pod `uid` (0 if it is another pod's, or a pod's end)."""
    owner, _, count = key.partition("/")
    return int(count) if owner == uid and count.isdigit() else 0


def record_pod(recorded: Iterable[str], key: str, existing: Iterable[str]) -> list[str]:
    """status.recordedPods after recording `key` (a pod UID: its end; `<uid>/<n>`: its trainer container's n-th
    in-place restart, which stands for every earlier one too, so only the newest is kept per pod): every pod end
    or restart already counted (or not) stays known for as long as the pod exists, however many end at once (the
    attempts history keeps only the last few). Keys of pods that no longer exist are dropped then: a deleted pod
    never comes back, so it can never be counted again."""
    existing = set(existing)
    uid, _, restart = key.partition("/")

    def keep(u: str) -> bool:
        owner, _, n = u.partition("/")
        return owner in existing and u != key and not (restart and n and owner == uid)
    return ([u for u in recorded if keep(u)] + [key])[-names.MAX_RECORDED_PODS:]


def _number(value: Any) -> bool:
    return real(value) is not None


def listed(items: Sequence[str], shown: int) -> str:
    """'a, b, c', or the first `shown` of `items` and how many more: a message stays short however many there are."""
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def invalid_report_event(pod: str, fields: Iterable[str], source: str) -> Event:
    """The Warning Event for a report with invalid fields (they were dropped, the rest used)."""
    fields = list(fields)
    return Event("Warning", names.REASON_INVALID_REPORT,
                 f"pod {pod}: the trainer's {source} has invalid field(s) {listed(fields, 10)}: ignored "
                 "(docs/contract.md says what each may hold)")


def newer_progress(stored: Mapping[str, Any] | None, report: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The progress to show: `report`, unless `stored` is from a later step.

    progress.step shows the newest step trained. After a failure the job resumes from its last checkpoint, so
    its rank 0 reports steps it already went through; showing those would make the column jump back during
    every recovery. The report is taken again once it reaches the stored step.
    """
    if not report:
        return stored
    if not stored:
        return report
    old, new = stored.get("step"), report.get("step")
    if _number(old) and (not _number(new) or new < old):
        return stored
    return report


def progress_summary(report: Mapping[str, Any]) -> str:
    """The one-line form of a report (valid_report's: every field checked)."""
    parts = []
    if "step" in report:
        parts.append(f"step {report['step']}")
    if "epoch" in report:
        parts.append(f"epoch {report['epoch']}")
    if "loss" in report:
        parts.append(f"loss {report['loss']:.4g}")
    for key, value in list((report.get("metrics") or {}).items())[:2]:
        if _number(value):
            parts.append(f"{shown(key)} {value:.4g}")
    if report.get("final"):
        parts.append("final")
    return " ".join(parts)


_PROGRESS_KEYS = ("step", "epoch", "loss", "samplesPerSecond", "lastCheckpointStep", "worldSize", "metrics",
                  "time", "final", "workerRestarts", "snapshotEvery", "lastSnapshotStep", "snapshotResident",
                  "members", "totalSteps")


def progress_status(report: Mapping[str, Any]) -> dict:
    """The subset of a progress report the status schema keeps (its valid fields), plus its one-line summary."""
    clean = valid_report({k: v for k, v in report.items() if k != "rank"})[0] or {}
    out: dict[str, Any] = {k: clean[k] for k in _PROGRESS_KEYS if k in clean}
    for key in ("loss", "samplesPerSecond", "time"):
        if key in out:
            out[key] = float(out[key])
    out["summary"] = progress_summary(clean)
    return out


# --- status.lastRecovery -----------------------------------------------------------------------------------------
# Clocks of the operator and the pods differ a little: an incident this close outside the recovery still matches.
RECOVERY_MATCH_SLACK_SECONDS = 5.0
_MAX_POD_NAME = 253


def incident_record(prev: Mapping[str, Any] | None, reason: str, now: datetime, window_seconds: float) -> dict:
    """status.lastIncident after an incident with `reason` at `now`: a new one, unless the previous one is within
    the incident window (the survivors failing after the first pod are the same incident: the first reason stays).
    """
    if prev:
        t = parse_time(prev.get("time"))
        if t is not None and prev.get("reason") and now - t < timedelta(seconds=window_seconds):
            return dict(prev)
    return {"reason": reason, "time": format_time(now)}


def _unix(value: float) -> str:
    return format_time(datetime.fromtimestamp(value, tz=timezone.utc))


def last_recovery(prev: Mapping[str, Any] | None, incident: Mapping[str, Any] | None,
                  report: Mapping[str, Any] | None, progress: Mapping[str, Any] | None = None
                  ) -> Mapping[str, Any] | None:
    """status.lastRecovery from global rank 0's report and the operator's last incident; `prev` when the report
    carries no complete `recovery` (plain scripts, an older trainer, a resume whose first step is not done yet).

    The incident is this recovery's fault when the operator recorded it between the trainer's last step before
    the fault and its first step after the resume (give or take RECOVERY_MATCH_SLACK_SECONDS of clock skew);
    otherwise the fault is WorkerRestart when rank 0's torchrun restarted its workers, else Unknown. Level-based:
    the same status and report always give the same value.

    A figure the trainer could not measure (no high-water mark survived: every pod lost, no checkpoint volume) is
    estimated by the operator when it recorded the incident (`_estimates`; listed in `estimated`): `progress` is
    status.progress as it stood before this write (the poller's and the pass's `prev`).
    """
    checked = valid_report({k: v for k, v in report.items() if k != "rank"})[0] if isinstance(report, Mapping) \
        else None
    rec = (checked or {}).get("recovery")
    if not isinstance(rec, Mapping):
        return prev
    at, seconds = rec.get("at"), rec.get("seconds")
    resumed = rec.get("resumedFrom")
    if not _number(at) or resumed not in names.RESUMED_FROM:
        return prev
    seconds = float(seconds) if _number(seconds) and 0 <= seconds <= at else None
    last_step = at - seconds if seconds is not None else None
    fault, started, incident_at = None, None, None
    t = parse_time((incident or {}).get("time"))
    if t is not None and (incident or {}).get("reason"):
        ts = t.timestamp()
        if ts <= at + RECOVERY_MATCH_SLACK_SECONDS and (last_step is None or
                                                         ts >= last_step - RECOVERY_MATCH_SLACK_SECONDS):
            fault, started, incident_at = str(incident["reason"]), format_time(t), ts  # type: ignore[index]
    if fault is None:
        restarts = (checked or {}).get("workerRestarts")
        fault = names.FAULT_WORKER_RESTART if _number(restarts) and restarts > 0 else names.FAULT_UNKNOWN
        started = _unix(last_step) if last_step is not None else None
    lost = rec.get("stepsLost")
    lost = int(lost) if _number(lost) else None
    estimated: list[str] = []
    if incident_at is not None and (seconds is None or lost is None):
        if (isinstance(prev, Mapping) and prev.get("estimated") and prev.get("startedAt") == started
                and prev.get("fault") == fault and prev.get("resumedFrom") == resumed):
            return prev  # the same recovery, estimated when it was first seen: progress has moved on since
        step = rec.get("step", 0 if resumed == "start" else None)  # from step 0
        seconds, lost, estimated = _estimates(prev, progress, incident_at, at, step, seconds, lost)
    pod = rec.get("restoredFromPod")
    out: dict[str, Any] = {
        "fault": fault,
        "startedAt": started,
        "seconds": round(seconds, 3) if seconds is not None else None,
        "stepsLost": lost,
        "resumedFrom": resumed,
        "restoredFromPod": pod[:_MAX_POD_NAME] if isinstance(pod, str) and pod else None,
        "estimated": estimated or None,
    }
    return {k: v for k, v in out.items() if v is not None}  # unknown figures are left out (merge patch: null deletes)


def _estimates(prev: Mapping[str, Any] | None, progress: Mapping[str, Any] | None, incident_at: float, at: float,
               step: Any, seconds: float | None, lost: int | None) -> tuple[float | None, int | None, list[str]]:
    """(seconds, stepsLost, the names of those the operator estimated) for a recovery the trainer could not measure,
    from what the operator saw itself (docs/recovery.md, "status.lastRecovery").

    seconds: from the incident (when the operator recorded the fault) to the first resumed step (`at`). stepsLost:
    the last step status.progress showed before the fault minus the step the run resumed at (0 from the start), a
    lower bound (the steps done after the operator last looked, at most one progressPeriodSeconds' worth, are not in
    it). Together they fall short of the cost by about the time from that progress to the incident.
    status.progress is from before the fault when its trainer time is before `at` (it never goes back: a run that
    started over is shown again only once it passes that step) and after the previous recovery `prev` ended; else,
    like an incident from before `prev` ended, it is no estimate.
    """
    estimated = []
    after = _recovery_end(prev)
    if after is not None and incident_at <= after:
        return seconds, lost, estimated  # that incident was the previous recovery's
    if seconds is None:
        seconds = max(0.0, at - incident_at)
        estimated.append("seconds")
    p = progress if isinstance(progress, Mapping) else {}
    seen, seen_at = p.get("step"), real(p.get("time"), 0.0, MAX_UNIX_TIME)
    if (lost is None and isinstance(seen, int) and not isinstance(seen, bool) and 0 <= seen <= MAX_COUNT
            and isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= seen
            and seen_at is not None and seen_at < at and (after is None or seen_at > after)):
        lost = seen - step
        estimated.append("stepsLost")
    return seconds, lost, estimated


def _recovery_end(record: Mapping[str, Any] | None) -> float | None:
    """When a recorded recovery ended (startedAt + seconds, Unix time), None when its start is not known."""
    if not isinstance(record, Mapping) or (started := parse_time(record.get("startedAt"))) is None:
        return None
    return started.timestamp() + (real(record.get("seconds"), 0.0, MAX_UNIX_TIME) or 0.0)
