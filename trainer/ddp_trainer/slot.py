"""The slot: the on-disk format of a training state, shared by the peer snapshot copies and the resident state.

A slot is one memory-mapped file holding one step's state: a header, the small non-tensor rest of the state
(positions, optimizer hyper-parameters, user extras, and the skeleton that places every tensor) pickled as its
*meta*, and a data region with every tensor's bytes at a fixed offset, so a writer copies the tensors in (one
``_foreach_copy_``, no allocation) instead of pickling them. The peer snapshots (``snapshot.py``) write two such
slots per pod, alternately; the resident state (``resident.py``) is one slot per rank whose data region is the
optimizer's own storage.

A slot is valid when its leading and trailing generation numbers match. A writer first zeroes the leading one
(:func:`invalidate`, :func:`begin_header`), rewrites the header, meta and data, and only then writes a new
generation at the end and at the start (:func:`seal`): a writer killed half-way (the pod dies, SIGKILL) leaves the
slot invalid, never half-written and valid, and :func:`read_slot` loads a slot only when it is valid and of the
reader's run. A reader's copy of the file is not atomic either: a writer may invalidate and rewrite the slot after
the reader copied the header and before it copied the data, and the copy then holds the old generations around new
(or half-new) data. So the reader reads both generations again from the file once its copy is complete (a seqlock):
a slot whose generations changed during the copy is read again (``READ_ATTEMPTS``), never returned.

A writer may also store a *fingerprint* of the data at the seal: a hash of a few words sampled at fixed strides in
every tensor (:func:`fingerprint`), re-computed by the reader from its copy. The resident state (``resident.py``)
needs it because its data region is the live parameters: something that changes them in place between save points
(an EMA helper's ``copy_to`` for evaluation, ``model.load_state_dict(best)``) changes a sealed slot without touching
its generations. A mismatch rejects the slot (reason ``modified``); 0 means no fingerprint (the peer copies).

Slot layout (little endian)::

    0   magic "DDPSNAP1"
    8   generation (u64, 0 while the header is being rewritten)
    16  step (i64)
    24  meta length (u64)
    32  data offset (u64, 64-byte aligned)
    40  data length (u64)
    48  fingerprint (u64, 0: none)
    64  meta: pickle of {"run_key", "skeleton", "specs": [(dtype, shape, offset, nbytes)], "every"}
    data offset + data length: generation again (u64)
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .state import TensorRef, unflatten

MAGIC = b"DDPSNAP1"
_HEADER = struct.Struct("<8sQqQQQQ")
HEADER_SIZE = 64
_FINGERPRINT_AT = 48
_ALIGN = 64
PAGE = 4096
# A reader copies a slot again when a writer changed it during the copy; after this many tries it gives up (None).
READ_ATTEMPTS = 3
# Words (4 bytes) sampled per tensor for the fingerprint: evenly spaced, the first and the last included.
FINGERPRINT_SAMPLES = 16


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Snapshot:
    """A state read back from a valid slot (:func:`read_slot`)."""

    step: int
    state: dict[str, Any]
    path: str
    every: int | None  # the snapshot interval K in force when it was written (None: not recorded)


class _MetaPickler(pickle.Pickler):
    """Pickles a skeleton's tensor placeholders as bare indices: pickling the 2-3 placeholders per parameter through
    ``TensorRef.__reduce__`` cost more than the rest of a small model's snapshot."""

    def persistent_id(self, obj: Any) -> int | None:
        return obj.index if type(obj) is TensorRef else None


class _MetaUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> TensorRef:
        return TensorRef(int(pid))


def data_specs(tensors: list[torch.Tensor]) -> tuple[list[tuple], int]:
    """Where each tensor goes in a slot's data region: ([(dtype name, shape, offset, nbytes)], data length)."""
    specs = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append((_dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset = align(offset + nbytes, _ALIGN)
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
    _HEADER.pack_into(mm, 0, MAGIC, 0, step, len(meta), data_off, data_len, 0)
    mm[HEADER_SIZE : HEADER_SIZE + len(meta)] = meta


def seal(mm: Any, data_off: int, data_len: int, gen: int, fingerprint: int = 0) -> None:
    """Make the slot valid: the fingerprint (0: none), the trailing generation, then the leading one (a reader needs
    both equal)."""
    struct.pack_into("<Q", mm, _FINGERPRINT_AT, fingerprint)
    struct.pack_into("<Q", mm, data_off + data_len, gen)
    struct.pack_into("<Q", mm, 8, gen)


def fingerprint_index(data_off: int, specs: list[tuple]) -> torch.Tensor:
    """The 4-byte words of a slot file that :func:`fingerprint` samples: FINGERPRINT_SAMPLES per tensor, evenly
    spaced (a tensor under 4 bytes has none). Computed once per layout."""
    index: list[int] = []
    for _, _, off, nbytes in specs:
        words = nbytes // 4
        if words == 0:
            continue
        first, k = (data_off + off) // 4, min(FINGERPRINT_SAMPLES, words)
        index.extend(first + i * (words - 1) // max(k - 1, 1) for i in range(k))
    return torch.tensor(index, dtype=torch.int64)


def fingerprint(words: torch.Tensor, index: torch.Tensor) -> int:
    """A 64-bit hash (never 0) of the sampled words: ``words`` is the slot file as int32 (``torch.frombuffer``),
    ``index`` from :func:`fingerprint_index`. One gather and one hash of ~64 bytes per tensor, whatever its size."""
    sample = words[index] if len(index) else words[:0]
    digest = hashlib.blake2b(sample.numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _words(data: bytearray) -> torch.Tensor:
    usable = len(data) - len(data) % 4
    return torch.frombuffer(data, dtype=torch.int32, count=usable // 4) if usable else torch.empty(0, dtype=torch.int32)


@dataclass
class SlotRead:
    """What :func:`load_slot` found: the snapshot, or why there is none (and the step the header claimed)."""

    snapshot: Snapshot | None
    reason: str | None = None  # "missing", "invalid", "other_run", "changing" (rewritten during every copy), "modified"
    step: int | None = None


def _generations(f: Any, data_off: int, data_len: int) -> tuple[bytes, bytes]:
    return os.pread(f.fileno(), 8, 8), os.pread(f.fileno(), 8, data_off + data_len)


def load_slot(path: str, run_key: str) -> SlotRead:
    """The snapshot in the slot file ``path`` if it is valid, whole and of run ``run_key``; else why not."""
    for _ in range(READ_ATTEMPTS):
        try:
            with open(path, "rb") as f:
                data = bytearray(f.read())
                if len(data) < HEADER_SIZE:
                    return SlotRead(None, "invalid")
                magic, gen, step, meta_len, data_off, data_len, mark = _HEADER.unpack_from(data, 0)
                if magic != MAGIC or gen == 0 or data_off + data_len + 8 > len(data):
                    return SlotRead(None, "invalid", step)
                copied = (bytes(data[8:16]), bytes(data[data_off + data_len : data_off + data_len + 8]))
                # The copy is whole only if no writer touched the slot since the header was copied: a writer
                # invalidates before its first change and seals with a new generation after its last.
                if _generations(f, data_off, data_len) != copied:
                    continue
                if copied[0] != copied[1]:
                    return SlotRead(None, "invalid", step)
        except OSError:
            return SlotRead(None, "missing")
        return _decode(data, path, run_key, step, meta_len, data_off, mark)
    return SlotRead(None, "changing")


def _decode(data: bytearray, path: str, run_key: str, step: int, meta_len: int, data_off: int,
            mark: int) -> SlotRead:
    try:
        meta = _MetaUnpickler(io.BytesIO(bytes(data[HEADER_SIZE : HEADER_SIZE + meta_len]))).load()
    except Exception:
        return SlotRead(None, "invalid", step)
    if meta.get("run_key") != run_key:
        return SlotRead(None, "other_run", step)
    if mark and fingerprint(_words(data), fingerprint_index(data_off, meta["specs"])) != mark:
        return SlotRead(None, "modified", step)
    base = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    tensors = [t.clone() for t in data_views(base, data_off, meta["specs"])]
    every = meta.get("every")
    return SlotRead(Snapshot(step=step, state=unflatten(meta["skeleton"], tensors), path=path,
                             every=int(every) if every is not None else None), None, step)


def read_slot(path: str, run_key: str) -> Snapshot | None:
    """The snapshot in the slot file ``path`` if it is valid, whole and of run ``run_key``, else None
    (:func:`load_slot` says why)."""
    return load_slot(path, run_key).snapshot


@functools.lru_cache(maxsize=4096)
def _sampled_words(words: int) -> np.ndarray:
    """The positions :func:`fingerprint_index` samples in a tensor of ``words`` 4-byte words."""
    k = min(FINGERPRINT_SAMPLES, words)
    return np.array([i * (words - 1) // max(k - 1, 1) for i in range(k)], dtype=np.int64)


def source_fingerprint(tensors: list[torch.Tensor], specs: list[tuple]) -> int:
    """:func:`fingerprint` of a slot that will hold ``tensors`` (laid out by ``specs``), taken from the tensors
    themselves, before the copy: the words it samples are those :func:`fingerprint_index` picks in the file. A writer
    that copies live tensors later (the async peer copies) seals this, so a change of the live tensors between the
    save point and the copy (an unguarded in-place swap of the weights) makes the slot read as ``modified``. 0 (no
    fingerprint) for CUDA tensors or a layout it cannot view as words. Through numpy: ~2 us a tensor."""
    samples: list[np.ndarray] = []
    try:
        for t, (_, _, _, nbytes) in zip(tensors, specs):
            words = nbytes // 4
            if words == 0:
                continue
            if t.is_cuda:
                return 0
            t = t.detach()
            try:
                a = t.numpy()
            except TypeError:  # a dtype numpy lacks (bfloat16): its bytes
                a = t.reshape(-1).view(torch.uint8).numpy()
            samples.append(a.reshape(-1).view(np.uint8)[: words * 4].view(np.int32)[_sampled_words(words)])
    except (RuntimeError, TypeError, ValueError):
        return 0
    sample = np.concatenate(samples) if samples else np.empty(0, dtype=np.int32)
    return int.from_bytes(hashlib.blake2b(sample.tobytes(), digest_size=8).digest(), "little") or 1
