"""pass_clock.PassClock: where a pass's time goes."""

import logging

from prometheus_client import REGISTRY

from ddp_operator.pass_clock import SLOW_PASS_SECONDS, PassClock


def _observed(stage):
    return REGISTRY.get_sample_value("ddpjob_reconcile_stage_seconds_count", {"stage": stage}) or 0.0


def test_a_slow_pass_is_logged_with_its_stages_and_every_stage_is_observed(caplog, monkeypatch):
    before = {s: _observed(s) for s in ("observe", "nodes", "writes")}
    ticks = iter([100.0, 100.02, 100.33, 101.5])
    monkeypatch.setattr("ddp_operator.pass_clock.time.monotonic", lambda: next(ticks))
    clock = PassClock()
    clock.lap("observe", 1001)
    clock.lap("nodes", 50)
    clock.lap("writes", 203)
    assert clock.summary() == "observe 0.02 s (1001), nodes 0.31 s (50), writes 1.17 s (203)"
    with caplog.at_level(logging.INFO, logger="ddp_operator"):
        clock.report("ml", "big")
    assert [r.getMessage() for r in caplog.records] == [
        "[ml/big] slow pass, 1.50 s: observe 0.02 s (1001), nodes 0.31 s (50), writes 1.17 s (203)"]
    assert {s: _observed(s) - before[s] for s in before} == {"observe": 1, "nodes": 1, "writes": 1}


def test_a_quick_pass_logs_nothing(caplog):
    clock = PassClock()
    clock.lap("observe", 2)
    clock.lap("plan")
    assert clock.total() < SLOW_PASS_SECONDS and clock.summary().startswith("observe ")
    with caplog.at_level(logging.INFO, logger="ddp_operator"):
        clock.report("ml", "small")
    assert caplog.records == []
