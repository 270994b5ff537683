"""A restore's read of a slot (the format: ``slot.py``): every candidate's header first, then one slot's data, read
straight into the live tensors.

Reading a slot whole (:func:`slot.read_slot`) holds the file's bytes and a copy of every tensor at once, and a
restore that read every candidate (two copy slots, the resident file) to keep the newest held several states at once:
at ~100M parameters with Adam several GB above training, enough for a pod with a tight memory limit to be OOM-killed
on every restart. So a restore reads :func:`read_header` of each candidate (the header, the meta and the trailing
generation: kilobytes whatever the state's size) and picks the newest valid one; :func:`load` then reads that one
slot's data with ``pread`` into the destination tensors themselves: the live model's parameters and buffers, the
optimizer's own state tensors where they already exist, new tensors otherwise (the optimizer then takes them as they
are: ``load_state_dict`` keeps a tensor of the parameter's dtype and device). No slot is mapped and nothing is read
twice: a restore's memory is the state it restores.

The generations are checked again after the data was read: a slot rewritten meanwhile (only possible while a writer
of a former worker still runs) is :class:`SlotChanged`, never a state; the destinations were overwritten by then, so
the caller fails the worker rather than train on them, and its restart reads the slot as it then is.
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch

from .slot import _HEADER, HEADER_SIZE, MAGIC, _MetaUnpickler, fingerprint, fingerprint_index
from .state import TensorRef, unflatten

_GEN = struct.Struct("<Q")


class SlotChanged(RuntimeError):
    """The slot was rewritten while it was being read."""


@dataclass(frozen=True)
class SlotHeader:
    """A valid slot's header and meta: everything about its state but the tensors' bytes."""

    path: str
    step: int
    every: int | None  # the snapshot interval K in force when it was written (None: not recorded)
    generation: int
    data_off: int
    data_len: int
    skeleton: Any
    specs: list[tuple]  # (dtype name, shape, offset in the data region, bytes) per tensor

    @property
    def nbytes(self) -> int:
        return sum(spec[3] for spec in self.specs)


def probe(path: str, run_key: str) -> tuple[SlotHeader | None, str | None, int | None]:
    """The header of the slot file ``path`` if it is valid, unmodified and of run ``run_key``, else why not (the
    reasons of ``slot.SlotRead``) and the step its header claims. Reads no tensor: the header, the meta, both
    generations and, where the writer sealed a fingerprint (``slot.fingerprint``), the few words it samples."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None, "missing", None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEADER_SIZE, 0)
        if len(head) < HEADER_SIZE:
            return None, "invalid", None
        magic, gen, step, meta_len, data_off, data_len, mark = _HEADER.unpack_from(head, 0)
        if magic != MAGIC or gen == 0 or data_off + data_len + 8 > size or HEADER_SIZE + meta_len > data_off:
            return None, "invalid", step
        tail = os.pread(fd, _GEN.size, data_off + data_len)
        if len(tail) != _GEN.size or _GEN.unpack(tail)[0] != gen:
            return None, "invalid", step
        try:
            meta = _MetaUnpickler(io.BytesIO(os.pread(fd, meta_len, HEADER_SIZE))).load()
            specs, skeleton = list(meta["specs"]), meta["skeleton"]
        except Exception:
            return None, "invalid", step
        if meta.get("run_key") != run_key:
            return None, "other_run", step
        if mark:
            index = fingerprint_index(data_off, specs).tolist()
            sample = torch.frombuffer(bytearray(b"".join(os.pread(fd, 4, 4 * i) for i in index)) or bytearray(4),
                                      dtype=torch.int32)[: len(index)]
            if fingerprint(sample, torch.arange(len(index))) != mark:
                return None, "modified", step
        if os.pread(fd, _GEN.size, 8) != head[8:16]:  # rewritten while the header was read
            return None, "changing", step
    except OSError:
        return None, "missing", None
    finally:
        os.close(fd)
    every = meta.get("every")
    return SlotHeader(path=path, step=step, every=int(every) if every is not None else None, generation=gen,
                      data_off=data_off, data_len=data_len, skeleton=skeleton, specs=specs), None, step


def read_header(path: str, run_key: str) -> SlotHeader | None:
    """The header of the slot file ``path`` if it is valid, unmodified and of run ``run_key``, else None
    (:func:`probe` says why)."""
    return probe(path, run_key)[0]


def newest(*headers: SlotHeader | None) -> SlotHeader | None:
    """The header of the newest step among ``headers`` (the first of equals)."""
    best = None
    for h in headers:
        if h is not None and (best is None or h.step > best.step):
            best = h
    return best


def destinations(skeleton: Any, specs: list[tuple], live: Any = None) -> list[torch.Tensor]:
    """A tensor for every spec of ``skeleton``: ``live``'s tensor at the same place in its tree where it has the same
    dtype and shape, else a new one (on the CPU)."""
    out: list[torch.Tensor | None] = [None] * len(specs)

    def walk(node: Any, other: Any) -> None:
        if isinstance(node, TensorRef):
            dtype, shape = getattr(torch, specs[node.index][0]), tuple(specs[node.index][1])
            if (isinstance(other, torch.Tensor) and other.dtype == dtype and tuple(other.shape) == shape
                    and out[node.index] is None):
                out[node.index] = other.detach()
        elif isinstance(node, dict) and isinstance(other, dict):
            for key, value in node.items():
                walk(value, other.get(key))
        elif isinstance(node, (list, tuple)) and isinstance(other, (list, tuple)) and len(node) == len(other):
            for a, b in zip(node, other, strict=True):
                walk(a, b)

    walk(skeleton, live)
    return [t if t is not None else torch.empty(tuple(spec[1]), dtype=getattr(torch, spec[0]))
            for t, spec in zip(out, specs, strict=True)]


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _read_into(fd: int, offset: int, nbytes: int, dst: torch.Tensor) -> None:
    if nbytes == 0:
        return
    direct = dst.device.type == "cpu" and dst.is_contiguous()
    buf = dst if direct else torch.empty(dst.shape, dtype=dst.dtype)  # one tensor's staging, not the state's
    view = _bytes_of(buf)
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:nbytes]], offset + done)
        if n <= 0:
            raise SlotChanged(f"slot ended {nbytes - done} bytes early")
        done += n
    if not direct:
        with torch.no_grad():
            dst.copy_(buf)


def load(header: SlotHeader, live: Any = None) -> dict[str, Any]:
    """The state in ``header``'s slot, its tensors read straight into ``live``'s where they fit (:func:`destinations`).
    :class:`SlotChanged` if the slot's generations are no longer the header's once its data is read."""
    dests = destinations(header.skeleton, header.specs, live)
    fd = os.open(header.path, os.O_RDONLY)
    try:
        for (_, _, off, nbytes), dst in zip(header.specs, dests, strict=True):
            _read_into(fd, header.data_off + off, nbytes, dst)
        lead = os.pread(fd, _GEN.size, 8)
        tail = os.pread(fd, _GEN.size, header.data_off + header.data_len)
    finally:
        os.close(fd)
    if [lead, tail] != [_GEN.pack(header.generation)] * 2:
        raise SlotChanged(f"{header.path} was rewritten while it was read (step {header.step})")
    return unflatten(header.skeleton, dests)
