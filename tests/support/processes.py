"""Processes the tests start on this machine: stopping one (`stop_process`), and the operator as a subprocess
(`OperatorProcess`, the one launcher of `python -m ddp_operator` for the integration tier and the e2e harness)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from ddp_trainer.testing import free_port
from tests.support.suite import REPO
from tests.support.waiting import wait_for


def stop_process(proc: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class OperatorProcess:
    """`python -m ddp_operator` on this machine against `kubeconfig`, watching the namespaces that `namespace` (a glob
    such as ddp-it-*) matches, its output appended to `log_path`; `env` is added to this process's environment.

    start() returns once its metrics endpoint answers (on a free port of 127.0.0.1), within `ready_timeout` seconds;
    its readiness endpoint (/readyz) is on another free port (readiness()).
    Used by tests/integration/ddp_cluster.py's Operator, test_leader_election.py's replicas and tests/e2e/harness.py's with
    DDPJOB_OPERATOR=subprocess.
    """

    def __init__(self, kubeconfig: str | Path, namespace: str, log_path: Path, *, ready_timeout: float | None,
                 env: Mapping[str, str] | None = None, args: Sequence[str] = ()):
        self.kubeconfig, self.namespace, self.log_path = str(kubeconfig), namespace, Path(log_path)
        self.ready_timeout = ready_timeout  # None: start() does not wait (e.g. a standby replica)
        self.env = dict(env or {})
        self.args = list(args)  # more of the operator's flags (e.g. leader election)
        self.proc: subprocess.Popen | None = None
        self.metrics_port = self.readiness_port = 0

    def start(self) -> None:
        self.metrics_port, self.readiness_port = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, **self.env,
               "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
        with open(self.log_path, "a") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ddp_operator", "--namespace", self.namespace,
                 "--metrics-port", str(self.metrics_port), "--liveness-port", "0",
                 "--readiness-port", str(self.readiness_port), *self.args],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        if self.ready_timeout is not None:
            wait_for(lambda: self.metrics_text() is not None, self.ready_timeout, "the operator's metrics endpoint",
                     interval=0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def metrics_text(self) -> str | None:
        """Its Prometheus metrics, None while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=3) as r:
                return r.read().decode()
        except OSError:
            return None

    def readiness(self) -> int | None:
        """The HTTP status of its GET /readyz (200 ready, 503 not), None while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.readiness_port}/readyz", timeout=3) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def log_tail(self, lines: int = 60) -> str:
        """The last `lines` lines of its log ("" before there is one)."""
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""
