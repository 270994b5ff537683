"""The store's keys, queues and waiting clients, and what each query does to them, as torch's own server (libuv
backend) does it. No sockets: a client is any hashable object with `send(bytes)`, through which a client blocked in
WAIT or BARRIER gets its STOP_WAITING when another client's query completes it.

What torch's server does and this one does too:
- a key is set by SET, MULTI_SET, ADD, APPEND, BARRIER and a COMPARE_SET that matched (or created it), and each of
  those wakes the clients waiting for it; a COMPARE_SET that did not match wakes them too (torch does);
- COMPARE_SET of an absent key creates it only if `expected` is empty, and otherwise answers `expected` (torch's
  documented lie, which c10d's rendezvous backend relies on: it sends an empty `expected` to create its state);
- GET and MULTI_GET of an absent key answer an empty value (the client waited for the key before asking);
- ADD reads the key's value as a decimal integer (leading blanks and trailing garbage allowed, as std::stoll does);
  a value that is none closes the asking client's connection, as torch's exception does;
- a client waits for one thing at a time: a WAIT or BARRIER replaces what it waited for before;
- a queue key counts as existing for WAIT and CHECK while it holds an item, and a push wakes one waiting client;
  queues are not keys (GETNUMKEYS, LIST_KEYS and DELETE_KEY ignore them).
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any, Callable

from ddp_store import protocol as p
from ddp_store.protocol import ProtocolError, Query

_INT = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_I64_MIN, _I64_MAX = -(2 ** 63), 2 ** 63 - 1


def stoll(value: bytes) -> int:
    """std::stoll of a value: the integer at its start; ProtocolError (torch raises) if there is none or it does not fit
    in 64 bits."""
    m = _INT.match(value)
    if not m:
        raise ProtocolError(f"ADD to a key whose value is not an integer: {value[:32]!r}")
    n = int(m.group(1))
    if not _I64_MIN <= n <= _I64_MAX:
        raise ProtocolError("ADD to a key whose value does not fit in 64 bits")
    return n


def _wrap(n: int) -> int:
    """Two's complement int64, as the C++ sum overflows."""
    return (n - _I64_MIN) % 2 ** 64 + _I64_MIN


class State:
    """Everything the store holds."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque[bytes]] = {}
        self.waiting: dict[bytes, list[Any]] = {}  # key -> clients waiting for it (once per time they named it)
        self.awaited: dict[Any, list] = {}  # client -> [keys still awaited, the keys it registered for]
        self._handlers: dict[int, Callable[..., bytes | None]] = {
            Query.SET: self.set, Query.COMPARE_SET: self.compare_set, Query.GET: self.get, Query.ADD: self.add,
            Query.CHECK: self.check, Query.WAIT: self.wait, Query.GETNUMKEYS: self.num_keys,
            Query.DELETE_KEY: self.delete, Query.APPEND: self.append, Query.MULTI_GET: self.multi_get,
            Query.MULTI_SET: self.multi_set, Query.CANCEL_WAIT: self.cancel_wait, Query.PING: self.ping,
            Query.QUEUE_PUSH: self.queue_push, Query.QUEUE_POP: self.queue_pop, Query.QUEUE_LEN: self.queue_len,
            Query.LIST_KEYS: self.list_keys, Query.BARRIER: self.barrier,
        }

    def execute(self, client: Any, request: tuple) -> bytes | None:
        """The reply to `request` (a parsed frame other than VALIDATE), or None for a query that has none (yet)."""
        handler = self._handlers.get(request[0])
        if handler is None:  # VALIDATE after the first frame: torch's server closes the connection too
            raise ProtocolError(f"query {Query(request[0]).name} out of place")
        return handler(client, *request[1:])

    def disconnected(self, client: Any) -> None:
        self._forget(client)

    # --- waiting ------------------------------------------------------------------------------------------------------
    def _present(self, key: bytes) -> bool:
        return key in self.data or bool(self.queues.get(key))

    def _register(self, client: Any, keys: tuple[bytes, ...]) -> None:
        self._forget(client)
        for key in keys:
            self.waiting.setdefault(key, []).append(client)
        self.awaited[client] = [len(keys), keys]

    def _forget(self, client: Any) -> None:
        entry = self.awaited.pop(client, None)
        if entry is None:
            return
        for key in set(entry[1]):
            clients = self.waiting.get(key)
            if clients is not None:
                clients[:] = [c for c in clients if c is not client]
                if not clients:
                    del self.waiting[key]

    def _arrived(self, client: Any) -> bool:
        """One of the client's keys arrived; True once all have (its wait is over and forgotten)."""
        entry = self.awaited.get(client)
        if entry is None:
            return False
        entry[0] -= 1
        if entry[0] > 0:
            return False
        del self.awaited[client]
        return True

    def _wake(self, key: bytes) -> None:
        for client in self.waiting.pop(key, ()):
            if self._arrived(client):
                client.send(p.STOP)

    def _wake_one(self, key: bytes) -> None:
        clients = self.waiting.get(key)
        while clients:
            client = clients.pop(0)
            if self._arrived(client):
                client.send(p.STOP)
                break
        if clients is not None and not clients:
            del self.waiting[key]

    # --- the queries --------------------------------------------------------------------------------------------------
    def ping(self, client: Any, nonce: int) -> bytes:
        return p.u32(nonce)

    def set(self, client: Any, key: bytes, value: bytes) -> None:
        self.data[key] = value
        self._wake(key)

    def compare_set(self, client: Any, key: bytes, expected: bytes, desired: bytes) -> bytes:
        current = self.data.get(key)
        if current is None:
            if expected:
                answer = expected
            else:
                self.data[key] = answer = desired
        else:
            if current == expected:
                self.data[key] = current = desired
            answer = current
        self._wake(key)
        return p.blob(answer)

    def get(self, client: Any, key: bytes) -> bytes:
        return p.blob(self.data.get(key, b""))

    def add(self, client: Any, key: bytes, delta: int) -> bytes:
        current = self.data.get(key)
        total = delta if current is None else _wrap(stoll(current) + delta)
        self.data[key] = str(total).encode()
        self._wake(key)
        return p.i64(total)

    def check(self, client: Any, keys: tuple[bytes, ...]) -> bytes:
        return p.u8(p.READY if all(map(self._present, keys)) else p.NOT_READY)

    def wait(self, client: Any, keys: tuple[bytes, ...]) -> bytes | None:
        missing = tuple(k for k in keys if not self._present(k))
        if not missing:
            self._forget(client)
            return p.STOP
        self._register(client, missing)
        return None

    def num_keys(self, client: Any) -> bytes:
        return p.i64(len(self.data))

    def delete(self, client: Any, key: bytes) -> bytes:
        return p.i64(0 if self.data.pop(key, None) is None else 1)

    def append(self, client: Any, key: bytes, value: bytes) -> None:
        self.data[key] = self.data.get(key, b"") + value
        self._wake(key)

    def multi_get(self, client: Any, keys: tuple[bytes, ...]) -> bytes:
        data = self.data
        return p.blobs(data.get(k, b"") for k in keys)

    def multi_set(self, client: Any, pairs: tuple[tuple[bytes, bytes], ...]) -> None:
        for key, value in pairs:
            self.set(client, key, value)

    def cancel_wait(self, client: Any) -> bytes:
        self._forget(client)
        return p.CANCELED

    def queue_push(self, client: Any, key: bytes, value: bytes) -> None:
        self.queues.setdefault(key, deque()).append(value)
        self._wake_one(key)

    def queue_pop(self, client: Any, key: bytes) -> bytes:
        queue = self.queues.get(key)
        if not queue:
            return p.i64(0)
        reply = p.i64(len(queue)) + p.blob(queue.popleft())
        if not queue:
            del self.queues[key]
        return reply

    def queue_len(self, client: Any, key: bytes) -> bytes:
        return p.i64(len(self.queues.get(key, ())))

    def list_keys(self, client: Any) -> bytes:
        return p.i64(len(self.data)) + p.blobs(self.data)

    def barrier(self, client: Any, key: bytes, world_size: int) -> bytes | None:
        current = self.data.get(key)
        count = 1 if current is None else stoll(current) + 1
        self.data[key] = str(count).encode()
        if count >= world_size:
            self._forget(client)
            self._wake(key)
            return p.STOP
        self._register(client, (key,))
        return None
