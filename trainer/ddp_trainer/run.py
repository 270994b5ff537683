"""The life cycle of one resumable training run: restore, iterate, save points, finish.

:class:`Run` ties the other modules together for a training loop::

    run = Run(session, model=ddp_model, optimizer=opt, seed=args.seed)
    run.restore()                              # peer snapshot, disk checkpoint or fresh start
    for epoch in run.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in run.batches(loader):       # skips consumed batches, reseeds RNGs per step
            ...forward/backward/optimizer.step()...
            run.step_done(loss=loss, samples=len(x))
        run.epoch_done(metrics={"valAccuracy": acc})  # after validation; also reached with no batch, once, by a
                                                       # run restored after the epoch's last batch
    run.finish(metrics={"testAccuracy": test_acc})

At every *save point*, after a step, the state is kept where a failure cannot take it with the process: a peer
snapshot in the pod's memory every K steps, every rank's resident state, a disk checkpoint every ``checkpoint_every``
steps (``savepoints.py``; K: ``cadence.py``). On (re)start the newest state any rank can reach, a snapshot or a disk
checkpoint, is restored on every rank (``restore.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import env as envmod
from . import rng
from .config import RunConfig
from .progress import Progress, ProgressServer, write_termination_log
from .recovery import HighWaterMark, complete, recovery_record
from .resident import ResidentState
from .restore import newest_state
from .sampler import ResumableDistributedSampler
from .savepoints import SavePoints
from .session import Session
from .slot_load import probe
from .snapshot import PeerSnapshots
from .state import Components, Position


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
        checkpoint_on_terminate: bool = True,
        **settings: Any,
    ) -> None:
        """``settings``: checkpoint_dir, checkpoint_every, keep_checkpoints, snapshot_dir, snapshot_every,
        snapshot_budget_pct, snapshot_resident, progress_port, log_every (:class:`~ddp_trainer.config.RunConfig` says
        what each one sets); one left out is read from its DDPJOB_* environment variable. ``None``/0 disables a
        feature."""
        self.session = session
        self.seed = seed
        self.components = Components(model, optimizer, scaler, scheduler, extra)
        self.position = Position(world_size=session.world_size)
        self.log = session.log
        config = self.config = RunConfig.from_env(os.environ, session.run_key, **settings)
        self.log_every = config.log_every
        self.saves = SavePoints(session, config, self.components, self._warn)
        if session.world_size > 2 and _rebuckets(model):
            self.log("ddp_rebuckets", level="warning", world_size=session.world_size,
                     fix="DistributedDataParallel(..., find_unused_parameters=True)")

        # The high-water mark of the last completed step (recovery.py): next to the pod's snapshots.
        self._mark: HighWaterMark | None = None
        if config.snapshot_dir:
            try:
                self._mark = HighWaterMark(config.snapshot_dir, session.run_key, session.local_rank)
            except OSError as exc:  # the recovery report is best effort; training must not die for it
                self._warn("highwater_unavailable", dir=config.snapshot_dir, error=exc.strerror)
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
        self._max_epochs: int | None = None
        self._last_step_time: float | None = None
        self._sps: float | None = None
        self._last_loss: float | None = None
        self._finished = False
        self.restored_from: str | None = None
        self.saves.on_terminate(checkpoint_on_terminate, highwater=self._mark)

    # -- properties ----------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.position.step

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def batch(self) -> int:
        """Batches of the current epoch consumed (after the batch loop: the epoch's length, also when it resumed
        there and the loop had none to give)."""
        return self.position.batch

    @property
    def extra(self) -> dict[str, Any]:
        """User state saved with every snapshot/checkpoint (best metric, patience counter, ...)."""
        return self.components.extra

    @property
    def stopped(self) -> bool:
        return self.position.stopped

    @property
    def snapshot_every(self) -> int:
        """K, the interval of the snapshot copies in force (:class:`~ddp_trainer.cadence.Cadence`)."""
        return self.saves.cadence.every

    @property
    def snapshots(self) -> PeerSnapshots | None:
        return self.saves.snapshots

    @property
    def resident(self) -> ResidentState | None:
        return self.saves.resident

    def _snapshot(self, step: int) -> None:
        # bench-overhead's exactness check (tests/benchmarks/trainer_overhead.py) starts a copy of the live state here.
        assert step == self.position.step
        self.saves.snapshot(self.position)

    def _warn(self, event: str, **fields: Any) -> None:
        self.log(event, all_ranks=True, level="warning", **fields)

    # -- restore -------------------------------------------------------------------------------------------
    def restore(self) -> str:
        """Load the newest state any rank can reach; returns "fresh", "local", "peer" or "checkpoint".

        Collective: every rank must call it, once, after building model/optimizer and before training.
        """
        s = self.session
        t0 = time.perf_counter()
        saves = self.saves
        # Headers only: the data of the one slot chosen is read later, straight into the live tensors (restore.py).
        copies = saves.snapshots.latest_header() if saves.snapshots is not None else None
        mine = None
        if saves.resident is not None:
            mine, why, claimed = probe(saves.resident.path, saves.resident.run_key)
            if why == "modified":
                self._warn("resident_state_modified", step=claimed, path=saves.resident.path,
                           reason="the parameters changed in place after the save point sealed them (a weight swap "
                                  "outside run.weights_swapped()): the copies or a checkpoint hold the state")
        local = mine if mine is not None and (copies is None or mine.step >= copies.step) else copies
        mark = self._mark.read() if self._mark is not None else None
        pod_index = envmod.get_int(envmod.POD_INDEX, None, minimum=0)
        got = newest_state(s, local, saves.checkpoints, mark, pod_index, live=self.components.state_dict(self.position))
        if copies is not None and saves.snapshots is not None:
            saves.snapshots.set_next_slot_after(copies)

        if got.state is not None:
            position = self.components.load_state_dict(got.state)
            exact = position.rescale(s.world_size)
            self.position = position
            self.log(
                "resume",
                source=got.source,
                step=position.step,
                epoch=position.epoch,
                batch=position.batch,
                from_rank=got.src_rank,
                exact=str(exact).lower(),
                seconds=round(time.perf_counter() - t0, 3),
                restart_count=s.restart_count,
                snapshot_every=got.bound,
            )
            # Every worker says where its own state came from (the line above is the group's): its resident file, its
            # pod's copy, or another rank (a peer's snapshot or rank 0's checkpoint, broadcast); ``held``: the newest
            # step it could read itself (-1: none).
            held = local.step if local is not None else -1
            own = got.source in ("local", "peer") and held == position.step
            self.log("rank_restored", all_ranks=True, local_rank=s.local_rank, step=position.step, held=held,
                     source=("resident" if local is not copies else "snapshot") if own else got.source)
        else:
            self.log("start", source="fresh", restart_count=s.restart_count)
        if saves.checkpoints is not None and got.disk_step >= 0:
            saves.checkpoints.last_saved_step = got.disk_step
        self.restored_from = got.source
        record, last_time = recovery_record(
            got.source, self.position.step, got.marks, restart_count=s.restart_count, restored_from_pod=got.pod,
        )
        self._recovery_pending = (record, last_time) if record is not None else None
        saves.save(self.position, checkpoint=False)
        # The pods (DDPJOB_POD_INDEX) that train in this world: with hot spares the rendezvous, not the pod
        # index, decides, and only the trainer can tell the operator (docs/contract.md, "members").
        indices = got.pod_indices
        members = sorted(set(indices)) if all(isinstance(i, int) for i in indices) else None
        self.progress.update(
            step=self.position.step, epoch=self.position.epoch, lastCheckpointStep=saves.checkpoint_step(),
            **({"members": members} if members is not None else {}),
            **({"recovery": record} if record is not None else {}),
            **saves.progress(),
        )
        return got.source

    # -- iteration -----------------------------------------------------------------------------------------
    def epochs(self, max_epochs: int) -> Iterator[int]:
        """Epoch numbers from the restored one up to ``max_epochs - 1``; ends early once stopped."""
        self._max_epochs = max_epochs
        while self.position.epoch < max_epochs and not self.position.stopped:
            yield self.position.epoch

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The batches of the current epoch not yet consumed, reseeding RNGs before each step.

        Call ``sampler.set_epoch(epoch)`` first. With :class:`ResumableDistributedSampler` skipping is free;
        with any other sampler the consumed batches are loaded and dropped. Call :meth:`step_done` once
        per batch.

        A run restored after the epoch's last batch (killed between its last step and :meth:`epoch_done`, e.g. during
        validation) gets no batch here: the code after the loop (validation, :meth:`epoch_done`) runs once for that
        epoch, as in an uninterrupted run, and must not assume the loop ran (docs/recovery.md, "Exactness").
        """
        n = len(loader)  # type: ignore[arg-type]
        self._epoch_len = n
        if self._max_epochs:
            self.progress.update(totalSteps=self._max_epochs * n)  # the run's length, for an ETA (docs/contract.md)
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
            self.saves.step_begins()  # after SIGTERM no step starts (savepoints.py)
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
        dt = max(now - self._last_step_time, 1e-9) if self._last_step_time is not None else None
        self.saves.step_timed(dt)
        if samples is not None and dt is not None:
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
        # A snapshot started before this step is complete before the step is logged, so the newest
        # valid snapshot is never more than K steps behind the log (already done on a CPU: the
        # optimizer step waited for the copy).
        self.saves.wait_copy()
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
        self.saves.save(pos, copies=self._epoch_len is None or pos.batch < self._epoch_len)
        self.progress.update(
            step=pos.step,
            epoch=pos.epoch,
            loss=self._last_loss,
            samplesPerSecond=round(self._sps or 0.0, 2),
            lastCheckpointStep=self.saves.checkpoint_step(),
            **recovered,
            **self.saves.progress(),
        )

    def epoch_done(self, metrics: dict[str, Any] | None = None, *, stop: bool = False) -> None:
        """Close the epoch (after validation); ``stop=True`` (agreed by all ranks) ends :meth:`epochs`."""
        pos = self.position
        finished = pos.epoch
        pos.epoch += 1
        pos.batch = 0
        pos.stopped = pos.stopped or stop
        self._epoch_len = None
        self.saves.save(pos)
        self.progress.update(epoch=pos.epoch, metrics=metrics or {}, lastCheckpointStep=self.saves.checkpoint_step())
        if self.session.is_main:
            self.log("epoch", epoch=finished, step=pos.step, stop=str(pos.stopped).lower(), **(metrics or {}))

    def weights_swapped(self) -> AbstractContextManager[None]:
        """Around an in-place swap of the weights between steps (an EMA's ``copy_to``/``restore`` for evaluation,
        ``load_state_dict(best)``): the resident state is invalid inside and sealed again after, with the weights
        then live (:meth:`SavePoints.weights_swapped`, docs/recovery.md)."""
        return self.saves.weights_swapped(self.position)

    # -- the end -------------------------------------------------------------------------------------------
    def finish(self, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Final checkpoint, termination-log record, peer snapshots removed. Returns the final record."""
        if self._finished:
            return self.progress.snapshot()
        self._finished = True
        self.saves.final_checkpoint(self.position)
        self.progress.update(
            step=self.position.step,
            epoch=self.position.epoch,
            metrics=metrics or {},
            lastCheckpointStep=self.saves.checkpoint_step(),
        )
        record = {**self.progress.snapshot(), "final": True}
        if self.session.is_main:
            write_termination_log(self.config.termination_log, record)
            self.log("done", step=self.position.step, epoch=self.position.epoch, **(metrics or {}))
        if self._server is not None:
            self._server.close()
            self._server = None
        self.saves.close()
        if self._mark is not None:
            self._mark.close(remove=True)
            self._mark = None
        return record


def _rebuckets(model: nn.Module) -> bool:
    """Whether ``model`` is a DDP that re-buckets its gradients after its first iteration (torch's default; not with
    ``find_unused_parameters=True`` unless ``static_graph``). With more than two ranks a resumed run then is not
    bitwise equal to an uninterrupted one: its first step all-reduces in the first iteration's layout, whose rounding
    differs (trainer/README.md, "Rules that keep resume exact")."""
    return isinstance(model, DistributedDataParallel) and (model.static_graph or not model.find_unused_parameters)
