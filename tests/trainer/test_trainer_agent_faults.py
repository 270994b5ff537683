"""Agents that fail in ways other than a clean kill, under ddp_trainer.launch in DDPJob pods (DDPJOB_POD_INDEX set):
a frozen node that wakes after its pod was recreated elsewhere, and an agent that fails on its own. Either must cost
the job one recovery, never the job (ddp_trainer.launch items 4 and 5, ddp_trainer.rendezvous rule 4)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from ddp_trainer.testing import LocalCluster, descendants, forked_workers, recovery_after_kill
from tests.trainer.digits_job import DIGITS_ARGS, JOB_TIMEOUT, SLOW, final_event

pytestmark = pytest.mark.slow

EXPIRY_S = 2  # LocalCluster's fault-tolerant keep-alives: 1 s x 2 attempts


def _pod(i: int) -> dict[str, str]:
    return {"DDPJOB_POD_INDEX": str(i)}


def _signal_tree(node, sig: int) -> None:
    for pid in [node.proc.pid, *descendants(node.proc.pid)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_a_frozen_agent_woken_after_its_replacement_joined_stops(tmp_path, reference):
    """A node frozen (SIGSTOP of its agent and workers: a paused VM, a kubelet cut off) until its heartbeats expired,
    its pod recreated on another node, then woken: the group resumed with the replacement from the survivor's
    snapshot, and the woken agent stops with TakenOver instead of taking the replacement's place back (on kind it
    did: rendezvous rule 4 forgot agents whose heartbeats had expired). The job ends with the reference weights and
    the group never re-forms after the wake."""
    with LocalCluster(tmp_path, args=[*DIGITS_ARGS, *SLOW], rdzv_id="frozen", store_process=True,
                      launcher="ddp_trainer.launch") as cluster:
        cluster.start_store()
        survivor = cluster.start_node(env=_pod(0))
        frozen = cluster.start_node(env=_pod(1))
        cluster.wait_for_step(25, timeout=JOB_TIMEOUT)
        _signal_tree(frozen, signal.SIGSTOP)
        frozen_at = time.time()
        time.sleep(EXPIRY_S * 2 + 1)  # long past the heartbeat expiry: torch forgets the frozen agent
        replacement = cluster.start_node("node1-replacement", env=_pod(1))
        rec = recovery_after_kill(cluster, frozen_at, timeout=JOB_TIMEOUT)
        assert rec["source"] == "peer", rec
        woken_at = time.time()
        _signal_tree(frozen, signal.SIGCONT)
        rcs = cluster.wait_exit([survivor, replacement], timeout=JOB_TIMEOUT)
        assert set(rcs.values()) == {0}, cluster.dump()
        assert frozen.proc.wait(timeout=60) != 0, cluster.dump()
        log = frozen.log_path.read_text(errors="replace")
        assert "was replaced by a newer agent of pod 1" in log, cluster.dump()
        assert not [e for e in cluster.events("resume") if e.time > woken_at], cluster.dump()  # no re-form
        assert final_event(cluster)["weights_sha256"] == reference["digest"], cluster.dump()


def test_an_agent_that_fails_leaves_the_rendezvous_open_for_its_replacement(tmp_path, reference):
    """An agent that ends on a failure (here its workers failed more often than --max-restarts allows; on kind, a
    role-info wait timed out) closed the rendezvous for good under torchrun: the recreated pod's agent failed with
    RendezvousClosedError, and so would every later one. In a DDPJob pod it leaves the rendezvous open; its
    replacement joins and training resumes from the survivor's snapshot, bitwise."""
    with LocalCluster(tmp_path, args=[*DIGITS_ARGS, *SLOW], rdzv_id="failed-agent", store_process=True,
                      launcher="ddp_trainer.launch") as cluster:
        cluster.start_store()
        survivor = cluster.start_node(env=_pod(0))
        failing = cluster.start_node(env=_pod(1), max_restarts=0)
        cluster.wait_for_step(25, timeout=JOB_TIMEOUT)
        workers = forked_workers(descendants(failing.proc.pid))
        assert workers, cluster.dump()
        failed_at = time.time()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        assert failing.proc.wait(timeout=JOB_TIMEOUT) != 0, cluster.dump()
        assert "the rendezvous stays open" in failing.log_path.read_text(errors="replace"), cluster.dump()
        replacement = cluster.start_node("node1-replacement", env=_pod(1))
        rec = recovery_after_kill(cluster, failed_at, timeout=JOB_TIMEOUT)
        rcs = cluster.wait_exit([survivor, replacement], timeout=JOB_TIMEOUT)
        assert set(rcs.values()) == {0}, cluster.dump()
        assert rec["source"] == "peer" and rec["steps_lost"] <= (rec["snapshot_every"] or 1), rec
        assert "RendezvousClosedError" not in replacement.log_path.read_text(errors="replace"), cluster.dump()
        assert final_event(cluster)["weights_sha256"] == reference["digest"], cluster.dump()
