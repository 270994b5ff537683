"""Where a (re)started run resumes from: every rank says what it holds, and the newest state reaches every rank.

On (re)start every rank reports the newest snapshot step it can read (its pod's copies or its own resident state)
and rank 0 the newest disk checkpoint; the newest wins. A snapshot newer than the disk is broadcast from the lowest
rank holding it to every rank (a replaced pod has none), so losing a non-rank-0 pod costs at most K steps (the
snapshot interval in force) and no storage reads; the resume line says which K bounded the loss.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .checkpoint import CheckpointStore
from .session import Session
from .slot import Snapshot


@dataclass(frozen=True)
class Restored:
    state: dict[str, Any] | None  # None: nothing to resume, a fresh start
    source: str  # "fresh", "local" (every rank holds it), "peer" or "checkpoint"
    src_rank: int | None  # the rank it came from
    bound: int | None  # a snapshot's: the snapshot interval K in force when it was written
    pod: str | None  # a snapshot's: the host name of the pod it came from
    disk_step: int  # the newest checkpoint on disk (-1: none)
    marks: list[Any]  # every rank's high-water mark (recovery.HighWaterMark.read)
    pod_indices: list[int | None]  # every rank's DDPJOB_POD_INDEX


def newest_state(
    session: Session, local: Snapshot | None, checkpoints: CheckpointStore | None, mark: Any, pod_index: int | None
) -> Restored:
    """The newest state any rank can reach, on every rank. Collective: every rank calls it, once.

    ``local``: the newest snapshot this rank can read; ``checkpoints``: global rank 0's store (None elsewhere);
    ``mark`` and ``pod_index``: what this rank adds to the others' recovery record and members."""
    s = session
    local_step = local.step if local is not None else -1
    local_every = local.every if local is not None else None
    disk_steps = checkpoints.steps() if checkpoints is not None else []
    disk_step = disk_steps[0] if disk_steps else -1
    gathered: list[Any] = [None] * s.world_size
    dist.all_gather_object(
        gathered, (local_step, disk_step, local_every, mark, socket.gethostname(), pod_index)
    )
    snap_steps = [int(g[0]) for g in gathered]
    disk_step = int(gathered[0][1])
    best_snap = max(snap_steps)

    state: dict[str, Any] | None = None
    source, src_rank = "fresh", None
    bound = None
    if disk_step > best_snap:
        payload: list[Any] = [None]
        if s.is_main:
            assert checkpoints is not None
            payload = [checkpoints.load_latest(newer_than=best_snap)]
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
    pod = gathered[src_rank][4] if source in ("peer", "local") and src_rank is not None else None
    return Restored(state=state, source=source, src_rank=src_rank, bound=bound, pod=pod, disk_step=disk_step,
                    marks=[g[3] for g in gathered], pod_indices=[g[5] for g in gathered])
