"""`kubectl ddp top [JOB]`: every job at a glance (phase, nodes, step, loss, samples/s, goodput, restarts), or one
job's pods (node, state, rank, restarts), its attempts as a timeline and its last recovery; refreshed in place
until Ctrl-C (`--once`: one screen, for scripts and for `watch`). `-o json|yaml` prints the rows instead.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

from kubectl_ddp import view
from kubectl_ddp.kube import Kube


def jobs_table(jobs: list[dict], now: datetime, all_namespaces: bool) -> Any:
    from rich.table import Table
    columns = view.JOB_COLUMNS if all_namespaces else view.JOB_COLUMNS[1:]
    table = Table(box=None, pad_edge=False, header_style="bold")
    for c in columns:
        table.add_column(c, no_wrap=True, justify="right" if c in ("STEP", "LOSS", "SAMPLES/S", "RESTARTS") else "left")
    for job in jobs:
        row = view.job_row(job, now)
        table.add_row(*(row if all_namespaces else row[1:]), style=_style(view.phase(job)))
    if not jobs:
        table.add_row("No DDPJobs found.")
    return table


def _style(phase: str) -> str:
    return {"Failed": "red", "Succeeded": "green", "Restarting": "yellow"}.get(phase, "")


def job_screen(job: dict, pods: list[dict], now: datetime) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    meta = job.get("metadata") or {}
    parts: list[Any] = [Text(f"{meta.get('namespace')}/{meta.get('name')}  " + view.progress_line(job), style="bold")]
    table = Table(box=None, pad_edge=False, header_style="bold")
    for c in view.POD_COLUMNS:
        table.add_column(c, no_wrap=True)
    for pod in sorted(pods, key=view.pod_sort_key):
        table.add_row(*view.pod_row(pod, now))
    parts += [Text(""), table]
    attempts = view.attempt_lines(job, now)
    parts += [Text(""), Text("Attempts (oldest first)", style="bold")]
    parts += [Text(line) for line in attempts] or [Text("  none")]
    recovery = view.recovery_line((job.get("status") or {}).get("lastRecovery"))
    parts += [Text(""), Text("Last recovery: " + (recovery or "none"), style="bold")]
    return Group(*parts)


def rows(kube: Kube, name: str | None, all_namespaces: bool) -> dict:
    now = datetime.now(timezone.utc)
    if name:
        job = kube.job(name)
        pods = sorted(kube.pods(name), key=view.pod_sort_key)
        return {"job": view.job_row(job, now), "jobColumns": list(view.JOB_COLUMNS),
                "pods": [view.pod_row(p, now) for p in pods], "podColumns": list(view.POD_COLUMNS),
                "attempts": view.attempt_lines(job, now),
                "lastRecovery": view.recovery_line((job.get("status") or {}).get("lastRecovery"))}
    return {"columns": list(view.JOB_COLUMNS),
            "jobs": [view.job_row(j, now) for j in kube.jobs(all_namespaces)]}


def screen(kube: Kube, name: str | None, all_namespaces: bool) -> Any:
    now = datetime.now(timezone.utc)
    if name:
        return job_screen(kube.job(name), kube.pods(name), now)
    return jobs_table(kube.jobs(all_namespaces), now, all_namespaces)


def top(kube: Kube, args: Any, console: Any) -> int:
    if args.output in ("json", "yaml"):
        data = rows(kube, args.job, args.all_namespaces)
        if args.output == "json":
            console.print_json(json.dumps(data))
        else:
            import yaml
            console.print(yaml.safe_dump(data, sort_keys=False), end="", markup=False, highlight=False)
        return 0
    if args.once or not console.is_terminal:
        console.print(screen(kube, args.job, args.all_namespaces))
        return 0
    from rich.live import Live
    try:
        with Live(screen(kube, args.job, args.all_namespaces), console=console, screen=False,
                  auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(screen(kube, args.job, args.all_namespaces), refresh=True)
    except KeyboardInterrupt:
        return 0
