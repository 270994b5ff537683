"""`kubectl ddp describe JOB`: one screen of a job: what was asked (spec summary), where it stands (phase,
progress, conditions), what went wrong and what it cost (attempts with faults, the last recovery, the last
incident) and the Events of the job and its pods, newest last.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

from kubectl_ddp import view
from kubectl_ddp.kube import Kube

MAX_EVENTS = 15


def spec_lines(job: Mapping[str, Any]) -> list[str]:
    spec = job.get("spec") if isinstance(job.get("spec"), Mapping) else {}
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or []
    trainer = next((c for c in containers if isinstance(c, Mapping) and c.get("name") == "trainer"), {})
    size = str(spec.get("nodes", "?"))
    if spec.get("minNodes") is not None or spec.get("maxNodes") is not None:
        size += f" (elastic {spec.get('minNodes', '?')}..{spec.get('maxNodes', '?')})"
    lines = [f"Nodes:        {size} x {spec.get('nprocPerNode', 1)} processes"
             + (f", {spec['spares']} spares" if spec.get("spares") else ""),
             f"Image:        {trainer.get('image', '-')}",
             f"Command:      {' '.join(map(str, (trainer.get('command') or []) + (trainer.get('args') or [])))}"]
    policy = spec.get("failurePolicy") if isinstance(spec.get("failurePolicy"), Mapping) else {}
    status = job.get("status") if isinstance(job.get("status"), Mapping) else {}
    lines.append(f"Budgets:      {status.get('restarts') or 0}/{policy.get('backoffLimit', 6)} backoffLimit (the user's "
                 f"code, hangs), {status.get('infraRestarts') or 0}/{policy.get('infraBackoffLimit', 50)} "
                 f"infraBackoffLimit (infrastructure); hang timeout "
                 f"{view.duration(policy.get('hangTimeoutSeconds', 1800))}")
    checkpoint = spec.get("checkpoint")
    if isinstance(checkpoint, Mapping):
        lines.append(f"Checkpoint:   {checkpoint.get('mountPath', '/checkpoints')} "
                     f"({', '.join(sorted((checkpoint.get('volume') or {}).keys()))})")
    return lines


def _folded(events: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Events that say the same of the same object one after another (one per condition a pass changed) as one."""
    out: list[Mapping[str, Any]] = []
    for e in events:
        same = ("involvedObject", "type", "reason", "message")
        if out and all(out[-1].get(k) == e.get(k) for k in same):
            out[-1] = {**e, "count": (out[-1].get("count") or 1) + (e.get("count") or 1)}
        else:
            out.append(e)
    return out


def event_lines(events: list[Mapping[str, Any]], now: datetime) -> list[str]:
    out = []
    for e in _folded(events)[-MAX_EVENTS:]:
        when = e.get("lastTimestamp") or e.get("eventTime") or (e.get("metadata") or {}).get("creationTimestamp")
        obj = e.get("involvedObject") or {}
        count = f" (x{e['count']})" if isinstance(e.get("count"), int) and e["count"] > 1 else ""
        out.append(f"{view.age(when, now):>6}  {e.get('type', ''):<7} {e.get('reason', ''):<22} "
                   f"{obj.get('kind', '')}/{obj.get('name', '')}: {(e.get('message') or '').strip()}{count}")
    return out


def render(job: Mapping[str, Any], pods: list[Mapping[str, Any]], events: list[Mapping[str, Any]],
           now: datetime) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    meta = job.get("metadata") or {}
    status = job.get("status") if isinstance(job.get("status"), Mapping) else {}
    parts: list[Any] = [Text(f"Name:         {meta.get('name')}", style="bold"),
                        Text(f"Namespace:    {meta.get('namespace')}"),
                        Text(f"Age:          {view.age(meta.get('creationTimestamp'), now)}")]
    parts += [Text(line) for line in spec_lines(job)]
    parts.append(Text(f"Phase:        {view.phase(job)}" + (f" ({status['reason']})" if status.get("reason") else "")
                      + (f": {status['message']}" if status.get("message") else ""), style="bold"))
    parts.append(Text(f"Progress:     {view.progress_line(job)}"))
    conditions = view.condition_rows(job, now)
    if conditions:
        table = Table("TYPE", "STATUS", "REASON", "AGE", "MESSAGE", box=None, pad_edge=False, header_style="bold",
                      title="Conditions", title_justify="left", title_style="bold")
        for row in conditions:
            table.add_row(*row)
        parts += [Text(""), table]
    pod_table = Table(*view.POD_COLUMNS, box=None, pad_edge=False, header_style="bold", title="Pods",
                      title_justify="left", title_style="bold")
    for pod in sorted(pods, key=view.pod_sort_key):
        pod_table.add_row(*view.pod_row(pod, now))
    parts += [Text(""), pod_table]
    parts += [Text(""), Text("Attempts (oldest first)", style="bold")]
    parts += [Text(line) for line in view.attempt_lines(job, now)] or [Text("  none")]
    recovery = view.recovery_line(status.get("lastRecovery"))
    incident = status.get("lastIncident") if isinstance(status.get("lastIncident"), Mapping) else None
    parts.append(Text(""))
    failure = view.failure_line(status.get("lastFailure"))
    if failure:
        parts.append(Text(f"Last failure: {failure}", style="bold"))
        message = (status.get("lastFailure") or {}).get("message")
        if isinstance(message, str) and message.strip():
            parts += [Text("  " + line) for line in message.strip().splitlines()[-6:]]
    avoided = status.get("avoidedNodes")
    if isinstance(avoided, list) and avoided:
        parts.append(Text("Avoided nodes: " + ", ".join(f"{a.get('node')} (until {a.get('until')})"
                                                        for a in avoided if isinstance(a, Mapping))))
    parts.append(Text("Last recovery: " + (recovery or "none"), style="bold"))
    if incident:
        parts.append(Text(f"Last incident: {incident.get('reason', '?')}, {view.age(incident.get('time'), now)} ago"))
    parts += [Text(""), Text("Events", style="bold")]
    parts += [Text(line) for line in event_lines(events, now)] or [Text("  none")]
    return Group(*parts)


def describe(kube: Kube, args: Any, console: Any) -> int:
    job = kube.job(args.job)
    pods = kube.pods(args.job, role=None)
    events = kube.events([args.job, *((p.get("metadata") or {}).get("name") for p in pods)])
    console.print(render(job, pods, events, datetime.now(timezone.utc)))
    return 0
