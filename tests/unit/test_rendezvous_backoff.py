"""ddpjob-c10d rule 9 (ddp_trainer.rendezvous_rules.backing_off): an agent whose write of the shared state lost the
compare-and-set waits a random, growing while before it tries again, instead of at once. Every agent writes the one
key, so N agents that write at once (a re-form: every survivor leaves its round) retried in lockstep: N²/2 attempts of
O(N) bytes, 31 lost per agent at 128 agents (make bench-rdzv-scale, docs/scale.md)."""

from __future__ import annotations

from ddp_trainer import rendezvous_rules as rr


class Holder:
    """A state holder whose syncs answer from a script: True (written), False (lost), None (a read)."""

    def __init__(self, answers):
        self.answers, self.reads = list(answers), 0
        self._last_sync_time = 0.0

    def sync(self):
        if self._last_sync_time == -1:  # a read forced past the cache
            self._last_sync_time, self.reads = 0.0, self.reads + 1
            return None
        return self.answers.pop(0)


def test_a_lost_write_waits_a_random_growing_while_and_a_written_one_starts_over(monkeypatch):
    waits = []
    monkeypatch.setattr(rr.time, "sleep", waits.append)
    monkeypatch.setattr(rr.random, "uniform", lambda lo, hi: hi)  # the longest wait each time
    holder = Holder([False, False, False, None, True, False])
    assert rr.backing_off(holder)
    assert [holder.sync() for _ in range(6)] == [False, False, False, None, True, False]
    base = rr.BACKOFF_BASE_S
    assert waits == [2 * base, 4 * base, 8 * base, 2 * base]  # a read leaves it; a write that took starts over
    assert holder.reads == 4, "after each wait the state is read afresh, not decided on as the lost write left it"


def test_the_wait_is_capped_and_random_below_it(monkeypatch):
    waits, bounds = [], []
    monkeypatch.setattr(rr.time, "sleep", waits.append)
    monkeypatch.setattr(rr.random, "uniform", lambda lo, hi: bounds.append((lo, hi)) or lo)
    holder = Holder([False] * 20)
    rr.backing_off(holder)
    for _ in range(20):
        holder.sync()
    assert all(lo == 0 for lo, _ in bounds) and max(hi for _, hi in bounds) == rr.BACKOFF_MAX_S


def test_a_holder_without_sync_is_left_alone():
    assert rr.backing_off(object()) is False


def test_a_small_jobs_wait_stays_within_its_poll_interval(monkeypatch):
    """At 8 nodes a waiting agent polls every 0.1 s (rule 6): a lost write never waits longer than that; at 512, 2 s."""
    from types import SimpleNamespace

    for nodes, cap in ((8, 0.1), (512, 2.0)):
        bounds = []
        monkeypatch.setattr(rr.time, "sleep", lambda s: None)
        monkeypatch.setattr(rr.random, "uniform", lambda lo, hi: bounds.append(hi) or lo)
        holder = Holder([False] * 12)
        holder._settings = SimpleNamespace(max_nodes=nodes)
        rr.backing_off(holder)
        for _ in range(12):
            holder.sync()
        assert max(bounds) == cap, (nodes, bounds)
