"""Save points: where a run keeps its state between steps, and when it writes it.

A *save point* is a moment where the state is consistent: after every step except an epoch's last
(whose save point is :meth:`Run.epoch_done`, after validation). At every K-th save point every pod's
local rank 0 starts copying the state into its peer snapshot (``snapshot.py``; asynchronously, overlapping the next
step; an optimizer step pre-hook waits until the copy has read the live tensors) and, every
``checkpoint_every`` steps, global rank 0 queues a disk checkpoint (``checkpoint.py``). K (``snapshot_every``) is
fixed (default 1: every save point) or, with ``auto``, chosen from the measured copy and step times so that snapshots
cost at most ``DDPJOB_SNAPSHOT_BUDGET_PCT`` (default 2 %) of the training time (``cadence.py``);
each pod decides its own K, logs it (``event=snapshot_interval``) and rank 0 reports it in progress
(``snapshotEvery``). A failure loses at most K steps. Where K may exceed 1 and the state is on the CPU, every rank
also keeps its parameters and optimizer state *resident* in its pod's snapshot directory (``resident.py``): the
optimizer updates them there and every save point seals them (the epoch's last step included), without a copy, so
a failure that leaves one rank outside its optimizer step loses at most one step (``snapshotResident``).

The resident state assumes that only the optimizer step changes the parameters between save points. A training loop
that swaps weights in place between them (an EMA's ``copy_to``/``restore`` around evaluation, loading the best
weights) says so with :meth:`SavePoints.weights_swapped` (``with run.weights_swapped():``): the copy in flight has
read the live tensors first, the resident file is invalid during the swap and sealed again after it. A swap without
it is caught at restore by the file's fingerprint (``event=resident_state_modified``; the copies or a checkpoint are
used instead).

On SIGTERM (an eviction, a drain, a preemption; torchrun stopping the workers for a new round) every rank finishes the
step it is in, if it can, and starts no other (:meth:`SavePoints.step_begins`, which :meth:`Run.batches` calls before
each step): no rank then gets past the step rank 0 reaches, since each step needs every rank's gradients. Global rank
0 then writes a checkpoint of its newest save point (the copy in flight completed first) and the high-water mark of
the last step it completed beside it (checkpoint.py), so a job whose pods are all stopped at once resumes at most one
step behind (none when the step in progress could finish), and says how many it lost. The wait for the step in
progress is bounded (:func:`stop_wait_s`): a step blocked in a collective whose peer is gone never finishes, and one
whose collective failed ends the process (session.py waits for the checkpoint then).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .cadence import Cadence
from .checkpoint import CheckpointStore
from .config import RunConfig
from .recovery import HighWaterMark
from .resident import ResidentState, Trial, supported as resident_supported
from .session import Session
from .slot import Snapshot
from .snapshot import PeerSnapshots
from .state import Components, Position, detached_copy


STOP_WAIT_MIN_S, STOP_WAIT_MAX_S = 0.5, 10.0


def stop_wait_s(step_s: float | None) -> float:
    """How long SIGTERM waits for the step in progress to reach its save point: two steps' time, within 0.5-10 s
    (2 s before a step was timed)."""
    return 2.0 if step_s is None else min(max(2.0 * step_s, STOP_WAIT_MIN_S), STOP_WAIT_MAX_S)


class SavePoints:
    """A run's peer snapshot copies, resident state and disk checkpoints (see the module doc)."""

    def __init__(self, session: Session, config: RunConfig, components: Components,
                 warn: Callable[..., None]) -> None:
        self.session = session
        self.components = components
        self.log = session.log
        self._warn = warn
        snapshot_dir, resident_mode, optimizer = config.snapshot_dir, config.snapshot_resident, components.optimizer
        self.checkpoint_every = config.checkpoint_every
        self.cadence = Cadence(config.snapshot_every, config.snapshot_budget_pct, config.snapshot_max_every)
        self._after_save: str | None = None  # "snapshot" or "checkpoint": the save point the running step follows

        # Only global rank 0 touches the checkpoint directory; it alone validates it.
        self.checkpoints: CheckpointStore | None = None
        if config.checkpoint_dir and session.is_main:
            self.checkpoints = CheckpointStore(config.checkpoint_dir, keep=config.keep_checkpoints, warn=warn)
        # Every rank reads its pod's snapshot at restore; only local rank 0 writes it.
        self.snapshots: PeerSnapshots | None = None
        if snapshot_dir and self.cadence.every:
            self.snapshots = PeerSnapshots(snapshot_dir, session.run_key)
        self.writes_snapshots = self.snapshots is not None and session.local_rank == 0
        # Every rank's resident state (resident.py): its own file, next to the pod's snapshots.
        self.resident: ResidentState | None = None
        # Only where copies may be more than one step apart (K adaptive or above 1): with K = 1 they lose no more.
        if (self.snapshots is not None and resident_mode is not False and resident_supported(optimizer)
                and (resident_mode or self.cadence.adaptive or self.cadence.every > 1)):
            self.resident = ResidentState(snapshot_dir, session.run_key, session.local_rank)
        self._resident_trial = Trial() if resident_mode is None else None
        self._hook: Any = None
        self._stopping = threading.Event()  # set on SIGTERM: no step starts any more (step_begins)
        self._highwater: HighWaterMark | None = None
        if (self.writes_snapshots or self.resident is not None) and optimizer is not None:
            # The snapshot thread copies parameters and optimizer state from the live tensors: the next
            # optimizer step (the first thing that changes them) waits until it has read them. And the
            # resident state is invalid from here until the save point after the step.
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._post_hook: Any = None
        if self.resident is not None and optimizer is not None:
            self._post_hook = optimizer.register_step_post_hook(self._after_optimizer_step)

    def on_terminate(self, checkpoint: bool, highwater: HighWaterMark | None = None) -> None:
        """Register what SIGTERM does (``checkpoint``: a last checkpoint from the newest save point, and the
        ``highwater`` mark of this rank's last completed step beside it). Callbacks run in reverse order."""
        if checkpoint and self.checkpoints is not None and self.writes_snapshots:
            self._highwater = highwater
            self.session.on_terminate(self._checkpoint_on_terminate)
        if self.resident is not None:
            # Before the checkpoint: an optimizer step in progress reaches its save point before the process exits
            # (and before the checkpoint above reads the newest state).
            self.session.on_terminate(self._hold_resident)
        # First of all, on every rank: the step in progress finishes, no other starts (module doc).
        self.session.on_terminate(self._stop)
        if self.writes_snapshots:
            # A process that ends otherwise (its collective failed: a peer is gone) leaves its copy in flight whole.
            self.session.on_exit(self._finish_copy)

    def step_begins(self) -> None:
        """The training loop is about to start a step (:meth:`Run.batches`). After SIGTERM it starts none: this blocks
        until the SIGTERM watcher ends the process."""
        if self._stopping.is_set():
            self.session.main_idle.set()
            threading.Event().wait()

    def _stop(self) -> None:
        self._stopping.set()
        self.session.main_idle.wait(stop_wait_s(self.cadence.step_s))

    def _finish_copy(self) -> None:
        if self.snapshots is not None:
            self.snapshots.wait_written(STOP_WAIT_MAX_S)

    # -- reading ---------------------------------------------------------------------------------------------
    def newest_local(self, copies: Snapshot | None, *, exiting: bool = False) -> Snapshot | None:
        """The newer of this pod's copies and this rank's resident state (``exiting``: read by the SIGTERM watcher
        while the training loop may go on, under the resident state's lock)."""
        res = self.resident
        mine = None
        if res is not None:
            mine = res.read_for_exit() if exiting else res.read()
            if mine is None and res.rejected == "modified":
                self._warn("resident_state_modified", step=res.rejected_step, path=res.path,
                           reason="the parameters changed in place after the save point sealed them (a weight swap "
                                  "outside run.weights_swapped()): the copies or a checkpoint hold the state")
        if mine is None or (copies is not None and copies.step > mine.step):
            return copies
        return mine

    def checkpoint_step(self) -> int | None:
        return self.checkpoints.last_saved_step if self.checkpoints is not None else None

    def progress(self) -> dict[str, Any]:
        """The copies' part of the progress report (the pods that write them)."""
        if not self.writes_snapshots or self.snapshots is None:
            return {}
        return {"snapshotEvery": self.cadence.every, "lastSnapshotStep": self.snapshots.last_step,
                "snapshotResident": self.resident is not None}

    # -- the training loop -----------------------------------------------------------------------------------
    def step_timed(self, dt: float | None) -> None:
        """A step ended, ``dt`` seconds after the one before (None: the first step)."""
        if dt is not None:
            self.cadence.step_timed(dt, self._after_save)
        self._after_save = None

    def wait_copy(self) -> None:
        """Wait for the copy in flight, if any."""
        if self.writes_snapshots and self.snapshots is not None and self.snapshots.in_flight_step is not None:
            self.snapshots.wait()

    def save(self, position: Position, checkpoint: bool = True, copies: bool = True) -> None:
        """The save point after ``position.step`` steps: the resident state, and (``copies``) the copies and
        (``checkpoint``) a checkpoint when due."""
        step = position.step
        state = None
        if self.resident is not None:
            self._commit_resident(position)
        if not copies:
            return
        if self.writes_snapshots and self.cadence.due(step):
            self.snapshot(position)
            self._after_save = "snapshot"
        if (
            checkpoint
            and self.checkpoints is not None
            and self.checkpoint_every
            and step % self.checkpoint_every == 0
            and step != self.checkpoints.last_saved_step
        ):
            state = state or self.components.state_dict(position)
            self.checkpoints.save_async(step, detached_copy(state))
            self._after_save = "checkpoint"  # its cost is the checkpoint's, not a snapshot's

    def _before_optimizer_step(self, *_: Any) -> None:
        if self.writes_snapshots and self.snapshots is not None:
            self.snapshots.wait_sources()
        if self.resident is not None:
            self.resident.begin_update()

    def _after_optimizer_step(self, *_: Any) -> None:
        if self.resident is not None:
            self.resident.end_update()

    @contextmanager
    def weights_swapped(self, position: Position) -> Iterator[None]:
        """Around an in-place change of the weights between save points (``position``: the last one's), e.g. an
        EMA's ``copy_to`` for evaluation and its ``restore``: the copy in flight first reads the live tensors, the
        resident file is invalid inside (a kill there resumes from the copies; SIGTERM waits for the block, as for
        an optimizer step) and is sealed again at the end with the weights then live. If the block raises, the file
        stays invalid until the next save point."""
        if self.writes_snapshots and self.snapshots is not None:
            self.snapshots.wait_sources()
        res = self.resident
        if res is None:
            yield
            return
        res.begin_update()
        try:
            yield
        except BaseException:
            res.abandon_update()
            raise
        if not res.laid_out:  # nothing was sealed before the swap (no optimizer step yet): nothing to seal after
            res.abandon_update()
            return
        try:
            res.commit(position.step, self.components.state_dict(position), self.components.optimizer)
        except OSError as exc:
            self._warn("resident_state_unavailable", dir=os.path.dirname(res.path), error=str(exc))
            self._resident_off()

    def _stable_tensors(self) -> set[int]:
        """Tensors only the optimizer step changes: the snapshot thread may read them live."""
        opt = self.components.optimizer
        if opt is None:
            return set()
        ptrs = {p.data_ptr() for group in opt.param_groups for p in group["params"]}
        for per_param in opt.state.values():
            ptrs.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        return ptrs

    def snapshot(self, position: Position) -> None:
        """Start a copy of the state at ``position`` (the previous one complete first); K settles on the way."""
        snaps = self.snapshots
        assert snaps is not None
        snaps.wait()  # the previous copy is complete: its time is measured
        line = self.cadence.settle(position.step, snaps.last_copy_s, snaps.last_step)
        if line is not None:
            self.log("snapshot_interval", all_ranks=True, **line, bytes=snaps.last_bytes,
                     budget_pct=self.cadence.budget_pct)
        state = self.components.state_dict(position)
        snaps.write_async(position.step, state, stable=self._stable_tensors(), every=self.cadence.every)

    def _commit_resident(self, position: Position) -> None:
        """Seal the resident state at this save point; with ``auto`` its first commits are a trial (resident.Trial)."""
        res, opt, step = self.resident, self.components.optimizer, position.step
        assert res is not None and opt is not None
        if not opt.state and step == 0:
            return  # nothing to keep yet: the first optimizer step creates the state, lay out after it
        layouts = res.layouts
        t0 = time.perf_counter()
        try:
            res.commit(step, self.components.state_dict(position), opt)
        except OSError as exc:  # /dev/shm too small for the state: the copies alone hold it from now on
            self._warn("resident_state_unavailable", dir=os.path.dirname(res.path), error=str(exc))
            self._resident_off()
            return
        if res.layouts != layouts:
            self.log("resident_state", all_ranks=self.session.local_rank == 0, step=step,
                     resident_bytes=res.resident_bytes, copied_bytes=res.copied_bytes)
            return  # a layout copies the whole state once: not what a commit costs
        trial, step_s = self._resident_trial, self.cadence.step_s
        if trial is None or trial.decided or step_s is None:
            return  # no trial, its decision taken, or no step measured yet to weigh a commit against
        off = trial.commit_timed(time.perf_counter() - t0, step_s, self.cadence.budget_pct)
        if off is not None:
            self.log("resident_state_off", all_ranks=self.session.local_rank == 0, **off)
            self._resident_off()

    def _resident_off(self) -> None:
        assert self.resident is not None
        self.resident.close(remove=True)
        self.resident = None

    # -- termination and the end -----------------------------------------------------------------------------
    def _hold_resident(self) -> None:
        if self.resident is not None and not self.resident.hold():
            self._warn("resident_state_unsealed",
                       reason="the training loop did not reach the save point after its optimizer step in time "
                              "(blocked after it, e.g. in a collective): the copies or a peer hold the state")

    def _checkpoint_on_terminate(self) -> None:
        # Runs on the SIGTERM thread while the main thread may be mid-step: use the last save point, its copy complete.
        assert self.snapshots is not None and self.checkpoints is not None
        t0 = time.perf_counter()
        self.snapshots.wait_written()
        snap = self.newest_local(self.snapshots.read_latest(), exiting=True)
        last = self.checkpoints.last_saved_step
        written = snap is not None and (last is None or snap.step > last)
        if written:
            assert snap is not None
            self.checkpoints.save(snap.step, snap.state)
            last = snap.step
        # Read after the checkpoint: a step that was in progress at the signal and completed meanwhile counts.
        mark = self._highwater.read() if self._highwater is not None else None
        if mark is not None:
            self.checkpoints.save_mark(mark[0], mark[1], self.session.run_key, last)
        if written:
            # seconds: what the grace period must cover (docs/recovery.md, "Checkpoint on eviction")
            self.log("checkpoint", step=last, reason="sigterm", highest_step=mark[0] if mark else None,
                     seconds=round(time.perf_counter() - t0, 3))

    def final_checkpoint(self, position: Position) -> None:
        """The last checkpoint, of the run's end (unless the newest already is), and no more."""
        if self.checkpoints is not None:
            self.checkpoints.flush()
            if self.checkpoints.last_saved_step != position.step:
                self.checkpoints.save(position.step, self.components.state_dict(position))
            self.checkpoints.close()

    def close(self) -> None:
        """The run is over: the hooks removed, the copies and the resident state deleted."""
        for hook in (self._hook, self._post_hook):
            if hook is not None:
                hook.remove()
        self._hook = self._post_hook = None
        if self.snapshots is not None:
            # The run is over: nothing to recover any more, and /dev/shm is memory.
            self.snapshots.close(remove=self.writes_snapshots)
        if self.resident is not None:
            self.resident.close(remove=True)
