"""Resident state: every rank's parameters and optimizer state live in a ``/dev/shm`` file, a snapshot without a copy.

A peer snapshot (``snapshot.py``) copies the whole state: ~16 bytes per parameter with Adam, 1.2 GB at 100M
parameters, which on a CPU costs as much memory bandwidth as a good part of a training step. So a large model can
only afford a copy every K steps. The copy is only needed because the live state sits in process memory and dies
with the process. Here the live state itself is placed in a memory-mapped file in the pod's ``/dev/shm`` (the
operator mounts a memory-backed emptyDir there; it outlives worker restarts inside the pod, not the pod): after
the first save point the optimizer's parameters and state tensors are views into that file, and the optimizer
updates them there. Nothing is copied per step and the process uses no more memory than before (the same pages,
only now named by a file).

The file is a slot (``slot.py``, the layout and validation of the snapshot copies: leading and trailing generation
numbers) whose data region *is* the storage of the tensors that only the optimizer step changes (the *resident*
ones); everything else in the state (buffers, tied or frozen tensors, scalars) is copied into its place at each
save point, and the small non-tensor rest is the pickled meta. Its validity follows the training loop:

- the optimizer step pre-hook (:meth:`ResidentState.begin_update`) zeroes the leading generation: while the
  optimizer rewrites the tensors in place the slot is invalid;
- the save point after the step (:meth:`ResidentState.commit`) writes the meta and the copied tensors, then seals
  the slot with a new generation and a fingerprint of the data (``slot.fingerprint``): valid, labelled with the
  completed step.

A rank killed inside that window (SIGKILL, OOM, a crash inside ``optimizer.step()``) leaves its slot invalid, never
half-updated and valid. Every rank keeps its own file (``resident-<local rank>.bin``), so after any failure that
leaves one rank whole, some rank holds the newest completed step and ``Run.restore`` broadcasts it: no step is lost
to the snapshot interval. The ranks that survive a failure are whole: they are stopped by SIGTERM, and the SIGTERM
watcher first takes the update lock (:meth:`ResidentState.hold`), so a rank never exits inside its optimizer step
while that step can finish (but waits at most ``HOLD_GRACE_S`` once the step returned: a loop blocked before its
save point, e.g. in a collective of its own, exits without sealing). Only a failure that catches every rank inside the window (in practice a single-process
job whose process dies in ``optimizer.step()``) needs the copies, which the pod's local rank 0 still writes every K
steps (``snapshot.py``): they bound what such a failure loses.

Two things besides the optimizer step touch the file, and neither may leave it labelled with a step it does not hold:

- *readers*. The SIGTERM checkpoint reads the file while the training loop may go on (when the watcher gave up
  waiting for a save point): it reads it only under the update lock (:meth:`ResidentState.read_for_exit`), so no
  optimizer step starts during the copy, and every reader re-checks both generations after its copy
  (``slot.load_slot``), so a copy that raced a writer is read again, never returned;
- *weights changed in place between save points* (an EMA helper's ``copy_to``/``restore`` around evaluation,
  ``model.load_state_dict(best)``): the parameters are the file, so such a change rewrites a sealed file. The guarded
  way is :meth:`ResidentState.begin_update` before the change and a commit after it (``SavePoints.weights_swapped``,
  ``with run.weights_swapped():``); an unguarded change is caught by the fingerprint, which no longer matches: the
  restore rejects the file (``event=resident_state_modified``) and resumes from the copies or a checkpoint. The
  fingerprint samples a few words per tensor, so it catches a change of the whole tensor (new weights), not a
  change of a few elements.

Only CPU tensors can live in ``/dev/shm``; with CUDA tensors resident state is off and the copies (side stream,
pinned memory) are what a pod holds. Space is reserved with ``posix_fallocate`` when the file is laid out, so a
``/dev/shm`` too small for the state is an error at that point (``OSError``, the run goes on with the copies alone)
instead of a SIGBUS in the middle of an optimizer step.
"""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time
from typing import Any

import torch

from .slot import (
    HEADER_SIZE,
    PAGE,
    Snapshot,
    align,
    begin_header,
    data_specs,
    data_views,
    fingerprint,
    fingerprint_index,
    invalidate,
    load_slot,
    pack_meta,
    seal,
)
from .state import flatten

FILE_NAME = "resident-{local_rank}.bin"
# The SIGTERM watcher waits this long for an optimizer step in progress to reach its save point (torch's agent sends
# SIGKILL 30 s after SIGTERM)...
HOLD_TIMEOUT_S = 20.0
# ...but only this long once the optimizer step has returned: the save point is then microseconds away, unless the
# training loop blocks in between (a collective of its own whose peer is gone), which must not delay the exit.
HOLD_GRACE_S = 1.0
# Resident state's trial (Trial): its first commits are measured, and it stays on when they cost at most this share of
# the snapshot budget (the copies are chosen for half of it: cadence.TARGET_SHARE_OF_BUDGET).
TRIAL_COMMITS = 5
SHARE_OF_BUDGET = 0.25


def supported(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether the optimizer's tensors can be resident: all of them on the CPU."""
    if optimizer is None:
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return bool(params) and all(p.device.type == "cpu" for p in params)


def _movable(optimizer: torch.optim.Optimizer) -> dict[int, tuple[torch.Tensor, Any, Any]]:
    """The tensors only the optimizer step changes, by ``data_ptr()``: (the tensor, container, key) to rebind each
    one (``(param, param, None)`` for a parameter, ``(value, state dict, key)`` for optimizer state)."""
    out: dict[int, tuple[torch.Tensor, Any, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.setdefault(p.data_ptr(), (p, p, None))
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    out.setdefault(value.data_ptr(), (value, optimizer.state[p], key))
    return out


class Trial:
    """Whether resident state is worth its commits (``DDPJOB_SNAPSHOT_RESIDENT=auto``). Its first TRIAL_COMMITS commits
    once a step has been timed are a trial: a commit costs the state dict's walk and pickle every step whatever the
    model's size, which a small model's short step cannot afford (the digits example: 0.17 ms of a ~15 ms step) and a
    large one does not notice (~100M parameters: 0.12 ms of 1.5 s; make bench-resident-commit). Resident state stays
    on when the median commit is within SHARE_OF_BUDGET of the budget; else the copies alone hold the state (their K
    bounds the loss)."""

    def __init__(self) -> None:
        self._costs: list[float] = []  # the first commits' seconds

    @property
    def decided(self) -> bool:
        return len(self._costs) >= TRIAL_COMMITS

    def commit_timed(self, seconds: float, step_s: float, budget_pct: float) -> dict[str, float] | None:
        """Count one commit; at the trial's end, if the commits cost too much, what the ``resident_state_off`` line
        says (None: undecided, or resident state stays on)."""
        self._costs.append(seconds)
        if len(self._costs) < TRIAL_COMMITS:
            return None
        cost_s = statistics.median(self._costs)
        share_pct = 100.0 * cost_s / step_s
        if share_pct <= budget_pct * SHARE_OF_BUDGET:
            return None
        return {"commit_ms": round(cost_s * 1e3, 3), "step_ms": round(step_s * 1e3, 3),
                "share_pct": round(share_pct, 3), "budget_pct": budget_pct}


class ResidentState:
    """One rank's resident state file for one run (see the module doc)."""

    def __init__(self, directory: str, run_key: str, local_rank: int) -> None:
        self.run_key = run_key
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, FILE_NAME.format(local_rank=local_rank))
        self._mm: mmap.mmap | None = None
        self._views: list[torch.Tensor] = []
        self._resident: list[bool] = []  # per flattened tensor: its view is the live tensor (nothing to copy)
        self._layout: tuple | None = None
        self._specs: list[tuple] = []
        self._data_off = 0
        self._data_len = 0
        self._words = torch.empty(0, dtype=torch.int32)  # the file as int32 words, and the ones the fingerprint samples
        self._sampled = torch.empty(0, dtype=torch.int64)
        self._generation = time.time_ns()
        # Held from the optimizer step pre-hook to the save point's seal, and by the SIGTERM watcher once it
        # decided to exit: a rank never exits half-way through an update it can finish.
        self._lock = threading.Lock()
        self._updating = False
        self._held = False  # the SIGTERM watcher took the lock for good (hold, read_for_exit): the process exits next
        self._stepped_at: float | None = None  # when the optimizer step of the update in progress returned
        self.rejected: str | None = None  # why the last read found no state ("modified", "changing", ...)
        self.rejected_step: int | None = None  # the step the rejected file's header claimed
        self.last_step: int | None = None
        self.resident_bytes = 0  # bytes the optimizer updates in the file (no copy)
        self.copied_bytes = 0  # bytes copied into it at each save point
        self.layouts = 0  # how many times the file was laid out (one copy of the whole state each)

    # -- writing -----------------------------------------------------------------------------------------
    def begin_update(self) -> None:
        """The optimizer is about to rewrite the resident tensors: the file is invalid until :meth:`commit`."""
        if self._updating:
            return
        self._lock.acquire()
        self._updating = True
        self._stepped_at = None
        if self._mm is not None:
            invalidate(self._mm)

    def abandon_update(self) -> None:
        """End an update without sealing (a weight swap that raised): the file stays invalid until the next commit."""
        if self._updating:
            self._updating = False
            self._stepped_at = None
            self._lock.release()

    @property
    def laid_out(self) -> bool:
        """Whether the file exists (the first commit lays it out)."""
        return self._mm is not None

    def end_update(self) -> None:
        """The optimizer step returned (its post-hook): the tensors are whole again, sealed at the save point."""
        if self._updating:
            self._stepped_at = time.monotonic()

    def commit(self, step: int, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Seal the file with ``state`` (the run's state after ``step`` completed steps).

        Lays the file out anew, copying the whole state once and making the optimizer's tensors views into it,
        whenever the state's shape changed or a movable tensor is not resident (the first save point, after an
        optimizer ``load_state_dict``)."""
        if not self._updating:
            self._lock.acquire()
            self._updating = True
        try:
            skeleton, tensors = flatten(state)
            if not self._fits(tensors):
                self._lay_out(tensors, optimizer)
            assert self._mm is not None
            meta = pack_meta(self.run_key, skeleton, self._specs, 1)
            if HEADER_SIZE + len(meta) > self._data_off:  # the meta outgrew its room: lay out again
                self._lay_out(tensors, optimizer, meta_len=len(meta))
                meta = pack_meta(self.run_key, skeleton, self._specs, 1)
            mm = self._mm
            begin_header(mm, step, meta, self._data_off, self._data_len)
            copy_to = [v for v, r in zip(self._views, self._resident, strict=True) if not r]
            if copy_to:
                with torch.no_grad():
                    torch._foreach_copy_(copy_to, [t for t, r in zip(tensors, self._resident, strict=True) if not r])
            self._generation += 1
            seal(mm, self._data_off, self._data_len, self._generation, fingerprint(self._words, self._sampled))
            self.last_step = step
        finally:
            self._updating = False
            self._stepped_at = None
            self._lock.release()

    def _fits(self, tensors: list[torch.Tensor]) -> bool:
        if self._mm is None or tuple((t.dtype, t.shape) for t in tensors) != self._layout:
            return False
        return all(not r or t.data_ptr() == v.data_ptr() for t, v, r in zip(tensors, self._views, self._resident,
                                                                              strict=True))

    def _lay_out(self, tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer, meta_len: int = 0) -> None:
        """A new file holding a copy of every tensor; the movable ones are then rebound to their copies."""
        specs, data_len = data_specs(tensors)
        # Room for the meta to grow (positions, extras and hyper-parameters change from step to step).
        data_off = align(HEADER_SIZE + max(meta_len * 2, 64 * 1024), PAGE)
        size = align(data_off + data_len + 8, PAGE)
        tmp = self.path + ".new"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS at a page fault later
            except OSError:
                os.unlink(tmp)
                raise
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        views = data_views(base, data_off, specs)
        movable = _movable(optimizer)
        resident = []
        with torch.no_grad():
            for t, v in zip(tensors, views, strict=True):
                v.copy_(t)
                owner = movable.pop(t.data_ptr(), None) if t.is_contiguous() and t.device.type == "cpu" else None
                # the optimizer's own tensor behind this entry of the state dict (same memory, shape and dtype)
                fits = owner is not None and owner[0].shape == t.shape and owner[0].dtype == t.dtype
                if fits:
                    _, container, key = owner
                    if key is None:
                        container.data = v
                    else:
                        container[key] = v
                resident.append(fits)
        invalidate(mm)
        os.replace(tmp, self.path)  # the old file (if any) lives on until nothing maps it
        # The old mapping is not closed: tensors of the caller's (the state dict being committed) may still view it.
        self._mm, self._views, self._resident = mm, views, resident
        self._specs, self._data_off, self._data_len = specs, data_off, data_len
        self._words, self._sampled = torch.frombuffer(mm, dtype=torch.int32), fingerprint_index(data_off, specs)
        self._layout = tuple((t.dtype, t.shape) for t in tensors)
        self.resident_bytes = sum(n for (_, _, _, n), r in zip(specs, resident, strict=True) if r)
        self.copied_bytes = sum(n for (_, _, _, n), r in zip(specs, resident, strict=True) if not r)
        self.layouts += 1

    # -- termination -------------------------------------------------------------------------------------
    def hold(self, timeout: float = HOLD_TIMEOUT_S, grace: float = HOLD_GRACE_S) -> bool:
        """For the SIGTERM watcher: wait until no update is in progress and keep the lock (the process exits
        next), so the file is valid when the process goes. False if the update was not sealed within ``timeout``,
        or within ``grace`` of its optimizer step's return."""
        if self._held:
            return True
        deadline = time.monotonic() + timeout
        while not self._lock.acquire(timeout=0.05):
            now, stepped = time.monotonic(), self._stepped_at
            if now >= deadline or (stepped is not None and now - stepped > grace):
                return False
        self._held = True
        return True

    def read_for_exit(self, timeout: float = HOLD_GRACE_S) -> Snapshot | None:
        """For the SIGTERM watcher: the sealed state, read under the lock, which it keeps (the process exits next, as
        after :meth:`hold`), so no optimizer step rewrites the file during the copy. None if an update in progress
        is not sealed within ``timeout`` (the watcher already waited in :meth:`hold`)."""
        if not self._held:
            if not self._lock.acquire(timeout=timeout):
                self.rejected, self.rejected_step = "updating", self.last_step
                return None
            self._held = True
        return self.read()

    # -- reading -----------------------------------------------------------------------------------------
    def read(self) -> Snapshot | None:
        """The state sealed in this rank's file, or None (no file, another run, invalid, or its data changed since
        the seal: :attr:`rejected` says which)."""
        got = load_slot(self.path, self.run_key)
        self.rejected, self.rejected_step = got.reason if got.snapshot is None else None, got.step
        return got.snapshot

    def close(self, *, remove: bool = False) -> None:
        """Forget the file; with ``remove`` delete it. The mapping is not closed: the model's tensors still use
        it (its memory is freed with them)."""
        self._mm = None
        self._views = []
        self._resident = []
        self._layout = None
        self._words, self._sampled = torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64)
        if remove:
            for path in (self.path, self.path + ".new"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
