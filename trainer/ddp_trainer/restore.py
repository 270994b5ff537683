"""Where a (re)started run resumes from: every rank says what it holds, and the newest state reaches every rank.

On (re)start every rank reports the newest snapshot step it can read (its pod's copies or its own resident state)
and rank 0 the newest disk checkpoint; the newest wins. A snapshot newer than the disk is broadcast from the lowest
rank holding it to every rank (a replaced pod has none), so losing a non-rank-0 pod costs at most K steps (the
snapshot interval in force) and no storage reads; the resume line says which K bounded the loss.

A restore holds no more than the state it restores: the ranks agree on the newest step from the slots' headers alone
(``slot_load.read_header``), only the rank that loads a slot reads its data, straight into the live tensors
(``slot_load.load``), and a peer's state crosses tensor by tensor into the receivers' live tensors rather than as one
pickle (which held the state twice more on each side).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import CheckpointStore
from .session import Session
from .slot_load import SlotHeader, destinations, load
from .state import flatten, unflatten


@dataclass(frozen=True)
class Restored:
    state: dict[str, Any] | None  # None: nothing to resume, a fresh start
    source: str  # "fresh", "local" (every rank holds it), "peer" or "checkpoint"
    src_rank: int | None  # the rank it came from
    bound: int | None  # a snapshot's: the snapshot interval K in force when it was written
    pod: str | None  # a snapshot's: the host name of the pod it came from
    disk_step: int  # the newest checkpoint on disk (-1: none)
    marks: list[Any]  # every rank's high-water mark (recovery.HighWaterMark.read), and the one left on the disk
    pod_indices: list[int | None]  # every rank's DDPJOB_POD_INDEX


def newest_state(
    session: Session, local: SlotHeader | None, checkpoints: CheckpointStore | None, mark: Any, pod_index: int | None,
    live: Any = None,
) -> Restored:
    """The newest state any rank can reach, on every rank. Collective: every rank calls it, once.

    ``local``: the header of the newest slot this rank can read (its data is read only if it is chosen);
    ``checkpoints``: global rank 0's store (None elsewhere); ``mark`` and ``pod_index``: what this rank adds to the
    others' recovery record and members; ``live``: the run's live state dict, whose tensors a snapshot is read into
    where they fit (``slot_load.destinations``)."""
    s = session
    local_step = local.step if local is not None else -1
    local_every = local.every if local is not None else None
    disk_steps = checkpoints.steps() if checkpoints is not None else []
    disk_step = disk_steps[0] if disk_steps else -1
    # The mark a run stopped by SIGTERM left beside its checkpoint (checkpoint.py): the last step of the incarnation
    # that ended, for when no rank's own mark survived (every pod replaced). Taken, so that no later restore uses it.
    taken = checkpoints.take_mark(s.run_key) if checkpoints is not None else None
    disk_mark = (taken[0], taken[1]) if taken is not None else None
    gathered: list[Any] = [None] * s.world_size
    dist.all_gather_object(
        gathered, (local_step, disk_step, local_every, mark, socket.gethostname(), pod_index, disk_mark)
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
            state, source = load(local, live), "local"
        else:
            mine = load(local, live) if local is not None and local_step == best_snap else None
            state, source = broadcast_state(s, mine, src_rank, live), "peer"
        bound = gathered[src_rank][2]
    pod = gathered[src_rank][4] if source in ("peer", "local") and src_rank is not None else None
    restored_step = int(state["position"]["step"]) if state is not None else 0
    marks = [g[3] for g in gathered]
    left = gathered[0][6]
    if left is not None and left[0] >= restored_step:  # never one from before the state restored (a stale file)
        marks.append(left)
    return Restored(state=state, source=source, src_rank=src_rank, bound=bound, pod=pod, disk_step=disk_step,
                    marks=marks, pod_indices=[g[5] for g in gathered])


def broadcast_state(session: Session, state: dict[str, Any] | None, src: int, live: Any = None) -> dict[str, Any]:
    """``src``'s ``state`` on every rank: its skeleton as an object, then each tensor by itself, received into the
    receiver's live tensor where it fits (``live``, as in ``slot_load.destinations``). Collective. A rank that holds
    the same step itself (``state`` not None) receives into its own tensors: replicas are equal, nothing is allocated."""
    mine = session.rank == src
    skeleton, tensors = flatten(state) if state is not None else (None, [])
    head: list[Any] = [(skeleton, [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors])]
    dist.broadcast_object_list(head, src=src)
    skeleton, specs = head[0]
    if not mine and [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors] != specs:
        tensors = destinations(skeleton, specs, live)
    # gloo sends CPU tensors; nccl device tensors: each one crosses through the session's device when it must
    device = session.device if session.backend == "nccl" else torch.device("cpu")
    for t in tensors:
        if t.device == device and t.is_contiguous():
            dist.broadcast(t, src=src)
            continue
        buf = t.to(device, memory_format=torch.contiguous_format) if mine else torch.empty(t.shape, dtype=t.dtype,
                                                                                           device=device)
        dist.broadcast(buf, src=src)
        if not mine:
            with torch.no_grad():
                t.copy_(buf)
    return unflatten(skeleton, tensors)
