"""The trainer's progress server (ddp_trainer.progress.ProgressServer) against clients that misbehave."""

import socket
import time
import urllib.request

from ddp_trainer.progress import Progress, ProgressServer


def test_a_client_that_sends_nothing_is_dropped_and_never_holds_the_server():
    progress = Progress(world_size=1)
    progress.update(step=7)
    server = ProgressServer(progress, 0, host="127.0.0.1", timeout=0.5)
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    try:
        # the endpoint still answers at once while they hold their connections...
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/progress", timeout=5) as r:
            assert b'"step": 7' in r.read()
        assert time.monotonic() - started < 0.5
        # ...and each silent one is closed by the server once its timeout is up (not held for ever)
        for sock in silent:
            sock.settimeout(3)
            assert sock.recv(1) == b"", "the server kept a connection that never sent a request"
        assert time.monotonic() - started < 3
    finally:
        for sock in silent:
            sock.close()
        server.close()
