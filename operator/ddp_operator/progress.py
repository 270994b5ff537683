"""The trainer's progress channel (docs/contract.md): probe GET :29401/progress on the job's pods.

Every pod's local rank 0 answers for itself, naming its global `rank`; `probe` looks for global rank 0's report
(a report without `rank`, from a trainer that serves on rank 0 alone, is rank 0's), `probe_each` asks every pod
at once (hang detection: which pod is stuck).

What a pod answers is untrusted, and the operator serves every job from one process, so a probe is bounded in
every way: one overall deadline per probe (not per socket operation: a pod that trickles a byte at a time
cannot hold it), plain HTTP/1.0 with no redirects followed, status 200 only, a capped body, and any error at
all (a malformed status line, JSON nested too deep, numbers out of range) means "no report".
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

from ddp_operator import names

DEADLINE_SECONDS = 2.0
MAX_RESPONSE_BYTES = 65536


def _get(ip: str, port: int, deadline: float) -> bytes:
    """The raw HTTP response (head and body) of GET /progress, read until EOF, the cap, or the deadline."""
    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("progress probe deadline")
        return left

    with socket.create_connection((ip, port), timeout=remaining()) as sock:
        host = f"[{ip}]" if ":" in ip else ip
        sock.settimeout(remaining())
        sock.sendall(f"GET {names.PROGRESS_PATH} HTTP/1.0\r\nHost: {host}:{port}\r\n"
                     f"Accept: application/json\r\nConnection: close\r\n\r\n".encode())
        data = bytearray()
        while True:
            sock.settimeout(remaining())
            chunk = sock.recv(16384)
            if not chunk:
                return bytes(data)
            data += chunk
            if len(data) > MAX_RESPONSE_BYTES:
                raise ValueError("progress response too large")


def _report(raw: bytes) -> Mapping[str, Any] | None:
    head, sep, body = raw.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/") or status[1] != b"200":
        return None  # redirects, errors and anything that is not HTTP are all "no report"
    # NaN/Infinity are not JSON: read as null (status.progress_status drops them, as it drops 1e999).
    report = json.loads(body, parse_constant=lambda _: None)
    return report if isinstance(report, dict) else None


def fetch(ip: str, timeout: float = DEADLINE_SECONDS, *, deadline: float | None = None) -> Mapping[str, Any] | None:
    """The JSON progress report served at ip, or None if nothing (valid) answers by the deadline."""
    end = deadline if deadline is not None else time.monotonic() + timeout
    try:
        return _report(_get(ip, names.PROGRESS_PORT, end))
    except Exception:  # noqa: BLE001 - whatever a pod sends back, it is only "no report"
        return None


def is_rank0(report: Mapping[str, Any]) -> bool:
    """Whether a report is global rank 0's; one without `rank` (an older trainer, a plain script) counts."""
    rank = report.get("rank", 0)
    return rank is None or (isinstance(rank, int) and not isinstance(rank, bool) and rank == 0)


def probe(ips: Iterable[str], preferred: str | None = None,
          timeout: float = DEADLINE_SECONDS) -> tuple[str, Mapping[str, Any]] | None:
    """Global rank 0's report: ask the pods, the one that answered as rank 0 last time first.

    `timeout` bounds the whole probe, however many pods are asked."""
    deadline = time.monotonic() + timeout
    ordered = sorted(set(ips), key=lambda ip: ip != preferred)
    for ip in ordered:
        if time.monotonic() >= deadline:
            break
        report = fetch(ip, deadline=deadline)
        if report is not None and is_rank0(report):
            return ip, report
    return None


MAX_PARALLEL_PROBES = 32


def probe_each(targets: Mapping[str, str], timeout: float = DEADLINE_SECONDS) -> dict[str, Mapping[str, Any] | None]:
    """Every pod's own report (pod name -> report, None when it did not answer), asked in parallel, each
    with its own deadline: a stuck pod costs one deadline, not one per pod after it."""
    if not targets:
        return {}
    names_ = list(targets)
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_PROBES, len(names_)),
                            thread_name_prefix="ddp-probe-each") as pool:
        answers = list(pool.map(lambda n: fetch(targets[n], timeout), names_))
    return dict(zip(names_, answers))
