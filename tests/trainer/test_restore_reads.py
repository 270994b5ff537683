"""What a restore reads and where it lands: one slot's data, chosen by the headers alone; and a restore after an
epoch's last step goes on into the next epoch, validating the finished one once, bit for bit.

Bytes read are the kernel's count for this process (``/proc/self/io`` rchar: every read(2)/pread(2), whatever
the code path), so the test holds for any reader that does not map the other slots in (a mapped slot is read
without a syscall: the restore never maps one)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_trainer.log import Logger
from ddp_trainer.run import Run
from ddp_trainer.session import Session
from ddp_trainer.slot import read_slot
from ddp_trainer.state import model_digest


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _run(session, shm, *, resident):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    run = Run(session, model=model, optimizer=opt, seed=1, checkpoint_dir=None, snapshot_dir=shm, snapshot_every=2,
              snapshot_resident=resident, progress_port=0, log_every=0)
    return run, model, opt


def _train(run, model, opt, steps):
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        model(torch.randn(16, 256, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        run.step_done()
    run.snapshots.wait()


@pytest.mark.parametrize("case", ["resident newest", "copies only", "resident torn"])
def test_a_restore_reads_only_the_newest_slots_data(tmp_path, single_process_group, case):
    """Both copy slots hold a state (steps 4 and 6), with resident state the resident file a newer one (7): the restore
    reads the headers, then the data of the newest valid source alone, into the live tensors; the restored state is
    the killed run's, bit for bit. Before: every slot and the resident file read in full (3 files' worth)."""
    shm = str(tmp_path / "shm")
    resident = case != "copies only"
    killed, model, opt = _run(single_process_group, shm, resident=resident)
    killed.restore()
    _train(killed, model, opt, 7)
    newest = 7 if case == "resident newest" else 6
    if case == "resident torn":  # killed inside its optimizer step: the file is invalid, the newest copy holds step 6
        killed.resident.begin_update()
    expected = model_digest(model) if newest == 7 else None
    paths = [s.path for s in killed.snapshots._slots] + ([killed.resident.path] if resident else [])
    held = {p: read_slot(p, "unit") for p in paths}
    steps = sorted(s.step for s in held.values() if s is not None)
    assert steps == ([4, 6, 7] if case == "resident newest" else [4, 6]), steps
    newest_snap = next(s for s in held.values() if s is not None and s.step == newest)
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(newest_snap.state))
    killed.snapshots.close()  # the kill: nothing is written any more, the files stay

    resumed, model2, opt2 = _run(single_process_group, shm, resident=resident)
    before = _bytes_read()
    source = resumed.restore()
    read = _bytes_read() - before
    assert source == "local" and resumed.step == newest
    # One state's data and its headers/meta (a few KiB each); reading a second slot would be 2x
    assert state_bytes <= read <= 1.2 * state_bytes + (256 << 10), (read, state_bytes)
    if expected is not None:
        assert model_digest(model2) == expected
    restored = {k: v for k, v in opt2.state_dict()["state"].items()}
    saved = newest_snap.state["optimizer"]["state"]
    for pid, per_param in saved.items():
        for key, value in per_param.items():
            assert torch.equal(restored[pid][key], value), (pid, key)
    for name, value in newest_snap.state["model"].items():
        assert torch.equal(model2.state_dict()[name], value), name
    resumed.finish()


def _tensors(tree):
    from ddp_trainer.state import flatten

    return flatten(tree)[1]


class _Killed(Exception):
    """The process dies here: nothing after it runs, the files in the snapshot directory stay."""


def test_a_restore_after_an_epochs_last_step_validates_that_epoch_once(tmp_path, single_process_group, monkeypatch,
                                                                        capsys):
    """The digits example killed during the validation of epoch 1, after that epoch's last step (a resident save point:
    batch == the epoch's length): the resumed run's epoch loop gets no batch of epoch 1, validates it once, closes it
    and trains epoch 2; its final weights are the uninterrupted run's, bit for bit."""
    from ddp_trainer.examples import digits

    calls: list[str] = []
    kill_at: list[int] = []
    evaluate = digits.evaluate

    def counted(module, data, session):
        calls.append("val" if len(data[1]) < 300 else "test")  # the val split has 179 samples, the test split 359
        if calls.count("val") in kill_at and calls[-1] == "val":
            raise _Killed()
        return evaluate(module, data, session)

    monkeypatch.setattr(digits, "evaluate", counted)
    monkeypatch.setenv("DDPJOB_SNAPSHOT_RESIDENT", "1")
    monkeypatch.setenv("DDPJOB_PROGRESS_PORT", "0")
    args = digits.parse_args(["--seed", "7", "--epochs", "3", "--patience", "0", "--batch-size", "64",
                              "--snapshot-every", "5"])  # 20 steps per epoch
    monkeypatch.setenv("DDPJOB_SNAPSHOT_DIR", str(tmp_path / "ref"))
    reference = digits.train(args, single_process_group)
    reference_digest = _digest(capsys.readouterr().out)
    assert calls == ["val", "val", "val", "test"]

    monkeypatch.setenv("DDPJOB_SNAPSHOT_DIR", str(tmp_path / "shm"))
    calls.clear()
    kill_at.append(2)  # the validation of epoch 1, after its 20th step
    with pytest.raises(_Killed):
        digits.train(args, single_process_group)
    calls.clear()
    kill_at.clear()
    capsys.readouterr()
    resumed = digits.train(args, single_process_group)
    out = capsys.readouterr().out
    assert "event=resume source=local step=40 epoch=1 batch=20 " in out, out  # restored after the epoch's last batch
    assert calls == ["val", "val", "test"], calls  # epoch 1 validated once, then epoch 2, then the test split
    assert out.count("event=epoch epoch=1 ") == 1 and "event=epoch epoch=2 " in out, out
    assert resumed["step"] == reference["step"] == 60
    assert resumed["metrics"] == reference["metrics"]
    assert _digest(out) == reference_digest  # the final weights, bit for bit


def _digest(out: str) -> str:
    finals = [line for line in out.splitlines() if "event=final " in line]
    assert finals, out
    return finals[-1].split("weights_sha256=")[1].split()[0]


def _peer_worker(rank: int, path: str, port: int, out: str) -> None:
    import os

    from ddp_trainer.restore import broadcast_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    session = Session(rank=rank, world_size=2, local_rank=rank, local_world_size=2, group_rank=0, restart_count=0,
                      run_key="unit", device=torch.device("cpu"), backend="gloo", log=Logger(rank))
    torch.manual_seed(rank)  # the receiver's live model starts different
    model = torch.nn.Linear(8, 4)
    live_weight = model.weight
    state = read_slot(path, "unit").state if rank == 0 else None
    got = broadcast_state(session, state, 0, live={"model": model.state_dict()})
    same_storage = got["model"]["weight"].data_ptr() == live_weight.data_ptr()
    torch.save({"state": got, "received_into_live": same_storage}, f"{out}-{rank}.pt")
    dist.destroy_process_group()


def test_a_peers_state_crosses_tensor_by_tensor_into_the_receivers_live_tensors(tmp_path):
    """restore.broadcast_state: the receiver gets the sender's state bit for bit, its model's tensors received in
    place (no pickle of the state, no second copy); tensors it has no live place for arrive as new ones."""
    import torch.multiprocessing as mp

    from ddp_trainer.snapshot import PeerSnapshots
    from ddp_trainer.testing import free_port

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    state = {"model": model.state_dict(), "extra": {"t": torch.arange(5)}, "position": {"step": 3}}
    snaps = PeerSnapshots(str(tmp_path / "shm"), "unit")
    snaps.write(3, state)
    path = snaps.latest_header().path
    mp.spawn(_peer_worker, args=(path, free_port(), str(tmp_path / "got")), nprocs=2, join=True)
    sent, received = torch.load(tmp_path / "got-0.pt"), torch.load(tmp_path / "got-1.pt")
    assert received["received_into_live"] is True
    for key in ("weight", "bias"):
        assert torch.equal(received["state"]["model"][key], state["model"][key])
        assert torch.equal(sent["state"]["model"][key], state["model"][key])
    assert torch.equal(received["state"]["extra"]["t"], torch.arange(5)) and received["state"]["position"]["step"] == 3
    snaps.close(remove=True)
