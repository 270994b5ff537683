"""The life cycle of one resumable training run: restore, iterate, save points, finish.

:class:`Run` ties the other modules together for a training loop::

    run = Run(session, model=ddp_model, optimizer=opt, seed=args.seed)
    run.restore()                              # peer snapshot, disk checkpoint or fresh start
    for epoch in run.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in run.batches(loader):       # skips consumed batches, reseeds RNGs per step
            ...forward/backward/optimizer.step()...
            run.step_done(loss=loss, samples=len(x))
        run.epoch_done(metrics={"valAccuracy": acc})
    run.finish(metrics={"testAccuracy": test_acc})

A *save point* is a moment where the state is consistent: after every step except an epoch's last
(whose save point is :meth:`Run.epoch_done`, after validation). At every K-th save point every pod's
local rank 0 starts copying the state into its peer snapshot (asynchronously, overlapping the next
step; an optimizer step pre-hook waits until the copy has read the live tensors) and, every
``checkpoint_every`` steps, global rank 0 queues a disk checkpoint. K (``snapshot_every``) is fixed
(default 1: every save point) or, with ``auto``, chosen from the measured copy and step times so that snapshots cost at most
``DDPJOB_SNAPSHOT_BUDGET_PCT`` (default 2 %) of the training time (:func:`cadence.choose_interval`);
each pod decides its own K, logs it (``event=snapshot_interval``) and rank 0 reports it in progress
(``snapshotEvery``). A failure loses at most K steps. Where K may exceed 1 and the state is on the CPU, every rank
also keeps its parameters and optimizer state *resident* in its pod's snapshot directory (``resident.py``): the
optimizer updates them there and every save point seals them (the epoch's last step included), without a copy, so
a failure that leaves one rank outside its optimizer step loses at most one step (``snapshotResident``).

On (re)start every rank reports the newest snapshot step its pod holds and rank 0 the newest disk
checkpoint; the newest wins. A snapshot newer than the disk is broadcast from the lowest rank holding
it to every rank (a replaced pod has none), so losing a non-rank-0 pod costs at most K steps (the
snapshot interval in force) and no storage reads; the resume line says which K bounded the loss.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import env as envmod
from . import rng
from .config import FROM_ENV, RunConfig
from .checkpoint import CheckpointStore
from .progress import Progress, ProgressServer, write_termination_log
from .recovery import HighWaterMark, complete, recovery_record
from .sampler import ResumableDistributedSampler
from .session import Session
from .resident import ResidentState, supported as resident_supported
from .cadence import StepCost, settle_interval
from .slot import Snapshot
from .snapshot import PeerSnapshots
from .state import Components, Position, detached_copy, unwrap

# Resident state's trial (Run._commit_resident): its first commits are measured, and it stays on when they cost at
# most this share of the snapshot budget (the copies are chosen for half of it: TARGET_SHARE_OF_BUDGET).
RESIDENT_TRIAL_COMMITS = 5
RESIDENT_SHARE_OF_BUDGET = 0.25


class Run:
    """Resume, peer recovery, checkpoints and progress for one training loop (see module doc)."""

    def __init__(
        self,
        session: Session,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any | None = None,
        scheduler: Any | None = None,
        extra: dict[str, Any] | None = None,
        seed: int = 0,
        checkpoint_dir: str | None = FROM_ENV,
        checkpoint_every: int | None = FROM_ENV,
        keep_checkpoints: int | None = FROM_ENV,
        snapshot_dir: str | None = FROM_ENV,
        snapshot_every: int | str | None = FROM_ENV,
        snapshot_budget_pct: float | None = FROM_ENV,
        snapshot_resident: bool | str | None = FROM_ENV,
        progress_port: int | None = FROM_ENV,
        log_every: int | None = FROM_ENV,
        checkpoint_on_terminate: bool = True,
    ) -> None:
        """Arguments left out are read from the DDPJOB_* environment (:class:`~ddp_trainer.config.RunConfig` says
        what each one sets); ``None``/0 disables a feature."""
        self.session = session
        self.seed = seed
        self.components = Components(model, optimizer, scaler, scheduler, extra)
        self.position = Position(world_size=session.world_size)
        self.log = session.log
        config = self.config = RunConfig.from_env(
            os.environ, session.run_key, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints, snapshot_dir=snapshot_dir, snapshot_every=snapshot_every,
            snapshot_budget_pct=snapshot_budget_pct, snapshot_resident=snapshot_resident,
            progress_port=progress_port, log_every=log_every,
        )
        snapshot_dir, resident_mode = config.snapshot_dir, config.snapshot_resident
        self.checkpoint_every = config.checkpoint_every
        # K: the snapshot interval in force (adaptive: starts at 1 until a copy has been measured)
        self.snapshot_adaptive = config.snapshot_every is None
        self.snapshot_every = 1 if config.snapshot_every is None else config.snapshot_every
        self.snapshot_budget_pct = config.snapshot_budget_pct
        self.snapshot_max_every = config.snapshot_max_every
        self._next_snapshot_step = 0
        self._step_s: float | None = None  # moving average of the time between step_done calls
        self._copy_seen: int | None = None
        # What one snapshot costs training: its copy's own time or what it adds to the step it overlaps (medians).
        self._step_cost = StepCost()
        self._after_save: str | None = None  # "snapshot" or "checkpoint": the save point the running step follows
        self.log_every = config.log_every

        # Only global rank 0 touches the checkpoint directory; it alone validates it.
        self.checkpoints: CheckpointStore | None = None
        if config.checkpoint_dir and session.is_main:
            self.checkpoints = CheckpointStore(config.checkpoint_dir, keep=config.keep_checkpoints, warn=self._warn)
        # Every rank reads its pod's snapshot at restore; only local rank 0 writes it.
        self.snapshots: PeerSnapshots | None = None
        if snapshot_dir and self.snapshot_every:
            self.snapshots = PeerSnapshots(snapshot_dir, session.run_key)
        self._writes_snapshots = self.snapshots is not None and session.local_rank == 0
        # Every rank's resident state (resident.py): its own file, next to the pod's snapshots.
        self.resident: ResidentState | None = None
        # Only where copies may be more than one step apart (K adaptive or above 1): with K = 1 they lose no more.
        if (self.snapshots is not None and resident_mode is not False and resident_supported(optimizer)
                and (resident_mode or self.snapshot_adaptive or self.snapshot_every > 1)):
            self.resident = ResidentState(snapshot_dir, session.run_key, session.local_rank)
        self._resident_trial = resident_mode is None
        self._resident_costs: list[float] = []  # the first commits' seconds (the trial, see _commit_resident)
        self._hook: Any = None
        if (self._writes_snapshots or self.resident is not None) and optimizer is not None:
            # The snapshot thread copies parameters and optimizer state from the live tensors: the next
            # optimizer step (the first thing that changes them) waits until it has read them. And the
            # resident state is invalid from here until the save point after the step.
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._post_hook: Any = None
        if self.resident is not None and optimizer is not None:
            self._post_hook = optimizer.register_step_post_hook(self._after_optimizer_step)

        # The high-water mark of the last completed step (recovery.py): next to the pod's snapshots.
        self._mark: HighWaterMark | None = None
        if snapshot_dir:
            try:
                self._mark = HighWaterMark(snapshot_dir, session.run_key, session.local_rank)
            except OSError as exc:  # the recovery report is best effort; training must not die for it
                self._warn("highwater_unavailable", dir=snapshot_dir, error=exc.strerror)
        self._recovery_pending: tuple[dict[str, Any], float | None] | None = None

        # Every pod's local rank 0 serves its own report (to tell which pod is stuck); the operator shows
        # global rank 0's.
        self.progress = Progress(session.world_size, rank=session.rank, worker_restarts=session.restart_count)
        self._server: ProgressServer | None = None
        if session.local_rank == 0 and config.progress_port:
            try:
                self._server = ProgressServer(self.progress, config.progress_port)
            except OSError as exc:  # progress is best effort; training must not die for it
                self._warn("progress_unavailable", port=config.progress_port, error=exc.strerror)

        self._epoch_len: int | None = None
        self._last_step_time: float | None = None
        self._sps: float | None = None
        self._last_loss: float | None = None
        self._finished = False
        self._interval_logged = False
        self.restored_from: str | None = None
        if checkpoint_on_terminate and self.checkpoints is not None and self._writes_snapshots:
            session.on_terminate(self._checkpoint_on_terminate)
        if self.resident is not None:
            # Registered last, so it runs first: an optimizer step in progress reaches its save point before the
            # process exits (and before the checkpoint above reads the newest state).
            session.on_terminate(self._hold_resident)

    # -- properties ----------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.position.step

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def extra(self) -> dict[str, Any]:
        """User state saved with every snapshot/checkpoint (best metric, patience counter, ...)."""
        return self.components.extra

    @property
    def stopped(self) -> bool:
        return self.position.stopped

    def _warn(self, event: str, **fields: Any) -> None:
        self.log(event, all_ranks=True, level="warning", **fields)

    # -- restore -------------------------------------------------------------------------------------------
    def restore(self) -> str:
        """Load the newest state any rank can reach; returns "fresh", "local", "peer" or "checkpoint".

        Collective: every rank must call it, once, after building model/optimizer and before training.
        """
        s = self.session
        t0 = time.perf_counter()
        copies = self.snapshots.read_latest() if self.snapshots is not None else None
        local = self._newest_local(copies)
        local_step = local.step if local is not None else -1
        local_every = local.every if local is not None else None
        disk_steps = self.checkpoints.steps() if self.checkpoints is not None else []
        disk_step = disk_steps[0] if disk_steps else -1
        mark = self._mark.read() if self._mark is not None else None
        pod_index = envmod.get_int(envmod.POD_INDEX, None, minimum=0)
        gathered: list[Any] = [None] * s.world_size
        dist.all_gather_object(
            gathered, (local_step, disk_step, local_every, mark, socket.gethostname(), pod_index)
        )
        snap_steps = [int(g[0]) for g in gathered]
        disk_step = int(gathered[0][1])
        best_snap = max(snap_steps)

        state: dict[str, Any] | None = None
        source, src_rank = "fresh", None
        bound = None  # the snapshot interval in force when the restored snapshot was written
        if disk_step > best_snap:
            payload: list[Any] = [None]
            if s.is_main:
                assert self.checkpoints is not None
                payload = [self.checkpoints.load_latest(newer_than=best_snap)]
            dist.broadcast_object_list(payload, src=0)
            if payload[0] is not None:
                _, state = payload[0]
                source, src_rank = "checkpoint", 0
        if state is None and best_snap >= 0:
            holders = [r for r, st in enumerate(snap_steps) if st == best_snap]
            src_rank = holders[0]
            if len(holders) == s.world_size:
                assert local is not None
                state, source = local.state, "local"
            else:
                payload = [local.state if s.rank == src_rank and local is not None else None]
                dist.broadcast_object_list(payload, src=src_rank)
                state = local.state if local is not None and local_step == best_snap else payload[0]
                source = "peer"
            bound = gathered[src_rank][2]
        if copies is not None and self.snapshots is not None:
            self.snapshots.set_next_slot_after(copies)

        if state is not None:
            position = self.components.load_state_dict(state)
            exact = True
            if position.world_size and position.world_size != s.world_size:
                # Another world size partitions the data differently: keep the share of the epoch that
                # was done (rounded up), which cannot be bitwise-identical to any uninterrupted run.
                exact = False
                consumed = position.batch * position.world_size
                position.batch = -(-consumed // s.world_size)
                position.world_size = s.world_size
            self.position = position
            self.log(
                "resume",
                source=source,
                step=position.step,
                epoch=position.epoch,
                batch=position.batch,
                from_rank=src_rank,
                exact=str(exact).lower(),
                seconds=round(time.perf_counter() - t0, 3),
                restart_count=s.restart_count,
                snapshot_every=bound if source in ("peer", "local") else None,
            )
        else:
            self.log("start", source="fresh", restart_count=s.restart_count)
        if self.checkpoints is not None and disk_step >= 0:
            self.checkpoints.last_saved_step = disk_step
        self.restored_from = source
        pod = gathered[src_rank][4] if source in ("peer", "local") and src_rank is not None else None
        record, last_time = recovery_record(
            source, self.position.step, [g[3] for g in gathered], restart_count=s.restart_count,
            restored_from_pod=pod,
        )
        self._recovery_pending = (record, last_time) if record is not None else None
        self._save_point(checkpoint=False)
        # The pods (DDPJOB_POD_INDEX) that train in this world: with hot spares the rendezvous, not the pod
        # index, decides, and only the trainer can tell the operator (docs/contract.md, "members").
        indices = [g[5] for g in gathered]
        members = sorted(set(indices)) if all(isinstance(i, int) for i in indices) else None
        self.progress.update(
            step=self.position.step, epoch=self.position.epoch, lastCheckpointStep=self._ckpt_step(),
            **({"members": members} if members is not None else {}),
            **({"recovery": record} if record is not None else {}),
            **self._snapshot_progress(),
        )
        return source

    # -- iteration -----------------------------------------------------------------------------------------
    def epochs(self, max_epochs: int) -> Iterator[int]:
        """Epoch numbers from the restored one up to ``max_epochs - 1``; ends early once stopped."""
        while self.position.epoch < max_epochs and not self.position.stopped:
            yield self.position.epoch

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The batches of the current epoch not yet consumed, reseeding RNGs before each step.

        Call ``sampler.set_epoch(epoch)`` first. With :class:`ResumableDistributedSampler` skipping is free;
        with any other sampler the consumed batches are loaded and dropped. Call :meth:`step_done` once
        per batch.
        """
        n = len(loader)  # type: ignore[arg-type]
        self._epoch_len = n
        start = self.position.batch
        rank = self.session.rank
        if start >= n:
            # Restored after the epoch's last step (a resident save point): the RNGs as an uninterrupted run leaves
            # them for what follows the epoch's batches (validation), reseeded before its loader ran dry.
            rng.seed_step(self.seed, self.position.step, rank)
            return
        skip = start
        sampler = getattr(loader, "sampler", None)
        batch_size = getattr(loader, "batch_size", None)
        if start and isinstance(sampler, ResumableDistributedSampler) and batch_size:
            sampler.set_start(start * batch_size)
            skip = 0
        it = iter(loader)
        for _ in range(skip):
            next(it)
        while True:
            rng.seed_step(self.seed, self.position.step, rank)
            try:
                batch = next(it)
            except StopIteration:
                return
            yield batch

    # -- save points ---------------------------------------------------------------------------------------
    def step_done(self, *, loss: float | torch.Tensor | None = None, samples: int | None = None) -> None:
        """Record a finished optimizer step (call after ``optimizer.step()`` and per-step schedulers)."""
        pos = self.position
        pos.step += 1
        pos.batch += 1
        now = time.perf_counter()
        if self._last_step_time is not None:
            dt = max(now - self._last_step_time, 1e-9)
            self._step_s = dt if self._step_s is None else 0.9 * self._step_s + 0.1 * dt
            self._step_cost.step(dt, self._after_save)
        self._after_save = None
        if samples is not None and self._last_step_time is not None:
            dt = max(now - self._last_step_time, 1e-9)
            rate = samples * self.session.world_size / dt
            self._sps = rate if self._sps is None else 0.9 * self._sps + 0.1 * rate
        self._last_step_time = now
        recovered: dict[str, Any] = {}
        if self._recovery_pending is not None:
            record, last_time = self._recovery_pending
            self._recovery_pending = None
            recovered = {"recovery": complete(record, last_time, time.time())}
            if self.session.is_main:
                self.log("recovered", **{k: v for k, v in recovered["recovery"].items()})
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach().item())
        if loss is not None:
            self._last_loss = loss
        if self._writes_snapshots and self.snapshots is not None and self.snapshots.in_flight_step is not None:
            # A snapshot started before this step is complete before the step is logged, so the newest
            # valid snapshot is never more than K steps behind the log (already done on a CPU: the
            # optimizer step waited for the copy).
            self.snapshots.wait()
        # The step line comes before the step's snapshot/checkpoint, so no restore is ever ahead of the
        # logged steps (steps lost, ddp_trainer.testing.steps_lost, is never negative by a logging race).
        # Rank 0 writes the full line; the first local rank of every other node a short one, so the
        # completed steps survive in some pod's log whichever pod is lost.
        if self.log_every and pos.step % self.log_every == 0:
            if self.session.is_main:
                self.log(
                    "step",
                    step=pos.step,
                    epoch=pos.epoch,
                    batch=pos.batch,
                    loss=self._last_loss,
                    samples_per_s=round(self._sps, 1) if self._sps else None,
                )
            elif self.session.local_rank == 0:
                self.log("step", all_ranks=True, step=pos.step, epoch=pos.epoch, batch=pos.batch)
        if self._mark is not None:
            # After the step line: the mark is never ahead of the logged steps (one definition of steps lost).
            self._mark.write(pos.step)
        # The epoch's last step is a save point of the resident state only: the copies and checkpoints wait for
        # epoch_done, after validation.
        self._save_point(copies=self._epoch_len is None or pos.batch < self._epoch_len)
        self.progress.update(
            step=pos.step,
            epoch=pos.epoch,
            loss=self._last_loss,
            samplesPerSecond=round(self._sps or 0.0, 2),
            lastCheckpointStep=self._ckpt_step(),
            **recovered,
            **self._snapshot_progress(),
        )

    def epoch_done(self, metrics: dict[str, Any] | None = None, *, stop: bool = False) -> None:
        """Close the epoch (after validation); ``stop=True`` (agreed by all ranks) ends :meth:`epochs`."""
        pos = self.position
        finished = pos.epoch
        pos.epoch += 1
        pos.batch = 0
        pos.stopped = pos.stopped or stop
        self._epoch_len = None
        self._save_point()
        self.progress.update(epoch=pos.epoch, metrics=metrics or {}, lastCheckpointStep=self._ckpt_step())
        if self.session.is_main:
            self.log("epoch", epoch=finished, step=pos.step, stop=str(pos.stopped).lower(), **(metrics or {}))

    def _before_optimizer_step(self, *_: Any) -> None:
        if self._writes_snapshots and self.snapshots is not None:
            self.snapshots.wait_sources()
        if self.resident is not None:
            self.resident.begin_update()

    def _after_optimizer_step(self, *_: Any) -> None:
        if self.resident is not None:
            self.resident.end_update()

    def _newest_local(self, copies: Snapshot | None) -> Snapshot | None:
        """The newer of this pod's copies and this rank's resident state."""
        mine = self.resident.read() if self.resident is not None else None
        if mine is None or (copies is not None and copies.step > mine.step):
            return copies
        return mine

    def _hold_resident(self) -> None:
        if self.resident is not None and not self.resident.hold():
            self._warn("resident_state_unsealed",
                       reason="the training loop did not reach the save point after its optimizer step in time "
                              "(blocked after it, e.g. in a collective): the copies or a peer hold the state")

    def _snapshot_due(self, step: int) -> bool:
        if not self._writes_snapshots or not self.snapshot_every:
            return False
        if self.snapshot_adaptive:
            return step >= self._next_snapshot_step
        return step % self.snapshot_every == 0

    def _stable_tensors(self) -> set[int]:
        """Tensors only the optimizer step changes: the snapshot thread may read them live."""
        opt = self.components.optimizer
        if opt is None:
            return set()
        ptrs = {p.data_ptr() for group in opt.param_groups for p in group["params"]}
        for per_param in opt.state.values():
            ptrs.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        return ptrs

    def _snapshot(self, step: int) -> None:
        snaps = self.snapshots
        assert snaps is not None
        snaps.wait()  # the previous copy is complete: its time is measured
        if self.snapshot_adaptive:
            k = self.snapshot_every
            if snaps.last_copy_s is not None and snaps.last_step != self._copy_seen:
                self._copy_seen = snaps.last_step
                self._step_cost.copy(snaps.last_copy_s)
            # one copy's cost is noisy (page cache, other processes): StepCost takes medians of the recent ones
            cost_s = self._step_cost.cost_s()
            step_s = self._step_cost.clean_s or self._step_s
            if cost_s is not None and step_s is not None:
                k = settle_interval(k, cost_s, step_s, self.snapshot_budget_pct, self.snapshot_max_every)
            measured = cost_s is not None and self._step_s is not None
            if k != self.snapshot_every or (measured and not self._interval_logged):
                self._interval_logged = True
                self.log(
                    "snapshot_interval",
                    all_ranks=True,
                    every=k,
                    previous=self.snapshot_every,
                    copy_ms=round(cost_s * 1e3, 3) if cost_s is not None else None,
                    step_ms=round(step_s * 1e3, 3) if step_s is not None else None,
                    bytes=snaps.last_bytes,
                    budget_pct=self.snapshot_budget_pct,
                )
            self.snapshot_every = k
            self._next_snapshot_step = step + k
        state = self.components.state_dict(self.position)
        snaps.write_async(step, state, stable=self._stable_tensors(), every=self.snapshot_every)

    def _snapshot_progress(self) -> dict[str, Any]:
        if not self._writes_snapshots or self.snapshots is None:
            return {}
        return {"snapshotEvery": self.snapshot_every, "lastSnapshotStep": self.snapshots.last_step,
                "snapshotResident": self.resident is not None}

    def _save_point(self, checkpoint: bool = True, copies: bool = True) -> None:
        step = self.position.step
        state = None
        if self.resident is not None:
            self._commit_resident(step)
        if not copies:
            return
        if self._snapshot_due(step):
            self._snapshot(step)
            self._after_save = "snapshot"
        if (
            checkpoint
            and self.checkpoints is not None
            and self.checkpoint_every
            and step % self.checkpoint_every == 0
            and step != self.checkpoints.last_saved_step
        ):
            state = state or self.components.state_dict(self.position)
            self.checkpoints.save_async(step, detached_copy(state))
            self._after_save = "checkpoint"  # its cost is the checkpoint's, not a snapshot's

    def _commit_resident(self, step: int) -> None:
        """Seal the resident state at this save point. Its first RESIDENT_TRIAL_COMMITS commits once a step has been
        timed are a trial: a commit costs the state dict's walk and pickle every step whatever the model's size, which
        a small model's short step cannot afford (the digits example: 0.17 ms of a ~15 ms step) and a large one does
        not notice (~100M parameters: 0.12 ms of 1.5 s; make bench-resident-commit). Resident state stays on when the
        median commit is within RESIDENT_SHARE_OF_BUDGET of the budget; else the copies alone hold the state (their K
        bounds the loss)."""
        res, opt = self.resident, self.components.optimizer
        assert res is not None and opt is not None
        if not opt.state and step == 0:
            return  # nothing to keep yet: the first optimizer step creates the state, lay out after it
        layouts = res.layouts
        t0 = time.perf_counter()
        try:
            res.commit(step, self.components.state_dict(self.position), opt)
        except OSError as exc:  # /dev/shm too small for the state: the copies alone hold it from now on
            self._warn("resident_state_unavailable", dir=os.path.dirname(res.path), error=str(exc))
            self._resident_off()
            return
        if res.layouts != layouts:
            self.log("resident_state", all_ranks=self.session.local_rank == 0, step=step,
                     resident_bytes=res.resident_bytes, copied_bytes=res.copied_bytes)
            return  # a layout copies the whole state once: not what a commit costs
        step_s = self._step_cost.clean_s or self._step_s
        if not self._resident_trial or len(self._resident_costs) >= RESIDENT_TRIAL_COMMITS or step_s is None:
            return  # no trial, its decision taken, or no step measured yet to weigh a commit against
        self._resident_costs.append(time.perf_counter() - t0)
        if len(self._resident_costs) < RESIDENT_TRIAL_COMMITS:
            return
        cost_s = statistics.median(self._resident_costs)
        share_pct = 100.0 * cost_s / step_s
        if share_pct > self.snapshot_budget_pct * RESIDENT_SHARE_OF_BUDGET:
            self.log("resident_state_off", all_ranks=self.session.local_rank == 0, commit_ms=round(cost_s * 1e3, 3),
                     step_ms=round(step_s * 1e3, 3), share_pct=round(share_pct, 3), budget_pct=self.snapshot_budget_pct)
            self._resident_off()

    def _resident_off(self) -> None:
        assert self.resident is not None
        self.resident.close(remove=True)
        self.resident = None

    def _ckpt_step(self) -> int | None:
        return self.checkpoints.last_saved_step if self.checkpoints is not None else None

    def _checkpoint_on_terminate(self) -> None:
        # Runs on the SIGTERM thread while the main thread may be mid-step: use the last save point.
        assert self.snapshots is not None and self.checkpoints is not None
        snap = self._newest_local(self.snapshots.read_latest())
        last = self.checkpoints.last_saved_step
        if snap is not None and (last is None or snap.step > last):
            self.checkpoints.save(snap.step, snap.state)
            self.log("checkpoint", step=snap.step, reason="sigterm")

    # -- the end -------------------------------------------------------------------------------------------
    def finish(self, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Final checkpoint, termination-log record, peer snapshots removed. Returns the final record."""
        if self._finished:
            return self.progress.snapshot()
        self._finished = True
        if self.checkpoints is not None:
            self.checkpoints.flush()
            if self.checkpoints.last_saved_step != self.position.step:
                self.checkpoints.save(self.position.step, self.components.state_dict(self.position))
            self.checkpoints.close()
        self.progress.update(
            step=self.position.step,
            epoch=self.position.epoch,
            metrics=metrics or {},
            lastCheckpointStep=self._ckpt_step(),
        )
        record = {**self.progress.snapshot(), "final": True}
        if self.session.is_main:
            write_termination_log(self.config.termination_log, record)
            self.log("done", step=self.position.step, epoch=self.position.epoch, **(metrics or {}))
        if self._server is not None:
            self._server.close()
            self._server = None
        for hook in (self._hook, self._post_hook):
            if hook is not None:
                hook.remove()
        self._hook = self._post_hook = None
        if self.snapshots is not None:
            # The run is over: nothing to recover any more, and /dev/shm is memory.
            self.snapshots.close(remove=self._writes_snapshots)
        if self.resident is not None:
            self.resident.close(remove=True)
        if self._mark is not None:
            self._mark.close(remove=True)
            self._mark = None
        return record


def model_digest(model: nn.Module) -> str:
    """sha256 over the model's state dict (names, dtypes, shapes and bytes): equal iff bitwise equal."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(unwrap(model).state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
