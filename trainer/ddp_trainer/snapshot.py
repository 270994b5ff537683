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
pod dies, SIGKILL) leaves that slot invalid and the other one intact.

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
:func:`choose_interval`'s decision.

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

import io
import math
import mmap
import os
import pickle
import queue
import re
import statistics
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from .state import TensorRef, flatten, unflatten

MAGIC = b"DDPSNAP1"
_HEADER = struct.Struct("<8sQqQQQ")
_HEADER_SIZE = 64
_ALIGN = 64
_PAGE = 4096
SLOT_NAMES = ("snapshot-0.bin", "snapshot-1.bin")


def choose_interval(copy_s: float, step_s: float, budget_pct: float, max_every: int = 50) -> int:
    """The snapshot interval K: the fewest steps between snapshots that keeps their cost within budget.

    ``copy_s`` is what one snapshot costs training (the save point's synchronous part plus the background
    copy's CPU time: on a CPU the copy takes a core and memory bandwidth from training, so the whole copy
    is counted even though it overlaps the next step), ``step_s`` the time of one training step. K = ceil(copy_s / (step_s * budget_pct / 100)), within 1..max_every. Steps lost per failure are
    at most K (the newest valid snapshot is never more than K steps behind the newest logged step).
    """
    if max_every < 1:
        raise ValueError(f"max_every={max_every} must be >= 1")
    if not (copy_s > 0.0) or not (step_s > 0.0) or not (budget_pct > 0.0):
        # nothing measured yet (or a zero budget): a zero budget means as rarely as allowed
        return max_every if budget_pct <= 0.0 and copy_s > 0.0 else 1
    k = math.ceil(copy_s / (step_s * budget_pct / 100.0) - 1e-9)
    return max(1, min(max_every, k))


# K is chosen for this share of the budget: the budget is a ceiling, not a target. The estimates of a snapshot's cost
# and of the step are medians of noisy samples, and they see only rank 0's own cost (not the memory bandwidth its copy
# takes from the other ranks on the machine): at ~100M parameters on 2 cores, a K chosen for 75 % of a 2 % budget
# measured 2.06 % (docs/recovery.md).
TARGET_SHARE_OF_BUDGET = 0.5


def settle_interval(k: int, copy_s: float, step_s: float, budget_pct: float, max_every: int = 50) -> int:
    """Keep the interval ``k`` while its snapshots cost at most the budget and at least half the target; else choose
    anew, the smallest K within the target (``TARGET_SHARE_OF_BUDGET`` of the budget).

    The band stops K flipping with every noisy estimate (K is what a user reads as the steps a failure may lose):
    a K chosen for the target costs between half the target and the target, so K only moves when the measured cost
    goes over the budget or below half the target."""
    target_pct = budget_pct * TARGET_SHARE_OF_BUDGET
    if k >= 1 and copy_s > 0.0 and step_s > 0.0 and budget_pct > 0.0 and k <= max_every:
        share_pct = 100.0 * copy_s / (k * step_s)
        if share_pct <= budget_pct and (k == 1 or share_pct >= target_pct / 2):
            return k
    return choose_interval(copy_s, step_s, target_pct, max_every)


class _MetaPickler(pickle.Pickler):
    """Pickles a skeleton's tensor placeholders as bare indices: pickling the 2-3 placeholders per parameter through
    ``TensorRef.__reduce__`` cost more than the rest of a small model's snapshot."""

    def persistent_id(self, obj: Any) -> int | None:
        return obj.index if type(obj) is TensorRef else None


class _MetaUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> TensorRef:
        return TensorRef(int(pid))


class StepCost:
    """What one snapshot costs training: its copy's own time, or what it adds to the step it overlaps.

    On a CPU a snapshot's copy runs during the next step (whose optimizer step waits for it) and can slow that step
    by more than the copy's own CPU time (memory bandwidth, caches). ``step(dt, after)`` takes every step's time
    and what it follows (None, "snapshot" or "checkpoint"); ``copy(s)`` every finished copy's own cost. Steps that
    follow no save point are the clean steps; steps after a checkpoint count for neither. ``cost_s()`` is the larger
    of the median copy and (median step after a snapshot - median clean step): medians over recent windows, so one
    step slowed by another process moves neither the cost nor K."""

    def __init__(self, window: int = 9, clean_window: int = 49) -> None:
        self._clean: deque[float] = deque(maxlen=clean_window)
        self._after: deque[float] = deque(maxlen=window)
        self._copies: deque[float] = deque(maxlen=window)

    @property
    def clean_s(self) -> float | None:
        return statistics.median(self._clean) if self._clean else None

    def step(self, dt: float, after: str | None) -> None:
        if after is None:
            self._clean.append(dt)
        elif after == "snapshot" and self._clean:
            self._after.append(dt)

    def copy(self, seconds: float) -> None:
        self._copies.append(seconds)

    def extra_s(self) -> float | None:
        """Median slowdown of the step after a snapshot (None until both kinds of step were seen)."""
        if not self._after or not self._clean:
            return None
        return max(0.0, statistics.median(self._after) - statistics.median(self._clean))

    def cost_s(self) -> float | None:
        if not self._copies:
            return None
        return max(statistics.median(self._copies), self.extra_s() or 0.0)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Snapshot:
    step: int
    state: dict[str, Any]
    path: str
    every: int | None = None  # the snapshot interval K in force when it was written


def default_dir(run_key: str, root: str = "/dev/shm/ddpjob") -> str:
    """Where a run keeps its snapshots when DDPJOB_SNAPSHOT_DIR is not set."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_key).strip("._") or "run"
    if not os.path.isdir(os.path.dirname(root)):  # no /dev/shm (macOS): fall back to the temp dir
        import tempfile

        root = os.path.join(tempfile.gettempdir(), "ddpjob")
    return os.path.join(root, safe)


def data_specs(tensors: list[torch.Tensor]) -> tuple[list[tuple], int]:
    """Where each tensor goes in a slot's data region: ([(dtype name, shape, offset, nbytes)], data length)."""
    specs = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append((_dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset = _align(offset + nbytes, _ALIGN)
    return specs, offset


def data_views(base: torch.Tensor, data_off: int, specs: list[tuple]) -> list[torch.Tensor]:
    """The tensors of a slot's data region laid out by ``specs`` (:func:`data_specs`), as views of ``base``."""
    return [base[data_off + off : data_off + off + n].view(getattr(torch, dtype)).view(shape)
            for dtype, shape, off, n in specs]


def pack_meta(run_key: str, skeleton: Any, specs: list[tuple], every: int | None) -> bytes:
    buf = io.BytesIO()
    _MetaPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(
        {"run_key": run_key, "skeleton": skeleton, "specs": specs, "every": every}
    )
    return buf.getvalue()


def invalidate(mm: Any) -> None:
    """Mark a slot invalid (leading generation 0): whatever happens to it next, it fails validation."""
    struct.pack_into("<Q", mm, 8, 0)


def begin_header(mm: Any, step: int, meta: bytes, data_off: int, data_len: int) -> None:
    """Invalidate the slot, then write its header and meta (the slot stays invalid until :func:`seal`)."""
    invalidate(mm)
    _HEADER.pack_into(mm, 0, MAGIC, 0, step, len(meta), data_off, data_len)
    mm[_HEADER_SIZE : _HEADER_SIZE + len(meta)] = meta


def seal(mm: Any, data_off: int, data_len: int, gen: int) -> None:
    """Make the slot valid: the trailing generation, then the leading one (a reader needs both equal)."""
    struct.pack_into("<Q", mm, data_off + data_len, gen)
    struct.pack_into("<Q", mm, 8, gen)


def read_slot(path: str, run_key: str) -> Snapshot | None:
    """The snapshot in the slot file ``path`` if it is valid and of run ``run_key``, else None."""
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
        meta = _MetaUnpickler(io.BytesIO(bytes(data[_HEADER_SIZE : _HEADER_SIZE + meta_len]))).load()
    except Exception:
        return None
    if meta.get("run_key") != run_key:
        return None
    base = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    tensors = [t.clone() for t in data_views(base, data_off, meta["specs"])]
    every = meta.get("every")
    return Snapshot(step=step, state=unflatten(meta["skeleton"], tensors), path=path,
                    every=int(every) if every is not None else None)


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
            self.last_copy_s = self.last_copy_wall_s = prepared_s + self._write(step, meta, tensors)

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
        self._jobs.put((step, meta, sources, event))

    def _writer_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._write_in_thread(*job)

    def _write_in_thread(self, step: int, meta: bytes, sources: list[torch.Tensor], event: Any) -> None:
        try:
            with self._lock:
                staged_s = 0.0
                if event is not None:
                    t0 = time.perf_counter()
                    sources = self._stage_cuda(sources, event)
                    self._sources_read.set()
                    staged_s = time.perf_counter() - t0
                c0 = time.thread_time()
                copy_wall_s = self._write(step, meta, sources, on_sources_read=self._sources_read.set)
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

    def _prepare(self, skeleton: Any, tensors: list[torch.Tensor], every: int | None) -> bytes:
        """The slot's meta, pickled now: the skeleton refers to live dicts (extra, param groups)."""
        layout = tuple((t.dtype, t.shape) for t in tensors)
        if layout != self._layout:
            self._specs, self._data_len = data_specs(tensors)
            self._layout = layout
        return pack_meta(self.run_key, skeleton, self._specs, every)

    def _write(self, step: int, meta: bytes, tensors: list[torch.Tensor],
               on_sources_read: Callable[[], None] | None = None) -> float:
        """Copy into the older slot; returns the copy's seconds (without a first-use slot allocation)."""
        specs, data_len = self._specs, self._data_len
        slot = self._slots[self._next]
        # Reuse the slot's data offset while the meta fits, so the cached views stay valid.
        if slot.views_key is not None and slot.views_key[0] >= _HEADER_SIZE + len(meta):
            data_off = slot.views_key[0]
        else:
            data_off = _align(_HEADER_SIZE + len(meta) * 2, _PAGE)
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
        seal(mm, data_off, data_len, gen)  # valid only now that the whole copy is in the slot
        self._next ^= 1
        self.last_step = step
        self.last_bytes = data_len
        return time.perf_counter() - t_copy

    # -- reading -----------------------------------------------------------------------------------------
    def read_latest(self) -> Snapshot | None:
        """The newest valid snapshot of this run in this pod, or None."""
        best: Snapshot | None = None
        for slot in self._slots:
            with self._lock:
                snap = read_slot(slot.path, self.run_key)
            if snap is not None and (best is None or snap.step > best.step):
                best = snap
        return best

    def peek_latest_step(self) -> int | None:
        snap = self.read_latest()
        return None if snap is None else snap.step

    def set_next_slot_after(self, snap: Snapshot | None) -> None:
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
