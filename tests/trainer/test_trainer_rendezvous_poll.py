"""How often an agent reads the rendezvous state from the store (ddp_trainer.rendezvous_rules.poll_interval), on
torch's own handler and state holder over a real TCPStore (loopback, no torchrun).

torch's state holder serves a cached state for 1 s whatever the join loop's delay (ddp_trainer.launch polls every
0.1 s): a waiting agent saw a completed round up to a second late, and every agent read the O(N) state once a
second whatever N. Under this backend's executor a waiting agent reads every poll_interval(N) (0.1 s up to 8 nodes,
growing past it, at most 2 s), and a training agent's look (num_nodes_waiting, every monitor interval) keeps
torch's 1 s, or the longer interval of a large job."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # noqa: E402

from ddp_trainer import rendezvous  # noqa: E402
from ddp_trainer.rendezvous_rules import poll_interval  # noqa: E402
from ddp_trainer.testing import free_port  # noqa: E402


class Counting(C10dRendezvousBackend):
    """A backend that counts its reads of the state."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reads = 0

    def get_state(self):
        self.reads += 1
        return super().get_state()


class LookingStore(dist.Store):
    """A store client that counts the looks at the state's version (rule 11: an ``add`` to ``<state key>/version``)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.looks = inner, 0

    def add(self, key, n):
        self.looks += key.endswith("/version")
        return self.inner.add(key, n)

    def __getattribute__(self, name):
        if name in ("set", "get", "compare_set", "check", "wait", "multi_get", "append", "delete_key", "set_timeout"):
            return getattr(object.__getattribute__(self, "inner"), name)
        return object.__getattribute__(self, name)


def _agent(port: int, run_id: str, pod: str, nodes: int):
    store = LookingStore(TCPStore("127.0.0.1", port, is_master=False))
    backend = Counting(store, run_id)
    timeout = dr.RendezvousTimeout(last_call=timedelta(seconds=0.05))
    handler = dr.DynamicRendezvousHandler.from_backend(run_id, store, backend, nodes, nodes, timeout=timeout)
    assert rendezvous.enable_take_over(handler, pod)  # this backend's executor, as under ddp_trainer.launch
    backend.looks = lambda: store.looks
    return handler, backend


def _reads_while_waiting(handler, backend, seconds: float) -> float:
    joined = threading.Thread(target=handler._op_executor.run, args=(dr._RendezvousJoinOp(), time.monotonic() + 60),
                              daemon=True)
    joined.start()
    time.sleep(0.5)  # entered the rendezvous
    before = backend.reads
    time.sleep(seconds)
    return (backend.reads - before) / seconds, joined


@pytest.fixture
def launch_delay(monkeypatch):
    """The join loop's delay under ddp_trainer.launch: 0.1 s instead of torch's 1 s."""
    from torch.distributed.elastic.rendezvous import utils

    monkeypatch.setattr(dr, "_delay", lambda seconds: utils._delay(min(seconds, 0.1) if isinstance(
        seconds, (int, float)) else seconds))


def test_a_small_jobs_waiting_agent_reads_every_tenth_of_a_second_and_a_training_one_every_second(launch_delay):
    port = free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (keeps the store)
    first, first_backend = _agent(port, "small", "0", 2)
    rate, joined = _reads_while_waiting(first, first_backend, 2.0)
    assert rate >= 1 / poll_interval(2) / 2, f"{rate:.1f} reads/s while waiting (torch's cache: 1/s)"

    second, _ = _agent(port, "small", "1", 2)
    arrived = time.monotonic()
    second._op_executor.run(dr._RendezvousJoinOp(), time.monotonic() + 30)
    joined.join(10)
    seen_s = time.monotonic() - arrived
    assert not joined.is_alive() and first._state_holder.state.complete
    assert seen_s < 0.6, f"the waiting agent saw the round complete {seen_s:.2f} s after the last one arrived"

    before = first_backend.reads
    for _ in range(20):  # training: torchrun's monitor looks every 0.1 s
        first.num_nodes_waiting()
        time.sleep(0.1)
    assert first_backend.reads - before <= 3, "a training agent's look reads the store at most once a second"


def test_a_large_jobs_waiting_agent_looks_less_often_and_reads_no_state_until_its_round_concerns_it(launch_delay):
    """Rule 6: it looks every poll_interval(64); rules 11 and 12: a look is a small key, and the whole state is not
    read while it does not change, nor when another agent's arrival changes it: the agent, a participant of a round
    not complete yet, waits for the round's completion key (before rule 12 it read the state at its next look after
    the arrival; before rule 11 at every look)."""
    port = free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    agent, backend = _agent(port, "large", "0", 64)
    looks0 = backend.looks()
    reads, joined = _reads_while_waiting(agent, backend, 3.0)
    looks = (backend.looks() - looks0) / 3.5  # from the join's start: _reads_while_waiting waits 0.5 s first
    assert looks <= 1.5 / (0.8 * poll_interval(64)), f"{looks:.1f} looks/s while waiting in a 64-node rendezvous"
    assert looks >= 0.5 / poll_interval(64), f"{looks:.1f} looks/s"
    assert reads * 3.0 <= 1, f"{reads * 3:.0f} reads of the whole state in 3 s while it did not change"
    # A second agent waits too; the first is the state's refresher (rule 10), which reads as before.
    waiting, waiting_backend = _agent(port, "large", "1", 64)
    threading.Thread(target=lambda: _join_quietly(waiting), daemon=True).start()
    other, _ = _agent(port, "large", "2", 64)
    try:
        _until(lambda: waiting._this_node in waiting._state_holder.state.participants, "the second agent joined")
        time.sleep(3 * poll_interval(64))
        before = waiting_backend.reads
        threading.Thread(target=lambda: _join_quietly(other), daemon=True).start()
        _until(lambda: other._this_node in other._state_holder.state.participants, "the third agent joined")
        time.sleep(3 * poll_interval(64))
        assert waiting_backend.reads == before, f"{waiting_backend.reads - before} reads for another's arrival"
        assert other._this_node not in waiting._state_holder.state.participants
        assert waiting._op_executor.versioned.quiet_looks >= 2
    finally:
        for h in (agent, waiting, other):
            h._stop_heartbeats()


def _until(done, what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _join_quietly(handler) -> None:
    try:
        handler._op_executor.run(dr._RendezvousJoinOp(), time.monotonic() + 30)
    except Exception:  # noqa: BLE001 (the round never fills; the test ends first)
        pass
