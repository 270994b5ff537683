"""Checkpoint on eviction, on loopback: a pod's torchrun agent (``python -m ddp_trainer.launch``, as in a DDPJob pod)
gets the kubelet's SIGTERM and stops every worker of the pod at once; global rank 0 writes a checkpoint of the last
completed step before it exits, and a fresh pod (nothing left in its ``/dev/shm``) resumes from it at most one step
behind the highest step logged, and reports exactly that in its recovery record.

The SIGTERM work is slowed (``SLOW_TERMINATE_S``, as a large model's state written to slow storage takes seconds):
the other worker exits at once and rank 0's collective fails while its checkpoint is still being written, which
must not end the process before the checkpoint is on the disk.

In one process (a one-rank group): what SIGTERM leaves (the checkpoint, the high-water mark beside it, no optimizer
step after it) and how a restore reads the mark (once; never one older than the state it restores).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from ddp_trainer.checkpoint import MARK_NAME, CheckpointStore, checkpoint_pod_state
from ddp_trainer.run import Run
from ddp_trainer.testing import REPO_TRAINER_DIR, LocalCluster, recovery_after_kill, steps_lost
from ddp_trainer.testing_cluster import parse_stamp
from tests.trainer.digits_job import DIGITS_ARGS, JOB_TIMEOUT, SLOW, final_event

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("evicted_worker.py")
STEPS = 60


def _launch(tmp_path: Path, name: str, env_extra: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    """One simulated pod: `python -m ddp_trainer.launch --standalone --nproc-per-node=2 evicted_worker.py`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPJOB_", "PET_", "TORCHELASTIC_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_TRAINER_DIR, "DDPJOB_PROGRESS_PORT": "0",
                "DDPJOB_RUN_KEY": "evicted", "DDPJOB_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
                "DDPJOB_CHECKPOINT_EVERY": "1000", "WORKER_STEPS": str(STEPS), **env_extra})
    out = tmp_path / f"{name}.log"
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ddp_trainer.launch", "--standalone", "--nproc-per-node=2",
                                 str(WORKER)], env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def _wait_for(proc: subprocess.Popen, out: Path, pattern: str, timeout: float = 120) -> re.Match:
    deadline = time.time() + timeout
    while not (m := re.search(pattern, out.read_text())):
        assert time.time() < deadline and proc.poll() is None, out.read_text()
        time.sleep(0.02)
    return m


def _events(text: str, event: str) -> list[tuple[float, dict[str, str]]]:
    """(time, fields) of the trainer's `event=<event>` lines."""
    found = []
    for line in text.splitlines():
        m = re.match(r"^(\S+Z) ddp_trainer (.*)$", line.strip())
        if m and f"event={event} " in m.group(2) + " ":
            found.append((parse_stamp(m.group(1)), dict(re.findall(r'(\w+)=("[^"]*"|\S+)', m.group(2)))))
    return found


def test_a_pod_stopped_by_sigterm_checkpoints_its_last_step_and_a_fresh_pod_resumes_there(tmp_path):
    proc, out = _launch(tmp_path, "evicted", {"DDPJOB_SNAPSHOT_DIR": str(tmp_path / "shm-evicted"),
                                               "SLOW_TERMINATE_S": "1.5"})
    try:
        _wait_for(proc, out, r"event=step step=15 ")
        os.kill(proc.pid, signal.SIGTERM)  # the kubelet's signal to the container's first process
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    logged = [(t, int(f["step"])) for t, f in _events(text, "step")]
    highest = max(s for _, s in logged)
    assert highest < STEPS, text  # stopped while training
    saved = CheckpointStore(str(tmp_path / "ckpt")).steps()
    assert saved and highest - 1 <= saved[0] <= highest, (saved, highest, text)
    sigterm = [f for _, f in _events(text, "checkpoint") if f.get("reason") == "sigterm"]
    assert [f["step"] for f in sigterm] == [str(saved[0])], text
    assert 0 < float(sigterm[0]["seconds"]) < 1.5, sigterm  # the checkpoint's own time, after the slow callback

    # A new pod: no snapshot, no high-water mark; only the checkpoint volume is left.
    proc, out = _launch(tmp_path, "replacement", {"DDPJOB_SNAPSHOT_DIR": str(tmp_path / "shm-replacement")})
    try:
        assert proc.wait(timeout=120) == 0, out.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text2 = out.read_text()
    (restored_at, resume), = _events(text2, "resume")
    assert resume["source"] == "checkpoint" and int(resume["step"]) == saved[0], text2
    lost = steps_lost(logged, saved[0], restored_at)
    assert lost is not None and lost <= 1
    (_, recovered), = _events(text2, "recovered")
    assert recovered["resumedFrom"] == "disk", recovered
    assert (recovered["highestStep"], recovered["stepsLost"]) == (str(highest), str(lost)), (recovered, highest, lost)
    assert float(recovered["seconds"]) > 0, recovered


def test_every_pod_stopped_one_after_the_other_resumes_from_rank_0s_last_step_bitwise(tmp_path, reference):
    """Two pods (agents of `python -m ddp_trainer.launch`, a store of their own, as in a DDPJob) stopped by SIGTERM,
    rank 0's pod 0.5 s after the other, as a drain or the eviction API does them one by one: the other rank exits at
    once and rank 0's collective fails before its own SIGTERM comes, so its worker cannot write the checkpoint; its
    agent, stopped next, writes it from the pod's snapshot. Fresh pods resume from it bitwise."""
    env = {"DDPJOB_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "DDPJOB_CHECKPOINT_EVERY": "1000"}
    with LocalCluster(tmp_path, args=[*DIGITS_ARGS, *SLOW], env=env, rdzv_id="evict-all", store_process=True,
                      launcher="ddp_trainer.launch") as cluster:
        cluster.start_store()
        cluster.start_node()
        cluster.start_node()
        at = cluster.wait_for_step(25, timeout=JOB_TIMEOUT, rank=0)
        rank0 = cluster.node(at.node)
        other = next(n for n in cluster.nodes if n is not rank0)
        stopped_at = cluster.kill(other, signal.SIGTERM)
        time.sleep(0.5)
        cluster.kill(rank0, signal.SIGTERM)
        cluster.wait_exit([rank0, other], timeout=120)
        saved = CheckpointStore(str(tmp_path / "ckpt")).steps()
        highest = max(e.int("step") for e in cluster.events("step"))
        assert saved and highest - 1 <= saved[0] <= highest, (saved, highest, cluster.dump())

        for i in range(2):  # new pods: nothing in their /dev/shm
            cluster.start_node(f"replacement{i}")
        rec = recovery_after_kill(cluster, stopped_at, timeout=JOB_TIMEOUT)
        rcs = cluster.wait_exit(cluster.nodes[2:], timeout=JOB_TIMEOUT)
        assert set(rcs.values()) == {0}, cluster.dump()
        assert rec["source"] == "checkpoint" and rec["resumed_from"] == saved[0], rec
        assert rec["steps_lost"] is not None and rec["steps_lost"] <= 1, rec
        (recovered,) = [e for e in cluster.events("recovered") if e.time >= stopped_at]
        assert (recovered["resumedFrom"], recovered["stepsLost"]) == ("disk", str(rec["steps_lost"])), recovered
        assert final_event(cluster)["weights_sha256"] == reference["digest"], cluster.dump()


def test_a_worker_killed_by_torchruns_shutdown_timeout_leaves_the_checkpoint_to_its_agent(tmp_path):
    """The agent waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default) for its workers after SIGTERM, then SIGKILLs
    them: a worker whose SIGTERM work takes longer (here 1.5 s against 1 s) never writes its checkpoint, and the agent
    writes it from the pod's snapshot instead (within the pod's grace period, which must cover both: docs/recovery.md,
    "Checkpoint on eviction")."""
    proc, out = _launch(tmp_path, "evicted", {"DDPJOB_SNAPSHOT_DIR": str(tmp_path / "shm-evicted"),
                                               "SLOW_TERMINATE_S": "1.5", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"})
    try:
        _wait_for(proc, out, r"event=step step=15 ")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    highest = max(int(f["step"]) for _, f in _events(text, "step"))
    assert "forcefully exiting" in text, text  # the worker was SIGKILLed in its SIGTERM work
    (_, line), = [(t, f) for t, f in _events(text, "checkpoint") if f.get("reason") == "sigterm"]
    assert line.get("by") == "agent" and highest - 1 <= int(line["step"]) <= highest, (line, highest)
    assert CheckpointStore(str(tmp_path / "ckpt")).steps() == [int(line["step"])]


def _run(session, tmp_path: Path, pod: str) -> tuple[Run, torch.nn.Module, torch.optim.Optimizer]:
    """A run on a pod of its own (its `/dev/shm`: ``tmp_path/pod``) sharing the checkpoint volume ``tmp_path/ckpt``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run = Run(session, model=model, optimizer=opt, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1000,
              snapshot_dir=str(tmp_path / pod), progress_port=0, log_every=0)
    run.restore()
    return run, model, opt


def _step(run: Run, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(run.step))).pow(2).mean().backward()
    opt.step()
    run.step_done()


def test_sigterm_finishes_the_step_in_progress_starts_no_other_and_leaves_a_checkpoint_and_its_mark(
        tmp_path, single_process_group):
    run, model, opt = _run(single_process_group, tmp_path, "pod-a")
    for _ in range(3):
        _step(run, model, opt)
    callbacks = list(reversed(single_process_group._term_callbacks))  # as Session._terminate runs them
    sigterm = threading.Thread(target=lambda: [cb() for cb in callbacks], daemon=True)
    sigterm.start()  # the signal comes in the middle of step 4: it waits for the step's save point
    while not run.saves._stopping.is_set():
        time.sleep(0.01)
    _step(run, model, opt)
    loop = threading.Thread(target=run.saves.step_begins, daemon=True)  # the training loop's next step
    loop.start()
    sigterm.join(10)
    assert not sigterm.is_alive()
    assert loop.is_alive() and single_process_group.main_idle.is_set(), "a step began after SIGTERM"
    store = CheckpointStore(str(tmp_path / "ckpt"))
    assert store.steps() == [4]  # the step in progress, finished
    assert (tmp_path / "ckpt" / MARK_NAME).exists()
    run.saves._stopping.clear()  # (the process would have exited: let the next run's test go on)

    # A new pod restores from the disk: it reads the mark, and takes it.
    again, _, _ = _run(single_process_group, tmp_path, "pod-b")
    recovery = again.progress.snapshot()["recovery"]
    assert (recovery["resumedFrom"], recovery["step"], recovery["highestStep"], recovery["stepsLost"]) == \
        ("disk", 4, 4, 0), recovery
    assert not (tmp_path / "ckpt" / MARK_NAME).exists()
    # The next restore knows no more: the mark was the stopped incarnation's, not this one's.
    third, _, _ = _run(single_process_group, tmp_path, "pod-c")
    assert third.progress.snapshot()["recovery"]["stepsLost"] is None


@pytest.mark.parametrize(("mark", "lost"), [(6, 1), (5, 0), (4, None)], ids=["one-ahead", "same", "stale"])
def test_a_restore_counts_the_steps_lost_from_the_mark_left_on_the_disk(tmp_path, single_process_group, mark, lost):
    """A checkpoint of step 5 and a mark of `mark`: the steps lost are mark - 5; a mark older than the state restored
    (left by an incarnation before it) is no measure and is ignored."""
    run, model, opt = _run(single_process_group, tmp_path, "pod-a")
    for _ in range(5):
        _step(run, model, opt)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save(5, run.components.state_dict(run.position))
    store.save_mark(mark, time.time() - 2.0, single_process_group.run_key, 5)
    again, _, _ = _run(single_process_group, tmp_path, "pod-b")
    recovery = again.progress.snapshot()["recovery"]
    assert (recovery["resumedFrom"], recovery["step"], recovery["stepsLost"]) == ("disk", 5, lost), recovery


def test_a_stopping_agent_checkpoints_its_pods_newest_state_once(tmp_path, single_process_group):
    """ddp_trainer.launch's fallback (its item 6): from the pod's /dev/shm alone, the newest snapshot as a checkpoint
    and the ranks' high-water mark beside it; nothing written when the disk holds that step already."""
    run, model, opt = _run(single_process_group, tmp_path, "pod-a")
    for _ in range(4):
        _step(run, model, opt)
    run.saves.wait_copy()
    ckpt, shm = str(tmp_path / "ckpt"), str(tmp_path / "pod-a")
    done = checkpoint_pod_state(shm, ckpt, single_process_group.run_key)
    assert (done["step"], done["written"], done["highest_step"]) == (4, True, 4), done
    step, state = CheckpointStore(ckpt).load_latest()
    assert step == 4 and all(torch.equal(a, b) for a, b in zip(state["model"].values(), model.state_dict().values()))
    assert checkpoint_pod_state(shm, ckpt, single_process_group.run_key)["written"] is False
    assert CheckpointStore(ckpt).take_mark(single_process_group.run_key)[:1] == (4,)
    assert checkpoint_pod_state(str(tmp_path / "empty"), ckpt, "unit")["step"] is None  # nothing to write from


def test_a_mark_of_another_run_or_unreadable_is_not_used_and_is_removed(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save_mark(7, 1.0, "ns/other", 7)
    assert store.take_mark("ns/job") is None and not (tmp_path / MARK_NAME).exists()
    (tmp_path / MARK_NAME).write_text("{not json")
    assert store.take_mark("ns/job") is None and not (tmp_path / MARK_NAME).exists()
    store.save_mark(7, 1.5, "ns/job", None)
    assert store.take_mark("ns/job") == (7, 1.5, None)
    assert store.steps() == []  # the mark is no checkpoint
