"""An elastic job's rendezvous under real torchrun agents on loopback (issue 34): an elastic 1..3 job at spec.nodes 2,
with lastCallTimeoutSeconds 10, run with the rendezvous backend and size file the operator gives its pods
(ddp_operator.env). Its round closes the moment the second agent joins, instead of waiting out the last call for a
third that was never wanted (torch's c10d: ~10 s on every start and resize); when the size becomes 3 a third agent
joins and the group re-forms at 3.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from ddp_operator.env import trainer_env
from ddp_operator.spec import parse_job
from ddp_trainer.testing import LocalCluster

pytestmark = pytest.mark.slow

IDLE_WORKER = str(Path(__file__).with_name("idle_worker.py"))
LAST_CALL_S = 10
JOB = {"apiVersion": "ddp.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": "el", "namespace": "t", "uid": "u"},
       "spec": {"nodes": 2, "minNodes": 1, "maxNodes": 3, "torchrun": {"lastCallTimeoutSeconds": LAST_CALL_S},
                "template": {"spec": {"containers": [{"name": "trainer", "image": "x", "command": ["torchrun"]}]}}}}


def _operator_env() -> dict[str, str]:
    return {e["name"]: e.get("value") for e in trainer_env(parse_job(JOB), 0, 0)}


def _worlds(cluster: LocalCluster) -> dict[str, list[int]]:
    return {n.name: [int(w) for w in re.findall(r"worker-start pod=\S+ rank=\d+ world=(\d+)",
                                                  n.log_path.read_text(errors="replace"))] for n in cluster.nodes}


def _watch(cluster: LocalCluster, done, timeout: float, what: str) -> tuple[float | None, float]:
    """Poll the rendezvous state: (when a participant was first seen in a round not yet complete, when ``done``
    first held)."""
    first = None
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = cluster.rendezvous_state()
        now = time.time()
        if state is not None:
            if first is None and state.participants and not state.complete:
                first = now
            if done(state):
                return first, now
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}\n{cluster.dump()}")


def test_an_elastic_round_closes_at_the_desired_size_and_follows_a_scale_up(tmp_path):
    env = _operator_env()
    backend = env["PET_RDZV_BACKEND"]
    size = tmp_path / "nodes"
    size.write_text("2\n")
    agent_env = {"IDLE_SECONDS": "40"}
    if "DDPJOB_NODES_FILE" in env:  # the kubelet's downward-API file, as the operator asks for it
        agent_env["DDPJOB_NODES_FILE"] = str(size)
    conf = {"last_call_timeout": str(LAST_CALL_S), "keep_alive_interval": "1", "keep_alive_max_attempt": "3"}
    with LocalCluster(tmp_path, nnodes=env["PET_NNODES"], module=IDLE_WORKER, rdzv_id="elastic", store_process=True,
                      rdzv_backend=backend, rdzv_conf=conf, env=agent_env) as cluster:
        cluster.start_store()
        for i in range(2):
            cluster.start_node(env={"DDPJOB_POD_INDEX": str(i)})
        first, complete = _watch(cluster, lambda s: s.complete and len(s.participants) == 2, 120, "a round of 2")
        waited = complete - (first or complete)
        print(f"backend {backend}: the round of 2 completed {waited:.2f} s after its first participant joined")
        assert waited < LAST_CALL_S / 2, f"the round waited {waited:.1f} s (last call {LAST_CALL_S} s)"
        deadline = time.time() + 60
        while sorted(ws[-1] if ws else 0 for ws in _worlds(cluster).values()) != [2, 2]:
            assert time.time() < deadline, cluster.dump()
            time.sleep(0.2)

        # kubectl scale 2 -> 3: the operator patches the size first, then creates pod 2
        size.write_text("3\n")
        cluster.start_node(env={"DDPJOB_POD_INDEX": "2"})
        _, at_three = _watch(cluster, lambda s: s.complete and len(s.participants) == 3, 120, "a round of 3")
        deadline = time.time() + 60
        while sorted(ws[-1] if ws else 0 for ws in _worlds(cluster).values()) != [3, 3, 3]:
            assert time.time() < deadline, cluster.dump()
            time.sleep(0.2)
        worlds = _worlds(cluster)
        print(f"worker starts per agent (world sizes): {worlds}")
        assert all(ws[-1] == 3 for ws in worlds.values()), worlds
        # one re-form for the new size: the first two started a worker of world 2, then one of world 3
        assert [ws for name, ws in sorted(worlds.items())][:2] == [[2, 3], [2, 3]], worlds
