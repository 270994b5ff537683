"""The trainer's progress channel (docs/contract.md): probe rank 0's GET :29401/progress on the job's pods."""

from __future__ import annotations

import json
import urllib.request
from typing import Any, Iterable, Mapping

from ddp_operator import names

TIMEOUT_SECONDS = 1.0


def fetch(ip: str, timeout: float = TIMEOUT_SECONDS) -> Mapping[str, Any] | None:
    """The JSON progress report served at ip, or None if nothing (valid) answers."""
    url = f"http://{ip}:{names.PROGRESS_PORT}{names.PROGRESS_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (pod IPs only)
            report = json.loads(response.read(65536))
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def probe(ips: Iterable[str], preferred: str | None = None) -> tuple[str, Mapping[str, Any]] | None:
    """Ask the pods, the one that answered last time first; only global rank 0 serves progress."""
    ordered = sorted(set(ips), key=lambda ip: ip != preferred)
    for ip in ordered:
        report = fetch(ip)
        if report is not None:
            return ip, report
    return None
