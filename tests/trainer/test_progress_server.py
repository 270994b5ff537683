"""The trainer's progress server (ddp_trainer.progress.ProgressServer) against clients that misbehave."""

import socket
import urllib.request

from ddp_trainer.progress import Progress, ProgressServer


def test_a_client_that_sends_nothing_is_dropped_and_never_holds_the_server():
    progress = Progress(world_size=1)
    progress.update(step=7)
    server = ProgressServer(progress, 0, host="127.0.0.1", timeout=0.5)
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    try:
        # the endpoint still answers while they hold their connections (no time bound: a busy machine is slow)...
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/progress", timeout=5) as r:
            assert b'"step": 7' in r.read()
        # ...and each silent one is closed by the server once its timeout (0.5 s) is up, not held for ever: the
        # server's close reaches the client as end-of-stream well before the client's own 5 s
        for sock in silent:
            sock.settimeout(5)
            assert sock.recv(1) == b"", "the server kept a connection that never sent a request"
    finally:
        for sock in silent:
            sock.close()
        server.close()
