"""The trainer under real torchrun agents on loopback (c10d), each agent a simulated pod.

Kills are SIGKILLs of a whole agent with its workers (own PID namespace where possible), as when a pod
dies. All waits poll the logs with generous deadlines: the CI machine has two busy cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from ddp_trainer.testing import (
    REPO_TRAINER_DIR, Event, LocalCluster, descendants, forked_workers, free_port, recovery_after_kill,
    torchrun_workers,
)
from tests.trainer.digits_job import DIGITS_ARGS, JOB_TIMEOUT, SLOW, final_event

pytestmark = pytest.mark.slow


def test_two_nodes_reach_accuracy_and_report_progress(reference):
    assert reference["test_accuracy"] >= 0.90
    steps = [p["step"] for p in reference["progress"]]
    assert steps and max(steps) > 0, "the progress endpoint never answered"
    sample = next(p for p in reference["progress"] if p["step"] > 0)
    assert {"step", "epoch", "loss", "samplesPerSecond", "lastCheckpointStep", "worldSize", "metrics", "time"} <= set(
        sample
    )
    assert sample["worldSize"] == 2 and sample["workerRestarts"] == 0
    # every pod's local rank 0 answers for itself, naming its global rank
    assert {p["rank"] for p in reference["progress_all"] if p["step"] > 0} == {0, 1}
    assert "recovery" not in sample  # an uninterrupted run recovered nothing
    term = reference["termination"]
    assert term["final"] is True and term["metrics"]["testAccuracy"] >= 0.90 and term["step"] == reference["steps"]


def _assert_every_rank_restored(cluster: LocalCluster, after: float, step: int, own: dict[str, str]) -> None:
    """Both workers of each pod in ``own`` restored ``step`` (their first event=rank_restored at or after ``after``):
    from their own state where they held that step (``own[pod]``: the pod's copy or the rank's resident file), else
    from a peer's broadcast."""
    lines: dict[tuple[str, int], Event] = {}
    for e in cluster.events("rank_restored"):
        if e.time >= after:
            lines.setdefault((e.node, e.int("local_rank")), e)
    got = {key: (e["source"], e.int("step")) for key, e in lines.items()}
    want = {(pod, local_rank): (source if (pod, local_rank) in lines and lines[pod, local_rank].int("held") == step
                                else "peer", step)
            for pod, source in own.items() for local_rank in (0, 1)}
    assert got == want, cluster.dump()


@pytest.mark.parametrize(("with_disk_checkpoints", "nproc_per_node"), [(True, 1), (False, 2)],
                         ids=["checkpoints", "peer-only-two-workers-per-pod"])
def test_kill_non_host_node_resumes_bitwise(tmp_path, request, with_disk_checkpoints, nproc_per_node):
    """Items 2 and 3: a replaced non-host node; with disk checkpoints off, recovery is peer-only.

    With two workers per pod (world size 4, ``--nproc-per-node 2``), local rank 1 of the victim pod is killed first
    (its agent restarts both workers in place), then the whole pod. After each kill every worker of every pod logs
    where its own state came from, and each restored the step the group resumed from: after the worker kill each
    rank holds it itself (the host pod, resident state on: both ranks their own resident file; the victim pod, copies
    only: both ranks the pod's copy, which local rank 0 alone writes); after the pod kill the host's two ranks their
    resident files and the replacement's two the broadcast. The final weights equal an uninterrupted 2x2 run's: so no
    local rank restored a wrong state, and the first step after a restart rounds as the uninterrupted run's (with more
    than two ranks DDP's re-bucketing after its first iteration would break that; trainer/README.md)."""
    reference = request.getfixturevalue("reference" if nproc_per_node == 1 else "reference_two_workers_per_pod")
    env, host_env, victim_env = {}, None, None
    if with_disk_checkpoints:
        env = {"DDPJOB_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "DDPJOB_CHECKPOINT_EVERY": "10"}
    if nproc_per_node > 1:
        host_env, victim_env = {"DDPJOB_SNAPSHOT_RESIDENT": "1"}, {"DDPJOB_SNAPSHOT_RESIDENT": "0"}
    kill_step = 33 if with_disk_checkpoints else 35
    with LocalCluster(tmp_path, nproc_per_node=nproc_per_node, args=[*DIGITS_ARGS, *SLOW], env=env,
                      rdzv_id=f"kill-{kill_step}") as cluster:
        host = cluster.start_node(env=host_env)
        victim = cluster.start_node(env=victim_env)
        since = float("-inf")
        if nproc_per_node > 1:
            cluster.wait_for_step(15, timeout=JOB_TIMEOUT)
            killed_at = cluster.kill_workers(victim, local_ranks=[1])
            rec = recovery_after_kill(cluster, killed_at, timeout=JOB_TIMEOUT)
            assert rec["source"] in ("local", "peer") and rec["steps_lost"] <= rec["snapshot_every"], rec
            _assert_every_rank_restored(cluster, killed_at, rec["resumed_from"],
                                        {host.name: "resident", victim.name: "snapshot"})
            since = rec["restored_at"]
        cluster.wait_for_step(kill_step, timeout=JOB_TIMEOUT)
        killed_at = cluster.kill(victim)
        replacement = cluster.start_node("node1-replacement", env=victim_env)
        rec = recovery_after_kill(cluster, killed_at, timeout=JOB_TIMEOUT, since=since)
        rcs = cluster.wait_exit([host, replacement], timeout=JOB_TIMEOUT)
        assert set(rcs.values()) == {0}, cluster.dump()
        assert rec["source"] == "peer", rec
        assert rec["snapshot_every"] is not None and rec["steps_lost"] <= rec["snapshot_every"], rec
        if nproc_per_node > 1:
            _assert_every_rank_restored(cluster, killed_at, rec["resumed_from"],
                                        {host.name: "resident", replacement.name: "peer"})
        assert final_event(cluster)["weights_sha256"] == reference["digest"], cluster.dump()
        if not with_disk_checkpoints:
            assert not any(e["event"] == "checkpoint" for e in cluster.events())


def _progress(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=5) as resp:
        return json.loads(resp.read())


def test_worker_kill_is_reported_as_a_recovery(tmp_path, reference):
    """A SIGKILLed worker (torchrun restarts the pod's workers in place): the progress channel's recovery
    object says where the state came from and how many steps were lost, the same number as the logs give
    (ddp_trainer.testing.steps_lost), and workerRestarts rises."""
    term = tmp_path / "termination-log"
    env = {"DDPJOB_TERMINATION_LOG": str(term)}
    victim_port = free_port()
    with LocalCluster(tmp_path, args=[*DIGITS_ARGS, *SLOW], env=env, rdzv_id="worker-kill") as cluster:
        cluster.start_node(env={"DDPJOB_PROGRESS_PORT": str(free_port())})
        victim = cluster.start_node(env={"DDPJOB_PROGRESS_PORT": str(victim_port)})
        cluster.wait_for_step(25, timeout=JOB_TIMEOUT)
        killed_at = cluster.kill_workers(victim)
        rec = recovery_after_kill(cluster, killed_at, timeout=JOB_TIMEOUT)
        # The victim's agent counted a restart; the survivor's did not (a membership change is no failure),
        # and either may hold global rank 0 (whose record the termination log keeps) after the re-form.
        victim_report = _progress(victim_port)
        rcs = cluster.wait_exit(timeout=JOB_TIMEOUT)
        assert set(rcs.values()) == {0}, cluster.dump()
        final = json.loads(term.read_text())
        recovery = final["recovery"]
        print("worker kill:", rec, recovery)
        assert recovery["resumedFrom"] in ("peer", "local"), recovery
        assert recovery["step"] == rec["resumed_from"], (recovery, rec)
        assert recovery["stepsLost"] == rec["steps_lost"] == recovery["highestStep"] - recovery["step"], (recovery, rec)
        assert 0 <= recovery["stepsLost"] <= 1, recovery
        assert recovery["restoredFromPod"] == socket.gethostname()
        assert 0 < recovery["seconds"] < JOB_TIMEOUT and recovery["at"] >= killed_at, recovery
        assert victim_report["workerRestarts"] >= 1, victim_report
        assert final_event(cluster)["weights_sha256"] == reference["digest"], cluster.dump()


@pytest.mark.parametrize("resident", ["0", "1"])
def test_kill_with_snapshot_interval_above_one_replays_bitwise(tmp_path, reference, resident):
    """A budget no copy fits forces K to its bound (8). Copies alone: the restore goes back up to 8 steps and
    replays them. With resident state: the survivor's holds the last completed step, so nothing is lost. Either way
    the final weights are the reference's."""
    env = {"DDPJOB_SNAPSHOT_EVERY": "auto", "DDPJOB_SNAPSHOT_BUDGET_PCT": "0.0001", "DDPJOB_SNAPSHOT_MAX_EVERY": "8",
           "DDPJOB_SNAPSHOT_RESIDENT": resident}
    with LocalCluster(tmp_path, args=[*DIGITS_ARGS, *SLOW], env=env, rdzv_id=f"kill-k8-{resident}") as cluster:
        host = cluster.start_node()
        victim = cluster.start_node()
        cluster.wait_for_step(44, timeout=JOB_TIMEOUT)
        killed_at = cluster.kill(victim)
        cluster.start_node("node1-replacement")
        rec = recovery_after_kill(cluster, killed_at, timeout=JOB_TIMEOUT)
        rcs = cluster.wait_exit([host, cluster.node("node1-replacement")], timeout=JOB_TIMEOUT)
        assert set(rcs.values()) == {0}, cluster.dump()
        print(f"recovery with K forced to 8, resident state {resident}:", rec)
        if resident == "1":
            assert rec["source"] == "peer" and rec["snapshot_every"] == 1 and rec["steps_lost"] == 0, rec
            assert cluster.events("resident_state"), cluster.dump()
        else:
            assert rec["source"] == "peer" and rec["snapshot_every"] == 8, rec
            assert 0 <= rec["steps_lost"] <= 8, rec
        intervals = [e.int("every") for e in cluster.events("snapshot_interval")]
        assert intervals and max(intervals) == 8, cluster.dump()
        assert final_event(cluster)["weights_sha256"] == reference["digest"], cluster.dump()


def test_kill_rendezvous_host_restarts_group_from_disk(tmp_path, reference):
    """Item 4 (torchrun-hosted store): the host dies, the group restarts with a new rendezvous id."""
    ckpt = tmp_path / "ckpt"
    env = {"DDPJOB_CHECKPOINT_DIR": str(ckpt), "DDPJOB_CHECKPOINT_EVERY": "10"}
    with LocalCluster(tmp_path, args=[*DIGITS_ARGS, *SLOW], env=env, rdzv_id="host-kill") as cluster:
        host = cluster.start_node()
        other = cluster.start_node()
        cluster.wait_for_step(37, timeout=JOB_TIMEOUT)
        killed_at = cluster.kill(host)
        # What the operator does when the rendezvous store is lost: stop the rest (graceful, as a pod
        # deletion) and start the whole group again under a new rendezvous id, on fresh pods.
        cluster.kill(other, signal.SIGTERM)
        cluster.wait_exit([host, other], timeout=120)
        for i in range(2):
            cluster.start_node(f"g1-node{i}", rdzv_id="host-kill-g1", is_host=(i == 0))
        rec = recovery_after_kill(cluster, killed_at, timeout=JOB_TIMEOUT)
        rcs = cluster.wait_exit(cluster.nodes[2:], timeout=JOB_TIMEOUT)
        assert set(rcs.values()) == {0}, cluster.dump()
        assert rec["source"] == "checkpoint" and rec["resumed_from"] in (30, rec["last_step_before_kill"]), rec
        assert final_event(cluster)["weights_sha256"] == reference["digest"], cluster.dump()


def test_store_process_survives_loss_of_rank0_node(tmp_path, reference):
    """Item 4 (the operator's design): a dedicated store; losing the rank-0 node is a membership change."""
    with LocalCluster(tmp_path, args=[*DIGITS_ARGS, *SLOW], rdzv_id="store", store_process=True) as cluster:
        cluster.start_store()
        cluster.start_node()
        cluster.start_node()
        step = cluster.wait_for_step(29, timeout=JOB_TIMEOUT, rank=0)
        victim = cluster.node(step.node)  # the node running global rank 0
        killed_at = cluster.kill(victim)
        cluster.start_node(f"{victim.name}-replacement")
        rec = recovery_after_kill(cluster, killed_at, timeout=JOB_TIMEOUT)
        rcs = cluster.wait_exit([n for n in cluster.nodes if n is not victim], timeout=JOB_TIMEOUT)
        assert set(rcs.values()) == {0}, cluster.dump()
        assert rec["source"] == "peer" and rec["steps_lost"] <= (rec["snapshot_every"] or 1), rec
        assert final_event(cluster)["weights_sha256"] == reference["digest"], cluster.dump()


def _python(args, env_extra=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPJOB_", "DIGITS_", "PET_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_TRAINER_DIR, **(env_extra or {})})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _standalone(tmp_path, args, env_extra=None):
    env = {"DDPJOB_PROGRESS_PORT": "0", "DDPJOB_SNAPSHOT_DIR": str(tmp_path / "shm"), **(env_extra or {})}
    return _python(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "ddp_trainer.examples.digits", *args],
        env,
        timeout=JOB_TIMEOUT,
    )


def test_bad_configuration_gives_clear_errors(tmp_path):
    """Item 5: missing torchrun env, bad values, an unusable checkpoint directory."""
    r = _python(["-m", "ddp_trainer.examples.digits"])
    assert r.returncode == 2 and "must be started by torchrun" in r.stderr and "RANK" in r.stderr, r.stderr
    r = _python(["-m", "ddp_trainer.examples.digits"], {"DIGITS_EPOCHS": "ten"})
    assert r.returncode == 2 and "DIGITS_EPOCHS='ten' is not an integer" in r.stderr, r.stderr
    not_a_dir = tmp_path / "not-a-dir"
    not_a_dir.write_text("")
    r = _standalone(tmp_path, ["--epochs", "1"], {"DDPJOB_CHECKPOINT_DIR": str(not_a_dir)})
    assert r.returncode != 0
    assert f"DDPJOB_CHECKPOINT_DIR='{not_a_dir}' exists but is not a directory" in r.stdout + r.stderr


def test_corrupt_newest_checkpoint_falls_back(tmp_path):
    """Item 5: the newest checkpoint is corrupt; the run resumes from the previous one and completes."""
    ckpt = tmp_path / "ckpt"
    env = {"DDPJOB_CHECKPOINT_DIR": str(ckpt), "DDPJOB_CHECKPOINT_EVERY": "15", "DDPJOB_SNAPSHOT_EVERY": "0"}
    args = ["--seed", "3", "--patience", "0", "--batch-size", "64"]
    first = _standalone(tmp_path, [*args, "--epochs", "2"], env)
    assert first.returncode == 0, first.stdout + first.stderr
    names = sorted(os.listdir(ckpt))
    assert len(names) >= 2, names
    newest = ckpt / names[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    second = _standalone(tmp_path, [*args, "--epochs", "3"], env)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    assert "event=checkpoint_corrupt" in out and names[-1] in out
    previous_step = int(names[-2].split("-")[1].split(".")[0])
    assert f"event=resume source=checkpoint step={previous_step} " in out, out
    assert "event=final" in out


def _launch_worker(tmp_path, script: str, nproc: int, env_extra: dict[str, str]):
    """A standalone torchrun of one of this directory's worker scripts, its output in ``tmp_path/out.log``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPJOB_", "PET_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_TRAINER_DIR, **env_extra})
    out = tmp_path / "out.log"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
             os.path.join(os.path.dirname(__file__), script)],
            env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return proc, out


def _wait_for_line(proc, out, pattern: str, timeout: float = 120):
    import re

    deadline = time.time() + timeout
    while not (m := re.search(pattern, out.read_text())):
        assert time.time() < deadline and proc.poll() is None, out.read_text()
        time.sleep(0.05)
    return m


def test_sigterm_while_blocked_in_collective(tmp_path):
    """A worker stuck in a collective (its peer gone) still reacts to the agent's SIGTERM at once."""
    proc, out = _launch_worker(tmp_path, "blocked_worker.py", 2, {"DDPJOB_PROGRESS_PORT": "0"})
    try:
        m = _wait_for_line(proc, out, r"ready rank=0 pid=(\d+)")
        time.sleep(0.5)  # let rank 0 enter the all_reduce (it cannot leave it)
        sent = time.time()
        os.kill(int(m.group(1)), signal.SIGTERM)
        while "terminate-callback rank=0" not in out.read_text():
            assert time.time() - sent < 10, out.read_text()
            time.sleep(0.05)
        assert proc.wait(timeout=120) != 0
        assert "exitcode: 143" in out.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _forked_workers(node) -> list[int]:
    """The node's workers forked by its forkserver (their environment is set after the fork, so /proc shows the
    forkserver's, without LOCAL_RANK)."""
    return forked_workers(descendants(node.proc.pid))


def test_forkserver_launcher_recovers_bitwise_with_forked_workers(tmp_path, reference):
    """`python -m ddp_trainer.launch`: torchrun whose workers fork from a warm forkserver; same recovery, same
    weights, and the workers are the forkserver's children (not fresh interpreters started by the agent)."""
    with LocalCluster(tmp_path, args=[*DIGITS_ARGS, *SLOW], rdzv_id="forkserver", store_process=True,
                      launcher="ddp_trainer.launch") as cluster:
        cluster.start_store()
        survivor = cluster.start_node()
        victim = cluster.start_node()
        cluster.wait_for_step(25, timeout=JOB_TIMEOUT)
        workers = _forked_workers(survivor)
        assert workers and not torchrun_workers(survivor), cluster.dump()  # no worker started as a fresh interpreter
        killed_at = cluster.kill(victim)
        cluster.start_node("node1-replacement")
        rec = recovery_after_kill(cluster, killed_at, timeout=JOB_TIMEOUT)
        restarted = _forked_workers(survivor)
        assert restarted and not set(restarted) & set(workers), cluster.dump()  # new workers, forked again
        rcs = cluster.wait_exit([survivor, cluster.node("node1-replacement")], timeout=JOB_TIMEOUT)
        assert set(rcs.values()) == {0}, cluster.dump()
        assert rec["source"] == "peer" and rec["steps_lost"] <= (rec["snapshot_every"] or 1), rec
        assert final_event(cluster)["weights_sha256"] == reference["digest"], cluster.dump()
        sessions = [e for e in cluster.events("session") if e.time >= killed_at]
        assert sessions and all(float(e["init_called"]) >= float(e["process_started"]) for e in sessions), sessions
        # the agent's own start, not its forkserver's (forked from it after torch's import, with its command line)
        for e in sessions:
            node = cluster.node(e.node)
            assert abs(float(e["agent_started"]) - node.started) < 1.0, (e, node.started)


def test_sigterm_inside_an_optimizer_step_leaves_the_resident_state_whole(tmp_path):
    """The agent's SIGTERM arrives while the optimizer rewrites the resident state: the worker finishes the step and
    seals it before it exits, so the file holds the step it was in (not a torn one, and not the one before)."""
    from ddp_trainer.resident import ResidentState

    shm = str(tmp_path / "shm")
    proc, out = _launch_worker(tmp_path, "slow_step_worker.py", 1, {
        "DDPJOB_SNAPSHOT_DIR": shm, "DDPJOB_RUN_KEY": "sigterm-resident", "DDPJOB_SNAPSHOT_RESIDENT": "1"})
    try:
        pid = int(_wait_for_line(proc, out, r"in-step after=2 pid=(\d+)").group(1))
        assert ResidentState(shm, "sigterm-resident", 0).read() is None  # inside the step: invalid
        os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=120) != 0
        text = out.read_text()
        assert "exitcode: 143" in text, text
        snap = ResidentState(shm, "sigterm-resident", 0).read()
        assert snap is not None and snap.step == 3, text  # the step it was in, sealed
        assert "resident_state_unsealed" not in text, text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigterm_while_blocked_after_an_optimizer_step_does_not_wait_for_the_save_point(tmp_path):
    """Blocked between its optimizer step and the save point (a collective whose peer is gone), a worker cannot seal
    its resident state: SIGTERM waits out the grace of a second, not the 20 s an optimizer step may take, says so,
    and leaves the file invalid (never valid with the old step's label)."""
    from ddp_trainer.resident import HOLD_TIMEOUT_S, ResidentState

    shm = str(tmp_path / "shm")
    proc, out = _launch_worker(tmp_path, "slow_step_worker.py", 1, {
        "DDPJOB_SNAPSHOT_DIR": shm, "DDPJOB_RUN_KEY": "sigterm-blocked", "DDPJOB_SNAPSHOT_RESIDENT": "1",
        "BLOCK_AFTER_STEP": "3"})
    try:
        pid = int(_wait_for_line(proc, out, r"blocked after=3 pid=(\d+)").group(1))
        sent = time.time()
        os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=120) != 0
        waited = time.time() - sent
        text = out.read_text()
        assert "exitcode: 143" in text and "event=resident_state_unsealed" in text, text
        assert waited < HOLD_TIMEOUT_S / 2, (waited, text)  # the grace (and the agent's own exit), not the 20 s
        assert "event=step step=2 " in text, text  # sealed at step 2 before the third optimizer step
        assert ResidentState(shm, "sigterm-blocked", 0).read() is None, text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
