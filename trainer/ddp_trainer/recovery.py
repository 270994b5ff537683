"""What a recovery cost, as the trainer sees it: a per-rank high-water mark and the ``recovery`` record.

Every rank keeps a *high-water mark* of the last optimizer step it completed (and when) in a tiny memory-mapped
file next to its pod's peer snapshot (``/dev/shm``: it outlives in-pod worker restarts, not the pod). Writing
it is a 32-byte store into shared memory after every step, no system call. At restore every rank reads its
mark and the ranks all-gather them, so the restored run knows the highest step any surviving rank completed
before the fault, even when the snapshot it restored is older.

:func:`recovery_record` turns that into the ``recovery`` object of the progress channel (docs/contract.md)::

    {"resumedFrom": "peer", "step": 120, "highestStep": 121, "stepsLost": 1, "restoredFromPod": "job-0",
     "seconds": 9.4, "at": 1735732800.0}

``stepsLost`` is ``highestStep - step``, never clamped (a negative value would be a bug, shown as is);
``seconds`` runs from the last step any rank completed before the fault to the first step completed after
the resume (``at``), so both are filled in once that first step is done (:func:`complete`).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import zlib
from typing import Any

MAGIC = b"DDPMARK1"
_MARK = struct.Struct("<8sqdQ")  # magic, step, unix time, crc32 of the run key
MARK_NAME = "highwater-{local_rank}.bin"

# Run.restore's sources -> the contract's names
RESUMED_FROM = {"fresh": "start", "checkpoint": "disk", "peer": "peer", "local": "local"}


class HighWaterMark:
    """The last step this local rank completed, in ``<directory>/highwater-<local rank>.bin``."""

    def __init__(self, directory: str, run_key: str, local_rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, MARK_NAME.format(local_rank=local_rank))
        self._key = zlib.crc32(run_key.encode())
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _MARK.size:
                os.ftruncate(fd, _MARK.size)
            self._mm: mmap.mmap | None = mmap.mmap(fd, _MARK.size)
        finally:
            os.close(fd)

    def read(self) -> tuple[int, float] | None:
        """(step, unix time) of the last completed step recorded for this run, or None."""
        if self._mm is None:
            return None
        magic, step, at, key = _MARK.unpack_from(self._mm, 0)
        if magic != MAGIC or key != self._key or step < 0:
            return None
        return int(step), float(at)

    def write(self, step: int, at: float | None = None) -> None:
        if self._mm is not None:
            _MARK.pack_into(self._mm, 0, MAGIC, step, time.time() if at is None else at, self._key)

    def close(self, *, remove: bool = False) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if remove:
            for rm, path in ((os.unlink, self.path), (os.rmdir, os.path.dirname(self.path))):
                try:
                    rm(path)  # the directory only goes when empty (the snapshots are removed first)
                except OSError:
                    pass


def recovery_record(
    source: str,
    step: int,
    marks: list[tuple[int, float] | None],
    *,
    restart_count: int = 0,
    restored_from_pod: str | None = None,
) -> tuple[dict[str, Any] | None, float | None]:
    """The ``recovery`` object after a restore (``seconds``/``at`` still None) and the time of the last step
    any rank completed before the fault (None if no mark survived).

    None when nothing was recovered: a fresh start with no mark anywhere on a first run (restart count 0).
    """
    valid = [m for m in marks if m is not None]
    highest = max((s for s, _ in valid), default=None)
    last_time = max((t for _, t in valid), default=None)
    if source == "fresh" and highest is None and restart_count == 0:
        return None, None
    record = {
        "resumedFrom": RESUMED_FROM.get(source, source),
        "step": int(step),
        "highestStep": highest,
        "stepsLost": highest - int(step) if highest is not None else None,
        "restoredFromPod": restored_from_pod,
        "seconds": None,
        "at": None,
    }
    return record, last_time


def complete(record: dict[str, Any], last_time: float | None, at: float) -> dict[str, Any]:
    """The record once the first step after the resume is done at unix time ``at``."""
    seconds = round(at - last_time, 3) if last_time is not None else None
    return {**record, "seconds": seconds, "at": round(at, 3)}
