"""Shared fixtures for the trainer tests: uninterrupted reference runs of the digits job, and a one-process group."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_trainer.log import Logger
from ddp_trainer.session import Session
from ddp_trainer.testing import LocalCluster, free_port
from tests.trainer.digits_job import DIGITS_ARGS, JOB_TIMEOUT, final_event


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """An uninterrupted 2-node run; also polls the progress endpoint while it trains."""
    work = tmp_path_factory.mktemp("reference")
    # Every pod's local rank 0 serves its own report: one port per simulated pod (they share the host).
    ports = [free_port(), free_port()]
    env = {"DDPJOB_TERMINATION_LOG": str(work / "termination-log")}
    seen: list[dict] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for port in ports:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=1) as resp:
                        seen.append(json.loads(resp.read()))
                except OSError:
                    pass
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    with LocalCluster(work, args=[*DIGITS_ARGS, "--step-delay", "0.01"], env=env, rdzv_id="reference") as cluster:
        poller.start()
        for port in ports:
            cluster.start_node(env={"DDPJOB_PROGRESS_PORT": str(port)})
        rcs = cluster.wait_exit(timeout=JOB_TIMEOUT)
        stop.set()
        poller.join()
        assert rcs == {"node0": 0, "node1": 0}, cluster.dump()
        final = final_event(cluster)
        termination = json.loads(Path(work / "termination-log").read_text())
        return {
            "digest": final["weights_sha256"],
            "test_accuracy": float(final["test_accuracy"]),
            "steps": final.int("step"),
            "progress": [p for p in seen if p.get("rank") == 0],
            "progress_all": seen,
            "termination": termination,
        }


@pytest.fixture(scope="session")
def reference_two_workers_per_pod(tmp_path_factory):
    """An uninterrupted run of 2 pods with 2 workers each (world size 4): the weights a killed 2x2 run ends with."""
    work = tmp_path_factory.mktemp("reference-2x2")
    with LocalCluster(work, nproc_per_node=2, args=DIGITS_ARGS, rdzv_id="reference-2x2") as cluster:
        cluster.start_node()
        cluster.start_node()
        rcs = cluster.wait_exit(timeout=JOB_TIMEOUT)
        assert rcs == {"node0": 0, "node1": 0}, cluster.dump()
        final = final_event(cluster)
        return {"digest": final["weights_sha256"], "steps": final.int("step")}


@pytest.fixture
def single_process_group():
    """A one-process gloo group and its Session: a Run's collectives without a second process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield Session(rank=0, world_size=1, local_rank=0, local_world_size=1, group_rank=0, restart_count=0,
                  run_key="unit", device=torch.device("cpu"), backend="gloo", log=Logger(0))
    dist.destroy_process_group()
