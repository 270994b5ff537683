"""Per-pod peer snapshots: the newest training state in shared memory, rewritten after every step.

DDP replicas are identical after each optimizer step, so any surviving pod holds what a replaced pod
needs. Each pod's local rank 0 keeps the state of the last completed step in ``/dev/shm`` (the
operator mounts a memory-backed emptyDir there; it outlives worker restarts inside the pod but not the
pod). Writing must be cheap enough to do every step, so instead of pickling the state a snapshot is
two preallocated, memory-mapped slot files that the state's tensors are copied into (one
``_foreach_copy_``, no allocation); the small non-tensor rest (positions, optimizer hyper-parameters,
user extras) is pickled into the slot header.

Slots alternate, so while one is being written the other still holds the previous complete step. A
slot is valid when its leading and trailing generation numbers match: a writer killed half-way (the
pod dies, SIGKILL) leaves that slot invalid and the other one intact. Since the copy happens
synchronously right after the optimizer step, a pod that logged step N has step N (or N-1 if killed
during the copy) in shared memory, whatever kills it.

Slot layout (little endian)::

    0   magic "DDPSNAP1"
    8   generation (u64, 0 while the header is being rewritten)
    16  step (i64)
    24  meta length (u64)
    32  data offset (u64, 64-byte aligned)
    40  data length (u64)
    64  meta: pickle of {"run_key", "skeleton", "specs": [(dtype, shape, offset, nbytes)]}
    data offset + data length: generation again (u64)
"""

from __future__ import annotations

import mmap
import os
import pickle
import re
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from .state import flatten, unflatten

MAGIC = b"DDPSNAP1"
_HEADER = struct.Struct("<8sQqQQQ")
_HEADER_SIZE = 64
_ALIGN = 64
_PAGE = 4096
SLOT_NAMES = ("snapshot-0.bin", "snapshot-1.bin")


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Snapshot:
    step: int
    state: dict[str, Any]
    path: str


def default_dir(run_key: str, root: str = "/dev/shm/ddpjob") -> str:
    """Where a run keeps its snapshots when DDPJOB_SNAPSHOT_DIR is not set."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_key).strip("._") or "run"
    if not os.path.isdir(os.path.dirname(root)):  # no /dev/shm (macOS): fall back to the temp dir
        import tempfile

        root = os.path.join(tempfile.gettempdir(), "ddpjob")
    return os.path.join(root, safe)


class _Slot:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.mm: mmap.mmap | None = None
        self.base: torch.Tensor | None = None
        self.size = 0
        self.views_key: tuple | None = None
        self.views: list[torch.Tensor] = []

    def ensure(self, size: int) -> None:
        if self.mm is not None and self.size >= size:
            return
        self.close()
        size = _align(int(size * 1.25) + _PAGE, _PAGE)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.size = size

    def close(self) -> None:
        self.views = []
        self.views_key = None
        self.base = None
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.size = 0


class PeerSnapshots:
    """The snapshot slots of one pod for one run."""

    def __init__(self, directory: str, run_key: str) -> None:
        self.directory = directory
        self.run_key = run_key
        os.makedirs(directory, exist_ok=True)
        self._slots = [_Slot(os.path.join(directory, name)) for name in SLOT_NAMES]
        self._next = 0
        self._generation = time.time_ns()
        self.last_step: int | None = None
        # The SIGTERM thread may read while the training thread writes; other processes only read
        # while nobody writes (at restore, before the first save point).
        self._lock = threading.Lock()
        self._layout: tuple | None = None
        self._specs: list[tuple] = []
        self._data_len = 0

    # -- writing -----------------------------------------------------------------------------------------
    def write(self, step: int, state: dict[str, Any]) -> None:
        """Copy ``state`` into the older slot. Synchronous; costs one memcpy of the tensors."""
        with self._lock:
            self._write(step, state)

    def _write(self, step: int, state: dict[str, Any]) -> None:
        skeleton, tensors = flatten(state)
        layout = tuple((t.dtype, t.shape) for t in tensors)
        if layout != self._layout:
            specs = []
            offset = 0
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                specs.append((_dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
                offset = _align(offset + nbytes, _ALIGN)
            self._layout, self._specs, self._data_len = layout, specs, offset
        specs, data_len = self._specs, self._data_len
        meta = pickle.dumps(
            {"run_key": self.run_key, "skeleton": skeleton, "specs": specs}, protocol=pickle.HIGHEST_PROTOCOL
        )
        slot = self._slots[self._next]
        # Reuse the slot's data offset while the meta fits, so the cached views stay valid.
        if slot.views_key is not None and slot.views_key[0] >= _HEADER_SIZE + len(meta):
            data_off = slot.views_key[0]
        else:
            data_off = _align(_HEADER_SIZE + len(meta) * 2, _PAGE)
        slot.ensure(data_off + data_len + 8)
        assert slot.mm is not None and slot.base is not None
        key = (data_off, self._layout)
        if slot.views_key != key:
            slot.views = [
                slot.base[data_off + off : data_off + off + n].view(t.dtype).view(t.shape)
                for t, (_, _, off, n) in zip(tensors, specs, strict=True)
            ]
            slot.views_key = key
        self._generation += 1
        gen = self._generation
        mm = slot.mm
        # Invalidate first: a writer killed anywhere below leaves a slot that fails validation.
        struct.pack_into("<Q", mm, 8, 0)
        _HEADER.pack_into(mm, 0, MAGIC, 0, step, len(meta), data_off, data_len)
        mm[_HEADER_SIZE : _HEADER_SIZE + len(meta)] = meta
        if tensors:
            with torch.no_grad():
                torch._foreach_copy_(slot.views, tensors)
        struct.pack_into("<Q", mm, data_off + data_len, gen)
        struct.pack_into("<Q", mm, 8, gen)
        self._next ^= 1
        self.last_step = step

    # -- reading -----------------------------------------------------------------------------------------
    def read_latest(self) -> Snapshot | None:
        """The newest valid snapshot of this run in this pod, or None."""
        best: Snapshot | None = None
        for slot in self._slots:
            with self._lock:
                snap = self._read(slot.path)
            if snap is not None and (best is None or snap.step > best.step):
                best = snap
        return best

    def peek_latest_step(self) -> int | None:
        snap = self.read_latest()
        return None if snap is None else snap.step

    def _read(self, path: str) -> Snapshot | None:
        try:
            with open(path, "rb") as f:
                data = bytearray(f.read())
        except OSError:
            return None
        if len(data) < _HEADER_SIZE:
            return None
        magic, gen, step, meta_len, data_off, data_len = _HEADER.unpack_from(data, 0)
        if magic != MAGIC or gen == 0 or data_off + data_len + 8 > len(data):
            return None
        (gen_end,) = struct.unpack_from("<Q", data, data_off + data_len)
        if gen_end != gen:
            return None
        try:
            meta = pickle.loads(bytes(data[_HEADER_SIZE : _HEADER_SIZE + meta_len]))
        except Exception:
            return None
        if meta.get("run_key") != self.run_key:
            return None
        base = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        tensors = []
        for dtype_name, shape, off, n in meta["specs"]:
            dtype = getattr(torch, dtype_name)
            tensors.append(base[data_off + off : data_off + off + n].view(dtype).view(shape).clone())
        return Snapshot(step=step, state=unflatten(meta["skeleton"], tensors), path=path)

    def set_next_slot_after(self, snap: Snapshot | None) -> None:
        """Write next into the slot that does not hold ``snap`` (keep the newest intact)."""
        if snap is not None:
            held = [s.path for s in self._slots].index(snap.path)
            self._next = held ^ 1

    def close(self, *, remove: bool = False) -> None:
        for slot in self._slots:
            slot.close()
            if remove:
                try:
                    os.unlink(slot.path)
                except OSError:
                    pass
        try:
            os.rmdir(self.directory)  # only succeeds when empty, e.g. a reader that never wrote
        except OSError:
            pass
