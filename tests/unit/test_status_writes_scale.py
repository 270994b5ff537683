"""Status writes of a clean job do not grow with its size (issue 28: <= 6 per clean job, independent of N). A job of
N pods takes longer to start the larger N is, and a pass that only changes the pod counts (nodes, nodesReady,
message) waits to be batched; with a fixed batching window the writes grew with the start-up's length (18 for 1,000
pods Running at 30/s). The window doubles with each count-only write in a row, so a start-up of any length costs a
few, and the counts shown stay at most the window old."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ddp_builders import job_body
from fake_api import fake_reconciler

from ddp_operator import jobs as jobsmod
from ddp_operator import names
from ddp_operator import reconciler as recmod


@pytest.fixture
def clock(monkeypatch):
    """A fake monotonic clock for the shell's coalescing and wake-ups."""
    now = [1000.0]
    fake = SimpleNamespace(monotonic=lambda: now[0], time=lambda: now[0])
    monkeypatch.setattr(recmod, "time", fake)
    monkeypatch.setattr(jobsmod, "time", fake)
    return now


def start(clock, nodes: int, per_second: float):
    """A job of `nodes` nodes whose pods turn Running at `per_second`; every half second a pass for that half
    second's pod events (coalesced: Reconciler.child_changed) and a tick of the ticker."""
    r = fake_reconciler(job_body(nodes=nodes, progressPeriodSeconds=0))
    key = ("ml", "mnist")
    r.reconcile(*key)
    pending = list(r.indexes["pods_by_job"][key])
    while pending:
        clock[0] += 0.5
        for _ in range(max(1, int(per_second * 0.5))):
            if pending:
                pending.pop(0)["status"] = {"phase": "Running", "podIP": "127.0.0.9",
                                            "conditions": [{"type": "Ready", "status": "True"}]}
        r.child_changed(*key)
        assert r.event_passes.settle()
        r.tick()
    for _ in range(140):  # 70 s more: every batched write made
        clock[0] += 0.5
        r.tick()
    return r


@pytest.mark.parametrize("nodes, per_second", [(10, 100), (100, 100), (1000, 100), (1000, 30)])
def test_a_clean_job_of_any_size_costs_at_most_6_status_writes(clock, nodes, per_second):
    r = start(clock, nodes, per_second)
    writes = [status for _, status in r.api.patches]
    final = r.indexes["ddpjobs_by_key"][("ml", "mnist")][0]["status"]
    assert final["phase"] == names.PHASE_RUNNING and final["nodes"]["ready"] == nodes, final
    assert len(writes) <= 6, f"{len(writes)} status writes for {nodes} pods at {per_second}/s"


def test_the_batching_window_doubles_with_each_count_only_write_and_is_capped():
    windows = [recmod.coalesce_window(streak) for streak in range(8)]
    assert windows[:4] == [2.0, 4.0, 8.0, 16.0]
    assert max(windows) == recmod.STATUS_COALESCE_MAX_SECONDS == 30.0
