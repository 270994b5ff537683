"""What the commands show, as plain strings and rows: pure functions of a DDPJob (a dict as the API returns it),
its pods and the clock, shared by `run`, `top` and `describe`.

Everything here reads status defensively: a field may be missing (an old operator, a job not yet reconciled) or
of another type (status is only as trustworthy as whoever may write it), and is then shown as "-".
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Mapping

from ddp_operator import names
from ddp_operator.observed import parse_time
from ddp_operator.report import real

DASH = "-"


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


_num = real  # a finite number, else None (the operator's own check of untrusted numbers)


def duration(seconds: float | None) -> str:
    """kubectl's short form: 45s, 3m20s, 2h5m, 3d4h."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return DASH
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s" if s < 600 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60}m"
    return f"{s // 86400}d{(s % 86400) // 3600}h"


def age(value: Any, now: datetime) -> str:
    t = parse_time(value)
    return duration((now - t).total_seconds()) if t is not None else DASH


def number(value: Any, digits: int = 4) -> str:
    """A loss or a metric: 4 significant digits; a rate: whole numbers from 100 up."""
    v = _num(value)
    if v is None:
        return DASH
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def phase(job: Mapping[str, Any]) -> str:
    value = _map(job.get("status")).get("phase")
    return value if isinstance(value, str) and value else names.PHASE_PENDING


def finished(job: Mapping[str, Any]) -> bool:
    return phase(job) in names.FINISHED_PHASES


def progress(job: Mapping[str, Any]) -> Mapping[str, Any]:
    return _map(_map(job.get("status")).get("progress"))


def total_steps(p: Mapping[str, Any]) -> int | None:
    """The run's length, when the script reports it (progress `totalSteps`; docs/contract.md)."""
    total = _num(p.get("totalSteps"))
    return int(total) if total is not None and total > 0 else None


def eta_seconds(p: Mapping[str, Any], since: tuple[float, float] | None) -> float | None:
    """Time left: the steps left at the step rate seen since `since` (the trainer's (time, step) when the caller
    first saw it); None without a total, or before the step moved."""
    total, step, t = total_steps(p), _num(p.get("step")), _num(p.get("time"))
    if total is None or step is None or t is None or since is None or t <= since[0] or step <= since[1]:
        return None
    return max(0.0, total - step) * (t - since[0]) / (step - since[1])


# What a narrow terminal's progress line leaves out first (run's live line): the least needed to follow a run.
_DROPPED_FIRST = ("samples/s", "epoch", "nodes")


def progress_line(job: Mapping[str, Any], eta: float | None = None, width: int | None = None) -> str:
    """One line: phase, nodes, step/epoch, loss, samples/s, ETA. Within `width` columns where given: samples/s, then
    the epoch, then the nodes are left out until it fits (an 80-column terminal keeps the step, the loss and the ETA
    on one row instead of wrapping the live line)."""
    status = _map(job.get("status"))
    p = progress(job)
    parts = [("phase", phase(job))]
    if isinstance(status.get("nodesReady"), str):
        parts.append(("nodes", f"nodes {status['nodesReady']}"))
    if _num(p.get("step")) is not None:
        total = total_steps(p)
        parts.append(("step", f"step {int(p['step'])}" + (f"/{total}" if total else "")))
    if _num(p.get("epoch")) is not None:
        parts.append(("epoch", f"epoch {int(p['epoch'])}"))
    if _num(p.get("loss")) is not None:
        parts.append(("loss", f"loss {number(p['loss'])}"))
    if _num(p.get("samplesPerSecond")) is not None:
        parts.append(("samples/s", f"{number(p['samplesPerSecond'], 3)} samples/s"))
    if eta is not None and not finished(job):
        parts.append(("eta", f"ETA {duration(eta)}"))
    restarts = status.get("restarts")
    if isinstance(restarts, int) and restarts:
        parts.append(("restarts", f"restarts {restarts}"))
    for drop in _DROPPED_FIRST:
        if width is None or len(" · ".join(text for _, text in parts)) <= width:
            break
        parts = [(kind, text) for kind, text in parts if kind != drop]
    return " · ".join(text for _, text in parts)


def recovery_line(recovery: Any) -> str | None:
    """status.lastRecovery in one sentence; None without one."""
    r = _map(recovery)
    if not r:
        return None
    fault = r.get("fault") if isinstance(r.get("fault"), str) else names.FAULT_UNKNOWN
    bits = [f"recovered from {fault}"]
    if isinstance(r.get("resumedFrom"), str):
        source = r["resumedFrom"]
        if isinstance(r.get("restoredFromPod"), str):
            source += f" ({r['restoredFromPod']})"
        bits.append(f"resumed from {source}")
    if _num(r.get("step")) is not None:
        bits.append(f"at step {int(r['step'])}")
    estimated = r.get("estimated") if isinstance(r.get("estimated"), list) else []
    if _num(r.get("stepsLost")) is not None:
        bits.append(f"{'≥ ' if 'stepsLost' in estimated else ''}{int(r['stepsLost'])} steps lost"
                    + (" (estimated)" if "stepsLost" in estimated else ""))
    if _num(r.get("seconds")) is not None:
        bits.append(f"{r['seconds']:.1f} s" + (" (estimated)" if "seconds" in estimated else ""))
    return ", ".join(bits)


def failure_line(failure: Any) -> str | None:
    """status.lastFailure in one line: class, why, rank, pod, budget; None without one."""
    f = _map(failure)
    if not f:
        return None
    bits = [f"{f.get('class', '?')} {f.get('reason', '?')}"]
    if isinstance(f.get("rank"), int):
        bits.append(f"rank {f['rank']}")
    bits.append(f"pod {f.get('pod', DASH)} on {f.get('node') or DASH}")
    if isinstance(f.get("exitCode"), int):
        bits.append(f"exit {f['exitCode']}")
    bits.append(f"spent {f.get('budget', 'none')}")
    return ", ".join(bits)


def goodput(job: Mapping[str, Any]) -> str:
    """status.goodput.ratio as a percentage, where the operator reports it."""
    ratio = _num(_map(_map(job.get("status")).get("goodput")).get("ratio"))
    return f"{ratio:.0%}" if ratio is not None else DASH


JOB_COLUMNS = ("NAMESPACE", "NAME", "PHASE", "NODES", "STEP", "LOSS", "SAMPLES/S", "GOODPUT", "RESTARTS", "AGE")


def job_row(job: Mapping[str, Any], now: datetime) -> list[str]:
    meta, status, p = _map(job.get("metadata")), _map(job.get("status")), progress(job)
    restarts = status.get("restarts")
    return [str(meta.get("namespace", DASH)), str(meta.get("name", DASH)), phase(job),
            status["nodesReady"] if isinstance(status.get("nodesReady"), str) and status["nodesReady"] else DASH,
            str(int(p["step"])) if _num(p.get("step")) is not None else DASH,
            number(p.get("loss")), number(p.get("samplesPerSecond"), 3), goodput(job),
            str(restarts) if isinstance(restarts, int) else "0", age(meta.get("creationTimestamp"), now)]


POD_COLUMNS = ("POD", "RANK", "NODE", "STATE", "RESTARTS", "AGE")


def _container_state(pod: Mapping[str, Any]) -> tuple[str, int]:
    status = _map(pod.get("status"))
    for c in status.get("containerStatuses") or []:
        c = _map(c)
        if c.get("name") != names.TRAINER_CONTAINER:
            continue
        state = _map(c.get("state"))
        restarts = c.get("restartCount") if isinstance(c.get("restartCount"), int) else 0
        if "running" in state:
            return ("Running" if c.get("ready") is not False else "Running (not ready)"), restarts
        for key in ("waiting", "terminated"):
            if key in state:
                reason = _map(state[key]).get("reason")
                return (str(reason) if reason else key.capitalize()), restarts
    return str(status.get("phase") or names.PHASE_PENDING), 0


def pod_row(pod: Mapping[str, Any], now: datetime) -> list[str]:
    meta = _map(pod.get("metadata"))
    state, restarts = _container_state(pod)
    if meta.get("deletionTimestamp"):
        state = "Terminating"
    labels = _map(meta.get("labels"))
    return [str(meta.get("name", DASH)), str(labels.get(names.LABEL_NODE_INDEX, DASH)),
            str(_map(pod.get("spec")).get("nodeName") or DASH), state, str(restarts),
            age(meta.get("creationTimestamp"), now)]


def pod_sort_key(pod: Mapping[str, Any]) -> tuple[int, str]:
    meta = _map(pod.get("metadata"))
    index = _map(meta.get("labels")).get(names.LABEL_NODE_INDEX)
    return (int(index) if isinstance(index, str) and index.isdigit() else 1 << 30, str(meta.get("name", "")))


def attempt_lines(job: Mapping[str, Any], now: datetime) -> list[str]:
    """status.attempts as a timeline, oldest first: when, which pod, why, and what it cost the budget."""
    out = []
    for a in _map(job.get("status")).get("attempts") or []:
        a = _map(a)
        when = age(a.get("time"), now)
        what = a.get("reason") or "Ended"
        if isinstance(a.get("restartCount"), int):
            what = f"{what} (restarted in place, restart {a['restartCount']})"
        if isinstance(a.get("exitCode"), int):
            what += f", exit {a['exitCode']}"
        budget = "counted" if a.get("counted") else ("disruption" if a.get("disruption") else "not counted")
        cls = f"{a['class']} {a.get('cause', '')}".rstrip() + ", " if isinstance(a.get("class"), str) else ""
        out.append(f"{when:>6} ago  rank {a.get('index', DASH)}  {a.get('pod', DASH)} on {a.get('node') or DASH}: "
                   f"{cls}{what} [{budget}]")
        message = a.get("message")
        if isinstance(message, str) and message.strip():
            out.append("            " + message.strip().splitlines()[-1][:200])
    return out


def condition_rows(job: Mapping[str, Any], now: datetime) -> list[list[str]]:
    rows = []
    for c in _map(job.get("status")).get("conditions") or []:
        c = _map(c)
        rows.append([str(c.get("type", DASH)), str(c.get("status", DASH)), str(c.get("reason") or DASH),
                     age(c.get("lastTransitionTime"), now), str(c.get("message") or "")])
    return rows
