"""Probing a job of many pods (issue 28): every pod is asked at once, so a poll of a 1,000-pod job costs one probe
deadline however many of its pods never answer; before, probes ran 32 at a time and each batch with a silent pod
cost a deadline of its own."""

from __future__ import annotations

import socket
import time

import pytest

from ddp_operator import names, progress
from ddp_trainer.testing import free_port


def _silent(ips: list[str]) -> tuple[list[socket.socket], int]:
    """Listening sockets on `ips`, one port for all, that accept and never answer (frozen pods)."""
    port = free_port()
    socks = []
    for ip in ips:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, port))
        s.listen(4)
        socks.append(s)
    return socks, port


@pytest.mark.parametrize("each", ["probe_each", "diagnose_each"])
def test_a_thousand_pod_job_with_300_silent_pods_costs_one_deadline(monkeypatch, each):
    silent_ips = [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(300)]
    socks, port = _silent(silent_ips)
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    monkeypatch.setattr(names, "DIAGNOSTICS_PORT", port)
    # the other 700 pods refuse at once (nothing listens there), as a pod whose server is not up yet
    targets = {f"j-{i}": ip for i, ip in enumerate(silent_ips + [f"127.0.9.{i % 250}" for i in range(700)])}
    try:
        started = time.monotonic()
        got = getattr(progress, each)(targets, timeout=0.5)
        took = time.monotonic() - started
    finally:
        for s in socks:
            s.close()
    assert got == {key: None for key in targets}
    # One deadline (0.5 s) plus 1,000 connects; probed 32 at a time, the ten batches with a silent pod took 5 s.
    assert took < 2.5, f"{each} of 1,000 pods, 300 of them silent, took {took:.1f} s: more than one deadline"


def test_each_poll_is_timed_in_the_operators_metrics(monkeypatch):
    """ddpjob_progress_poll_seconds: how long one job's poll took (bench-scale-sim reads its slowest)."""
    from fake_api import fake_reconciler, running_job
    from ddp_builders import Silent
    from ddp_operator import metrics

    port = free_port()
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    r = fake_reconciler()
    key, _, _ = running_job(r, "timed", failurePolicy={"hangTimeoutSeconds": 20})

    def count(le: str) -> float:
        return metrics.PROGRESS_POLL_SECONDS.collect()[0].samples and next(
            s.value for s in metrics.PROGRESS_POLL_SECONDS.collect()[0].samples
            if s.name.endswith("_bucket") and s.labels["le"] == le)
    fast, total = count("0.25"), count("+Inf")
    silent = Silent("127.0.0.2", port)
    try:
        r.poller._poll_isolated(key, r.jobs.record(key))
    finally:
        silent.close()
    assert count("+Inf") == total + 1
    assert count("0.25") == fast  # one silent pod: the poll took its deadline
