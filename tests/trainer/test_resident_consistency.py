"""The resident state is never saved or resumed half-updated, nor holding weights its step did not produce.

Two ways a slot sealed as step N could hold something else, both caught here:
- a reader copying the file while a writer rewrites it (the SIGTERM checkpoint racing the next optimizer step): the
  reader's copy mixes two steps under the older step's generations unless it reads only a sealed file and re-checks
  both generations after the copy;
- weights changed in place between save points (an EMA helper's ``copy_to`` around evaluation, a
  ``load_state_dict(best)``): the file is the live parameters, so it changes with them; its sealed fingerprint no
  longer matches and the restore falls back to the copies, and ``SavePoints.weights_swapped`` is the guarded way.
"""

from __future__ import annotations

import builtins
import threading

import pytest
import torch
from ddp_trainer import slot as slotmod
from ddp_trainer.resident import ResidentState
from ddp_trainer.run import Run
from ddp_trainer.session import Session
from ddp_trainer.state import Components, Position, flatten


class _InterleavedFile:
    """A file whose first read copies the header, lets ``between`` run (the writer, on another core), then copies
    the rest: what a reader's copy of a large file looks like to a writer that does not wait for it."""

    def __init__(self, real, between):
        self._real, self._between = real, between

    def read(self, n=-1):
        if self._between is None:
            return self._real.read(n)
        head = self._real.read(slotmod.HEADER_SIZE if n < 0 else min(n, slotmod.HEADER_SIZE))
        between, self._between = self._between, None
        between()
        return head + self._real.read(-1 if n < 0 else n - len(head))

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._real.close()


def _interleave(monkeypatch, path_suffix, between):
    """The next read of a file whose path ends with ``path_suffix`` runs ``between`` after copying the header."""
    pending = [between]

    def opener(path, *args, **kwargs):
        real = builtins.open(path, *args, **kwargs)
        if str(path).endswith(path_suffix) and pending:
            return _InterleavedFile(real, pending.pop())
        return real

    monkeypatch.setattr(slotmod, "open", opener, raising=False)


def _tensors(state):
    return [t.detach().clone() for t in flatten(state)[1]]


def _bitwise(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                                    for x, y in zip(a, b, strict=True))


def _resident_after_steps(tmp_path, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    comp = Components(model, opt)
    res = ResidentState(str(tmp_path), "unit", 0)
    opt.register_step_pre_hook(lambda *_: res.begin_update())
    opt.register_step_post_hook(lambda *_: res.end_update())
    pos = Position(step=0)

    def step():
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        pos.step += 1

    for _ in range(steps):
        step()
        res.commit(pos.step, comp.state_dict(pos), opt)
    return res, comp, pos, step


@pytest.mark.parametrize("writer", ["left mid-update", "rewritten and sealed"])
def test_a_read_racing_a_rewrite_is_never_accepted_as_the_older_step(tmp_path, monkeypatch, writer):
    """The reader copies the header of sealed step 3; the next optimizer step then rewrites the parameters (and, in
    the second case, its save point seals step 4); then the reader copies the data and the trailing generation. The
    copy mixes steps 3 and 4 under step 3's generations: it must be refused or re-read, never returned as step 3."""
    res, comp, pos, step = _resident_after_steps(tmp_path, 3)
    sealed = {3: _tensors(comp.state_dict(pos))}

    def the_next_step():
        step()  # the optimizer pre-hook invalidates, the optimizer rewrites the resident tensors in place
        if writer == "rewritten and sealed":
            res.commit(pos.step, comp.state_dict(pos), comp.optimizer)
            sealed[pos.step] = _tensors(comp.state_dict(pos))

    _interleave(monkeypatch, "resident-0.bin", the_next_step)
    got = res.read()
    whole = got is None or (got.step in sealed and _bitwise(_tensors(got.state), sealed[got.step]))
    assert whole, f"step {got.step} read back holding other tensors than the state sealed as step {got.step}"
    if writer == "rewritten and sealed":
        assert got is not None and got.step == 4  # re-read: the newer sealed step, whole


def _run(session, shm, ckpt=None, **settings):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    settings = {"snapshot_every": 5, "snapshot_resident": True, "checkpoint_every": 0, **settings}
    run = Run(session, model=model, optimizer=opt, seed=3, checkpoint_dir=ckpt, snapshot_dir=shm,
              progress_port=0, log_every=0, **settings)
    run.restore()
    return run, model, opt


def _forward_backward(run, model, opt):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(run.step))
    opt.zero_grad()
    model(x).pow(2).mean().backward()


def _train_to(run, model, opt, last, states):
    while run.step < last:
        _forward_backward(run, model, opt)
        opt.step()
        run.step_done()
        states[run.step] = _tensors(run.components.state_dict(run.position))


def test_the_sigterm_checkpoint_taken_during_an_optimizer_step_holds_exactly_its_steps_state(
        tmp_path, single_process_group, monkeypatch):
    """SIGTERM arrives after step 4's optimizer step while the loop is slow to reach its save point (past the 1 s
    grace: the watcher gives up waiting, resident_state_unsealed). The loop then seals step 4 and runs step 5's
    optimizer step while the SIGTERM checkpoint reads the resident file. The checkpoint must hold exactly the state
    of the step it is labelled with, bitwise."""
    shm, ckpt = str(tmp_path / "shm"), str(tmp_path / "ckpt")
    run, model, opt = _run(single_process_group, shm, ckpt, snapshot_every=50)
    states = {0: _tensors(run.components.state_dict(run.position))}
    _train_to(run, model, opt, 3, states)
    gave_up, sealed, header_copied, stepped = (threading.Event() for _ in range(4))
    warn = run.saves._warn

    def spy(event, **fields):
        warn(event, **fields)
        if event == "resident_state_unsealed":
            gave_up.set()
    monkeypatch.setattr(run.saves, "_warn", spy)
    opt.register_step_post_hook(lambda *_: stepped.set() if run.step == 4 else None)

    def between_header_and_data():
        header_copied.set()
        stepped.wait(3)  # the next optimizer step, if it can start, rewrites the file meanwhile

    assert sealed  # (the events exist before the reader's hook can use them)
    real_opener = builtins.open

    def opener(path, *args, **kwargs):
        real = real_opener(path, *args, **kwargs)
        if str(path).endswith("resident-0.bin") and not header_copied.is_set():
            sealed.wait(10)
            return _InterleavedFile(real, between_header_and_data)
        return real
    monkeypatch.setattr(slotmod, "open", opener, raising=False)

    _forward_backward(run, model, opt)
    opt.step()  # step 4's optimizer step: the file is invalid until its save point
    callbacks = list(reversed(single_process_group._term_callbacks))  # as Session._terminate runs them
    sigterm = threading.Thread(target=lambda: [cb() for cb in callbacks], daemon=True)
    sigterm.start()
    assert gave_up.wait(10)
    run.step_done()  # the loop reaches its save point late: step 4 sealed
    states[4] = _tensors(run.components.state_dict(run.position))
    sealed.set()
    _forward_backward(run, model, opt)
    header_copied.wait(10)
    step5 = threading.Thread(target=opt.step, daemon=True)  # step 5's optimizer step, racing the reader
    step5.start()
    sigterm.join(30)
    assert not sigterm.is_alive()
    if run.resident is not None and run.resident._lock.locked() and step5.is_alive():
        run.resident._lock.release()  # the watcher kept the lock (the process exits next): let the test end
    step5.join(10)

    got = run.saves.checkpoints.load_latest()
    assert got is not None, "no checkpoint written on SIGTERM"
    step, state = got
    whole = step in states and _bitwise(_tensors(state), states[step])
    assert whole, f"the SIGTERM checkpoint labelled step {step} does not hold step {step}'s state"
    run.snapshots.close()


def _ema_weights(model):
    return [p.detach().clone().mul_(0.5).add_(0.25) for p in model.parameters()]


def test_weights_swapped_in_place_without_the_guard_are_never_resumed_as_the_step(tmp_path, single_process_group,
                                                                                  capsys):
    """An EMA helper copies its weights into the live parameters in place for evaluation after step 7 and the
    process dies before they are restored. The resident file is those parameters, still sealed as step 7: the
    restore must refuse it (resident_state_modified) and resume from the copies (step 5) with step 5's weights,
    bitwise."""
    shm = str(tmp_path / "shm")
    run, model, opt = _run(single_process_group, shm)
    states = {0: _tensors(run.components.state_dict(run.position))}
    _train_to(run, model, opt, 7, states)
    run.snapshots.wait()
    ema = _ema_weights(model)
    with torch.no_grad():
        for p, e in zip(model.parameters(), ema, strict=True):
            p.copy_(e)  # ema.copy_to(model.parameters())
    run.snapshots.close()  # killed during evaluation: the weights are never restored
    capsys.readouterr()

    resumed, model2, _ = _run(single_process_group, shm)
    out = capsys.readouterr().out
    swapped = all(torch.equal(p, e) for p, e in zip(model2.parameters(), ema, strict=True))
    assert not swapped, f"resumed step {resumed.step} (from {resumed.restored_from}) with the EMA weights"
    whole = resumed.step in states and _bitwise(_tensors(resumed.components.state_dict(resumed.position)),
                                                states[resumed.step])
    assert whole, f"resumed step {resumed.step} with other weights than step {resumed.step}'s"
    assert resumed.step == 5 and resumed.restored_from == "local"  # the copies
    assert "event=resident_state_modified" in out, out
    resumed.snapshots.close()


@pytest.mark.parametrize("crash", ["inside the swap", "after the swap"])
def test_weights_swapped_guard_invalidates_for_the_swap_and_reseals_after(tmp_path, single_process_group, crash):
    """The guarded way (``with run.weights_swapped():``, SavePoints.weights_swapped): killed inside the swap, the
    resident file is invalid and the run resumes from the copies (step 5), bitwise; after it the file is sealed
    again with the restored weights, training goes on, and a kill then resumes the newest step itself, bitwise."""
    shm = str(tmp_path / "shm")
    run, model, opt = _run(single_process_group, shm)
    states = {0: _tensors(run.components.state_dict(run.position))}
    _train_to(run, model, opt, 7, states)
    live = [p.detach().clone() for p in model.parameters()]
    with run.weights_swapped():
        assert run.resident.read() is None  # invalid while the weights are not step 7's
        with torch.no_grad():
            for p, e in zip(model.parameters(), _ema_weights(model), strict=True):
                p.copy_(e)  # ema.copy_to(model.parameters())
        if crash == "inside the swap":
            run.snapshots.wait()  # killed here: nothing more is written
            resumed, _, _ = _run(single_process_group, shm)
            assert resumed.step == 5 and _bitwise(_tensors(resumed.components.state_dict(resumed.position)),
                                                  states[5])
            resumed.snapshots.close()
        with torch.no_grad():
            for p, w in zip(model.parameters(), live, strict=True):
                p.copy_(w)  # ema.restore()
    if crash == "after the swap":
        got = run.resident.read()
        assert got is not None and got.step == 7 and _bitwise(_tensors(got.state), states[7])
        _train_to(run, model, opt, 8, states)  # the guard released the update lock: training goes on
        got = run.resident.read()
        assert got is not None and got.step == 8 and _bitwise(_tensors(got.state), states[8])
        run.snapshots.wait()  # killed here
        resumed, _, _ = _run(single_process_group, shm)
        assert resumed.step == 8 and _bitwise(_tensors(resumed.components.state_dict(resumed.position)), states[8])
        resumed.snapshots.close()
    run.snapshots.close()


def test_a_sampled_word_changed_after_the_seal_rejects_the_slot_as_modified(tmp_path):
    """The fingerprint in the header: a parameter changed in place after the seal is refused with its reason; the
    same file unchanged reads back."""
    res, comp, pos, _ = _resident_after_steps(tmp_path, 2)
    assert res.read() is not None and res.rejected is None
    weight = comp.optimizer.param_groups[0]["params"][0]
    first = weight.view(-1)[0].item()
    with torch.no_grad():
        weight.view(-1)[0] = first + 1.0  # the first word of every tensor is sampled
    assert res.read() is None and res.rejected == "modified"
    with torch.no_grad():
        weight.view(-1)[0] = first
    got = res.read()
    assert got is not None and got.step == 2 and res.rejected is None
