"""Per-pod peer snapshots: the newest training state in shared memory, rewritten after every step.

DDP replicas are identical after each optimizer step, so any surviving pod holds what a replaced pod
needs. Each pod's local rank 0 keeps the state of the last completed step in ``/dev/shm`` (the
operator mounts a memory-backed emptyDir there; it outlives worker restarts inside the pod but not the
pod). Writing must be cheap enough to do every step, so instead of pickling the state a snapshot is
two preallocated, memory-mapped slot files that the state's tensors are copied into (one
``_foreach_copy_``, no allocation); the small non-tensor rest (positions, optimizer hyper-parameters,
user extras) is pickled into the slot header.

Slots alternate, so while one is being written the other still holds the previous complete step. A
slot is valid when its leading and trailing generation numbers match (the format: ``slot.py``): a writer
killed half-way (the pod dies, SIGKILL) leaves that slot invalid and the other one intact.

The copy is asynchronous (:meth:`PeerSnapshots.write_async`): at a save point only the tensors that can
change before the next optimizer step (buffers such as BatchNorm statistics, which the next forward
updates, and anything else the caller does not declare *stable*) are cloned, and the non-tensor rest is
pickled; a background thread then copies the stable tensors (parameters, optimizer state) straight from
the live objects into the slot while the next forward/backward runs. The run installs an optimizer
step pre-hook that waits until the thread has read its sources (:meth:`PeerSnapshots.wait_sources`), so
the slot holds exactly the state of the step it is labelled with. On CUDA the thread copies on a side
stream into pinned staging buffers (after an event recorded at the save point), then into the slot; on
CPU it copies directly. Only one write is in flight; a slot's generation is written after its copy has
completed, so a slot is only ever valid with a whole step in it. How often to write (every K steps) is
``cadence.py``'s decision.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import torch

from .slot import (HEADER_SIZE, PAGE, Snapshot, align, begin_header, data_specs, data_views, pack_meta, seal,
                   source_fingerprint)
from .slot_load import SlotChanged, SlotHeader, load, newest, read_header
from .state import flatten

SLOT_NAMES = ("snapshot-0.bin", "snapshot-1.bin")


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
        size = align(int(size * 1.25) + PAGE, PAGE)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, size)
        # Fault every page in now (once per slot): otherwise the first copies into a slot pay the
        # page allocation and look far more expensive than the copies that follow.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self.mm = mmap.mmap(self.fd, size, flags=flags)
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
        # Held while a slot is written (by the writer thread for asynchronous writes): the SIGTERM thread
        # may read meanwhile; other processes only read while nobody writes (at restore).
        self._lock = threading.Lock()
        self._layout: tuple | None = None
        self._specs: list[tuple] = []
        self._data_len = 0
        # asynchronous writes: one in flight at a time, on one long-lived writer thread (starting a thread
        # per snapshot costs more than copying a small model's state)
        self._jobs: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._sources_read = threading.Event()
        self._sources_read.set()
        self._done = threading.Event()
        self._done.set()
        self._error: BaseException | None = None
        self._pinned: list[torch.Tensor | None] = []
        self._stream: Any = None
        self.in_flight_step: int | None = None
        self.last_copy_s: float | None = None  # what the last write cost training (see _write_in_thread)
        self.last_copy_wall_s: float | None = None  # its wall time
        self.last_sync_s: float | None = None  # the save point's own part of the last asynchronous write
        self.last_bytes = 0  # tensor bytes in the last write
        self.stall_s = 0.0  # total time callers waited for a write in flight

    # -- writing -----------------------------------------------------------------------------------------
    def write(self, step: int, state: dict[str, Any], every: int | None = None) -> None:
        """Copy ``state`` into the older slot. Synchronous; costs one memcpy of the tensors."""
        self.wait()
        t0 = time.perf_counter()
        skeleton, tensors = flatten(state)
        meta = self._prepare(skeleton, tensors, every)
        prepared_s = time.perf_counter() - t0
        with self._lock:
            self.last_copy_s = self.last_copy_wall_s = prepared_s + self._write(
                step, meta, tensors, mark=source_fingerprint(tensors, self._specs))

    def write_async(
        self, step: int, state: dict[str, Any], *, stable: Collection[int] = (), every: int | None = None
    ) -> None:
        """Start copying ``state`` into the older slot and return; the slot is valid once the copy is done.

        ``stable``: ``data_ptr()`` of tensors that stay unchanged until the caller next calls
        :meth:`wait_sources` (parameters and optimizer state, guarded by an optimizer step pre-hook);
        they are copied by the writer thread from the live objects. Every other tensor is cloned here.
        """
        self.wait()
        t0 = time.perf_counter()
        skeleton, tensors = flatten(state)
        sources = []
        cuda = False
        with torch.no_grad():
            for t in tensors:
                t = t.detach()
                if t.data_ptr() not in stable or not t.is_contiguous():
                    t = t.clone(memory_format=torch.contiguous_format)
                cuda = cuda or t.is_cuda
                sources.append(t)
        meta = self._prepare(skeleton, sources, every)
        # What the slot must hold, sampled now: the stable tensors are read later by the writer thread, and a change
        # of them meanwhile that is not an optimizer step (an unguarded in-place swap) must not be sealed as this step.
        mark = source_fingerprint(sources, self._specs)
        event = None
        if cuda:  # only reached with CUDA tensors: nothing here initialises CUDA otherwise
            event = torch.cuda.Event()
            event.record()
        self._sources_read.clear()
        self._done.clear()
        self.in_flight_step = step
        self.last_sync_s = time.perf_counter() - t0
        if self._writer is None:
            self._writer = threading.Thread(target=self._writer_loop, name="ddp-snapshot", daemon=True)
            self._writer.start()
        self._jobs.put((step, meta, sources, event, mark))

    def _writer_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._write_in_thread(*job)

    def _write_in_thread(self, step: int, meta: bytes, sources: list[torch.Tensor], event: Any, mark: int) -> None:
        try:
            with self._lock:
                staged_s = 0.0
                if event is not None:
                    t0 = time.perf_counter()
                    sources = self._stage_cuda(sources, event)
                    self._sources_read.set()
                    staged_s = time.perf_counter() - t0
                c0 = time.thread_time()
                copy_wall_s = self._write(step, meta, sources, on_sources_read=self._sources_read.set, mark=mark)
                copy_cpu_s = time.thread_time() - c0
            self.last_copy_wall_s = (self.last_sync_s or 0.0) + staged_s + copy_wall_s
            # The cost to training: the save point's part, the device transfer (wall: it holds PCIe and
            # a stream), and the CPU time of the host copy (the cores and memory bandwidth it takes from
            # training). Not the host copy's wall time: on a busy machine that includes waiting for a
            # core, which costs training nothing.
            self.last_copy_s = (self.last_sync_s or 0.0) + staged_s + min(copy_cpu_s, copy_wall_s)
        except BaseException as exc:  # reported to the training thread at its next wait
            self._error = exc
        finally:
            self.in_flight_step = None
            self._sources_read.set()
            self._done.set()

    def _stage_cuda(self, sources: list[torch.Tensor], event: Any) -> list[torch.Tensor]:
        """Device tensors → pinned host buffers on a side stream, after the save point's work is done."""
        if len(self._pinned) != len(sources):
            self._pinned = [None] * len(sources)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=next(t.device for t in sources if t.is_cuda))
        out = []
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(event)
            for i, t in enumerate(sources):
                if not t.is_cuda:
                    out.append(t)
                    continue
                buf = self._pinned[i]
                if buf is None or buf.dtype != t.dtype or buf.shape != t.shape:
                    buf = self._pinned[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                out.append(buf)
        self._stream.synchronize()
        return out

    def wait_sources(self) -> float:
        """Block until the write in flight has read the live tensors; returns the seconds waited."""
        if self._sources_read.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._sources_read.wait()
        waited = time.perf_counter() - t0
        self.stall_s += waited
        return waited

    def wait(self) -> float:
        """Block until the write in flight (if any) is complete and its slot valid; re-raises its error."""
        waited = 0.0
        if not self._done.is_set():
            t0 = time.perf_counter()
            self._done.wait()
            waited = time.perf_counter() - t0
            self.stall_s += waited
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
        return waited

    def wait_written(self, timeout: float | None = None) -> bool:
        """For the SIGTERM watcher (another thread): wait until the write in flight, if any, has sealed its slot;
        its error, if any, stays for the training thread."""
        return self._done.wait(timeout)

    def _prepare(self, skeleton: Any, tensors: list[torch.Tensor], every: int | None) -> bytes:
        """The slot's meta, pickled now: the skeleton refers to live dicts (extra, param groups)."""
        layout = tuple((t.dtype, t.shape) for t in tensors)
        if layout != self._layout:
            self._specs, self._data_len = data_specs(tensors)
            self._layout = layout
        return pack_meta(self.run_key, skeleton, self._specs, every)

    def _write(self, step: int, meta: bytes, tensors: list[torch.Tensor],
               on_sources_read: Callable[[], None] | None = None, mark: int = 0) -> float:
        """Copy into the older slot; returns the copy's seconds (without a first-use slot allocation)."""
        specs, data_len = self._specs, self._data_len
        slot = self._slots[self._next]
        # Reuse the slot's data offset while the meta fits, so the cached views stay valid.
        if slot.views_key is not None and slot.views_key[0] >= HEADER_SIZE + len(meta):
            data_off = slot.views_key[0]
        else:
            data_off = align(HEADER_SIZE + len(meta) * 2, PAGE)
        slot.ensure(data_off + data_len + 8)
        t_copy = time.perf_counter()  # the slot's one-time allocation above is not the copy's cost
        assert slot.mm is not None and slot.base is not None
        key = (data_off, self._layout)
        if slot.views_key != key:
            slot.views = data_views(slot.base, data_off, specs)
            slot.views_key = key
        self._generation += 1
        gen = self._generation
        mm = slot.mm
        begin_header(mm, step, meta, data_off, data_len)
        if tensors:
            with torch.no_grad():
                torch._foreach_copy_(slot.views, tensors)
        if on_sources_read is not None:
            on_sources_read()
        seal(mm, data_off, data_len, gen, mark)  # valid only now that the whole copy is in the slot
        self._next ^= 1
        self.last_step = step
        self.last_bytes = data_len
        return time.perf_counter() - t_copy

    # -- reading -----------------------------------------------------------------------------------------
    def latest_header(self) -> SlotHeader | None:
        """The header of the newest valid snapshot of this run in this pod, or None; reads no tensor (``slot_load``)."""
        with self._lock:
            return newest(*(read_header(slot.path, self.run_key) for slot in self._slots))

    def read_latest(self) -> Snapshot | None:
        """The newest valid snapshot of this run in this pod, or None: the headers first, then that one slot's data."""
        with self._lock:
            for _ in range(3):  # a slot rewritten between its header and its data (a writer of a former worker)
                head = newest(*(read_header(slot.path, self.run_key) for slot in self._slots))
                if head is None:
                    return None
                try:
                    return Snapshot(step=head.step, state=load(head), path=head.path, every=head.every)
                except (SlotChanged, OSError):
                    continue
        return None

    def set_next_slot_after(self, snap: SlotHeader | Snapshot | None) -> None:
        """Write next into the slot that does not hold ``snap`` (keep the newest intact)."""
        if snap is not None:
            held = [s.path for s in self._slots].index(snap.path)
            self._next = held ^ 1

    def close(self, *, remove: bool = False) -> None:
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._jobs.put(None)
                self._writer.join()
                self._writer = None
            self._close(remove)

    def _close(self, remove: bool) -> None:
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
