"""What the end-to-end tests and the cluster benchmarks share: the cluster, the images, the operator,
DDPJobs of the digits example, and reading what the trainer did (progress endpoint, log lines).

Plain functions and small classes, no pytest: tests/e2e/conftest.py wraps them in fixtures and the
benchmarks (tests/benchmarks/{e2e_recovery,startup,api_writes,scale}.py) call them directly.

Provider-agnostic: everything goes through kubectl and the API server (rank 0's progress is read through
the API server's pod proxy), so the same code runs on the embedded cluster and on kind.

The operator (`DDPJOB_OPERATOR`):
- `helm` (default): the chart installed as release `ddp-operator` in `ddp-system` (the release name
  and namespace `make demo` and `make kind-e2e` use), watching every namespace, running the image
  localhost/ddp-operator:0.1.0. Uninstalled afterwards unless it was there before.
- `installed`: an operator already runs in the cluster (hack/kind-e2e.sh installs the chart itself).
- `subprocess`: `python -m ddp_operator` on this machine against the kubeconfig, watching only
  namespaces named `ddp-e2e-*` (every namespace these tests and benchmarks create), so it can run
  beside the integration and chart tests, which have operators of their own.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from calendar import timegm
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import yaml

REPO = Path(__file__).resolve().parents[2]
for _path in (REPO, REPO / "trainer"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
from ddp_trainer.testing import StepsLostError, held_steps, steps_lost  # noqa: E402  the one definition of steps lost
from ddp_trainer.testing import forked_workers, parent_pid  # noqa: E402
from hack import cluster as embedded  # noqa: E402,F401  hack/cluster.py (h.embedded: the benchmarks use it)
from tests import tools  # noqa: E402
from tests.support.kube import (  # noqa: E402  the suite's cluster helpers, shared with the benchmarks
    Cluster,
    Kubectl,
    create_test_namespace,
    dump_namespace,
    ensure_image,
    wait_crd_established,
)
from tests.support.kube import connect as _connect  # noqa: E402
from tests.support.processes import OperatorProcess  # noqa: E402
from tests.support.suite import OWN_OPERATOR_NS_PREFIXES  # noqa: E402
from tests.support.waiting import WaitTimeout, wait_for  # noqa: E402

TAG = "0.1.0"
OPERATOR_IMAGE = f"localhost/ddp-operator:{TAG}"
TRAINER_IMAGE = f"localhost/ddp-trainer:{TAG}"
STORE_IMAGE = f"localhost/ddp-store:{TAG}"  # the rendezvous-store pods' (store/Dockerfile)
RELEASE = "ddp-operator"
OPERATOR_NS = "ddp-system"
CHART = REPO / "helm" / "ddp-operator"
CRD_FILE = REPO / "manifests" / "base" / "crd.yaml"
DIGITS_SAMPLE = REPO / "manifests" / "samples" / "digits.yaml"
NS_PREFIX = "ddp-e2e-"
LABEL_JOB, LABEL_ROLE = "ddp.dev/job-name", "ddp.dev/role"
PROGRESS_PORT = 29401
METRICS_PORT = 8080
# A host directory every node of the cluster under test sees at this same path: the embedded cluster's node is the
# host, and kind's workers mount it (hack/kind-config.yaml). For state that must outlive pods that may come back
# on another node (a checkpoint on "shared storage").
SHARED_HOST_DIR = "/var/tmp/ddpjob-shared"


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# cluster and images

def connect() -> Cluster:
    """The cluster under test, as tests/conftest.py's `cluster` fixture chooses it: the one
    DDPJOB_TEST_KUBECONFIG names (kind), else the embedded cluster (started if it is down); never an
    arbitrary $KUBECONFIG."""
    return _connect()


def operator_mode() -> str:
    mode = os.environ.get("DDPJOB_OPERATOR", "helm")
    if mode not in ("helm", "installed", "subprocess"):
        raise ValueError(f"DDPJOB_OPERATOR must be helm, installed or subprocess, not {mode!r}")
    return mode


def ensure_images(cluster: Cluster) -> None:
    """The operator, trainer and store images on the cluster's node(s), rebuilt only when their inputs changed."""
    if cluster.embedded:
        # The build script skips an image whose inputs are unchanged without starting the builder.
        subprocess.run([str(REPO / "hack" / "build-images.sh")], check=True, cwd=REPO)
    elif cluster.kind_name and operator_mode() != "installed":
        for name in ("operator", "trainer", "store"):
            ensure_image(cluster, f"localhost/ddp-{name}:{TAG}", REPO / name / "Dockerfile", REPO)
    # Anything else (hack/kind-e2e.sh, a real cluster): the images are already where the nodes pull from.


def image_id(cluster: Cluster, ref: str) -> str | None:
    """containerd's digest of `ref` on the embedded cluster (None elsewhere)."""
    if not cluster.embedded:
        return None
    p = subprocess.run([sys.executable, str(REPO / "hack" / "image.py"), "ls"], capture_output=True, text=True)
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == ref:
            return parts[1]
    return None


# --------------------------------------------------------------------------------------------
# the operator

class Operator:
    """The operator the tests run against, started and stopped according to DDPJOB_OPERATOR."""

    def __init__(self, cluster: Cluster, kubectl: Kubectl, mode: str | None = None, *, kueue: bool = False):
        self.cluster, self.k = cluster, kubectl
        self.mode = mode or operator_mode()
        self.kueue = kueue  # the operator's Kueue integration (chart value kueue.enabled)
        self.installed_here = False
        self.process: OperatorProcess | None = None  # DDPJOB_OPERATOR=subprocess: the last one started

    @property
    def proc(self) -> subprocess.Popen | None:
        """The operator's process in subprocess mode (None before it started and once stopped)."""
        return self.process.proc if self.process is not None else None

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> "Operator":
        if self.mode == "installed":
            self._wait_deployment()
            if self.kueue and not self._kueue_enabled():
                raise AssertionError("these tests need the operator's Kueue integration: install the chart with "
                                     "--set kueue.enabled=true, or run them with DDPJOB_OPERATOR=helm")
            return self
        if self.mode == "helm":
            self._helm_install()  # the chart carries the CRD and upgrades it (crds.enabled)
        else:
            # The CRD as the repository has it now.
            self.k("apply", "--server-side", "--force-conflicts", "--field-manager=ddp-e2e", "-f", str(CRD_FILE))
            self._start_subprocess()
        wait_crd_established(self.k, "ddpjobs.ddp.dev")
        return self

    def set_kueue(self, enabled: bool) -> "Operator":
        """Turn the operator's Kueue integration on or off in place (helm: an upgrade of the same release, which
        rolls its pod; subprocess: a restart; installed: only checked, the cluster's owner set it)."""
        if self.mode == "installed":
            self.kueue = enabled
            return self.start()
        if enabled != self.kueue:
            self.kueue = enabled
            if self.process is not None:
                self.process.stop()
            self.start()
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        if self.installed_here:
            log(f"helm uninstall {RELEASE} -n {OPERATOR_NS}")
            self.helm("uninstall", RELEASE, "-n", OPERATOR_NS, "--wait", "--timeout", "120s", check=False)
            self.k("delete", "namespace", OPERATOR_NS, "--ignore-not-found", check=False, timeout=180)
            self.installed_here = False

    def helm(self, *args: str, check: bool = True, timeout: float = 400) -> subprocess.CompletedProcess:
        p = subprocess.run([tools.tool("helm"), f"--kubeconfig={self.cluster.kubeconfig}", *args],
                           capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def _helm_install(self) -> None:
        existed = self.helm("status", RELEASE, "-n", OPERATOR_NS, check=False).returncode == 0
        if not existed:  # a previous uninstall may still be removing the namespace
            wait_for(lambda: self.k("get", "namespace", OPERATOR_NS, check=False).returncode != 0
                     or self.k.json("get", "namespace", OPERATOR_NS)["status"].get("phase") != "Terminating",
                     180, f"namespace {OPERATOR_NS} to finish terminating")
        # Not the namespaces of the tests with operators of their own: those run beside this one (make test).
        values: dict[str, Any] = {"kueue": {"enabled": self.kueue},
                                  "watch": {"exclude": [p + "*" for p in OWN_OPERATOR_NS_PREFIXES]}}
        digest = image_id(self.cluster, OPERATOR_IMAGE)
        if digest:
            # The tag stays 0.1.0 across local rebuilds; the digest as an annotation rolls the Pod
            # whenever the image changed, so the tests never run a stale operator.
            values["podAnnotations"] = {"e2e.ddp.dev/image-id": digest}
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(values, f)
        try:
            log(f"helm upgrade --install {RELEASE} {CHART.relative_to(REPO)} -n {OPERATOR_NS} (watching every namespace)")
            # --take-ownership: the CRD may be there without a release's marks (a kubectl apply of it, or a chart
            # from before the CRD moved from crds/ into templates/); this release then carries it.
            args = ("upgrade", "--install", RELEASE, str(CHART), "-n", OPERATOR_NS, "--create-namespace",
                    "-f", f.name, "--take-ownership", "--wait", "--timeout", "240s")

            def upgraded():
                p = self.helm(*args, check=False)
                if p.returncode == 0:
                    return True
                if "another operation" in p.stderr:  # e.g. `make demo` upgrading the same release
                    return False
                raise AssertionError(f"helm {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}")
            wait_for(upgraded, 300, f"helm upgrade of {RELEASE}", interval=5, fatal=AssertionError)
        finally:
            os.unlink(f.name)
        self.installed_here = self.installed_here or not existed  # an upgrade of our own release keeps it ours
        self._wait_deployment()

    def _wait_deployment(self) -> None:
        def ready():
            deps = self.k.json("get", "deployments", "-A", "-l", "app.kubernetes.io/name=ddp-operator")["items"]
            return [d for d in deps if (d.get("status", {}).get("availableReplicas") or 0) >= 1
                    and d["status"].get("updatedReplicas") == d["status"].get("replicas")]
        found = wait_for(ready, 240, "an available ddp-operator Deployment")
        self.deployment = found[0]
        log(f"operator: deployment {found[0]['metadata']['namespace']}/{found[0]['metadata']['name']}")

    def _kueue_enabled(self) -> bool:
        env = self.deployment["spec"]["template"]["spec"]["containers"][0].get("env") or []
        return {"name": "DDP_OPERATOR_KUEUE", "value": "true"} in env

    def _start_subprocess(self) -> None:
        log_path = Path(tempfile.mkdtemp(prefix="ddp-e2e-operator-")) / "operator.log"
        log(f"python -m ddp_operator --namespace '{NS_PREFIX}*' (log: {log_path})")
        self.process = OperatorProcess(self.cluster.kubeconfig, NS_PREFIX + "*", log_path, ready_timeout=60,
                                       env={"DDP_OPERATOR_KUEUE": str(self.kueue).lower()})
        self.process.start()

    # -- observation --------------------------------------------------------------------------
    def pods(self) -> list[dict]:
        if self.mode == "subprocess":
            return []
        ns = self.deployment["metadata"]["namespace"]
        sel = ",".join(f"{k}={v}" for k, v in self.deployment["spec"]["selector"]["matchLabels"].items())
        return [p for p in self.k.json("get", "pods", "-n", ns, "-l", sel)["items"]
                if p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]

    def metrics_text(self) -> str | None:
        """The operator's Prometheus metrics (through the API server's pod proxy for an in-cluster one)."""
        try:
            if self.mode == "subprocess":
                return self.process.metrics_text() if self.process is not None else None
            pod = self.pods()[0]
            ns = pod["metadata"]["namespace"]
            port = next((p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])
                         if p.get("name") == "metrics"), METRICS_PORT)
            p = self.k("get", "--raw", f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}:{port}/proxy/metrics",
                       "--request-timeout=5s", check=False, timeout=15)
            return p.stdout if p.returncode == 0 else None
        except Exception:  # noqa: BLE001 - not up yet
            return None

    def rss_mib(self) -> float | None:
        """Resident memory of the operator process (prometheus_client's process collector)."""
        text = self.metrics_text() or ""
        m = re.search(r"^process_resident_memory_bytes ([0-9.e+]+)$", text, re.M)
        if m:
            return float(m.group(1)) / 2**20
        if self.proc is not None:  # no process collector: read /proc
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return None

    def username(self) -> str:
        """The API user the operator acts as (what the audit log records)."""
        if self.mode == "subprocess":
            return "kubernetes-admin"  # unused for filtering: see api_writes.py
        spec = self.deployment["spec"]["template"]["spec"]
        sa = spec.get("serviceAccountName") or "default"
        return f"system:serviceaccount:{self.deployment['metadata']['namespace']}:{sa}"

    def log_lines(self) -> list[tuple[float, str]]:
        """The operator's log as (time, line): its own stamps for a subprocess, the runtime's in the cluster."""
        if self.mode == "subprocess":
            out = []
            for line in self.logs(tail=100_000).splitlines():
                m = re.match(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]", line)
                if m:  # kopf's asctime: local time
                    out.append((time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000,
                                line))
            return out
        d = self.deployment["metadata"]
        p = self.k("logs", "-n", d["namespace"], f"deployment/{d['name']}", "--timestamps", "--tail=5000",
                   check=False, timeout=60)
        return stamped_lines(p.stdout)

    def logs(self, tail: int = 200) -> str:
        if self.mode == "subprocess":
            return self.process.log_tail(tail) if self.process is not None else ""
        d = self.deployment["metadata"]
        p = self.k("logs", "-n", d["namespace"], f"deployment/{d['name']}", f"--tail={tail}", check=False)
        return p.stdout + p.stderr


# --------------------------------------------------------------------------------------------
# namespaces

def start_operator() -> tuple[Cluster, Kubectl, Operator]:
    """Every benchmark's prelude: connect, make sure both images exist, start (or adopt) the operator."""
    cluster = connect()
    k = Kubectl(cluster.kubeconfig)
    ensure_images(cluster)
    return cluster, k, Operator(cluster, k).start()


@contextlib.contextmanager
def bench_namespace(label: str) -> Iterator[tuple[Kubectl, Operator, str]]:
    """A cluster benchmark's prelude and epilogue: the operator started (start_operator) and a fresh namespace,
    yielded as (kubectl, operator, namespace); the namespace's diagnostics printed when the benchmark raises, then
    the namespace deleted and the operator stopped, however it ended."""
    _, k, op = start_operator()
    ns = None
    try:
        ns = new_namespace(k, label)
        yield k, op, ns
    except BaseException:
        if ns is not None:
            print(diagnostics(k, ns, op), file=sys.stderr)
        raise
    finally:
        if ns is not None:
            delete_namespace(k, ns)
        op.stop()


def new_namespace(k: Kubectl, label: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")[:36].strip("-")
    return create_test_namespace(k, f"{NS_PREFIX}{base}-{secrets.token_hex(3)}")


def delete_namespace(k: Kubectl, name: str, wait: bool = False) -> None:
    k("delete", "namespace", name, f"--wait={str(wait).lower()}", "--ignore-not-found", check=False, timeout=300)


# --------------------------------------------------------------------------------------------
# DDPJobs of the digits example

def digits_job(name: str, *, nodes: int = 2, min_nodes: int | None = None, max_nodes: int | None = None,
               step_delay: float = 0.0, epochs: int | None = None, progress_period: int = 2,
               env: dict[str, str] | None = None, cpu_request: str = "100m", spec: dict | None = None) -> dict:
    """manifests/samples/digits.yaml, renamed and tuned: `step_delay` seconds of sleep per step (time to
    kill a pod mid-run), tiny CPU requests (the control plane shares two cores with training)."""
    job = copy.deepcopy(next(d for d in yaml.safe_load_all(DIGITS_SAMPLE.read_text()) if d and d["kind"] == "DDPJob"))
    job["metadata"] = {"name": name}
    s = job["spec"]
    s["nodes"] = nodes
    if min_nodes is not None:
        s["minNodes"] = min_nodes
    if max_nodes is not None:
        s["maxNodes"] = max_nodes
    s["progressPeriodSeconds"] = progress_period
    trainer = next(c for c in s["template"]["spec"]["containers"] if c["name"] == "trainer")
    trainer["resources"]["requests"]["cpu"] = cpu_request
    variables = {"DIGITS_STEP_DELAY": str(step_delay)}
    if epochs is not None:
        variables["DIGITS_EPOCHS"] = str(epochs)
    variables.update(env or {})
    trainer["env"] = [e for e in trainer.get("env", []) if e["name"] not in variables] + \
        [{"name": k, "value": v} for k, v in variables.items()]
    for key, value in (spec or {}).items():
        s[key] = value
    return job


CHECKPOINT_MOUNT = "/checkpoints"


def with_disk_checkpoint(job: dict, host_dir: str, every: int = 5) -> dict:
    """The job with a disk checkpoint every `every` steps on `host_dir`, a directory of the node (under
    SHARED_HOST_DIR: every node of the cluster sees it, so the job may come back on another), made writable for the
    trainer's uid by an init container."""
    job = copy.deepcopy(job)
    s = job["spec"]
    s["checkpoint"] = {"volume": {"hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}},
                       "mountPath": CHECKPOINT_MOUNT}
    trainer = next(c for c in s["template"]["spec"]["containers"] if c["name"] == "trainer")
    trainer["env"] = [e for e in trainer.get("env", []) if e["name"] != "DDPJOB_CHECKPOINT_EVERY"] + \
        [{"name": "DDPJOB_CHECKPOINT_EVERY", "value": str(every)}]
    s["template"]["spec"]["initContainers"] = [{
        "name": "checkpoint-owner", "image": TRAINER_IMAGE, "imagePullPolicy": "IfNotPresent",
        "command": ["chown", "1000:1000", CHECKPOINT_MOUNT],
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}},
        "volumeMounts": [{"name": "checkpoint", "mountPath": CHECKPOINT_MOUNT}]}]
    return job


def apply(k: Kubectl, namespace: str, obj: dict | list[dict]) -> None:
    objs = obj if isinstance(obj, list) else [obj]
    k("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(objs), timeout=300)


def job(k: Kubectl, namespace: str, name: str) -> dict:
    return k.json("get", "ddpj", name, "-n", namespace)


def status(k: Kubectl, namespace: str, name: str) -> dict:
    return job(k, namespace, name).get("status") or {}


def job_kube_events(k: Kubectl, namespace: str, name: str) -> list[dict]:
    """The Kubernetes Events of DDPJob `name`, in the API server's order."""
    return k.json("get", "events", "-n", namespace, "--field-selector",
                  f"involvedObject.kind=DDPJob,involvedObject.name={name}")["items"]


def wait_job_event(k: Kubectl, namespace: str, name: str, match: Callable[[dict], bool], what: str,
                   timeout: float = 30) -> dict:
    """The first Event of DDPJob `name` that `match`es, waiting for it: the operator posts a pass's Events after the
    status write that a test saw, so on a busy machine they come a moment later. Fails listing the Events there."""
    try:
        return wait_for(lambda: next((e for e in job_kube_events(k, namespace, name) if match(e)), None), timeout,
                        f"{namespace}/{name}: the Event {what}")
    except WaitTimeout:
        seen = [(e.get("type"), e.get("reason"), e.get("message")) for e in job_kube_events(k, namespace, name)]
        raise AssertionError(f"no Event {what} within {timeout:.0f} s: {seen}") from None


def wait_phase(k: Kubectl, namespace: str, name: str, phase: str, timeout: float,
               fail_on: tuple[str, ...] = ("Failed",)) -> dict:
    """Wait for status.phase == phase; fails at once when the job ends in a phase of `fail_on`."""
    def check():
        st = status(k, namespace, name)
        if st.get("phase") == phase:
            return st
        if st.get("phase") in fail_on:
            raise PhaseError(f"{namespace}/{name} is {st.get('phase')}: reason={st.get('reason')} "
                             f"message={st.get('message')}")
        return None
    return wait_for_or_raise(check, timeout, f"{namespace}/{name} phase {phase}", PhaseError)


class PhaseError(AssertionError):
    """The job reached a terminal phase other than the one waited for."""


def wait_for_or_raise(check: Callable[[], Any], timeout: float, what: str,
                      fatal: type[BaseException] | tuple[type[BaseException], ...],
                      interval: float = 0.5) -> Any:
    """wait_for, except that exceptions of type `fatal` end the wait at once."""
    return wait_for(check, timeout, what, interval, fatal=fatal)


def trainer_pods(k: Kubectl, namespace: str, name: str) -> list[dict]:
    pods = k.json("get", "pods", "-n", namespace, "-l", f"{LABEL_JOB}={name},{LABEL_ROLE}=trainer")["items"]
    return sorted(pods, key=lambda p: p["metadata"]["name"])


def running(pod: dict) -> bool:
    return pod.get("status", {}).get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")


def progress(k: Kubectl, namespace: str, pod: str) -> dict | None:
    """GET /progress of one pod through the API server's pod proxy (every pod's local rank 0 serves its own
    report, naming its global `rank`); None unless it answers."""
    p = k("get", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}:{PROGRESS_PORT}/proxy/progress",
          "--request-timeout=3s", check=False, timeout=10)
    if p.returncode != 0 and os.environ.get("DDPJOB_TEST_KUBECONFIG"):
        # On a multi-node cluster whose CNI enforces NetworkPolicy (kind) the API server's node is outside the job's
        # policy, which admits only the operator to this port: ask from inside the pod instead. The enforcer may
        # refuse the connection or drop it (the proxy then times out), so any failure falls back.
        p = k("exec", "-n", namespace, pod, "-c", "trainer", "--", "python", "-c",
              "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen("
              f"'http://127.0.0.1:{PROGRESS_PORT}/progress', timeout=3).read().decode())",
              check=False, timeout=15)
    if p.returncode != 0:
        return None
    try:
        return json.loads(p.stdout)
    except ValueError:
        return None


def rank0(k: Kubectl, namespace: str, name: str, min_step: int = 1) -> tuple[str, dict] | None:
    """(pod, progress) of the pod whose trainer serves global rank 0's progress, once it reached `min_step`
    (a report without `rank`, from an image where rank 0 alone serves, is rank 0's)."""
    for pod in trainer_pods(k, namespace, name):
        if running(pod):
            prog = progress(k, namespace, pod["metadata"]["name"])
            if prog is not None and prog.get("rank", 0) == 0 and (prog.get("step") or 0) >= min_step:
                return pod["metadata"]["name"], prog
    return None


def wait_rank0_step(k: Kubectl, namespace: str, name: str, step: int, timeout: float) -> tuple[str, dict]:
    """Wait until rank 0 reports at least `step` steps; fails at once if the job ended."""
    def check():
        found = rank0(k, namespace, name, step)
        if found:
            return found
        st = status(k, namespace, name)
        if st.get("phase") in ("Failed", "Succeeded"):
            raise PhaseError(f"{namespace}/{name} ended {st.get('phase')} before step {step}: {st.get('message')}")
        return None
    return wait_for_or_raise(check, timeout, f"{namespace}/{name} rank 0 at step {step}", PhaseError)


def kill_pod(k: Kubectl, namespace: str, pod: str) -> float:
    """Delete a training pod as a crash would: no grace period. Returns the wall-clock time of the kill."""
    t = time.time()
    k("delete", "pod", pod, "-n", namespace, "--grace-period=0", "--force", "--wait=false")
    return t


def evict_pods(k: Kubectl, namespace: str, pods: list[str]) -> float:
    """Evict every pod of `pods` at once through the eviction API (a policy/v1 Eviction POSTed to pods/<name>/eviction,
    what `kubectl drain` does per pod; kubectl has no verb for it): the API server marks each DisruptionTarget and
    deletes it with its own grace period (SIGTERM first). The node is not cordoned. Returns the wall-clock time."""
    def evict(pod: str) -> None:
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}
        k("create", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", "-f", "-", input=json.dumps(body),
          timeout=30)
    t = time.time()
    with ThreadPoolExecutor(max(1, len(pods))) as pool:
        list(pool.map(evict, pods))
    return t


class LogFollower:
    """`kubectl logs -f` of one pod's trainer container, from its first line to the container's end: the lines of a
    pod that is about to go (its log goes with the pod object)."""

    def __init__(self, k: Kubectl, namespace: str, pod: str):
        self.pod = pod
        self.proc = subprocess.Popen([k.binary, f"--kubeconfig={k.kubeconfig}", "logs", "-f", "-n", namespace, pod,
                                      "-c", "trainer"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def text(self, timeout: float = 60) -> str:
        """Everything it printed, once the container ended (stopped after `timeout` seconds)."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


def follow_logs(k: Kubectl, namespace: str, pods: list[str]) -> list[LogFollower]:
    """A LogFollower per pod, given half a second to attach before the caller stops the pods (a pod deleted before
    its stream opened would leave none)."""
    followers = [LogFollower(k, namespace, pod) for pod in pods]
    time.sleep(0.5)
    return followers


_STAMPED = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z (.*)$")


def stamped_lines(text: str) -> list[tuple[float, str]]:
    """`kubectl logs --timestamps` output as (time, line): the container runtime's own nanosecond stamps, on the
    node's clock (the host's, for the embedded cluster and kind), whatever the process printed."""
    out = []
    for raw in text.splitlines():
        m = _STAMPED.match(raw)
        if m:
            out.append((timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) + float(m.group(2) or 0), m.group(3)))
    return out


def parse_rfc3339(text: str | None) -> float | None:
    """An API timestamp ("2026-01-01T12:00:00Z", or with microseconds as events' eventTime) as epoch seconds."""
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z$", text or "")
    return timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) + float(m.group(2) or 0) if m else None


def pod_log_lines(k: Kubectl, namespace: str, pod: str, container: str = "trainer") -> list[tuple[float, str]]:
    """Every line of a container's current log with its runtime timestamp ([] when there is none)."""
    p = k("logs", "-n", namespace, pod, "-c", container, "--timestamps", check=False, timeout=30)
    return stamped_lines(p.stdout) if p.returncode == 0 else []


# What `kubectl logs` says when there is no log to read (not a failure to read one): no previous container, no pod.
LOG_READS = 3  # tries of one `kubectl logs` (pod_logs)
_NO_LOG = ("previous terminated container", "not found", "waiting to start", "ContainerCreating", "PodInitializing")


def pod_logs(k: Kubectl, namespace: str, pod: str, tail: int | None = None, previous: bool = False) -> str:
    """The trainer container's log; `previous`: of the container before its last in-place restart ("" if none).

    A read that failed for another reason (the kubelet slow to answer on a busy machine) is tried again rather than
    taken for "no log". A dead container the kubelet already removed is "no log": see recovery_after's `before`."""
    args = ["logs", "-n", namespace, pod, "-c", "trainer"] + ([f"--tail={tail}"] if tail else []) + \
        (["--previous"] if previous else [])
    for _ in range(LOG_READS):
        p = k(*args, check=False, timeout=30)
        if p.returncode == 0:
            return p.stdout
        if any(s in p.stderr for s in _NO_LOG):
            return ""
        time.sleep(1.0)
    return ""


# --------------------------------------------------------------------------------------------
# host processes of a pod (the embedded cluster's containers are host processes)

def _environ(pid: str) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(e.decode(errors="replace").split("=", 1) for e in raw.split(b"\0") if b"=" in e)


def _ppid(pid: str) -> str | None:
    parent = parent_pid(pid)
    return None if parent is None else str(parent)


def pod_processes(namespace: str, job: str, index: int) -> dict[str, list[int]]:
    """{"agents": [...], "workers": [...]}: the torchrun agent(s) of pod `index` (no LOCAL_RANK, parent not
    one of the pod's processes) and its workers: started by torchrun (LOCAL_RANK in the environment they were
    started with, parent without it: not DataLoader workers) or forked by ddp_trainer.launch's forkserver (their
    environment is set after the fork, so /proc shows the forkserver's: ddp_trainer.testing.forked_workers)."""
    mine: dict[str, dict[str, str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        env = _environ(d)
        if env and env.get("DDPJOB_NAME") == job and env.get("DDPJOB_NAMESPACE") == namespace \
                and env.get("DDPJOB_POD_INDEX") == str(index):
            mine[d] = env
    agents = [int(p) for p, env in mine.items() if "LOCAL_RANK" not in env and _ppid(p) not in mine]
    workers = {int(p) for p, env in mine.items()
               if "LOCAL_RANK" in env and "LOCAL_RANK" not in mine.get(_ppid(p) or "", {})}
    return {"agents": sorted(agents), "workers": sorted(workers | set(forked_workers(mine)))}


# --------------------------------------------------------------------------------------------
# the trainer's log lines: `<ISO time>Z ddp_trainer rank=0 event=step step=12 ...`

_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d{3})Z ddp_trainer (.*)$")
_KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


@dataclass(frozen=True)
class Event:
    time: float
    pod: str
    event: str
    fields: dict[str, str]

    def int(self, key: str, default: int = -1) -> int:
        try:
            return int(self.fields[key])
        except (KeyError, ValueError):
            return default


def events(text: str, pod: str = "") -> list[Event]:
    out = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        t = timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) + int(m.group(2)) / 1000
        fields = {k: v.strip('"') for k, v in _KV.findall(m.group(3))}
        out.append(Event(t, pod, fields.get("event", ""), fields))
    return out


def job_events(k: Kubectl, namespace: str, name: str, previous: bool = False) -> list[Event]:
    """Trainer log events of every current training pod, in time order; `previous`: those of each pod's trainer
    container before its last in-place restart too (restartPolicy OnFailure keeps the pod, not the log)."""
    found: list[Event] = []
    for pod in trainer_pods(k, namespace, name):
        pname = pod["metadata"]["name"]
        found += events(pod_logs(k, namespace, pname), pname)
        if previous:
            found += events(pod_logs(k, namespace, pname, previous=True), pname)
    return sorted(found, key=lambda e: e.time)


@dataclass(frozen=True)
class Recovery:
    seconds: float  # kill -> first training step of the re-formed group
    resumed_from: int  # the step the group resumed from (0: started over)
    source: str  # "peer", "local", "disk" or "fresh"
    # ddp_trainer.testing.steps_lost: the highest step any surviving pod logged before the restore minus
    # resumed_from (None: no step line in the window, e.g. an image whose non-rank-0 pods log no steps)
    steps_lost: int | None
    restored_at: float  # log time of the restore (pass as `since` for the next kill of the same job)


def recovery_after(k: Kubectl, namespace: str, name: str, killed_at: float, step_at_kill: int | None = None,
                   timeout: float = 180, *, since: float = float("-inf"), previous: bool = False,
                   before: Sequence[Event] = ()) -> Recovery:
    """Wait for the first step after a resume (or fresh start) logged after `killed_at`.

    Steps lost come from the trainer's own log lines in the job's current pods (the killed pod's are gone
    with it; the survivors' remain), never from `step_at_kill`, a progress reading taken before the kill
    (kept in the signature for callers that pass it). `since`: the previous restore of the same job.
    `previous`: read the logs of trainer containers restarted in place too (job_events). `before`: the job's
    events read just before the kill, for a kill that restarts the trainers in place: the kubelet may have
    removed a dead container already (`kubectl logs --previous`: not found), and its steps with it.
    """
    def check():
        evs = sorted([*job_events(k, namespace, name, previous), *before], key=lambda e: e.time)
        after = [e for e in evs if e.time >= killed_at]
        restart = next((e for e in after if e.event in ("resume", "start")), None)
        if restart is None:
            st = status(k, namespace, name)
            if st.get("phase") in ("Failed", "Succeeded"):
                raise PhaseError(f"{namespace}/{name} ended {st.get('phase')} without resuming")
            return None
        resumed = restart.int("step", 0) if restart.event == "resume" else 0
        step = next((e for e in after if e.event == "step" and e.time >= restart.time and e.int("step") > resumed),
                    None)
        if step is None:
            return None
        lost = steps_lost(((e.time, e.int("step")) for e in evs if e.event == "step"), resumed, restart.time,
                          since=since, held=held_steps(evs, killed_at, step.time))
        source = restart.fields.get("source", "fresh")
        return Recovery(round(step.time - killed_at, 2), resumed, source, lost, restart.time)
    # a negative steps lost is a bug to report at once, not a "not yet"
    return wait_for_or_raise(check, timeout, f"{namespace}/{name} to resume training", (PhaseError, StepsLostError),
                             interval=1.0)


def first_step_after(k: Kubectl, namespace: str, name: str, after: float, timeout: float) -> float:
    """Wall-clock time of the job's first training step logged at or after `after` (the trainers' own
    `event=step` lines); fails at once if the job failed."""
    def check():
        st = status(k, namespace, name)
        if st.get("phase") == "Failed":
            raise PhaseError(f"{namespace}/{name} failed: {st.get('message')}")
        steps = [e.time for e in job_events(k, namespace, name) if e.event == "step" and e.time >= after]
        return min(steps) if steps else None
    return wait_for_or_raise(check, timeout, f"{namespace}/{name}'s first step", PhaseError, interval=0.5)


def final_accuracy(k: Kubectl, namespace: str, name: str) -> float | None:
    """testAccuracy from status.progress (the termination-log JSON), else from rank 0's log line."""
    st = status(k, namespace, name)
    acc = ((st.get("progress") or {}).get("metrics") or {}).get("testAccuracy")
    if acc is not None:
        return float(acc)
    for e in job_events(k, namespace, name):
        if e.event == "final" and "test_accuracy" in e.fields:
            return float(e.fields["test_accuracy"])
    return None


def p50(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    mid = len(v) // 2
    return round(v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2, 2)


def diagnostics(k: Kubectl, namespace: str, operator: Operator | None = None) -> str:
    text = dump_namespace(k, namespace)
    if operator is not None:
        text += "\n----- operator log -----\n" + operator.logs(150)
    return text


# --- Kueue (tests/e2e/test_e2e_kueue.py, tests/benchmarks/kueue_queue.py) --------------------------------------
KUEUE_API = "kueue.x-k8s.io/v1beta2"
KUEUE_QUEUE = "team-a"
# A 2-node digits job asks for 2 x 100m + the store's 10m CPU and 2 x 512Mi + 64Mi memory: this quota fits one.
KUEUE_ONE_JOB_QUOTA = {"cpu": "300m", "memory": "1600Mi"}


def kueue_module():
    """hack/kueue.py (installs the pinned Kueue into the cluster)."""
    from hack import kueue
    return kueue


def kueue_queue(k: Kubectl, namespace: str, flavor: str, quota: dict[str, str] = KUEUE_ONE_JOB_QUOTA) -> str:
    """A ClusterQueue named after `namespace` (only its LocalQueues may use it; preempting lower priorities) with
    `quota` on `flavor`, and the LocalQueue KUEUE_QUEUE in `namespace`; waits until it is active. Returns the
    ClusterQueue's name (cluster-scoped: the caller deletes it)."""
    apply(k, namespace, [
        {"apiVersion": KUEUE_API, "kind": "ClusterQueue", "metadata": {"name": namespace},
         "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                  "preemption": {"withinClusterQueue": "LowerPriority"},
                  "resourceGroups": [{"coveredResources": sorted(quota), "flavors": [
                      {"name": flavor, "resources": [{"name": r, "nominalQuota": q} for r, q in sorted(quota.items())]}
                  ]}]}},
        {"apiVersion": KUEUE_API, "kind": "LocalQueue", "metadata": {"name": KUEUE_QUEUE, "namespace": namespace},
         "spec": {"clusterQueue": namespace}},
    ])

    def active():
        conds = k.json("get", "clusterqueue", namespace).get("status", {}).get("conditions") or []
        return any(c["type"] == "Active" and c["status"] == "True" for c in conds)
    wait_for(active, 60, f"ClusterQueue {namespace} to be active")
    return namespace


def queued(manifest: dict, priority: str | None = None) -> dict:
    """The DDPJob in LocalQueue KUEUE_QUEUE (and a WorkloadPriorityClass)."""
    manifest = copy.deepcopy(manifest)
    labels = manifest["metadata"].setdefault("labels", {})
    labels["kueue.x-k8s.io/queue-name"] = KUEUE_QUEUE
    if priority:
        labels["kueue.x-k8s.io/priority-class"] = priority
    return manifest


def workload(k: Kubectl, namespace: str, job: str) -> dict | None:
    """The DDPJob's Kueue Workload (by the job-name label the operator puts on it)."""
    items = k.json("get", "workloads.kueue.x-k8s.io", "-n", namespace, "-l", f"{LABEL_JOB}={job}")["items"]
    return items[0] if items else None
