"""Rule 10 of this project's executor (ddp_trainer.rendezvous_batch) on torch's own handlers and state holders over a
real TCPStore (loopback, no torchrun): agents announce themselves in one small store operation and whoever writes the
shared state places every announced agent, so a start or a re-form of N agents takes a handful of writes of the state,
not one (or three) per agent, each agent's store operations stay a few, and every agent is still ranked exactly once.

Before rule 10, every agent wrote the whole state itself, one compare-and-set after another on the one key, and the
losers retried: at 256 agents on 2 cores the re-form after a loss did not complete within two minutes (make
bench-rdzv-scale, docs/scale.md)."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # noqa: E402

from ddp_trainer import rendezvous  # noqa: E402
from ddp_trainer.testing import free_port  # noqa: E402

N = 16  # rule 10 applies past 8 nodes, as rule 8 does
KEEP_ALIVE_S, ATTEMPTS = 1, 3  # the operator's defaults


def _counted(op: str):
    def call(self, *args):
        self.ops[op] = self.ops.get(op, 0) + 1
        return getattr(self.inner, op)(*args)

    return call


class CountingStore(dist.Store):
    """A store client that counts its operations by kind (torch calls them through its own Store type: one method
    each)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.ops = inner, {}

    set, get, compare_set, add, check = (_counted(op) for op in ("set", "get", "compare_set", "add", "check"))
    wait, multi_get, append, delete_key = (_counted(op) for op in ("wait", "multi_get", "append", "delete_key"))


class Counting(C10dRendezvousBackend):
    """A backend that counts its compare-and-sets of the state (``tries``) and those that took (``writes``)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.writes = self.tries = 0

    def set_state(self, state, token=None):
        out = super().set_state(state, token)
        self.tries += 1
        self.writes += bool(out and out[2])
        return out


def _agent(port: int, run_id: str, i: int, pod: str, nodes: int = N):
    store = CountingStore(TCPStore("127.0.0.1", port, is_master=False))
    backend = Counting(store, run_id)
    handler = dr.DynamicRendezvousHandler.from_backend(
        run_id, store, backend, nodes, nodes, local_addr=f"agent-{i}",
        timeout=dr.RendezvousTimeout(join=timedelta(60)), keep_alive_interval=KEEP_ALIVE_S,
        keep_alive_max_attempt=ATTEMPTS)
    assert rendezvous.enable_take_over(handler, pod)  # this backend's executor, as under ddp_trainer.launch
    assert handler._op_executor.helping is not None
    return handler, backend, store


def _next_round(handlers) -> dict:
    out: dict = {}

    def join(h):
        try:
            out[h] = h.next_rendezvous().rank
        except Exception as e:  # noqa: BLE001 (an outcome)
            out[h] = e

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _fresh(handler):
    """The state as the store has it now (the holder's cache bypassed), judged by this agent's holder."""
    handler._state_holder._last_sync_time = -1
    handler._state_holder.sync()
    return handler._state_holder.state


@pytest.fixture
def store_port(monkeypatch):
    """A store, the join loop's turn under ddp_trainer.launch (0.1 s), no store in rank 0 (as the operator sets it)."""
    from torch.distributed.elastic.rendezvous import utils

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setattr(dr, "_delay", lambda seconds: utils._delay(min(seconds, 0.1) if isinstance(
        seconds, (int, float)) else seconds))
    port = free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield port
    del master


def test_sixteen_agents_form_and_re_form_in_a_few_writes_every_agent_ranked_once(store_port):
    agents = [_agent(store_port, "help", i, str(i)) for i in range(N)]
    handlers = [h for h, _, _ in agents]
    ranks = _next_round(handlers)
    assert sorted(ranks.values()) == list(range(N)) and set(ranks) == set(handlers), ranks
    formed = sum(b.writes for _, b, _ in agents)
    time.sleep(1.5 * KEEP_ALIVE_S)  # every agent's first heartbeat in the round: rule 5's record, by key now
    trained = sum(b.writes for _, b, _ in agents) - formed

    lost = handlers[1]
    lost._stop_heartbeats()  # killed without leaving; its pod's new agent takes its place at once (rule 4)
    replacement = _agent(store_port, "help", N, "1")
    members = [a for a in agents if a[0] is not lost] + [replacement]
    writes0, tries0 = sum(b.writes for _, b, _ in members), [b.tries for _, b, _ in members]
    ranks = _next_round([h for h, _, _ in members])
    writes = sum(b.writes for _, b, _ in members) - writes0
    tries = [b.tries - t for (_, b, _), t in zip(members, tries0)]
    try:
        assert sorted(ranks.values()) == list(range(N)) and set(ranks) == {h for h, _, _ in members}, ranks
        state = _fresh(members[0][0])
        assert state.complete and set(state.participants) == {h._this_node for h in ranks}
        assert lost._this_node not in state.participants and not state.wait_list
        # torch: about 3 writes per agent to re-form, rule 8 about 1 (test_trainer_rendezvous_batching.py)
        assert formed <= N / 2, f"{formed} state writes to form a group of {N}"
        # rule 5's record is a key of the round's; the one writer left is the refresher, once a keep-alive interval
        assert trained <= 3, f"{trained} state writes in {1.5 * KEEP_ALIVE_S} s of training"
        assert writes <= N / 2, f"{writes} state writes to re-form a group of {N}"
        assert sum(tries) <= N / 2 and max(tries) <= 4, f"compare-and-sets of the state per agent: {sorted(tries)}"
    finally:
        for h, _, _ in members:
            h._stop_heartbeats()


def test_an_agent_that_announced_and_died_expires_as_if_it_had_written_itself(store_port):
    """And a participant silent after it was heard of in its round (rule 5's record, a key now) expires as before."""
    agents = [_agent(store_port, "dead", i, str(i)) for i in range(N)]
    handlers = [h for h, _, _ in agents]
    assert sorted(_next_round(handlers).values()) == list(range(N))
    time.sleep(1.5 * KEEP_ALIVE_S)  # every agent heard of the round
    silent = handlers.pop(3)
    silent._stop_heartbeats()
    doomed, _, _ = _agent(store_port, "dead", N, str(N))
    assert doomed._op_executor.helping.announce(_fresh(doomed), doomed._this_node) == -1  # then it dies
    writer = handlers[0]
    _fresh(writer)
    writer._state_holder.mark_dirty()  # any write of the state (a heartbeat's, a join's) folds it in
    assert writer._state_holder.sync() is True
    state = _fresh(writer)
    assert doomed._this_node in state.redundancy_list, "placed as its own join would have: the round is full"
    assert set(state.participants) == {h._this_node for h in handlers} | {silent._this_node}
    time.sleep(KEEP_ALIVE_S * ATTEMPTS + 1.5)
    state = _fresh(writer)
    try:
        assert doomed._this_node not in state.redundancy_list and doomed._this_node not in state.last_heartbeats
        assert silent._this_node not in state.participants, "rule 5 judged it: it had been heard of"
        assert state.complete and set(state.participants) == {h._this_node for h in handlers}, "the others stay"
    finally:
        for h in handlers:
            h._stop_heartbeats()


def test_one_refresher_keeps_the_states_heartbeats_fresh_so_readers_read_no_heartbeat_keys(store_port):
    """Heartbeats are keys of their own (rule 7): once the state's copies are older than the expiry, every agent's
    every read fetched all N keys to judge them (O(N²) a poll interval). The round's first participant writes them
    into the state once a keep-alive interval instead."""
    agents = [_agent(store_port, "fresh", i, str(i)) for i in range(N)]
    handlers = [h for h, _, _ in agents]
    assert sorted(_next_round(handlers).values()) == list(range(N))
    time.sleep(1.5 * KEEP_ALIVE_S)
    before = [s.ops.get("multi_get", 0) for _, _, s in agents]
    time.sleep(KEEP_ALIVE_S * ATTEMPTS + 2)  # every heartbeat the round's writes put into the state has expired
    key_reads = [s.ops.get("multi_get", 0) - b for (_, _, s), b in zip(agents, before)]
    state = _fresh(handlers[5])
    try:
        assert state.complete and set(state.participants) == set(h._this_node for h in handlers)
        oldest = min(state.last_heartbeats.values())
        assert (datetime.now(timezone.utc) - oldest).total_seconds() < KEEP_ALIVE_S * ATTEMPTS
        assert sum(1 for n in key_reads if n) <= 1, f"agents that read heartbeat keys: {key_reads}"
    finally:
        for h in handlers:
            h._stop_heartbeats()
