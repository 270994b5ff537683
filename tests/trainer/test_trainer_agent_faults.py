"""Agents that fail in ways other than a clean kill, under ddp_trainer.launch in DDPJob pods (DDPJOB_POD_INDEX set):
a frozen node that wakes after its pod was recreated elsewhere, an agent that fails on its own, and an agent held up
just as its first round completes. None may cost the job more than one recovery (ddp_trainer.launch items 4 and 5,
ddp_trainer.rendezvous rules 4 and 5); the last must cost it nothing."""

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


def test_a_stall_as_the_first_round_completes_does_not_split_the_group(tmp_path, reference):
    """One agent held up (SIGSTOP of it and its workers: a cold page cache on a loaded node, a paused container) after
    both agents joined round 0, and woken once the other agent completed the round and the keep-alive expiry passed.
    torch's expiry dropped it from the round it was part of: it joined round 1 alone while the other waited in round 0
    for MASTER_ADDR until its store wait timed out (DistStoreError after 60 s, then a counted restart; on kind, 3 of 11
    cold starts). Under rendezvous rule 5 it keeps its place: the group starts in round 0 and trains to the end with
    the reference weights, nobody restarts."""
    expiry = 10  # keep-alive 1 s x 10: the held agent must not expire before the round completes (last call 5 s)
    with LocalCluster(tmp_path, nnodes="2:3", args=[*DIGITS_ARGS, *SLOW], rdzv_id="stall", store_process=True,
                      launcher="ddp_trainer.launch",
                      rdzv_conf={"last_call_timeout": "5", "keep_alive_max_attempt": str(expiry)}) as cluster:
        cluster.start_store()
        held = cluster.start_node(env=_pod(0))
        cluster.start_node(env=_pod(1))
        cluster.wait_for_rendezvous(lambda s: len(s.participants) == 2 and not s.complete, timeout=JOB_TIMEOUT,
                                    what="both agents in round 0")
        _signal_tree(held, signal.SIGSTOP)
        held_at = time.time()
        cluster.wait_for_rendezvous(lambda s: s.complete, timeout=60, what="round 0 completed by the other agent")
        time.sleep(max(0.0, held_at + expiry + 4 - time.time()))  # past the held agent's heartbeat expiry
        _signal_tree(held, signal.SIGCONT)
        rcs = cluster.wait_exit(timeout=JOB_TIMEOUT)
        assert set(rcs.values()) == {0}, cluster.dump()
        logs = "".join(n.log_path.read_text(errors="replace") for n in cluster.nodes)
        assert "DistStoreError" not in logs and "will restart worker group" not in logs, cluster.dump()
        assert cluster.rendezvous_state().round == 0, "the group formed once, in round 0"
        assert not cluster.events("resume"), cluster.dump()
        assert final_event(cluster)["weights_sha256"] == reference["digest"], cluster.dump()
