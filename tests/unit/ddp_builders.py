"""Builders shared by the unit tests: DDPJob bodies and observed pods.

A plain module (not conftest.py) with a unique name, so `from ddp_builders import ...` never resolves to another
suite's conftest when several test directories run together."""

import copy
import http.server
import json
import socket
import threading
from datetime import datetime, timedelta, timezone

from ddp_operator import names
from ddp_operator.observed import format_time, observe_pod
from ddp_operator.spec import parse_job

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
IMAGE = "localhost/ddp-trainer:0.1.0"


def job_body(name="mnist", namespace="ml", **spec):
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name, "namespace": namespace, "uid": "0b5c-uid", "generation": 1},
        "spec": {
            "nodes": 2,
            "template": {"spec": {"containers": [
                {"name": "trainer", "image": IMAGE, "command": ["torchrun", "-m", "ddp_trainer.examples.digits"]}]}},
        },
    }
    body["spec"].update(copy.deepcopy(spec))
    return body


def make_job(**spec):
    return parse_job(job_body(**spec))


def pod(name, *, role="trainer", index=None, group=0, phase="Running", exit_code=None, reason=None,
        message=None, deleting_since=None, node="node-1", disruption=None, status_reason=None, uid=None,
        ready=None, finished_at=None, restart_policy="OnFailure", restart_count=0, last_exit_code=None,
        last_reason=None, last_message=None, waiting=None, annotations=None):
    """A pod as the API server shows it. Trainer pods default to restartPolicy OnFailure (as rendered): a trainer
    `exit_code` != 0 in a Running pod is then a failure the kubelet restarts in place; `restart_count` and
    `last_*` describe the container's restarts (lastState.terminated), `waiting` its waiting reason."""
    labels = {names.LABEL_JOB_NAME: "mnist", names.LABEL_ROLE: role, names.LABEL_GROUP: str(group)}
    if index is not None:
        labels[names.LABEL_NODE_INDEX] = str(index)
    container = names.TRAINER_CONTAINER if role == "trainer" else names.RDZV_CONTAINER
    cs = {"name": container, "restartCount": restart_count}
    if last_exit_code is not None:
        cs["lastState"] = {"terminated": {"exitCode": last_exit_code, "reason": last_reason or "Error",
                                          "finishedAt": format_time(NOW)}}
        if last_message is not None:
            cs["lastState"]["terminated"]["message"] = last_message
    if waiting is not None:
        cs["state"] = {"waiting": {"reason": waiting}}
    if exit_code is not None:
        cs["state"] = {"terminated": {"exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0 else "Error")}}
        if message is not None:
            cs["state"]["terminated"]["message"] = message
        if finished_at is not None:
            cs["state"]["terminated"]["finishedAt"] = format_time(finished_at)
    conditions = []
    if ready if ready is not None else phase == "Running":
        conditions.append({"type": "Ready", "status": "True"})
    if disruption:
        conditions.append({"type": "DisruptionTarget", "status": "True", "reason": disruption})
    meta = {"name": name, "uid": uid or f"uid-{name}-{group}", "labels": labels}
    if annotations:
        meta["annotations"] = dict(annotations)
    if deleting_since is not None:
        meta["deletionTimestamp"] = format_time(deleting_since)
    status = {"phase": phase, "containerStatuses": [cs], "conditions": conditions}
    if status_reason:
        status["reason"] = status_reason
    spec = {"nodeName": node, "restartPolicy": restart_policy if role == "trainer" else "Never"}
    return {"metadata": meta, "spec": spec, "status": status}


def trainer(index, **kw):
    return pod(f"mnist-{index}", index=index, **kw)


def rdzv(**kw):
    return pod("mnist-rdzv", role="rdzv", **kw)


def observed(*pods, gone=(), **kw):
    from ddp_operator.plan import Observed
    states = tuple(observe_pod(p) for p in pods) + tuple(observe_pod(p, gone=True) for p in gone)
    return Observed(pods=states, **kw)


def later(seconds):
    return NOW + timedelta(seconds=seconds)


class ProgressServer:
    """A pod's side of an HTTP channel on one loopback address (GET /progress, or a diagnostics sidecar's
    /diagnosis): answers `answer` as JSON (changeable between requests), records every path asked in `paths`."""

    def __init__(self, ip, port, answer):
        self.answer, self.paths = answer, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server API)
                server.paths.append(self.path)
                body = json.dumps(server.answer).encode()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_):
                pass

        self.server = http.server.HTTPServer((ip, port), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Silent:
    """A pod whose process is stopped: the kernel accepts the connection, nobody ever answers."""

    def __init__(self, ip, port):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, port))
        self.sock.listen(16)

    def close(self):
        self.sock.close()
