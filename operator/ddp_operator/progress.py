"""The trainer's progress channel (docs/contract.md): probe GET :29401/progress on the job's pods; and the diagnostics
sidecar's GET :29402/diagnosis (docs/diagnostics.md).

Every pod's local rank 0 answers for itself, naming its global `rank`. `probe_each` asks every pod at once (up to
MAX_PARALLEL_PROBES, on one event loop: a poll of a job of 1,000 pods costs one deadline however many never answer),
each probe with its own deadline (one pod that never answers costs one deadline, never hides the others); `rank0`
picks global rank 0's report from the answers (a report without `rank`, from a trainer that serves on rank 0
alone, is rank 0's); `probe` is the two together. `diagnose_each` asks every pod's diagnostics sidecar the same way
(with `log`, the sidecar first prints every worker's full stacks to its own log, headed by that reason).

What a pod answers is untrusted, and the operator serves every job from one process, so a probe is bounded in
every way: one overall deadline per probe (not per socket operation: a pod that trickles a byte at a time
cannot hold it), plain HTTP/1.0 with no redirects followed, status 200 only, a capped body, and any error at
all (a malformed status line, JSON nested too deep, numbers out of range) means "no report".
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from typing import Any, Awaitable, Callable, Iterable, Mapping

from ddp_operator import names

DEADLINE_SECONDS = 2.0
MAX_RESPONSE_BYTES = 65536
# A diagnosis reads every worker's stack with py-spy first (the sidecar gives py-spy at most 5 s): more time than a
# progress report, and more bytes (up to stall.MAX_WORKERS workers, each with two frames of up to 512 characters).
DIAGNOSIS_DEADLINE_SECONDS = 8.0
# With ?log=<reason> the sidecar also dumps every thread of every worker, with locals, to its log before it answers.
DIAGNOSIS_LOG_DEADLINE_SECONDS = 15.0
# A hang is acted on at once: its diagnoses wait no longer than this (a pod frozen whole, its sidecar with it, never
# answers; the hang is then recorded without that pod's stacks rather than 15 s later).
HANG_DIAGNOSIS_DEADLINE_SECONDS = 3.0
MAX_DIAGNOSIS_BYTES = 262144


async def _get(ip: str, port: int, deadline: float, path: str | None = None,
               limit: int = MAX_RESPONSE_BYTES) -> bytes:
    """The raw HTTP response (head and body) of GET `path` (the progress path by default), read until EOF, the cap,
    or the deadline."""
    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("progress probe deadline")
        return left

    reader, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), remaining())
    try:
        host = f"[{ip}]" if ":" in ip else ip
        writer.write(f"GET {path or names.PROGRESS_PATH} HTTP/1.0\r\nHost: {host}:{port}\r\n"
                     f"Accept: application/json\r\nConnection: close\r\n\r\n".encode())
        await asyncio.wait_for(writer.drain(), remaining())
        data = bytearray()
        while True:
            chunk = await asyncio.wait_for(reader.read(16384), remaining())
            if not chunk:
                return bytes(data)
            data += chunk
            if len(data) > limit:
                raise ValueError("response too large")
    finally:
        writer.transport.abort()  # never waits on a pod that does not read


async def _answer(ip: str, port: int, deadline: float, path: str | None, limit: int) -> Mapping[str, Any] | None:
    try:
        return _report(await _get(ip, port, deadline, path, limit))
    except Exception:  # noqa: BLE001 - whatever a pod sends back, it is only "no answer"
        return None


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
    return asyncio.run(_answer(ip, names.PROGRESS_PORT, end, None, MAX_RESPONSE_BYTES))


def _diagnosis_path(log: str | None) -> str:
    return names.DIAGNOSTICS_PATH + (f"?log={urllib.parse.quote(log, safe='')}" if log else "")


def fetch_diagnosis(ip: str, log: str | None = None, timeout: float | None = None) -> Mapping[str, Any] | None:
    """The JSON answer of the diagnostics sidecar at ip (`log`: the reason it is asked to log full stacks for), or
    None if nothing (valid JSON) answers by the deadline. Checking its fields is stall.valid_diagnosis's."""
    timeout = timeout or (DIAGNOSIS_LOG_DEADLINE_SECONDS if log else DIAGNOSIS_DEADLINE_SECONDS)
    return asyncio.run(_answer(ip, names.DIAGNOSTICS_PORT, time.monotonic() + timeout, _diagnosis_path(log),
                               MAX_DIAGNOSIS_BYTES))


def is_rank0(report: Mapping[str, Any]) -> bool:
    """Whether a report is global rank 0's; one without `rank` (an older trainer, a plain script) counts."""
    rank = report.get("rank", 0)
    return rank is None or (isinstance(rank, int) and not isinstance(rank, bool) and rank == 0)


def rank0(answers: Mapping[str, Mapping[str, Any] | None],
          preferred: str | None = None) -> tuple[str, Mapping[str, Any]] | None:
    """(key, report) of global rank 0's report among `answers` (key -> report or None): `preferred`'s (the pod
    that answered as rank 0 last time) if it still does, else the first in key order; None if none does."""
    ordered = sorted(answers, key=lambda k: (k != preferred, k))
    return next(((k, answers[k]) for k in ordered  # type: ignore[misc]
                 if answers[k] is not None and is_rank0(answers[k])), None)  # type: ignore[arg-type]


def probe(ips: Iterable[str], preferred: str | None = None,
          timeout: float = DEADLINE_SECONDS) -> tuple[str, Mapping[str, Any]] | None:
    """(ip, report) of global rank 0: every pod asked at once, so `timeout` bounds the whole probe."""
    ips = sorted(set(ips))
    return rank0(probe_each({ip: ip for ip in ips}, timeout), preferred)


# Probes in flight at once per probe_each/diagnose_each (one socket each): at least names.MAX_NODES, so every pod of
# the largest job is asked at once and a poll costs one deadline, however many pods never answer.
MAX_PARALLEL_PROBES = 1024


def probe_each(targets: Mapping[str, str], timeout: float = DEADLINE_SECONDS) -> dict[str, Mapping[str, Any] | None]:
    """Every pod's own report (key, e.g. the pod's UID, -> report, None when it did not answer), asked in
    parallel, each with its own deadline: a stuck pod costs one deadline, not one per pod after it. More pods
    than MAX_PARALLEL_PROBES take a deadline per batch."""
    port = names.PROGRESS_PORT
    return _each(targets, lambda ip: _answer(ip, port, time.monotonic() + timeout, None, MAX_RESPONSE_BYTES))


def diagnose_each(targets: Mapping[str, str], log: str | None = None,
                  timeout: float | None = None) -> dict[str, Mapping[str, Any] | None]:
    """Every pod's diagnostics sidecar's answer (key -> answer, None when it did not answer), asked as probe_each
    asks for progress: in parallel, each with its own deadline (`timeout`, else fetch_diagnosis's)."""
    seconds = timeout or (DIAGNOSIS_LOG_DEADLINE_SECONDS if log else DIAGNOSIS_DEADLINE_SECONDS)
    port, path = names.DIAGNOSTICS_PORT, _diagnosis_path(log)
    return _each(targets, lambda ip: _answer(ip, port, time.monotonic() + seconds, path, MAX_DIAGNOSIS_BYTES))


def _each(targets: Mapping[str, str],
          ask: Callable[[str], Awaitable[Mapping[str, Any] | None]]) -> dict[str, Mapping[str, Any] | None]:
    """Every target asked on one event loop of this thread, MAX_PARALLEL_PROBES at a time; each probe's deadline
    starts when it does."""
    if not targets:
        return {}
    keys = list(targets)

    async def every() -> list[Mapping[str, Any] | None]:
        slots = asyncio.Semaphore(MAX_PARALLEL_PROBES)

        async def one(ip: str) -> Mapping[str, Any] | None:
            async with slots:
                return await ask(ip)
        return await asyncio.gather(*(one(targets[k]) for k in keys))
    return dict(zip(keys, asyncio.run(every())))
