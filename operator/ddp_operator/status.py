"""Status bookkeeping: conditions (lastTransitionTime kept while unchanged), Events on condition changes,
pod counts, the bounded attempts history and the progress summary. Pure functions of their arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ddp_operator import names
from ddp_operator.observed import PodState

WARNING_CONDITIONS = {names.COND_FAILED, names.COND_RESTARTING}


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


def attempt(pod: PodState, *, counted: bool, now: str, reason: str | None = None) -> dict:
    record: dict[str, Any] = {
        "pod": pod.name,
        "uid": pod.uid,
        "index": pod.index,
        "node": pod.node,
        "exitCode": pod.exit_code,
        "reason": reason or pod.disruption or pod.reason or pod.phase,
        "message": pod.message[-200:],
        "counted": counted,
        "disruption": pod.disruption is not None,
        "time": now,
    }
    return {k: v for k, v in record.items() if v is not None and v != ""}


def append_attempt(attempts: list[dict], record: dict) -> list[dict]:
    return (list(attempts) + [record])[-names.ATTEMPTS_HISTORY:]


def progress_summary(report: Mapping[str, Any]) -> str:
    parts = []
    if report.get("step") is not None:
        parts.append(f"step {report['step']}")
    if report.get("epoch") is not None:
        parts.append(f"epoch {report['epoch']}")
    if isinstance(report.get("loss"), (int, float)):
        parts.append(f"loss {report['loss']:.4g}")
    metrics = report.get("metrics") or {}
    for key, value in list(metrics.items())[:2]:
        if isinstance(value, (int, float)):
            parts.append(f"{key} {value:.4g}")
    if report.get("final"):
        parts.append("final")
    return " ".join(parts)


_PROGRESS_KEYS = ("step", "epoch", "loss", "samplesPerSecond", "lastCheckpointStep", "worldSize", "metrics",
                  "time", "final")


def progress_status(report: Mapping[str, Any]) -> dict:
    """The subset of a progress report the status schema keeps, plus its one-line summary."""
    out: dict[str, Any] = {}
    for key in _PROGRESS_KEYS:
        value = report.get(key)
        if key in ("step", "epoch", "worldSize", "lastCheckpointStep") and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            out[key] = int(value)
        elif key in ("loss", "samplesPerSecond", "time") and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            out[key] = float(value)
        elif key == "metrics" and isinstance(value, dict):
            out[key] = value
        elif key == "final" and isinstance(value, bool):
            out[key] = value
    out["summary"] = progress_summary(report)
    return out
