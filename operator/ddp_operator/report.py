"""A trainer's report (the progress endpoint's JSON, the termination message; docs/contract.md): what each field
the operator reads may hold. Pure.

Reports come from the job's own pods, so nothing in them is trusted: `valid_report` checks every field's type and
range (NaN, Infinity, 1e300 and integers beyond int64 are what the API server or datetime refuse) and drops the
invalid ones, keeping the rest; the edges that read a report (observed.py for the termination message, poller.py
for the progress endpoint) report those with an InvalidReport Event. It never raises.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ddp_operator import names


def valid_members(value: Any) -> tuple[int, ...] | None:
    """A report's `members` (pod indices of the training world) if well formed: a short list of indices."""
    if (not isinstance(value, list) or len(value) > names.MAX_NODES + names.MAX_SPARES
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < names.MAX_NODES for i in value)):
        return None
    return tuple(sorted(set(value)))


# Bounds of what a report may say. Integers beyond 2**53 are not exact in JSON readers and beyond int64 the API
# server refuses the status; times are Unix seconds a datetime can hold (the year 9999).
MAX_COUNT = 2 ** 53
MAX_UNIX_TIME = 253402300799.0
MAX_METRICS = 32
MAX_METRIC_NAME = 128
MAX_FIELD_NAME_SHOWN = 64


def _count(value: Any) -> int | None:
    """A non-negative integer within MAX_COUNT (an integral float too), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value <= MAX_COUNT else None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and 0 <= value <= MAX_COUNT:
        return int(value)
    return None


def _signed(value: Any) -> int | None:
    count = _count(abs(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and (not isinstance(value, float) or math.isfinite(value)) else None
    return None if count is None else (count if value >= 0 else -count)


def real(value: Any, low: float = -math.inf, high: float = math.inf) -> float | None:
    """A finite number within [low, high], else None (bools, huge ints that no float holds, NaN/Infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and abs(value) > 2 ** 1000:
        return None
    number = float(value)
    return number if math.isfinite(number) and low <= number <= high else None


def _unix_time(value: Any) -> float | None:
    return real(value, 0.0, MAX_UNIX_TIME)


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _members(value: Any) -> list[int] | None:
    members = valid_members(value)
    return list(members) if members is not None else None


def _pod_name(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= 253 else None


def _resumed_from(value: Any) -> str | None:
    return value if isinstance(value, str) and value in names.RESUMED_FROM else None


def _number_or_none(value: Any) -> Any:
    """A metric's leaf: a finite number; None for null, NaN or Infinity (not measured); _BAD for anything else."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    number = real(value)
    if number is None:
        return _BAD
    return value if isinstance(value, float) or abs(value) <= MAX_COUNT else number


_BAD = object()


def _metric(value: Any) -> Any:
    """One metric: a number, or a short list or object of numbers (one level deep; a non-finite one nulled in a
    list, left out of an object). None when it is anything else."""
    leaf = _number_or_none(value)
    if leaf is not _BAD:
        return leaf
    if isinstance(value, list) and len(value) <= MAX_METRICS:
        items = [_number_or_none(v) for v in value]
        return None if any(i is _BAD for i in items) else items
    if isinstance(value, Mapping) and len(value) <= MAX_METRICS:
        pairs = {k: _number_or_none(v) for k, v in value.items()}
        if any(v is _BAD or not isinstance(k, str) or len(k) > MAX_METRIC_NAME for k, v in pairs.items()):
            return None
        return {k: v for k, v in pairs.items() if v is not None}
    return None


_REPORT_FIELDS = {
    "rank": _count, "step": _count, "epoch": _count, "lastCheckpointStep": _count, "worldSize": _count,
    "workerRestarts": _count, "snapshotEvery": _count, "lastSnapshotStep": _count, "totalSteps": _count,
    "loss": real, "samplesPerSecond": lambda v: real(v, 0.0), "time": _unix_time,
    "final": _flag, "snapshotResident": _flag, "members": _members,
}
_RECOVERY_FIELDS = {
    "at": _unix_time, "seconds": lambda v: real(v, 0.0, MAX_UNIX_TIME), "stepsLost": _signed,
    "resumedFrom": _resumed_from, "restoredFromPod": _pod_name, "step": _count, "highestStep": _count,
}


def shown(name: Any) -> str:
    """A field name from a report, fit for a message: printable and short."""
    text = "".join(c if c.isprintable() else "?" for c in str(name))
    return text if len(text) <= MAX_FIELD_NAME_SHOWN else text[:MAX_FIELD_NAME_SHOWN] + "..."


def _fields(raw: Mapping, rules: Mapping[str, Any], prefix: str, invalid: list[str]) -> dict:
    out: dict[str, Any] = {}
    for key, rule in rules.items():
        value = raw.get(key)
        if value is None:
            continue  # not reported, or null: "not measured" (a diverging loss, no checkpoint yet)
        clean = rule(value)
        if clean is None:
            invalid.append(prefix + key)
        else:
            out[key] = clean
    return out


def valid_report(report: Any) -> tuple[dict | None, tuple[str, ...]]:
    """A trainer's report (docs/contract.md) with every field the operator reads checked: (the report with the
    valid fields alone, the names of the invalid ones). A field of the wrong type or out of range is dropped,
    the rest kept; fields the operator does not read are left out. A report whose `rank` is not a rank is
    nobody's (None): whose step, recovery or members it gives cannot be told. Never raises."""
    if not isinstance(report, Mapping):
        return None, ()
    invalid: list[str] = []
    out = _fields(report, _REPORT_FIELDS, "", invalid)
    if "rank" in invalid:
        return None, ("rank",)
    metrics = report.get("metrics")
    if isinstance(metrics, Mapping):
        kept = {}
        for key, value in list(metrics.items())[:4 * MAX_METRICS]:
            if value is None:
                continue  # not measured (the trainer writes a NaN metric as null)
            clean = _metric(value)
            if isinstance(key, str) and len(key) <= MAX_METRIC_NAME and clean is not None and \
                    len(kept) < MAX_METRICS:
                kept[key] = clean
            else:
                invalid.append(f"metrics.{shown(key)}")
        out["metrics"] = kept
    elif metrics is not None:
        invalid.append("metrics")
    recovery = report.get("recovery")
    if isinstance(recovery, Mapping):
        out["recovery"] = _fields(recovery, _RECOVERY_FIELDS, "recovery.", invalid)
    elif recovery is not None:
        invalid.append("recovery")
    return out, tuple(invalid)
