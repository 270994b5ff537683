"""A training agent's heartbeat under this project's executor (ddp_trainer.rendezvous, rule 7), on torch's own handler
and state holder over a real TCPStore (loopback, no torchrun).

torch keeps every agent's last heartbeat inside the one shared state, so each heartbeat rewrote the whole state (a
compare-and-set of O(N) bytes) once per keep-alive interval: N agents wrote O(N²) bytes a second, and their writes
raced each other (make bench-rdzv-scale: docs/scale.md). Under rule 7 a heartbeat is one small key of its own; the
shared state is written only when the membership changes (and once per round by rule 5), and a silent agent is still
dropped once its heartbeats expire."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

pytest.importorskip("torch")

from torch.distributed import TCPStore  # noqa: E402
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # noqa: E402

from ddp_trainer import rendezvous, rendezvous_rules  # noqa: E402
from ddp_trainer.testing import free_port  # noqa: E402

KEEP_ALIVE_S, ATTEMPTS = 1, 2  # expiry after 2 s


class Counting(C10dRendezvousBackend):
    """A backend that counts its writes of the state."""

    def __init__(self, *args):
        super().__init__(*args)
        self.writes = 0

    def set_state(self, state, token=None):
        self.writes += 1
        return super().set_state(state, token)


def _group(port: int, run_id: str, n: int):
    agents = []
    for i in range(n):
        store = TCPStore("127.0.0.1", port, is_master=False)
        backend = Counting(store, run_id)
        handler = dr.DynamicRendezvousHandler.from_backend(
            run_id, store, backend, n, n, local_addr=f"agent-{i}", timeout=dr.RendezvousTimeout(join=timedelta(60)),
            keep_alive_interval=KEEP_ALIVE_S, keep_alive_max_attempt=ATTEMPTS)
        assert rendezvous.enable_take_over(handler, str(i))  # this backend's executor, as under ddp_trainer.launch
        agents.append((handler, backend))
    threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h, _ in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "the group did not form"
    return agents


def _fresh(handler):
    """The state as the store has it now (the holder's cache bypassed), judged by this agent's holder (under its
    heartbeat lock, as torch's own looks: its keep-alive timer syncs the same holder)."""
    with handler._heartbeat_lock:
        handler._state_holder._last_sync_time = -1
        handler._state_holder.sync()
        return handler._state_holder.state


@pytest.fixture
def group(monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the operator sets it: no store in rank 0
    port = free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    agents = _group(port, "beats", 3)
    yield agents
    for h, _ in agents:
        h._stop_heartbeats()
    del master


def test_a_training_agents_heartbeats_do_not_rewrite_the_shared_state_and_keep_it_alive(group):
    before = [b.writes for _, b in group]
    time.sleep(3 * KEEP_ALIVE_S * ATTEMPTS)  # three expiries' worth of heartbeats
    writes = [b.writes - w for (_, b), w in zip(group, before)]
    # rule 5: one write each (the first heartbeat in the round records that the agent heard of it), none after
    assert max(writes) <= 1, f"state writes per agent in {3 * KEEP_ALIVE_S * ATTEMPTS} s of training: {writes}"
    state = _fresh(group[0][0])
    assert state.complete and set(state.participants) == {h._this_node for h, _ in group}, state.participants


def test_a_silent_agent_is_still_dropped_once_its_heartbeats_expire(group):
    silent = group[1][0]
    time.sleep(1.5 * KEEP_ALIVE_S)  # every agent sent a heartbeat in the round (rule 5 keeps the unheard ones)
    silent._stop_heartbeats()
    time.sleep(KEEP_ALIVE_S * ATTEMPTS + 1.5)
    state = _fresh(group[0][0])
    assert silent._this_node not in state.participants and silent._this_node not in state.last_heartbeats
    assert {group[0][0]._this_node, group[2][0]._this_node} <= set(state.participants)


def _until(done, timeout: float = 10 * KEEP_ALIVE_S) -> None:
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_a_training_agents_heartbeat_key_goes_out_before_its_look_at_the_state(group):
    """torch's keep-alive looks at the state (a sync: store calls, the state read when it changed) before it sends the
    heartbeat; on a loaded machine those calls were slow and the key went out later than the expiry allows (512 agents
    on 2 cores: live agents dropped, the re-form churned; docs/scale.md). The key now goes first."""
    handler = group[0][0]
    beats, holder = handler._op_executor.beats, handler._state_holder
    _until(lambda: not rendezvous_rules._unheard(holder.state, handler._this_node))  # rule 5 recorded its first
    handler._stop_heartbeats()  # the test calls the keep-alive itself
    sends: list[float] = []
    send, sync = beats.send, holder.sync
    beats.send = lambda node: (sends.append(time.time()), send(node))[1]
    holder.sync = lambda: (time.sleep(1.5 * KEEP_ALIVE_S), sync())[1]  # a look slowed down by a loaded machine
    started = time.time()
    handler._keep_alive()
    assert sends and sends[0] - started < 0.5 * KEEP_ALIVE_S, f"heartbeat key sent {sends[0] - started:.2f} s late" \
        if sends else "no heartbeat key sent"
    state = _fresh(group[1][0])
    assert handler._this_node in state.participants, "the agent stays a participant"


def test_a_waiting_agents_heartbeat_key_goes_out_while_its_join_loop_is_slow(group):
    """While an agent waits in next_rendezvous, torch's timer is stopped and the join loop sends the heartbeats; one
    turn of it can take seconds on a loaded machine (a read of the whole state, lost writes), and the key went out as
    late (512 agents on 2 cores: live agents dropped while the group re-formed). A thread of the agent's sends it."""
    waiting = group[0][0]
    beats, holder = waiting._op_executor.beats, waiting._state_holder
    _until(lambda: not rendezvous_rules._unheard(holder.state, waiting._this_node))  # heard of the round (rule 5)
    sync = holder.sync
    holder.sync = lambda: (time.sleep(2 * KEEP_ALIVE_S * ATTEMPTS), sync())[1]  # each turn slower than the expiry
    joining = threading.Thread(target=waiting.next_rendezvous, daemon=True)  # the others train on: it waits
    joining.start()
    ages = []
    try:
        for _ in range(int(3 * KEEP_ALIVE_S * ATTEMPTS / 0.2)):
            time.sleep(0.2)
            ages.append(time.time() - float(beats._store.get(beats.key(waiting._this_node))))
    finally:
        holder.sync = sync
        group[1][0].set_closed()  # its join ends (RendezvousClosedError)
        joining.join(4 * KEEP_ALIVE_S * ATTEMPTS)
    assert max(ages) < KEEP_ALIVE_S * ATTEMPTS, f"the waiting agent's heartbeat key was {max(ages):.2f} s old"
