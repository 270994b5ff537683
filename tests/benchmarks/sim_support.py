"""What tests/benchmarks/scale_sim.py observes, apart from its scenarios: every pod of a namespace as a watch sees it
(`PodWatch`), the operator it runs as a host process and what /proc says of it (`SimOperator`), the operator's API
writes in the audit log (`operator_writes`, over api_writes.AuditCursor), and loopback servers that accept and never answer
(`SilentServers`, the slow probes of the hang scenario), the pods kwok deleted under the operator's replacements
(`kwok_raced`), and how long the API server takes to list every labelled pod as a restarted operator does
(`timed_listing`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.watch.watch import iter_resp_lines

from tests.benchmarks.api_writes import WRITE_VERBS, classify
from tests.support.processes import OperatorProcess
from tests.support.suite import SIM_NS_PREFIX

LABEL_JOB, LABEL_ROLE, LABEL_INDEX = "ddp.dev/job-name", "ddp.dev/role", "ddp.dev/node-index"


def timed_listing(api: kclient.CoreV1Api, page: int = 100) -> dict:
    """List every labelled pod of every namespace a page at a time, as a restarted operator's watch does: the seconds
    spent waiting for the API server's pages (`server_s`), decoding them (`decode_s`), the pods and the bytes. Taken
    just before the restart scenario's kill, it tells the control plane's share of the restart from the operator's."""
    server = decode = 0.0
    pods = size = 0
    token = None
    while True:
        t0 = time.monotonic()
        resp = api.list_pod_for_all_namespaces(label_selector=LABEL_JOB, limit=page, _continue=token,
                                               _preload_content=False)
        data = resp.data
        t1 = time.monotonic()
        listing = json.loads(data)
        decode += time.monotonic() - t1
        server += t1 - t0
        pods, size = pods + len(listing.get("items") or []), size + len(data)
        token = (listing.get("metadata") or {}).get("continue")
        if not token:
            return {"server_s": round(server, 1), "decode_s": round(decode, 1), "pods": pods, "mb": round(size / 1e6)}


class PodWatch(threading.Thread):
    """Every labelled pod of one namespace, as a watch sees it, stamped with this machine's clock on arrival: when each
    (name, uid) first appeared, when it was first Running, its pod IP and node, and when it went."""

    def __init__(self, kubeconfig: str, namespace: str):
        super().__init__(daemon=True, name=f"watch-{namespace}")
        self.namespace = namespace
        self.api = kclient.CoreV1Api(kconfig.new_client_from_config(config_file=str(kubeconfig)))
        self.lock = threading.Lock()
        self.created: dict[str, float] = {}  # uid -> first seen
        self.names: dict[str, str] = {}  # uid -> pod name
        self.running: dict[str, float] = {}  # uid -> first seen Running
        self.gone: dict[str, float] = {}  # uid -> deleted
        self.ip: dict[str, str] = {}
        self.node: dict[str, str] = {}
        self.jobs: dict[str, str] = {}  # uid -> its job
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self._resp = None

    def run(self) -> None:
        version = ""
        while not self.stopped.is_set():
            try:
                if not version:
                    listing = self.api.list_namespaced_pod(self.namespace, label_selector=LABEL_JOB,
                                                           _preload_content=False)
                    body = json.loads(listing.data)
                    now = time.time()
                    for item in body["items"]:
                        self._see("ADDED", item, now)
                    version = body["metadata"]["resourceVersion"]
                self._resp = self.api.list_namespaced_pod(self.namespace, label_selector=LABEL_JOB, watch=True,
                                                          resource_version=version, timeout_seconds=300,
                                                          allow_watch_bookmarks=True, _preload_content=False)
                for line in iter_resp_lines(self._resp):
                    if not line:
                        continue
                    ev = json.loads(line)
                    if ev.get("type") == "ERROR":
                        version = ""  # expired: list again
                        break
                    obj = ev["object"]
                    version = obj["metadata"].get("resourceVersion") or version
                    if ev["type"] != "BOOKMARK":
                        self._see(ev["type"], obj, time.time())
            except BaseException as e:  # noqa: BLE001 - a broken stream is re-opened; stop() ends it
                if self.stopped.is_set():
                    return
                self.error = e
                time.sleep(0.5)

    def _see(self, kind: str, pod: dict, now: float) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        uid = meta["uid"]
        with self.lock:
            if uid not in self.created:
                self.created[uid] = now
                self.names[uid] = meta["name"]
                self.jobs[uid] = (meta.get("labels") or {}).get(LABEL_JOB, "")
            if status.get("podIP"):
                self.ip[uid] = status["podIP"]
            if pod.get("spec", {}).get("nodeName"):
                self.node[uid] = pod["spec"]["nodeName"]
            if status.get("phase") == "Running" and uid not in self.running:
                self.running[uid] = now
            if kind == "DELETED":
                self.gone.setdefault(uid, now)

    def delete(self, name: str) -> float:
        """Delete pod `name` of this namespace (default grace period, as `kubectl delete pod` does); when it was
        asked (epoch seconds, just before the request)."""
        at = time.time()
        self.api.delete_namespaced_pod(name, self.namespace)
        return at

    def stop(self) -> None:
        self.stopped.set()
        try:
            if self._resp is not None:
                self._resp.close()
        except Exception:  # noqa: BLE001
            pass

    # -- views -----------------------------------------------------------------------------------
    def live(self, job: str | None = None) -> dict[str, str]:
        """uid -> name of the pods not gone (of `job`, else every job)."""
        with self.lock:
            return {u: n for u, n in self.names.items() if u not in self.gone and (job is None or self.jobs[u] == job)}

    def count(self, job: str | None = None, running: bool = False) -> int:
        with self.lock:
            return sum(1 for u in self.names if u not in self.gone and (job is None or self.jobs[u] == job)
                       and (not running or u in self.running))

    def uids_by_name(self, job: str | None = None) -> dict[str, list[str]]:
        """Every pod name seen, with the UIDs it had in the order they appeared."""
        out: dict[str, list[str]] = {}
        with self.lock:
            for u in sorted(self.names, key=lambda u: self.created[u]):
                if job is None or self.jobs[u] == job:
                    out.setdefault(self.names[u], []).append(u)
        return out

    def ips(self) -> dict[str, str]:
        with self.lock:
            return dict(self.ip)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"created": dict(self.created), "running": dict(self.running), "gone": dict(self.gone),
                    "names": dict(self.names), "node": dict(self.node)}


def wait_until(check, timeout: float, what: str, interval: float = 0.1) -> float:
    """Poll `check` until true; the time it first was (epoch seconds). AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return time.time()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class SimOperator:
    """`python -m ddp_operator --namespace 'ddp-sim-*'` on this machine (tests/support/processes.py), and its CPU
    seconds and memory from /proc, summed over every process it ran (a killed one's included)."""

    def __init__(self, kubeconfig: str | Path):
        self.log_path = Path(tempfile.mkdtemp(prefix="ddp-sim-operator-")) / "operator.log"
        self.process = OperatorProcess(kubeconfig, SIM_NS_PREFIX + "*", self.log_path, ready_timeout=90)
        self.cpu_before = 0.0  # CPU seconds of the processes that ended
        self.hwm_before = 0.0
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        proc = self.process.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> "SimOperator":
        self.started_at = time.time()
        self.process.start()
        return self

    def stat(self) -> tuple[float, float, float]:
        """(CPU seconds, RSS MiB, peak RSS MiB) of the running process; zeros when none runs."""
        pid = self.pid
        if pid is None:
            return 0.0, 0.0, 0.0
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":" in line)
            return cpu, int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024
        except (OSError, KeyError, ValueError, IndexError):
            return 0.0, 0.0, 0.0

    def cpu_seconds(self) -> float:
        return round(self.cpu_before + self.stat()[0], 2)

    def rss_mib(self) -> float:
        return round(self.stat()[1], 1)

    def peak_rss_mib(self) -> float:
        """The highest resident memory of any of its processes so far (VmHWM)."""
        return round(max(self.hwm_before, self.stat()[2]), 1)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing of it runs on."""
        cpu, _, hwm = self.stat()
        self.cpu_before += cpu
        self.hwm_before = max(self.hwm_before, hwm)
        proc = self.process.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        self.process.proc = None

    def stop(self) -> None:
        cpu, _, hwm = self.stat()
        self.cpu_before += cpu
        self.hwm_before = max(self.hwm_before, hwm)
        self.process.stop()

    def metrics(self) -> str:
        return self.process.metrics_text() or ""

    def log_tail(self, lines: int = 60) -> str:
        return self.process.log_tail(lines)


def operator_writes(events: list[dict], namespace: str, since: float = 0.0, until: float = float("inf")) -> Counter:
    """The operator's writes in `namespace` by kind (api_writes.classify: creates, status_writes, ...): the
    kubeconfig user's, minus kubectl's (this program) and kwok's (pod status), never a control plane component's."""
    from tests.benchmarks.api_writes import ts
    kinds: Counter = Counter()
    for ev in events:
        ref = ev.get("objectRef") or {}
        agent = ev.get("userAgent", "")
        if ev.get("verb") not in WRITE_VERBS or ref.get("namespace") != namespace or \
                ev.get("stage") != "ResponseComplete" or agent.startswith(("kubectl", "kwok")) or \
                ev.get("user", {}).get("username", "").startswith("system:"):
            continue
        if not since <= ts(ev["requestReceivedTimestamp"]) <= until:
            continue
        kinds[classify(ev)] += 1
    return kinds


class SilentServers:
    """Listening sockets on given loopback addresses (the progress and diagnostics ports) that accept every
    connection and never answer: a probe of them runs into its deadline. Counts the connections accepted."""

    def __init__(self, ips: list[str], ports: tuple[int, ...]):
        self.socks: list[socket.socket] = []
        self.accepted = 0
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        for ip in ips:
            for port in ports:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((ip, port))
                s.listen(128)
                s.settimeout(0.2)
                self.socks.append(s)
        self.threads = [threading.Thread(target=self._serve, args=(s,), daemon=True) for s in self.socks]

    def __enter__(self) -> "SilentServers":
        for t in self.threads:
            t.start()
        return self

    def _serve(self, s: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = s.accept()
            except (socket.timeout, OSError):
                continue
            self.accepted += 1
            self.held.append(conn)  # never read, never answered; closed at the end
            if len(self.held) > 4096:
                self.held.pop(0).close()

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(2)
        for s in self.socks + self.held:
            try:
                s.close()
            except OSError:
                pass


def kwok_raced(events: list[dict]) -> set[str]:
    """Pods ("namespace/name") kwok deleted when nobody had asked to delete them, in the audit `events`.

    kwok deletes a pod only once it is being deleted, and by name, without the UID precondition a kubelet sends: when
    the operator force-deleted a pod of a lost node and created its replacement before kwok's delete of the old one
    went out, that delete took the replacement (seconds after its create), and the operator rightly made the pod
    again. A kwok delete whose pod's last create came after its last delete by anyone else is that: a simulation
    artifact, told apart from a pod the operator made twice (scale_sim's duplicates) and reported on its own."""
    last: dict[str, str] = {}  # "namespace/name" -> the last create or delete of it by anyone but kwok
    out = set()
    for ev in sorted(events, key=lambda e: e.get("stageTimestamp") or ""):
        ref = ev.get("objectRef") or {}
        if ref.get("resource") != "pods" or ref.get("subresource") \
                or ev.get("verb") not in ("create", "delete", "deletecollection") \
                or (ev.get("responseStatus") or {}).get("code") not in (200, 201):
            continue
        key = f"{ref.get('namespace')}/{ref.get('name')}"
        if ev["verb"] == "deletecollection":  # e.g. the namespace controller's: every pod of the namespace
            last.update({k: "delete" for k in last if k.startswith(f"{ref.get('namespace')}/")})
        elif not (ev.get("userAgent") or "").startswith("kwok/"):
            last[key] = ev["verb"]
        elif ev["verb"] == "delete" and last.get(key) == "create":
            out.add(key)
    return out
