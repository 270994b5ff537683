"""torch's TCPStore wire protocol as torch 2.13's client speaks it: the query types, frame parsing, reply encoding and
the limits. Pure (no sockets).

A client sends frames of one query byte and its fields, in the host's byte order (little endian wherever torch runs);
a key or value is a u64 length and its bytes, a list of keys a u64 count and the keys::

    VALIDATE     u32 magic                 first frame of every connection, nothing else may come first; no reply
    PING         u32 nonce                 -> u32 the nonce
    SET          key value                 no reply
    COMPARE_SET  key expected desired      -> value: the key's value after the query (see state.compare_set)
    GET          key                       -> value, empty when absent (the client WAITs for the key first)
    ADD          key i64                   -> i64 the sum, which the key now holds in decimal
    CHECK        keys                      -> u8 READY (all exist) or NOT_READY
    WAIT         keys                      -> u8 STOP_WAITING once every key exists: at once or much later
    GETNUMKEYS                             -> i64
    DELETE_KEY   key                       -> i64 keys deleted (0 or 1)
    APPEND       key value                 no reply
    MULTI_GET    keys                      -> one value per key (the client WAITs for them first)
    MULTI_SET    u64 n, n x (key value)    no reply
    CANCEL_WAIT                            -> u8 WAIT_CANCELED (after a STOP_WAITING already on its way)
    QUEUE_PUSH   key value                 no reply
    QUEUE_POP    key                       -> i64 the queue's length before the pop, then the value if it was > 0
    QUEUE_LEN    key                       -> i64
    LIST_KEYS                              -> i64 n, then n keys
    BARRIER      key i64 world_size        -> u8 STOP_WAITING once world_size clients arrived at the key

A wait that times out is the client's business: it sends CANCEL_WAIT and raises. The client prefixes keys with "/"
itself; the server stores them as they come. The limits are torch's own server's (libuv backend); a frame past them,
of an unknown query, or a first frame that is not VALIDATE with the magic closes the connection, as torch's does.
tests/trainer/test_store_protocol.py holds the server to the real client, op by op.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Union


class Query(IntEnum):
    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


MAGIC = 0x3C85F7CE  # VALIDATE's number
READY, NOT_READY = 0, 1  # CHECK's replies
STOP_WAITING, WAIT_CANCELED = 0, 1  # WAIT's, BARRIER's and CANCEL_WAIT's replies
MAX_KEY_COUNT = 128 * 1024
MAX_KEY_BYTES = 8 * 1024
MAX_VALUE_BYTES = 8 * 1024 * 1024

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

# A parsed frame: (query, *fields); a field is bytes (a key or value), int, tuple of keys or tuple of (key, value).
Request = tuple
Buffer = Union[bytes, bytearray, memoryview]


class ProtocolError(ValueError):
    """A frame no torch client sends: its connection is closed."""


class _Short(Exception):
    """The frame is not all there yet: `need` is how far the buffer must reach at least before it can be."""

    def __init__(self, need: int) -> None:
        super().__init__(need)
        self.need = need


def _u64(buf: Buffer, pos: int) -> tuple[int, int]:
    end = pos + 8
    if end > len(buf):
        raise _Short(end)
    return _U64.unpack_from(buf, pos)[0], end


def _blob(buf: Buffer, pos: int, limit: int, what: str) -> tuple[bytes, int]:
    n, pos = _u64(buf, pos)
    if n > limit:
        raise ProtocolError(f"a {what} of {n} bytes (at most {limit})")
    end = pos + n
    if end > len(buf):
        raise _Short(end)
    return bytes(buf[pos:end]), end  # one copy: `buf` is bytes or a memoryview


def _key(buf: Buffer, pos: int) -> tuple[bytes, int]:
    return _blob(buf, pos, MAX_KEY_BYTES, "key")


def _value(buf: Buffer, pos: int) -> tuple[bytes, int]:
    return _blob(buf, pos, MAX_VALUE_BYTES, "value")


def _count(buf: Buffer, pos: int) -> tuple[int, int]:
    n, pos = _u64(buf, pos)
    if n > MAX_KEY_COUNT:
        raise ProtocolError(f"{n} keys in one query (at most {MAX_KEY_COUNT})")
    return n, pos


def _keys(buf: Buffer, pos: int) -> tuple[tuple[bytes, ...], int]:
    n, pos = _count(buf, pos)
    keys = []
    for _ in range(n):
        key, pos = _key(buf, pos)
        keys.append(key)
    return tuple(keys), pos


def _pairs(buf: Buffer, pos: int) -> tuple[tuple[tuple[bytes, bytes], ...], int]:
    n, pos = _count(buf, pos)
    pairs = []
    for _ in range(n):
        key, pos = _key(buf, pos)
        value, pos = _value(buf, pos)
        pairs.append((key, value))
    return tuple(pairs), pos


def _fixed(size: int, unpack):
    def read(buf: Buffer, pos: int) -> tuple[int, int]:
        end = pos + size
        if end > len(buf):
            raise _Short(end)
        return unpack(buf, pos)[0], end
    return read


_u32 = _fixed(4, _U32.unpack_from)
_i64 = _fixed(8, _I64.unpack_from)

# Each query's fields, in order.
FIELDS = {
    Query.VALIDATE: (_u32,),
    Query.SET: (_key, _value),
    Query.COMPARE_SET: (_key, _value, _value),
    Query.GET: (_key,),
    Query.ADD: (_key, _i64),
    Query.CHECK: (_keys,),
    Query.WAIT: (_keys,),
    Query.GETNUMKEYS: (),
    Query.DELETE_KEY: (_key,),
    Query.APPEND: (_key, _value),
    Query.MULTI_GET: (_keys,),
    Query.MULTI_SET: (_pairs,),
    Query.CANCEL_WAIT: (),
    Query.PING: (_u32,),
    Query.QUEUE_PUSH: (_key, _value),
    Query.QUEUE_POP: (_key,),
    Query.QUEUE_LEN: (_key,),
    Query.LIST_KEYS: (),
    Query.BARRIER: (_key, _i64),
}
_READERS = tuple(FIELDS[q] for q in sorted(FIELDS))


def parse(buf: Buffer, pos: int = 0) -> tuple[Request | None, int]:
    """(the frame at `pos` of `buf`, where the next one starts), or (None, how far `buf` must reach at least before
    the frame can be whole) while it is incomplete. Raises ProtocolError. Give bytes or a memoryview: a value is then
    copied once."""
    if pos >= len(buf):
        return None, pos + 1
    query = buf[pos]
    if query >= len(_READERS):
        raise ProtocolError(f"unknown query type {query}")
    fields: list = [query]
    at = pos + 1
    try:
        for read in _READERS[query]:
            value, at = read(buf, at)
            fields.append(value)
    except _Short as short:
        return None, short.need
    return tuple(fields), at


# --- replies ----------------------------------------------------------------------------------------------------------
def u8(value: int) -> bytes:
    return _U8.pack(value)


def u32(value: int) -> bytes:
    return _U32.pack(value)


def i64(value: int) -> bytes:
    return _I64.pack(value)


def blob(value: bytes) -> bytes:
    """A key or value as the client reads one: u64 length, bytes."""
    return _U64.pack(len(value)) + value


def blobs(values) -> bytes:
    return b"".join(_U64.pack(len(v)) + v for v in values)


STOP = u8(STOP_WAITING)
CANCELED = u8(WAIT_CANCELED)


# --- what a client sends (tests and the benchmark's own probes) -------------------------------------------------------
def frame(query: Query, *fields: Union[bytes, int, tuple]) -> bytes:
    """A query as torch's client writes it, fields given as parse() returns them (ints of VALIDATE/PING are u32,
    other ints i64)."""
    out = [u8(query)]
    for field in fields:
        if isinstance(field, bytes):
            out.append(blob(field))
        elif isinstance(field, tuple):
            out.append(_U64.pack(len(field)))
            out.extend(blob(item[0]) + blob(item[1]) if isinstance(item, tuple) else blob(item) for item in field)
        else:
            out.append(u32(field) if query in (Query.VALIDATE, Query.PING) else i64(field))
    return b"".join(out)
