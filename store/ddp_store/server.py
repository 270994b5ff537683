"""The store's event loop: one thread, `selectors` (epoll on Linux), every client a non-blocking socket, as torch's
own server runs one libuv loop. A client blocked in WAIT costs nothing until another client's query completes it
(state.py sends its STOP_WAITING then); the wait's timeout is the client's (it sends CANCEL_WAIT). SIGTERM and SIGINT
end the loop at once (the pod's grace period is 5 s): every connection is closed, which is how the trainers' agents
learn the store is gone (they fail and rejoin its replacement, docs/recovery.md).
"""

from __future__ import annotations

import selectors
import signal
import socket
import sys
import time
from typing import Any, Callable, TextIO

from ddp_store import protocol as p
from ddp_store.protocol import ProtocolError, Query
from ddp_store.state import State

RECV_BYTES = 256 * 1024
BACKLOG = 4096  # the kernel caps it at net.core.somaxconn; a 512-node job connects at once
_LISTENER, _WAKEUP = object(), object()


def log_line(event: str, stream: TextIO | None = None, **fields: Any) -> None:
    """One structured line: `<UTC time>Z ddp_store event=<event> key=value ...` (the trainer's format)."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
    parts = [stamp, "ddp_store", f"event={event}", *(f"{k}={v}" for k, v in fields.items())]
    out = stream or sys.stdout
    out.write(" ".join(parts) + "\n")
    out.flush()


class Connection:
    """One client: the start of a frame not all there yet, and the replies the socket did not take yet."""

    __slots__ = ("sock", "inbuf", "need", "out", "validated", "events", "broken", "dirty")

    def __init__(self, sock: socket.socket, dirty: set) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.need = 0  # inbuf must reach this length before the frame in it can be whole
        self.out = bytearray()
        self.validated = False  # the first frame was VALIDATE with the magic
        self.events = selectors.EVENT_READ
        self.broken = False
        self.dirty = dirty  # the server's set of connections to look at after this turn of the loop

    def send(self, data: bytes) -> None:
        """A reply (this client's, or its STOP_WAITING after another client's query): sent at once where the socket
        takes it, else kept until it is writable."""
        if not self.out and not self.broken:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.broken = True
                self.dirty.add(self)
                return
            if sent == len(data):
                return
            data = data[sent:]
        self.out += data
        self.dirty.add(self)


def bind(host: str | None, port: int) -> socket.socket:
    """The listening socket: `host`, or every address (IPv6 and IPv4 where the host has both, as torch's server)."""
    if host:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=BACKLOG)
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("::", port), family=socket.AF_INET6, backlog=BACKLOG, dualstack_ipv6=True)
        except OSError:  # IPv6 disabled in the pod's network namespace
            pass
    return socket.create_server(("0.0.0.0", port), backlog=BACKLOG)


class Server:
    """`Server(host, port).serve()` until SIGTERM (when `signals`) or `stop()` from another thread."""

    def __init__(self, host: str | None = None, port: int = 0, *, log: Callable[..., None] = log_line) -> None:
        self.listener = bind(host, port)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.state = State()
        self.log = log
        self.selector = selectors.DefaultSelector()
        self.dirty: set[Connection] = set()
        self.connections: set[Connection] = set()
        self.queries = 0
        self.stop_reason = ""
        self._recv = bytearray(RECV_BYTES)  # every read lands here first
        self._recv_view = memoryview(self._recv)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, _LISTENER)
        self.selector.register(self._wake_r, selectors.EVENT_READ, _WAKEUP)

    # --- life cycle ---------------------------------------------------------------------------------------------------
    def serve(self, signals: bool = False) -> None:
        if signals:
            # The C-level handler writes the signal's number to the wake-up socket, which ends the select at once.
            signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: None)
        self.log("listening", port=self.port)
        try:
            self._loop()
        finally:
            if signals:
                signal.set_wakeup_fd(-1)
            self.close()

    def stop(self) -> None:
        """Ends serve() (from any thread)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def close(self) -> None:
        for conn in list(self.connections):
            self._close(conn)
        for sock in (self.listener, self._wake_r, self._wake_w):
            try:
                self.selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self.selector.close()
        self.log("stopped", reason=self.stop_reason or "closed", queries=self.queries, keys=len(self.state.data))

    def _loop(self) -> None:
        while True:
            for key, mask in self.selector.select():
                conn = key.data
                if conn is _LISTENER:
                    self._accept()
                elif conn is _WAKEUP:
                    data = self._wake_r.recv(64)
                    number = next((b for b in data if b), 0)
                    self.stop_reason = signal.Signals(number).name if number else "stop"
                    return
                else:
                    if mask & selectors.EVENT_READ:
                        self._read(conn)
                    if mask & selectors.EVENT_WRITE and conn in self.connections:
                        self._flush(conn)
            while self.dirty:
                conn = self.dirty.pop()
                if conn.broken:
                    self._close(conn)
                else:
                    self._flush(conn)

    # --- connections --------------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: the client's connect times out and it retries, as with torch's server
                return
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            conn = Connection(sock, self.dirty)
            self.connections.add(conn)
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _close(self, conn: Connection) -> None:
        if conn not in self.connections:
            return
        self.connections.discard(conn)
        self.dirty.discard(conn)
        self.state.disconnected(conn)
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _read(self, conn: Connection) -> None:
        try:
            n = conn.sock.recv_into(self._recv)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not n:
            self._close(conn)
            return
        if conn.inbuf:  # the rest of a frame: parse only once it can be whole
            conn.inbuf += self._recv_view[:n]
            if len(conn.inbuf) < conn.need:
                return
            view = memoryview(conn.inbuf)
        else:
            view = self._recv_view[:n]
        try:
            pos = self._serve(conn, view)
        except ProtocolError:
            # What torch's server does with a frame it cannot serve: no reply, the connection closed.
            view.release()
            self._close(conn)
            return
        if conn.inbuf:
            view.release()
            del conn.inbuf[:pos]
        else:
            conn.inbuf = bytearray(view[pos:])  # empty, or the start of a frame
            view.release()

    def _serve(self, conn: Connection, view: memoryview) -> int:
        """Every whole frame in `view`, answered; returns where the first incomplete one starts."""
        pos = 0
        while True:
            request, end = p.parse(view, pos)
            if request is None:
                if not conn.validated and pos < len(view) and view[pos] != Query.VALIDATE:
                    raise ProtocolError("the first query is not VALIDATE")
                conn.need = end - pos
                return pos
            pos = end
            if not conn.validated:
                if request[0] != Query.VALIDATE or request[1] != p.MAGIC:
                    raise ProtocolError("the first query is not VALIDATE with torch's magic number")
                conn.validated = True
                continue
            self.queries += 1
            reply = self.state.execute(conn, request)
            if reply is not None:
                conn.send(reply)

    def _flush(self, conn: Connection) -> None:
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(conn)
                return
            del conn.out[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if events != conn.events:
            conn.events = events
            self.selector.modify(conn.sock, events, conn)
