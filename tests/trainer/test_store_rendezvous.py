"""The rendezvous store (store/ddp_store) as the real users drive it: two torchrun agents (one process each, loopback,
every agent is_host=0 as in a DDPJob) form a round through it with torch's c10d backend and with ours (ddpjob-c10d),
and their workers all_reduce over gloo; losing the store fails the agents, as losing torch's store did (the
operator's recovery rests on that: plan/rdzv_lost.py)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from ddp_trainer.rendezvous import BACKEND
from ddp_trainer.testing import LocalCluster

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).with_name("allreduce_worker.py"))


def _sums(cluster: LocalCluster) -> list[str]:
    return sorted(m for n in cluster.nodes for m in re.findall(r"allreduce rank=(\d) world=2 sum=3",
                                                                n.log_path.read_text(errors="replace")))


@pytest.mark.parametrize("backend", ["c10d", BACKEND])
def test_two_agents_form_a_round_and_all_reduce_through_the_store(tmp_path, backend):
    with LocalCluster(tmp_path, module=WORKER, rdzv_id=f"store-{backend}", store_process=True,
                      rdzv_backend=backend) as cluster:
        assert cluster.store_program == "ddp_store"
        cluster.start_store()
        for i in range(2):
            cluster.start_node(env={"DDPJOB_POD_INDEX": str(i)})
        rcs = cluster.wait_exit(cluster.nodes, timeout=180)
        assert rcs == {"node0": 0, "node1": 0}, cluster.dump()
        assert _sums(cluster) == ["0", "1"], cluster.dump()
        state = cluster.rendezvous_state()  # torch's own backend reads the shared state back
        assert state is not None and state.complete and state.closed, vars(state)  # round 0 formed, closed at the end


def test_the_agents_fail_when_the_store_is_lost(tmp_path):
    with LocalCluster(tmp_path, module=WORKER, rdzv_id="store-lost", store_process=True,
                      env={"IDLE_SECONDS": "120"}, max_restarts=0) as cluster:
        cluster.start_store()
        for i in range(2):
            cluster.start_node(env={"DDPJOB_POD_INDEX": str(i)})
        deadline = time.time() + 120
        while len(_sums(cluster)) < 2:
            assert time.time() < deadline and all(n.alive() for n in cluster.nodes), cluster.dump()
            time.sleep(0.2)
        cluster.kill(cluster.store, sig=15)
        assert cluster.store.proc.wait(timeout=10) == 0, cluster.dump()
        rcs = cluster.wait_exit(cluster.nodes, timeout=90)
        assert all(rc != 0 for rc in rcs.values()), (rcs, cluster.dump())
