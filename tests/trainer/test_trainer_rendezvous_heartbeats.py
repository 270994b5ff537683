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

from ddp_trainer import rendezvous  # noqa: E402
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
    """The state as the store has it now (the holder's cache bypassed), judged by this agent's holder."""
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
