"""A job's metric history: what `kubectl ddp plot` draws, kept where it survives pods and the operator.

`status.progress` holds the latest report only. The history is a bounded series of those reports, one point per
progress write, in a ConfigMap of the job's own (`<job>-history`, data key `history.json`, owned by the job so it
goes with it). A ConfigMap because the job's readers can read it with ordinary namespace permissions (the pods'
ports are closed to the API server's proxy by the job's NetworkPolicy), and because a series kept in status would
be carried by every status write and every watch event of every DDPJob.

The format (version 1)::

    {"version": 1, "stride": 4, "points": [{"step": 0, "time": 1735732800.0, "loss": 2.3, "samplesPerSecond":
     410.0, "epoch": 0, "metrics": {"valAccuracy": 0.9}}, ...]}

Points are in step order, at most MAX_POINTS. `stride` is the spacing kept, in steps: a point whose step falls in
the bucket (step // stride) of the last point replaces it (the latest value of the bucket wins); when the series
outgrows MAX_POINTS the stride doubles and every bucket keeps its latest point, so the whole run stays evenly
sampled however long it grows. A point at or below the last step (steps redone after a recovery) cuts the series
there first: the history shows what the model followed.

Pure: no client, no clock. The operator writes it (`poller`, at most every FLUSH_SECONDS while the step moves);
`decode` trusts nothing, since anyone who may edit the namespace's ConfigMaps may edit this one.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ddp_operator import names
from ddp_operator.report import real

FORMAT_VERSION = 1
DATA_KEY = "history.json"
MAX_POINTS = 512
# Points reach the history when status.progress is written (at most every progressPeriodSeconds); the ConfigMap is
# written at most this often, so a job costs one extra write per this many seconds while it trains.
FLUSH_SECONDS = 30.0
MAX_METRICS = 16
_MAX_NAME = 63
_POINT_KEYS = ("step", "time", "loss", "samplesPerSecond", "epoch")


_number = real  # a finite number, else None (report.real: bools, NaN, ints no float holds)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 63:
        return None
    return value


def point(progress: Mapping[str, Any] | None) -> dict | None:
    """The history point of a status.progress (or a point read back): its step, time, loss, throughput, epoch and
    scalar metrics; None without a valid step."""
    if not isinstance(progress, Mapping):
        return None
    step = _count(progress.get("step"))
    if step is None:
        return None
    out: dict[str, Any] = {"step": step}
    for key in ("time", "loss", "samplesPerSecond"):
        value = _number(progress.get(key))
        if value is not None:
            out[key] = value
    epoch = _count(progress.get("epoch"))
    if epoch is not None:
        out["epoch"] = epoch
    metrics = progress.get("metrics")
    if isinstance(metrics, Mapping):
        kept = {}
        for name, value in metrics.items():
            value = _number(value)
            if isinstance(name, str) and 0 < len(name) <= _MAX_NAME and value is not None and len(kept) < MAX_METRICS:
                kept[name] = value
        if kept:
            out["metrics"] = kept
    return out


def _thinned(points: list[dict], stride: int) -> list[dict]:
    """The latest point of every stride bucket."""
    kept: list[dict] = []
    for p in points:
        if kept and kept[-1]["step"] // stride == p["step"] // stride:
            kept[-1] = p
        else:
            kept.append(p)
    return kept


def added(points: list[dict], stride: int, new: Mapping[str, Any] | None) -> tuple[list[dict], int]:
    """(points, stride) with the progress `new` taken in; unchanged when it has no valid step or repeats the last."""
    p = point(new)
    if p is None:
        return points, stride
    if points and points[-1] == p:
        return points, stride
    kept = [q for q in points if q["step"] < p["step"]]
    if kept and kept[-1]["step"] // stride == p["step"] // stride and len(kept) > 1:
        kept[-1] = p  # the bucket's latest value; the first point of the run is kept as it is
    else:
        kept.append(p)
    while len(kept) > MAX_POINTS:
        stride *= 2
        kept = [kept[0]] + _thinned(kept[1:], stride)
    return kept, stride


def encode(points: list[dict], stride: int) -> str:
    return json.dumps({"version": FORMAT_VERSION, "stride": stride, "points": points}, separators=(",", ":"))


def decode(text: Any) -> tuple[list[dict], int]:
    """(points, stride) from a ConfigMap's `history.json`; whatever is malformed is left out (an unreadable
    document is an empty history)."""
    try:
        doc = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        return [], 1
    stride = _count(doc.get("stride")) or 1
    points: list[dict] = []
    raw = doc.get("points")
    for item in raw[:MAX_POINTS] if isinstance(raw, list) else []:
        p = point(item)
        if p is not None and (not points or p["step"] > points[-1]["step"]):
            points.append(p)
    return points, stride


def from_configmap(cm: Mapping[str, Any] | None) -> tuple[list[dict], int]:
    data = (cm or {}).get("data") or {}
    return decode(data.get(DATA_KEY)) if isinstance(data, Mapping) else ([], 1)


def series(points: list[dict], progress: Mapping[str, Any] | None = None) -> list[dict]:
    """The points to show: the history, plus the latest status.progress when it is past the last flushed point."""
    p = point(progress)
    if p is not None and (not points or p["step"] > points[-1]["step"]):
        return [*points, p]
    return list(points)


def configmap(namespace: str, job: str, uid: str, points: list[dict], stride: int) -> dict:
    """The ConfigMap body, owned by the job (deleted with it)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": names.history_configmap(job),
            "namespace": namespace,
            "labels": {names.LABEL_JOB_NAME: job, names.LABEL_MANAGED_BY: names.MANAGED_BY},
            "ownerReferences": [{"apiVersion": names.API_VERSION, "kind": names.KIND, "name": job, "uid": uid,
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "data": {DATA_KEY: encode(points, stride)},
    }
