"""progress.probe against a local HTTP server standing in for rank 0's /progress endpoint."""

import http.server
import json
import threading

from ddp_operator import names, progress
from ddp_trainer.testing import free_port

from ddp_builders import ProgressServer


def test_probe_finds_the_pod_that_answers(monkeypatch):
    report = {"step": 7, "loss": 0.5}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps(report).encode() if self.path == names.PROGRESS_PATH else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(names, "PROGRESS_PORT", server.server_address[1])
    try:
        # 127.0.0.2 refuses (nothing listens there on that port); 127.0.0.1 is "rank 0".
        assert progress.probe(["127.0.0.2", "127.0.0.1"]) == ("127.0.0.1", report)
        assert progress.probe(["127.0.0.2"]) is None
    finally:
        server.shutdown()


# --- a pod's answer is untrusted: every probe is bounded --------------------------------------------------------
import socket  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402


class RawServer:
    """A TCP server on 127.0.0.1 whose every connection is handed to `serve(conn)` in its own thread."""

    def __init__(self, serve):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.serve, self.closed = serve, threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        try:
            conn.recv(4096)
            self.serve(conn, self.closed)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.closed.set()
        self.sock.close()


def _reply(status, body, headers=""):
    def serve(conn, _closed):
        conn.sendall(f"HTTP/1.0 {status}\r\n{headers}Content-Type: application/json\r\n\r\n".encode() + body)
    return serve


def _trickle(conn, closed):
    conn.sendall(b"HTTP/1.0 200 OK\r\n")
    while not closed.wait(0.05):
        conn.sendall(b"X")  # one header byte at a time, forever


def _trickle_body(conn, closed):
    conn.sendall(b'HTTP/1.0 200 OK\r\n\r\n{"step": 1')
    while not closed.wait(0.05):
        conn.sendall(b" ")


GOOD = json.dumps({"step": 3}).encode()
NASTY = {
    "trickled-head": _trickle,
    "trickled-body": _trickle_body,
    "server-error": _reply("500 Internal Server Error", GOOD),
    "not-found": _reply("404 Not Found", GOOD),
    "bad-status-line": lambda conn, _: conn.sendall(b"\x00\xff garbage\r\n\r\n" + GOOD),
    "huge": _reply("200 OK", b'{"step": 1, "x": "' + b"a" * (8 << 20) + b'"}'),
    "deeply-nested": _reply("200 OK", b"[" * 60000 + b"]" * 60000),
    "nested-object": _reply("200 OK", b'{"a":' * 30000 + b"1" + b"}" * 30000),
    "long-integer": _reply("200 OK", b'{"step": ' + b"9" * 6000 + b"}"),
    "not-an-object": _reply("200 OK", b"[1, 2]"),
    "silent": lambda conn, closed: closed.wait(30),
}


def _probe_bounded(ips, limit):
    """progress.probe(ips) run in a thread: (returned within `limit` seconds, its result, seconds taken)."""
    out = {}

    def run():
        try:
            out["result"] = progress.probe(ips)
        except BaseException as e:  # noqa: BLE001 - an exception escaping the probe is a failure too
            out["result"] = e
    started = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    return not t.is_alive(), out.get("result", "still running"), time.monotonic() - started


@pytest.mark.parametrize("case", sorted(NASTY))
def test_probe_of_a_misbehaving_pod_is_none_within_the_deadline(monkeypatch, case):
    server = RawServer(NASTY[case])
    monkeypatch.setattr(names, "PROGRESS_PORT", server.port)
    try:
        finished, result, took = _probe_bounded(["127.0.0.1"], progress.DEADLINE_SECONDS + 2)
    finally:
        server.close()
    assert finished and result is None, (case, result)
    assert took < progress.DEADLINE_SECONDS + 0.5, case


def test_the_deadline_bounds_the_whole_probe_not_each_pod(monkeypatch):
    server = RawServer(_trickle)
    monkeypatch.setattr(names, "PROGRESS_PORT", server.port)
    try:
        # Three addresses of the same trickling "pod": the deadline is for the probe, not per address.
        finished, result, took = _probe_bounded(["127.0.0.1", "127.0.0.3", "127.0.0.4"],
                                                3 * progress.DEADLINE_SECONDS)
    finally:
        server.close()
    assert finished and result is None and took < progress.DEADLINE_SECONDS + 0.5


def test_non_finite_numbers_in_a_report_are_not_passed_on(monkeypatch):
    server = RawServer(_reply("200 OK", b'{"step": 9, "loss": NaN, "samplesPerSecond": 1e999, '
                                        b'"metrics": {"acc": -Infinity}}'))
    monkeypatch.setattr(names, "PROGRESS_PORT", server.port)
    try:
        found = progress.probe(["127.0.0.1"])
    finally:
        server.close()
    assert found is not None
    from ddp_operator.status import progress_status
    out = progress_status(found[1])
    json.dumps(out, allow_nan=False)
    assert out["step"] == 9 and "loss" not in out and "samplesPerSecond" not in out


def test_redirects_are_not_followed(monkeypatch):
    good = RawServer(_reply("200 OK", GOOD))
    redirect = RawServer(_reply("302 Found", b"", f"Location: http://127.0.0.1:{good.port}/progress\r\n"))
    try:
        monkeypatch.setattr(names, "PROGRESS_PORT", good.port)
        assert progress.probe(["127.0.0.1"]) == ("127.0.0.1", {"step": 3})
        monkeypatch.setattr(names, "PROGRESS_PORT", redirect.port)
        assert progress.probe(["127.0.0.1"]) is None
    finally:
        good.close()
        redirect.close()


# --- every pod answers for itself ---------------------------------------------------------------------------------
def test_probe_takes_global_rank_0s_report_and_one_without_rank_is_rank_0(monkeypatch):
    port = free_port()
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    servers = [ProgressServer("127.0.0.3", port, {"rank": 1, "step": 9}), ProgressServer("127.0.0.4", port, {"rank": 0, "step": 8})]
    try:
        # the pod asked first answers as rank 1: not the one the status shows
        assert progress.probe(["127.0.0.3", "127.0.0.4"], preferred="127.0.0.3") == (
            "127.0.0.4", {"rank": 0, "step": 8})
        assert progress.probe(["127.0.0.3"]) is None
    finally:
        for s in servers:
            s.close()
    legacy = ProgressServer("127.0.0.5", port, {"step": 7})  # an older trainer / a plain script: rank 0 alone serves
    try:
        assert progress.probe(["127.0.0.5"]) == ("127.0.0.5", {"step": 7})
    finally:
        legacy.close()
    assert progress.is_rank0({"rank": 0}) and progress.is_rank0({}) and not progress.is_rank0({"rank": True})


def test_probe_each_asks_every_pod_in_parallel_a_stuck_one_costs_one_deadline(monkeypatch):
    # a stopped process: the kernel accepts the connection, nobody ever answers
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    stuck.bind(("127.0.0.6", 0))
    stuck.listen(16)
    port = stuck.getsockname()[1]
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    ok = ProgressServer("127.0.0.7", port, {"rank": 1, "step": 4})
    try:
        started = time.monotonic()
        got = progress.probe_each({"j-0": "127.0.0.6", "j-1": "127.0.0.7", "j-2": "127.0.0.8"}, timeout=0.5)
        assert time.monotonic() - started < 1.5
        assert got == {"j-0": None, "j-1": {"rank": 1, "step": 4}, "j-2": None}
        assert progress.probe_each({}) == {}
    finally:
        ok.close()
        stuck.close()
