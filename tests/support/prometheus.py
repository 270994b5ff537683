"""A real Prometheus on this machine for the metrics tests: the pinned build (hack/build-binaries.sh prometheus),
started on a free loopback port with its data in a directory of the test's, scraping the given targets every second;
PromQL through its HTTP API; and the Grafana dashboard's queries with its template variables filled in, so that every
query the chart ships is run against a real Prometheus (Grafana itself is not ours to run: its licence)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ddp_trainer.testing import free_port
from hack.common import pinned_path
from tests.support.processes import stop_process
from tests.support.suite import REPO
from tests.support.waiting import wait_for

DASHBOARD = REPO / "helm" / "ddp-operator" / "dashboards" / "ddpjob.json"
BUILD_TIMEOUT_S = 1200  # a cold build is about 2 minutes on 2 cores (docs/metrics.md); a busy machine takes longer


def binary() -> str:
    """The pinned Prometheus (never another one on PATH), built first when it is missing (kwok's pattern:
    build-binaries.sh waits for a build already under way, e.g. make test's in the background). A build that fails
    fails the test, with its output."""
    path = pinned_path("prometheus")
    assert path is not None
    if not os.access(path, os.X_OK):
        p = subprocess.run([str(REPO / "hack" / "build-binaries.sh"), "prometheus"], capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)
        assert p.returncode == 0, f"hack/build-binaries.sh prometheus failed:\n{p.stdout[-3000:]}{p.stderr[-6000:]}"
        assert os.access(path, os.X_OK), f"hack/build-binaries.sh prometheus left no {path}"
    return str(path)


class Prometheus:
    """`prometheus` scraping `targets` (host:port) every second at /metrics, as job `ddp-operator`."""

    def __init__(self, targets: list[str], workdir: Path, *, interval: str = "1s") -> None:
        self.targets, self.workdir, self.interval = targets, Path(workdir), interval
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout: float = 60) -> "Prometheus":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = {"global": {"scrape_interval": self.interval, "scrape_timeout": self.interval,
                             "evaluation_interval": self.interval},
                  "scrape_configs": [{"job_name": "ddp-operator", "static_configs": [{"targets": self.targets}]}]}
        (self.workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.port = free_port()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [binary(), f"--config.file={self.workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        wait_for(self._ready, ready_timeout, f"Prometheus ready on {self.url} (log: {self.log_path})", interval=0.2)
        return self

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"Prometheus exited:\n{self.log_tail()}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc)
        self.proc = None

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    # -- the HTTP API ----------------------------------------------------------------------------
    def _get(self, path: str, params: list[tuple[str, str]]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                answer = json.load(r)
        except urllib.error.HTTPError as e:  # a bad query: 400 with the parser's error
            answer = json.loads(e.read() or b"{}")
        assert answer.get("status") == "success", f"GET {url}: {answer}"
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's vector: [{"metric": {labels}, "value": [time, "text"]}]; a scalar as one such row."""
        data = self._get("/api/v1/query", [("query", expr)])
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        assert data["resultType"] == "vector", f"{expr}: a {data['resultType']}, not a vector"
        return data["result"]

    def value(self, expr: str) -> float | None:
        """The one value of an instant query, None when it returns no series (more than one fails)."""
        rows = self.query(expr)
        assert len(rows) <= 1, f"{expr}: {len(rows)} series, expected at most one: {rows}"
        return float(rows[0]["value"][1]) if rows else None

    def label_values(self, label: str, match: str) -> list[str]:
        return self._get(f"/api/v1/label/{label}/values", [("match[]", match)])

    def targets_up(self) -> bool:
        active = self._get("/api/v1/targets", [("state", "active")])["activeTargets"]
        return bool(active) and all(t.get("health") == "up" for t in active)


# -- the dashboard ---------------------------------------------------------------------------------
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.+),\s*)?(\w+)\)\s*$")


def substitute(text: str, variables: dict[str, str]) -> str:
    """Grafana's `$name` and `${name}` replaced by `variables` (an unknown variable raises KeyError)."""
    return _VARIABLE.sub(lambda m: variables[m.group(1) or m.group(2)], text)


def dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def panel_queries(board: dict, variables: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel (rows' panels too), variables substituted."""
    out = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            walk(panel.get("panels") or [])
            for target in panel.get("targets") or []:
                if target.get("expr"):
                    out.append((panel.get("title", ""), substitute(target["expr"], variables)))
    walk(board.get("panels") or [])
    return out


def variable_queries(board: dict, variables: dict[str, str]) -> list[tuple[str, str, str]]:
    """(variable, label, series selector) of every `label_values(selector, label)` query variable, substituted."""
    out = []
    for var in (board.get("templating") or {}).get("list") or []:
        if var.get("type") != "query":
            continue
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        m = _LABEL_VALUES.match(substitute(text, variables))
        assert m, f"variable {var.get('name')}: not label_values(selector, label): {text!r}"
        out.append((var["name"], m.group(2), m.group(1) or "{__name__=~'.+'}"))
    return out
