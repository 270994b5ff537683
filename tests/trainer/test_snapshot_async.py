"""The snapshot interval K (a pure function) and the asynchronous snapshot writer: a slot is valid only
once its copy is complete, the live tensors are read before the next optimizer step may change them, and
a reader never sees a torn step."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from ddp_trainer import snapshot as snapmod
from ddp_trainer.cadence import StepCost, choose_interval, settle_interval
from ddp_trainer.run import Run
from ddp_trainer.snapshot import PeerSnapshots
from ddp_trainer.state import model_digest


def test_interval_keeps_the_copy_within_the_budget():
    # copy 10 ms, step 100 ms, 2 % budget: 10 / (100 * 0.02) = 5 steps
    assert choose_interval(0.010, 0.100, 2.0) == 5
    assert choose_interval(0.0101, 0.100, 2.0) == 6  # rounded up: never over budget
    assert choose_interval(0.001, 0.100, 2.0) == 1  # cheap copies: every step
    assert choose_interval(10.0, 0.100, 2.0, max_every=50) == 50  # bounded: steps lost stay known
    assert choose_interval(0.010, 0.100, 10.0) == 1
    for copy_s, step_s, budget in [(0.3, 1.4, 2.0), (0.02, 0.15, 2.0), (1e-4, 1e-2, 0.5)]:
        k = choose_interval(copy_s, step_s, budget)
        assert 1 <= k <= 50 and copy_s / (k * step_s) <= budget / 100 + 1e-12


def test_step_cost_is_what_a_snapshot_adds_to_the_step_it_overlaps():
    cost = StepCost()
    cost.step(0.150, "snapshot")
    cost.copy(0.010)
    assert cost.extra_s() is None and cost.cost_s() == 0.010  # no clean step yet: the copy's own time
    for _ in range(20):
        cost.step(0.100, None)
    cost.step(0.400, "checkpoint")  # a checkpoint's step counts for neither
    assert cost.extra_s() is None and abs(cost.clean_s - 0.100) < 1e-9
    cost.step(0.160, "snapshot")
    assert abs(cost.extra_s() - 0.060) < 1e-9 and abs(cost.cost_s() - 0.060) < 1e-9  # larger than the copy
    cost.step(0.090, "snapshot")
    cost.step(0.090, "snapshot")  # faster than the clean steps: costs nothing, never negative
    assert cost.extra_s() == 0.0 and cost.cost_s() == 0.010
    # With it, K counts the slowdown: a 25 ms copy that adds 118 ms to a 164 ms step needs K = 36 for 2 %.
    assert choose_interval(max(0.025, 0.118), 0.164, 2.0) == 36


def test_step_cost_ignores_a_step_slowed_by_something_else():
    """Medians: one step stalled by another process (3x the step) moves neither the clean time nor the cost."""
    cost = StepCost()
    for i in range(40):
        cost.step(0.300 if i == 17 else 0.100, None)
        if i % 4 == 3:
            cost.step(0.900 if i == 19 else 0.102, "snapshot")
            cost.copy(0.001)
    assert abs(cost.clean_s - 0.100) < 1e-9
    assert abs(cost.cost_s() - 0.002) < 1e-9


def test_interval_settles_instead_of_following_every_estimate():
    # 2 ms snapshots on a 100 ms step: 2 % at K = 1, the budget: kept
    assert settle_interval(1, 0.002, 0.100, 2.0) == 1
    # over the budget: the smallest K within the target, half the budget (1 %): 2.4 ms -> K 3 (0.8 %)
    assert settle_interval(1, 0.0024, 0.100, 2.0) == 3
    assert settle_interval(2, 0.0030, 0.100, 2.0) == 2  # the estimate wobbles: 1.5 % at K 2, kept
    assert settle_interval(2, 0.0011, 0.100, 2.0) == 2  # 0.55 %: above half the target (0.5 %), kept
    assert settle_interval(2, 0.0009, 0.100, 2.0) == 1  # 0.45 %: below it, and K 1 is within the target
    assert settle_interval(5, 0.009, 0.100, 2.0) == 5  # 1.8 %: within the budget, kept
    assert settle_interval(5, 0.011, 0.100, 2.0) == 11  # 2.2 %: over the budget -> ceil(11 / 1) = 11 (1 %)
    assert settle_interval(8, 0.0042, 0.100, 2.0) == 8  # 0.53 %: kept
    assert settle_interval(8, 0.003, 0.100, 2.0) == 3  # 0.38 %: below half the target, K follows the cost down
    assert settle_interval(60, 0.005, 0.100, 2.0, max_every=50) == 5  # outside the bound: chosen anew
    for k in range(1, 51):
        for copy_s in (0.0005, 0.003, 0.02, 0.2):
            got = settle_interval(k, copy_s, 0.1, 2.0)
            assert 1 <= got <= 50 and (100 * copy_s / (got * 0.1) <= 2.0 or got == 50)
            # a chosen K is kept by the next estimate of the same cost
            assert settle_interval(got, copy_s, 0.1, 2.0) == got


def test_interval_before_anything_is_measured_and_bad_bounds():
    assert choose_interval(0.0, 0.1, 2.0) == 1
    assert choose_interval(0.01, 0.0, 2.0) == 1
    assert choose_interval(0.01, 0.1, 0.0, max_every=7) == 7  # zero budget: as rarely as allowed
    with pytest.raises(ValueError):
        choose_interval(0.01, 0.1, 2.0, max_every=0)


def test_async_write_holds_the_state_of_its_step(tmp_path):
    snaps = PeerSnapshots(str(tmp_path / "shm"), "k")
    param = torch.zeros(1000)
    buf = torch.zeros(3)
    snaps.write_async(1, {"p": param, "b": buf}, stable={param.data_ptr()}, every=4)
    buf.add_(1)  # not stable: cloned at the save point, so this change is not in step 1
    snaps.wait_sources()  # what the optimizer step pre-hook does before changing `param`
    param.add_(1)
    snaps.wait()
    got = snaps.read_latest()
    assert got.step == 1 and got.every == 4
    assert torch.equal(got.state["p"], torch.zeros(1000)) and torch.equal(got.state["b"], torch.zeros(3))
    assert snaps.last_bytes >= 1003 * 4 and snaps.last_copy_s is not None and snaps.last_copy_s > 0
    snaps.close(remove=True)


def test_weights_swapped_in_place_before_the_async_copy_read_them_are_never_sealed_as_the_step(tmp_path):
    """An unguarded in-place swap (an EMA's copy_to for evaluation) right after a save point, before the writer
    thread has read the live tensors: the slot would hold the swapped weights labelled as the step. The save point's
    fingerprint of its sources no longer matches the copy, so every reader rejects it and the previous step stands."""
    snaps = PeerSnapshots(str(tmp_path / "shm"), "k")
    param = torch.arange(1000, dtype=torch.float32)
    snaps.write_async(1, {"p": param}, stable={param.data_ptr()})
    snaps.wait()
    with snaps._lock:  # the writer thread has not started the copy of step 2 yet
        snaps.write_async(2, {"p": param}, stable={param.data_ptr()})
        param.copy_(torch.full((1000,), -7.0))  # the swap, outside run.weights_swapped()
    snaps.wait()
    got = PeerSnapshots(str(tmp_path / "shm"), "k").read_latest()
    assert got.step == 1 and torch.equal(got.state["p"], torch.arange(1000, dtype=torch.float32))
    snaps.close(remove=True)


def test_a_slot_is_invalid_until_its_copy_completes_and_readers_never_see_a_torn_step(tmp_path, monkeypatch):
    shm = str(tmp_path / "shm")
    snaps = PeerSnapshots(shm, "k")
    snaps.write(1, {"w": torch.full((4096,), 1.0)})
    started, release = threading.Event(), threading.Event()
    real_copy = torch._foreach_copy_

    def slow_copy(dst, src):  # copy half, then stop as if the pod were killed mid-copy
        dst[0][:2048].copy_(src[0][:2048])
        started.set()
        release.wait(10)
        real_copy(dst, src)

    monkeypatch.setattr(snapmod.torch, "_foreach_copy_", slow_copy)
    snaps.write_async(2, {"w": torch.full((4096,), 2.0)})
    assert started.wait(10)
    # another process reading now (no lock shared): the half-written slot is invalid, step 1 intact
    other = PeerSnapshots(shm, "k").read_latest()
    assert other.step == 1 and torch.equal(other.state["w"], torch.full((4096,), 1.0))
    release.set()
    snaps.wait()
    got = PeerSnapshots(shm, "k").read_latest()
    assert got.step == 2 and torch.equal(got.state["w"], torch.full((4096,), 2.0))
    snaps.close(remove=True)


def test_a_failed_copy_leaves_the_previous_step_and_is_reported(tmp_path, monkeypatch):
    shm = str(tmp_path / "shm")
    snaps = PeerSnapshots(shm, "k")
    snaps.write(1, {"w": torch.ones(8)})

    def broken_copy(dst, src):
        dst[0][:4].zero_()
        raise OSError("no space left on device")

    monkeypatch.setattr(snapmod.torch, "_foreach_copy_", broken_copy)
    snaps.write_async(2, {"w": torch.full((8,), 2.0)})
    with pytest.raises(OSError, match="no space"):
        snaps.wait()
    got = PeerSnapshots(shm, "k").read_latest()
    assert got.step == 1 and torch.equal(got.state["w"], torch.ones(8))
    monkeypatch.undo()
    snaps.close(remove=True)


def _train(session, shm, *, stop_at=None, budget=2.0, every="auto", resident=True, torn=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    run = Run(session, model=model, optimizer=opt, seed=3, checkpoint_dir=None, snapshot_dir=shm,
              snapshot_every=every, snapshot_budget_pct=budget, snapshot_resident=resident, progress_port=0,
              log_every=0)
    run.restore()
    restored = run.step
    data = torch.randn(40, 8, 32)
    ks = []
    for _ in run.epochs(2):
        for xb in run.batches(data):
            loss = model(xb + torch.randn_like(xb) * 0.01).pow(2).mean()  # the per-step reseeded RNG counts
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.step_done(loss=loss)
            ks.append(run.progress.snapshot().get("snapshotEvery"))
            if stop_at is not None and run.step == stop_at:
                if torn:  # killed inside the next optimizer step: its update is half done, its save point never comes
                    model(xb).pow(2).mean().backward()
                    opt.step()
                # a kill: whatever the newest complete snapshot is, nothing is written any more
                run.snapshots.wait()
                run.snapshots.close()
                return run, None, ks, restored
        run.epoch_done()
    run.finish()
    return run, model_digest(model), ks, restored


@pytest.mark.parametrize("case", ["copies only", "resident state torn"])
def test_adaptive_interval_above_one_resumes_bitwise_from_an_older_step(tmp_path, single_process_group, monkeypatch,
                                                                        case):
    """A tiny budget forces K > 1: the restore goes back to a step s <= the last one and replays exactly. Without
    resident state, or with this (only) rank's resident state torn by a kill inside its optimizer step."""
    _, reference, _, _ = _train(single_process_group, str(tmp_path / "ref"), every=0)
    monkeypatch.setenv("DDPJOB_SNAPSHOT_MAX_EVERY", "7")
    shm = str(tmp_path / "shm")
    resident, torn = case == "resident state torn", case == "resident state torn"
    killed, _, ks, _ = _train(single_process_group, shm, stop_at=53, budget=0.0001, resident=resident, torn=torn)
    assert max(k for k in ks if k) == 7, ks  # the budget is unreachable: K at its bound
    if resident:
        assert killed.resident is not None and killed.resident.read() is None  # torn: invalid, never half-valid
    resumed, digest, _, restored = _train(single_process_group, shm, budget=0.0001, resident=resident)
    assert resumed.restored_from == "local" and restored == killed.snapshots.last_step
    assert 53 - 7 <= restored < 53  # steps lost: more than the step in flight, at most K
    assert digest == reference  # replayed from an older step, bit for bit


def test_resident_state_resumes_the_last_completed_step_bitwise(tmp_path, single_process_group, monkeypatch):
    """With K at 7, the resident state still holds the last completed step: a kill between steps loses none."""
    _, reference, _, _ = _train(single_process_group, str(tmp_path / "ref"), every=0)
    monkeypatch.setenv("DDPJOB_SNAPSHOT_MAX_EVERY", "7")
    shm = str(tmp_path / "shm")
    killed, _, _, _ = _train(single_process_group, shm, stop_at=53, budget=0.0001)
    assert killed.resident is not None and killed.snapshots.last_step < 53  # the copies are behind
    params = [p for g in killed.components.optimizer.param_groups for p in g["params"]]
    views = {v.data_ptr() for v in killed.resident._views}
    assert all(p.data_ptr() in views for p in params)  # the optimizer updated the file itself: no copy
    resumed, digest, _, restored = _train(single_process_group, shm, budget=0.0001)
    assert resumed.restored_from == "local" and restored == 53  # the last completed step: nothing lost
    assert digest == reference


def test_an_epochs_last_step_is_a_resident_save_point(tmp_path, single_process_group, monkeypatch):
    """Killed after an epoch's last step (before validation and epoch_done): the resumed run ends the epoch and
    trains on, bit for bit."""
    _, reference, _, _ = _train(single_process_group, str(tmp_path / "ref"), every=0)
    shm = str(tmp_path / "shm")
    _train(single_process_group, shm, stop_at=40, every=5)
    resumed, digest, _, restored = _train(single_process_group, shm, every=5)
    assert resumed.restored_from == "local" and restored == 40
    assert digest == reference


def test_cpu_snapshots_never_initialise_cuda(tmp_path):
    """In a process of its own: on a GPU machine another test of this process may have initialised CUDA."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from ddp_trainer.snapshot import PeerSnapshots\n"
        "snaps = PeerSnapshots(sys.argv[1], 'k')\n"
        "p = torch.ones(10)\n"
        "snaps.write_async(1, {'p': p}, stable={p.data_ptr()})\n"
        "snaps.wait()\n"
        "snaps.close(remove=True)\n"
        "print('cuda initialised:', torch.cuda.is_initialized())\n"
    )
    import os

    from ddp_trainer.testing import REPO_TRAINER_DIR

    env = {**os.environ, "PYTHONPATH": REPO_TRAINER_DIR}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "shm")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and "cuda initialised: False" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU path is tested above)")
def test_cuda_snapshot_goes_through_a_side_stream_and_pinned_buffers(tmp_path):
    snaps = PeerSnapshots(str(tmp_path / "shm"), "k")
    p = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    b = torch.zeros(4, device="cuda")
    p.mul_(2)  # queued on the current stream before the save point: must be in the snapshot
    snaps.write_async(3, {"p": p, "b": b}, stable={p.data_ptr()})
    b.add_(1)
    snaps.wait_sources()
    p.add_(1)
    snaps.wait()
    got = snaps.read_latest()
    assert got.step == 3 and torch.equal(got.state["p"], (torch.arange(1 << 20, dtype=torch.float32) * 2))
    assert torch.equal(got.state["b"], torch.zeros(4))
    snaps.close(remove=True)


def test_the_resident_trial_weighs_the_median_commit_against_the_step():
    """The trial's rule on fixed timings: the digits example's 0.17 ms commit against a ~1 ms step is far past the
    budget's share (resident state off, saying why); against a 0.3 s step it is nothing (on). Undecided until
    TRIAL_COMMITS commits."""
    from ddp_trainer import resident

    def decide(commit_s, step_s):
        trial = resident.Trial()
        out = [trial.commit_timed(commit_s, step_s, 2.0) for _ in range(resident.TRIAL_COMMITS)]
        assert all(o is None for o in out[:-1]) and trial.decided
        return out[-1]

    off = decide(0.00017, 0.001)
    assert off is not None and off["share_pct"] == pytest.approx(17.0) and off["budget_pct"] == 2.0, off
    assert decide(0.00017, 0.3) is None


@pytest.mark.parametrize("slow_step", [False, True])
def test_resident_state_stays_on_only_where_its_commits_are_cheap_for_the_step(tmp_path, single_process_group,
                                                                               slow_step, monkeypatch):
    """auto, in a real run: the first commits are a trial; commits that cost more than the step they seal (made
    20 ms here, so that the outcome does not hang on the timing of a busy machine) turn resident state off and the
    copies alone keep the state; against a step of 1 s a real commit costs nothing and resident state stays on.
    The rule itself on fixed timings: test_the_resident_trial_weighs_the_median_commit_against_the_step."""
    from ddp_trainer import resident
    if not slow_step:
        commit = resident.ResidentState.commit

        def slow_commit(self, *args, **kwargs):
            time.sleep(0.02)
            return commit(self, *args, **kwargs)
        monkeypatch.setattr(resident.ResidentState, "commit", slow_commit)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    run = Run(single_process_group, model=model, optimizer=opt, checkpoint_dir=None, snapshot_dir=str(tmp_path),
              snapshot_every="auto", snapshot_resident="auto", progress_port=0, log_every=0)
    run.restore()
    assert run.resident is not None
    for xb in run.batches(torch.randn(9, 4, 8)):
        model(xb).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if slow_step:
            time.sleep(1.0)  # a commit stays within its share (0.5 % of the step: 5 ms) even on a busy machine
        run.step_done()
    assert (run.resident is not None) == slow_step
    assert run.progress.snapshot()["snapshotResident"] == slow_step
    run.finish()
