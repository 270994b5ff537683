"""Atomic, verified files: the on-disk format shared by checkpoints.

A file is ``MAGIC | sha256(payload) | payload`` where the payload is ``torch.save`` output. Writing goes
to a temporary file in the same directory, is fsynced, renamed over the target and the directory is
fsynced, so a reader sees either the old file or the complete new one; the digest catches everything
else (truncation, bit rot, a partial copy).

Loading uses ``torch.load(weights_only=True)``: a checkpoint directory is shared storage, and the digest
proves integrity, not origin, so a file planted there must not run code when a trainer resumes. The
trainer's own state (state dicts, the position dict, plain extras) needs no more than tensors and builtin
containers; anything else a user keeps in ``extra`` must be allowed with
``torch.serialization.add_safe_globals``.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from typing import Any

import torch

MAGIC = b"DDPCKPT1"
_DIGEST = 32


class CorruptFileError(Exception):
    """The file is not a complete, intact ddp_trainer file."""


def encode(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getvalue()
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode(data: bytes, *, name: str = "<bytes>") -> Any:
    if len(data) < len(MAGIC) + _DIGEST or not data.startswith(MAGIC):
        raise CorruptFileError(f"{name}: not a ddp_trainer file (bad header, {len(data)} bytes)")
    digest = data[len(MAGIC) : len(MAGIC) + _DIGEST]
    payload = memoryview(data)[len(MAGIC) + _DIGEST :]
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptFileError(f"{name}: checksum mismatch (truncated or corrupted)")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # a valid digest over a bad payload: written by something else
        raise CorruptFileError(f"{name}: cannot unpickle: {exc}") from exc


def atomic_write(path: str, data: bytes, *, fsync: bool = True) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)
    if fsync:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def save_file(path: str, obj: Any, *, fsync: bool = True) -> None:
    atomic_write(path, encode(obj), fsync=fsync)


def load_file(path: str) -> Any:
    """Load a file written by :func:`save_file` (e.g. a checkpoint), verifying its digest."""
    with open(path, "rb") as f:
        data = f.read()
    return decode(data, name=path)
