"""The rendezvous store (store/ddp_store, what the <job>-rdzv pod runs) against torch's real TCPStore client: every
query the client can send gives what torch's own server gives (the same script against both, compared), waits are
answered when their keys appear and time out in the client, compare_set and add hold under concurrent clients, many
clients at once, SIGTERM ends it at once with status 0, and hostile bytes close only their own connection."""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from ddp_store import protocol as p
from ddp_trainer.testing import free_port

REPO = Path(__file__).resolve().parents[2]
SECOND = datetime.timedelta(seconds=1)


class StoreProcess:
    """`python -m ddp_store` on a loopback port, as the pod runs it."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO / "store"), "DDPJOB_RDZV_PORT": "0"}
        self.proc = subprocess.Popen([sys.executable, "-m", "ddp_store", "--host", "127.0.0.1"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        m = re.search(r" ddp_store event=listening port=(\d+)", line)
        assert m, f"no listening line: {line!r}"
        self.port = int(m.group(1))

    def client(self, timeout: datetime.timedelta = 10 * SECOND) -> TCPStore:
        return TCPStore("127.0.0.1", self.port, is_master=False, timeout=timeout)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=10)
        return rc, self.proc.stdout.read()


@pytest.fixture
def store():
    s = StoreProcess()
    yield s
    s.stop()


def _outcome(call):
    try:
        return ("ok", call())
    except Exception as e:  # noqa: BLE001 - the outcome compared is the exception's type and words
        return ("raised", type(e).__name__, re.sub(r"\d+ms", "<n>ms", str(e).splitlines()[0]))


def _script(c: TCPStore) -> list:
    """Every query the client sends, with the edge cases the rendezvous code meets."""
    short = datetime.timedelta(milliseconds=300)
    steps = [
        lambda: c.list_keys(),
        lambda: c.num_keys(),
        lambda: c.set("k", b"v1"),
        lambda: c.get("k"),
        lambda: c.set("k", b"\x00\xffbinary"),
        lambda: c.get("k"),
        lambda: c.add("n", 5),
        lambda: c.add("n", -7),
        lambda: c.add("n", 0),
        lambda: c.get("n"),
        lambda: c.set("weird", b"  12abc"),
        lambda: c.add("weird", 1),  # std::stoll: leading blanks and trailing garbage
        lambda: c.compare_set("cas", "", "created"),  # absent, expected empty: created
        lambda: c.compare_set("cas", "created", "swapped"),  # matched
        lambda: c.compare_set("cas", "stale", "lost"),  # no match: the current value
        lambda: c.compare_set("absent", "expected", "x"),  # absent, expected not empty: `expected`, nothing set
        lambda: c.check(["absent"]),
        lambda: c.check(["k", "n"]),
        lambda: c.check(["k", "nope"]),
        lambda: c.check([]),
        lambda: c.delete_key("k"),
        lambda: c.delete_key("k"),
        lambda: c.append("ap", "ab"),
        lambda: c.append("ap", "cd"),
        lambda: c.get("ap"),
        lambda: c.multi_set(["m1", "m2", "m3"], ["a", "", "c"]),
        lambda: c.multi_get(["m1", "m2", "m3"]),
        lambda: c.multi_get([]),
        lambda: c.wait(["m1", "m2"]),
        lambda: c.wait(["m1", "never"], short),
        lambda: c.get("m1"),  # the connection still serves after a timed-out wait
        lambda: c.set_timeout(short),
        lambda: c.get("missing"),
        lambda: c.multi_get(["m1", "missing"]),
        lambda: c.set_timeout(10 * SECOND),
        lambda: c.queue_len("q"),
        lambda: c.queue_push("q", "one"),
        lambda: c.queue_push("q", "two"),
        lambda: c.queue_len("q"),
        lambda: c.check(["q"]),
        lambda: c.queue_pop("q", False),
        lambda: c.queue_pop("q", True),
        lambda: c.queue_pop("q", False),
        lambda: c.check(["q"]),
        lambda: (c.set_timeout(short), c.queue_pop("q", True)),
        lambda: c.set_timeout(10 * SECOND),
        lambda: c.barrier("bar", 1, SECOND),
        lambda: c.barrier("bar", 2, SECOND),  # the count is 2 now: through at once
        lambda: c.barrier("bar-alone", 2, short),
        lambda: c.get("bar"),
        lambda: c.num_keys(),
        lambda: sorted(c.list_keys()),
        lambda: c.has_extended_api(),
        lambda: c.clone().get("m1"),
    ]
    return [_outcome(step) for step in steps]


def test_every_query_answers_as_torchs_own_server(store):
    torch_server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    expected = _script(TCPStore("127.0.0.1", torch_server.port, is_master=False, timeout=10 * SECOND))
    got = _script(store.client())
    assert len(got) == len(expected)
    diffs = [(i, e, g) for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    assert not diffs, f"(step, torch's server, ddp_store) where they differ: {diffs}"


def test_a_wait_is_answered_when_its_keys_appear_and_times_out_in_the_client(store):
    waiter, writer = store.client(), store.client()
    done = {}

    def wait() -> None:
        started = time.monotonic()
        waiter.wait(["a", "b"], 30 * SECOND)
        done["after"] = time.monotonic() - started

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    writer.set("a", "1")
    time.sleep(0.3)
    assert t.is_alive(), "answered before its second key existed"
    writer.set("b", "2")
    t.join(timeout=5)
    assert not t.is_alive() and done["after"] < 5
    # torch's own get waits for its key: answered by another client's add
    getter = threading.Thread(target=lambda: done.setdefault("got", waiter.get("later")))
    getter.start()
    time.sleep(0.3)
    writer.add("later", 3)
    getter.join(timeout=5)
    assert done.get("got") == b"3"
    started = time.monotonic()
    with pytest.raises(Exception, match="wait timeout"):
        waiter.wait(["never"], datetime.timedelta(milliseconds=500))
    assert 0.4 < time.monotonic() - started < 5
    writer.set("never", "now")  # the cancelled wait is forgotten: nothing arrives late on the waiter's connection
    assert waiter.get("a") == b"1"


def test_a_blocking_queue_pop_and_a_barrier_are_answered_by_other_clients(store):
    a, b = store.client(), store.client()
    got = {}
    popper = threading.Thread(target=lambda: got.setdefault("pop", a.queue_pop("jobs", True)))
    popper.start()
    time.sleep(0.3)
    b.queue_push("jobs", "work")
    popper.join(timeout=5)
    assert got["pop"] == b"work" and b.queue_len("jobs") == 0
    clients = [store.client() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda c: c.barrier("all", 4, 10 * SECOND), clients))
    assert a.get("all") == b"4"


def test_compare_set_and_add_hold_under_concurrent_clients(store):
    clients = [store.client() for _ in range(16)]
    rounds = 50

    def adds(c: TCPStore) -> None:
        for _ in range(rounds):
            c.add("counter", 1)

    def cas_increments(ic: tuple[int, TCPStore]) -> int:
        me, c = ic
        lost = 0
        for i in range(rounds):
            while True:
                current = c.compare_set("cas-counter", "", "0")  # created by the first, read by the others
                desired = f"{int(current.split(b'/')[0]) + 1}/{me}/{i}".encode()  # unique: a win is unmistakable
                if c.compare_set("cas-counter", current, desired) == desired:
                    break
                lost += 1
        return lost

    with ThreadPoolExecutor(len(clients)) as pool:
        list(pool.map(adds, clients))
        lost = sum(pool.map(cas_increments, enumerate(clients)))
    c = store.client()
    assert c.get("counter") == str(16 * rounds).encode()
    # a compare_set that read the current value won exactly once per increment: lost races were retried
    assert c.get("cas-counter").split(b"/")[0] == str(16 * rounds).encode(), lost


def test_many_clients_at_once(store):
    """64 torch clients, and 512 raw connections (a 512-node job's agents) all blocked in one WAIT, answered by one
    SET. (torch's client resolves its own address when it connects, which can take the resolver's 5 s timeout:
    hence the long connect timeout.)"""
    n = 64
    with ThreadPoolExecutor(16) as pool:
        clients = list(pool.map(lambda _: store.client(timeout=60 * SECOND), range(n)))
        list(pool.map(lambda ic: ic[1].set(f"agent/{ic[0]}", str(ic[0])), enumerate(clients)))
    values = clients[0].multi_get([f"agent/{i}" for i in range(n)])
    assert values == [str(i).encode() for i in range(n)]
    assert clients[-1].num_keys() == n
    raw = []
    try:
        for i in range(512):
            s = socket.create_connection(("127.0.0.1", store.port), timeout=30)
            s.sendall(p.frame(p.Query.VALIDATE, p.MAGIC) + p.frame(p.Query.ADD, b"/joined", 1)
                      + p.frame(p.Query.WAIT, (b"/go",)))
            raw.append(s)
        for s in raw:
            assert len(s.recv(8)) == 8  # ADD's reply; WAIT's is still pending
        assert clients[0].get("joined") == b"512"
        clients[0].set("go", "1")
        assert all(s.recv(1) == p.STOP for s in raw)
    finally:
        for s in raw:
            s.close()


def test_sigterm_ends_the_store_at_once_and_its_clients_see_it_gone(store):
    client, waiter = store.client(), store.client()
    client.set("k", "v")
    failed = {}

    def wait() -> None:
        try:
            waiter.wait(["never"], 60 * SECOND)
        except Exception as e:  # noqa: BLE001 - any error: the store went away
            failed["error"] = e

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    started = time.monotonic()
    rc, output = store.stop()
    assert rc == 0 and time.monotonic() - started < 2, output
    assert re.search(r"event=stopped reason=SIGTERM queries=\d+ keys=1", output), output
    t.join(timeout=10)
    assert "error" in failed, "the blocked client did not learn that the store is gone"
    with pytest.raises(Exception):
        client.get("k")


def _raw(port: int, payload: bytes, validate: bool = True) -> bytes:
    """What the server answers to `payload` on a new connection, until it closes it (or 1 s of silence)."""
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        if validate:
            s.sendall(p.frame(p.Query.VALIDATE, p.MAGIC))
        s.sendall(payload)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            return out + b"<open>"
        return out + b"<closed>"


@pytest.mark.parametrize("payload, validate", [
    (b"GET / HTTP/1.1\r\n\r\n", False),  # not a torch client
    (p.frame(p.Query.PING, 7), False),  # anything but VALIDATE first
    (p.frame(p.Query.VALIDATE, 12345), False),  # the wrong magic
    (b"\x63", True),  # an unknown query
    (p.frame(p.Query.VALIDATE, p.MAGIC), True),  # VALIDATE again
    (p.u8(p.Query.GET) + p._U64.pack(p.MAX_KEY_BYTES + 1), True),  # a key past the limit
    (p.u8(p.Query.SET) + p.blob(b"k") + p._U64.pack(p.MAX_VALUE_BYTES + 1), True),  # a value past it
    (p.u8(p.Query.WAIT) + p._U64.pack(p.MAX_KEY_COUNT + 1), True),  # too many keys
    (p.frame(p.Query.SET, b"text", b"x") + p.frame(p.Query.ADD, b"text", 1), True),  # ADD to a non-number
])
def test_hostile_bytes_close_only_their_connection(store, payload, validate):
    keep = store.client()
    keep.set("before", "1")
    assert _raw(store.port, payload, validate).endswith(b"<closed>")
    assert keep.get("before") == b"1" and keep.add("after", 1) == 1


def test_a_client_gone_while_waiting_is_forgotten(store):
    assert _raw(store.port, p.frame(p.Query.WAIT, (b"/gone",))) == b"<open>"  # blocked, then closed by us
    c = store.client()
    c.set("gone", "now")  # waking a client that left must not break the store
    assert _raw(store.port, p.frame(p.Query.PING, 42)) == p.u32(42) + b"<open>"
    assert c.get("gone") == b"now"


def test_a_frame_split_anywhere_and_a_large_value_are_served_once_whole(store):
    frames = (p.frame(p.Query.VALIDATE, p.MAGIC) + p.frame(p.Query.SET, b"/split", b"v" * 100)
              + p.frame(p.Query.GET, b"/split"))
    with socket.create_connection(("127.0.0.1", store.port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(len(frames)):
            s.sendall(frames[i:i + 1])
            time.sleep(0.001)
        reply = b""
        while len(reply) < 108:
            reply += s.recv(4096)
    assert reply == p.blob(b"v" * 100)
    big = os.urandom(p.MAX_VALUE_BYTES)  # torch's own limit, reached
    c = store.client()
    c.set("big", big)
    assert c.get("big") == big and c.compare_set("big", big, b"small") == b"small"
