"""How many writes of the shared rendezvous state a re-form costs under this project's executor (ddp_trainer.rendezvous,
rule 8), on torch's own handler and state holder over a real TCPStore (loopback, no torchrun).

Every write is a compare-and-set of the whole state, O(N) bytes, and all agents write the one key, so writes are
serialised and the losers retry: torch's re-form after a loss took three writes per survivor (leave the round, enter
the wait list, enter the new round), 3N writes of O(N) bytes one after another (make bench-rdzv-scale: docs/scale.md).
Under rule 8 a survivor leaves for the wait list in one write, and the write that opens the new round admits every
agent waiting for it, by rule 2's priority: about one write per agent."""

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

N = 10  # rule 8 applies past 8 nodes


class Counting(C10dRendezvousBackend):
    """A backend that counts the writes of the state that took (a lost compare-and-set is not a write)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.writes = 0

    def set_state(self, state, token=None):
        out = super().set_state(state, token)
        self.writes += bool(out and out[2])
        return out


def _agent(port: int, i: int, pod: str):
    store = TCPStore("127.0.0.1", port, is_master=False)
    backend = Counting(store, "batch")
    handler = dr.DynamicRendezvousHandler.from_backend(
        "batch", store, backend, N, N, local_addr=f"agent-{i}", timeout=dr.RendezvousTimeout(join=timedelta(60)),
        keep_alive_interval=1, keep_alive_max_attempt=3)
    assert rendezvous.enable_take_over(handler, pod)  # this backend's executor, as under ddp_trainer.launch
    return handler, backend


def _next_round(handlers) -> dict:
    ranks: dict = {}
    threads = [threading.Thread(target=lambda h=h: ranks.__setitem__(h, h.next_rendezvous().rank), daemon=True)
               for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return ranks


@pytest.fixture
def launch_delay(monkeypatch):
    """The join loop's turn under ddp_trainer.launch (0.1 s), and no store in rank 0 (as the operator sets it)."""
    from torch.distributed.elastic.rendezvous import utils

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setattr(dr, "_delay", lambda seconds: utils._delay(min(seconds, 0.1) if isinstance(
        seconds, (int, float)) else seconds))


def test_a_re_form_writes_the_state_about_once_per_agent(launch_delay):
    port = free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (keeps the store)
    agents = [_agent(port, i, str(i)) for i in range(N)]
    assert sorted(_next_round([h for h, _ in agents]).values()) == list(range(N))
    time.sleep(1.5)  # every agent's first heartbeat in the round (rule 5 writes it into the state)

    lost, _ = agents[1]
    lost._stop_heartbeats()  # killed without leaving; its pod's new agent takes its place at once (rule 4)
    replacement = _agent(port, N, "1")
    members = [h for h, _ in agents if h is not lost] + [replacement[0]]
    backends = [b for h, b in agents if h is not lost] + [replacement[1]]
    before = sum(b.writes for b in backends)
    ranks = _next_round(members)
    writes = sum(b.writes for b in backends) - before
    assert sorted(ranks.values()) == list(range(N)) and set(ranks) == set(members), ranks
    assert writes <= 1.5 * N, f"{writes} state writes to re-form a group of {N} (torch: about 3 per agent)"
    for h in members:
        h._stop_heartbeats()
