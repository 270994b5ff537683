"""Checkpoints live on shared storage and their digest proves integrity, not origin: loading one must never run
code (torch.load weights_only), while the trainer's own checkpoints (model, optimizer, scheduler, scaler, extras,
position) still load exactly."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from ddp_trainer import storage
from ddp_trainer.checkpoint import FORMAT, CheckpointStore
from ddp_trainer.state import Components, Position, TensorRef, _map_leaves, flatten


class _Exploit:
    """Unpickling this runs a shell command (the classic pickle payload)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_carrying_a_pickle_exploit_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = str(tmp_path / "evil.pt")
    storage.save_file(path, {"format": FORMAT, "step": 1, "state": {"extra": _Exploit(str(marker))}})
    with pytest.raises(storage.CorruptFileError, match="cannot unpickle"):
        storage.load_file(path)
    assert not marker.exists(), "loading a checkpoint ran code"


def test_a_planted_checkpoint_is_skipped_for_the_trainers_own(tmp_path):
    marker = tmp_path / "pwned"
    warnings = []
    store = CheckpointStore(str(tmp_path / "ck"), keep=3, warn=lambda event, **kw: warnings.append((event, kw)))
    state = _full_state(10)
    store.save(10, state)
    # Newer than the real one and with a valid digest: only the unpickler can tell.
    storage.save_file(store.path(20), {"format": FORMAT, "step": 20, "state": {"extra": _Exploit(str(marker))}})
    step, loaded = store.load_latest()
    assert step == 10 and _equal(loaded, state)
    assert warnings[0][0] == "checkpoint_corrupt" and warnings[0][1]["step"] == 20
    assert not marker.exists()
    store.close()


def _full_state(step: int) -> dict:
    """Everything the trainer puts into a checkpoint, with stateful optimizer, scheduler and scaler."""
    torch.manual_seed(step)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    scaler = torch.amp.GradScaler("cpu")
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched.step()
    extra = {"best_val": 0.5, "bad_epochs": 1, "history": [0.1, 0.2], "name": "run", "nothing": None}
    return Components(model, opt, scaler, sched, extra=extra).state_dict(
        Position(step=step, epoch=1, batch=2, world_size=2))


def _equal(a, b) -> bool:
    """Same tensors (dtype and values) and the same everything else."""
    sa, ta = flatten(a)
    sb, tb = flatten(b)
    return (len(ta) == len(tb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb))
            and _plain(sa) == _plain(sb))


def _plain(skeleton):
    return _map_leaves(skeleton, lambda x: ("tensor", x.index) if isinstance(x, TensorRef) else x)


def test_the_trainers_own_checkpoint_still_loads(tmp_path):
    state = _full_state(7)
    store = CheckpointStore(str(tmp_path / "ck"), keep=2)
    store.save(7, state)
    step, loaded = store.load_latest()
    assert step == 7 and _equal(loaded, state)
    # and it restores into fresh components
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    extra: dict = {}
    pos = Components(model, opt, torch.amp.GradScaler("cpu"), sched, extra=extra).load_state_dict(loaded)
    assert pos == Position(step=7, epoch=1, batch=2, world_size=2) and extra["history"] == [0.1, 0.2]
    store.close()
