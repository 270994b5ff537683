"""Progress for the operator: an HTTP endpoint on every pod's local rank 0 and the final termination-log JSON.

``GET /progress`` on ``DDPJOB_PROGRESS_PORT`` (29401) answers the contract's JSON (docs/contract.md)::

    {"rank": 0, "workerRestarts": 0, "step": 120, "epoch": 5, "loss": 0.08, "samplesPerSecond": 2210.5, "lastCheckpointStep": 100,
     "worldSize": 2, "metrics": {"valAccuracy": 0.97}, "time": 1735732800.0}

The training loop only replaces a dict (no locks, no I/O per step); the server thread serialises it on
request, so the operator decides the rate. Pull, not push: nothing needs Kubernetes credentials.

Both the endpoint and the termination log are strict JSON: a NaN or infinite loss or metric (a diverging run)
is written as ``null``, since JSON has no such numbers and the API server would refuse them in status.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import env as envmod

PATH = "/progress"
# A connection that has not sent its request (or taken its answer) within this long is closed: a client that
# connects and sends nothing would otherwise hold a server thread for as long as the pod lives. The operator's
# probe gives up after 2 s anyway.
REQUEST_TIMEOUT_SECONDS = 10.0


def finite(value: Any) -> Any:
    """`value` with every NaN/Infinity replaced by None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(record: dict[str, Any], **kwargs: Any) -> str:
    """Strict JSON (allow_nan=False) of a record whose non-finite numbers became null."""
    return json.dumps(finite(record), allow_nan=False, **kwargs)


class Progress:
    """The latest progress record; updated by the training loop, read by the server thread."""

    def __init__(self, world_size: int, *, rank: int = 0, worker_restarts: int = 0) -> None:
        self._record: dict[str, Any] = {
            "rank": rank,
            "workerRestarts": worker_restarts,
            "step": 0,
            "epoch": 0,
            "loss": None,
            "samplesPerSecond": 0.0,
            "lastCheckpointStep": None,
            "worldSize": world_size,
            "metrics": {},
            "time": time.time(),
        }

    def update(self, **fields: Any) -> None:
        record = dict(self._record)
        if "metrics" in fields:
            record["metrics"] = {**record["metrics"], **(fields.pop("metrics") or {})}
        record.update(fields)
        record["time"] = time.time()
        self._record = record  # one reference assignment: readers see the old or the new dict

    def snapshot(self) -> dict[str, Any]:
        return dict(self._record)


class _Handler(BaseHTTPRequestHandler):
    progress: Progress

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        if self.path.split("?", 1)[0] not in (PATH, "/"):
            self.send_error(404)
            return
        body = dumps(self.progress.snapshot()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: stay quiet
        return


class ProgressServer:
    """Serves a :class:`Progress` on all interfaces from a daemon thread; each connection gets `timeout` seconds
    per socket operation (BaseHTTPRequestHandler.timeout), then it is closed."""

    def __init__(self, progress: Progress, port: int, host: str = "",
                 timeout: float = REQUEST_TIMEOUT_SECONDS) -> None:
        handler = type("Handler", (_Handler,), {"progress": progress, "timeout": timeout})
        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="ddp-progress", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def write_termination_log(path: str | None, record: dict[str, Any]) -> bool:
    """Write the final record where Kubernetes reads a container's termination message.

    Only writes when the file already exists (the kubelet creates it) or the path was given explicitly
    (``DDPJOB_TERMINATION_LOG``); outside Kubernetes nothing is created under /dev. Kubernetes keeps at
    most 4096 bytes, so metrics are dropped before the record is cut.
    """
    if not path:
        return False
    body = dumps(record, separators=(",", ":"))
    if len(body) > 4096:
        body = dumps({**record, "metrics": {}}, separators=(",", ":"))[:4096]
    try:
        with open(path, "w") as f:
            f.write(body)
    except OSError:
        return False
    return True


def termination_log_path(explicit: str | None, default: str = envmod.DEFAULT_TERMINATION_LOG) -> str | None:
    if explicit:
        return explicit
    return default if os.path.exists(default) else None
