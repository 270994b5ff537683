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
reader's run.

Slot layout (little endian)::

    0   magic "DDPSNAP1"
    8   generation (u64, 0 while the header is being rewritten)
    16  step (i64)
    24  meta length (u64)
    32  data offset (u64, 64-byte aligned)
    40  data length (u64)
    64  meta: pickle of {"run_key", "skeleton", "specs": [(dtype, shape, offset, nbytes)], "every"}
    data offset + data length: generation again (u64)
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch

from .state import TensorRef, unflatten

MAGIC = b"DDPSNAP1"
_HEADER = struct.Struct("<8sQqQQQ")
HEADER_SIZE = 64
_ALIGN = 64
PAGE = 4096


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
    _HEADER.pack_into(mm, 0, MAGIC, 0, step, len(meta), data_off, data_len)
    mm[HEADER_SIZE : HEADER_SIZE + len(meta)] = meta


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
    if len(data) < HEADER_SIZE:
        return None
    magic, gen, step, meta_len, data_off, data_len = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or gen == 0 or data_off + data_len + 8 > len(data):
        return None
    (gen_end,) = struct.unpack_from("<Q", data, data_off + data_len)
    if gen_end != gen:
        return None
    try:
        meta = _MetaUnpickler(io.BytesIO(bytes(data[HEADER_SIZE : HEADER_SIZE + meta_len]))).load()
    except Exception:
        return None
    if meta.get("run_key") != run_key:
        return None
    base = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    tensors = [t.clone() for t in data_views(base, data_off, meta["specs"])]
    every = meta.get("every")
    return Snapshot(step=step, state=unflatten(meta["skeleton"], tensors), path=path,
                    every=int(every) if every is not None else None)
