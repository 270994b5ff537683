"""read_cache.ReadCache (reads of cluster-wide objects reused for a while, a pass's nodes read side by side) and
pass_clock.PassClock (where a pass's time goes)."""

import logging
import threading
import time

import pytest
from prometheus_client import REGISTRY

from ddp_operator.pass_clock import SLOW_PASS_SECONDS, PassClock
from ddp_operator.read_cache import ReadCache


def test_get_many_reads_each_distinct_name_once_side_by_side_and_reuses_what_it_read():
    reads: list[str] = []
    # Three reads that each wait for the other two: read one after the other, the barrier breaks.
    barrier = threading.Barrier(3, timeout=5)

    def read(name):
        reads.append(name)
        barrier.wait()
        return f"state of {name}"

    cache = ReadCache(60)
    got = cache.get_many(["n1", "n2", "n1", "n3", "n2"], read)
    assert got == {"n1": "state of n1", "n2": "state of n2", "n3": "state of n3"}
    assert sorted(reads) == ["n1", "n2", "n3"]
    # Within the cache's seconds nothing is read again; a new name is read alone, in the caller's thread.
    alone: list[str] = []
    assert cache.get_many(["n3", "n4"], lambda n: alone.append(threading.current_thread().name) or n) == \
        {"n3": "state of n3", "n4": "n4"}
    assert alone == [threading.current_thread().name]
    assert cache.get("n1", lambda n: pytest.fail("read again")) == "state of n1"
    assert cache.get_many([], read) == {}


def test_get_many_raises_a_failed_read_after_the_others_and_keeps_what_they_read():
    def read(name):
        if name == "bad":
            raise RuntimeError("500 from the API server")
        time.sleep(0.05)
        return name.upper()

    cache = ReadCache(60)
    with pytest.raises(RuntimeError, match="500"):
        cache.get_many(["a", "bad", "b"], read)
    assert {n: v for n, (v, _) in cache.entries.items()} == {"a": "A", "b": "B"}
    expired = ReadCache(0)
    expired.get_many(["a"], read)
    assert expired.get_many(["a"], lambda n: "again") == {"a": "again"}


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
