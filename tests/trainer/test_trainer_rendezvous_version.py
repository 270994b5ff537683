"""Rule 11 of this project's executor (ddp_trainer.rendezvous_version) on torch's own handlers and state holders over a
real TCPStore (loopback, no torchrun): an agent reads the whole shared state only when it changed (a version key every
write bumps, looked at first), and rule 10's refresher vouches for the heartbeats in a small key instead of rewriting the
state, so a group that trains reads and writes no state at all, and a silent agent still expires.

Before rule 11 every agent read the whole state (O(N) bytes, unpickled) at every look past torch's cache, changed or
not, and the refresher rewrote it once a keep-alive interval: at 512 agents on 2 cores each agent read the 27 KB state
about 100 times while the group formed and no round completed (docs/scale.md)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

from test_trainer_rendezvous_helping import ATTEMPTS, KEEP_ALIVE_S, N, _agent, _fresh, _next_round  # noqa: E402
from test_trainer_rendezvous_helping import store_port  # noqa: E402,F401 (the fixture)

from ddp_trainer import rendezvous_version  # noqa: E402


def _ops(agents, op: str) -> list[int]:
    return [s.ops.get(op, 0) for _, _, s in agents]


def test_a_training_group_reads_and_writes_no_state_and_a_silent_agent_still_expires(store_port):
    agents = [_agent(store_port, "version", i, str(i)) for i in range(N)]
    handlers = [h for h, _, _ in agents]
    assert sorted(_next_round(handlers).values()) == list(range(N))
    time.sleep(1.5 * KEEP_ALIVE_S)  # every agent heard of the round (rule 5: a key of the round's)
    reads0, writes0, keys0 = _ops(agents, "get"), sum(b.tries for _, b, _ in agents), _ops(agents, "multi_get")
    idle_s = KEEP_ALIVE_S * ATTEMPTS + 2  # the heartbeats the round's writes put into the state have all expired
    for _ in range(int(idle_s / 0.25)):  # training: every agent looks at the rendezvous (num_nodes_waiting)
        for h in handlers:
            h.num_nodes_waiting()
        time.sleep(0.25)
    reads = [a - b for a, b in zip(_ops(agents, "get"), reads0)]
    writes = sum(b.tries for _, b, _ in agents) - writes0
    key_reads = [a - b for a, b in zip(_ops(agents, "multi_get"), keys0)]
    try:
        # before rule 11: a read per agent per look past the 1 s cache (the refresher's write changed it every second)
        assert max(reads) == 0, f"reads of the whole state per agent in {idle_s} s of training: {reads}"
        assert writes == 0, f"{writes} state writes in {idle_s} s of training (the refresher vouches instead)"
        # The refresher's vouch spares the others the N heartbeat keys; one that comes late (a starved refresher on a
        # loaded machine) sends a reader to the keys for that look only: a few reads in all, where every agent read
        # them at every look past the expiry without the vouch.
        assert sum(key_reads) <= len(handlers), f"heartbeat key reads per agent in {idle_s} s: {key_reads}"
        assert all(h._op_executor.versioned is not None for h in handlers)

        silent = handlers[4]
        silent._stop_heartbeats()  # killed without leaving
        time.sleep(KEEP_ALIVE_S * ATTEMPTS + 1.5)
        state = _fresh(handlers[7])
        assert silent._this_node not in state.participants, "the vouch left it out: judged by its key, it expired"
        assert set(state.participants) == {h._this_node for h in handlers if h is not silent}, "the others stay"
    finally:
        for h in handlers:
            h._stop_heartbeats()


def test_a_look_keeps_the_state_only_while_it_is_the_stores(store_port):
    """A write by one agent is seen by every other at its next look (the version moved), and each reads it once."""
    agents = [_agent(store_port, "moved", i, str(i)) for i in range(N)]
    handlers = [h for h, _, _ in agents]
    assert sorted(_next_round(handlers).values()) == list(range(N))
    try:
        for h in handlers:
            _fresh(h)
        reads0 = _ops(agents, "get")
        writer = handlers[2]
        writer._state_holder.mark_dirty()
        assert writer._state_holder.sync() is True  # a write of the state as it is: a new version
        version = writer._op_executor.versioned.known[0]
        for h in handlers:
            _fresh(h)
            assert h._op_executor.versioned.known[0] == version, "every look saw the new version"
        reads = [a - b for a, b in zip(_ops(agents, "get"), reads0)]
        assert reads[2] == 0 and all(r == 1 for i, r in enumerate(reads) if i != 2), reads
        for h in handlers:
            _fresh(h)
        assert _ops(agents, "get") == [r0 + r for r0, r in zip(reads0, reads)], "unchanged: nobody read it again"
    finally:
        for h in handlers:
            h._stop_heartbeats()


def test_vouch_lines_round_trip_and_garbage_is_ignored():
    assert rendezvous_version.parse_vouch(rendezvous_version.vouch_line(7, 12.5, ["a_1_2", "b_3_4"])) == \
        (7, 12.5, {"a_1_2", "b_3_4"})
    assert rendezvous_version.parse_vouch(b"3 1.000") == (3, 1.0, set())
    for raw in ("", b"", "x 1", "1 nan", "-1 2.0", "1", None, 3):
        assert rendezvous_version.parse_vouch(raw) is None, raw



def test_an_agent_waiting_for_its_round_reads_no_state_while_others_write_and_reads_it_when_the_round_completes(
        store_port):
    """Rule 12: an agent placed for the next round (in the wait list) looks at that round's key while the state changes
    under it, and reads the state when the round opens: every member ranked once. Before rule 12 it read the whole state
    at its next look after each write."""
    agents = [_agent(store_port, "quiet", i, str(i)) for i in range(N)]
    handlers = [h for h, _, _ in agents]
    assert sorted(_next_round(handlers).values()) == list(range(N))
    time.sleep(1.5 * KEEP_ALIVE_S)  # every agent heard of the round (rule 5)
    first, writer, others = handlers[0], handlers[2], [h for h in handlers if h is not handlers[0]]
    versioned = first._op_executor.versioned
    out: dict = {}
    leaving = threading.Thread(target=lambda: out.setdefault(first, first.next_rendezvous().rank), daemon=True)
    leaving.start()  # it leaves the round and waits in the wait list for the next
    try:
        deadline = time.monotonic() + 10
        while first._this_node not in _fresh(writer).wait_list:
            assert time.monotonic() < deadline, "the leaving agent was never placed in the wait list"
            time.sleep(0.05)
        time.sleep(0.5)  # its own write's read is behind it
        reads0, looks0 = versioned.full_reads, versioned.quiet_looks
        for _ in range(WRITES):  # the state changes under it, round R+1 still waiting: new versions
            writer._state_holder.mark_dirty()
            assert writer._state_holder.sync() is True
            time.sleep(0.4)  # two of its poll intervals at 16 nodes (rule 6: 0.2 s)
        reads, looks = versioned.full_reads - reads0, versioned.quiet_looks - looks0
        # a read once the state it holds is old enough that someone in it may have expired (3 s), not one per write
        assert reads <= WRITES // 4 and looks >= WRITES, f"{reads} reads of the state and {looks} looks at {WRITES} writes"

        ranks = _next_round(others)  # the others join: the round completes, and the waiting agent learns its rank
        leaving.join(30)
        ranks.update(out)
        assert sorted(ranks.values()) == list(range(N)) and set(ranks) == set(handlers), ranks
        assert versioned.full_reads > reads0, "it read the state once the round completed"
    finally:
        for h in handlers:
            h._stop_heartbeats()


WRITES = 8
