"""Suite-wide fixtures: a real Kubernetes cluster and the means to use it from tests.

- `cluster` (session): the cluster under test. The embedded cluster of hack/cluster.py, brought up
  when needed and left up afterwards (a second session starts in a second, not a minute; a cluster
  another checkout of this host runs is reused); or the cluster `DDPJOB_TEST_KUBECONFIG` names (kind:
  `make kind-e2e` sets it for the cluster it made). `$KUBECONFIG` is never used: it may point at a
  real cluster, and the tests install CRDs, Helm releases and pods and restart the embedded cluster.
  When the cluster cannot be reached or started, the session fails with the reason when CI=true and
  skips cluster tests otherwise. `cluster.found` lists what the session found on the cluster that is
  not the tests' (non-system namespaces, workloads in `default`): the restart tests leave such a
  cluster alone.
- `kubectl` (session): kubectl bound to that cluster: `kubectl("get", "pods")` returns the
  CompletedProcess (raising with stdout/stderr on failure unless check=False), `kubectl.json(...)`
  the parsed `-o json` output.
- `foreign_operators_paused` (session): DDPJob operators the session did not install that watch
  every namespace (e.g. `make demo`'s release) would reconcile the tests' jobs too; tests that run
  operators of their own request it: such Deployments are scaled to 0 and restored to their replica
  count when the session ends.
- `namespace` (function): a fresh namespace per test, deleted afterwards; when the test failed,
  its pods, events, descriptions and container logs are printed first (shown in the report).
- `wait_for` (and the module-level function): poll a condition with a timeout, never a fixed sleep.
- `ensure_image`: make a locally built image available to the cluster (embedded: hack/image.py
  into containerd, a no-op when nothing changed; kind: docker build + kind load, or offline
  (DDPJOB_IMAGE_BUILDER=buildah) buildah + hack/image.py kind-load).
- Tests marked `cluster_restart` (they stop the cluster) run after every other test.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
from hack import cluster as embedded  # noqa: E402  hack/cluster.py
from hack import image as image_builder  # noqa: E402  hack/image.py

from tests import tools  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() == "true"


# --------------------------------------------------------------------------------------------
# plain helpers (importable: `from tests.conftest import wait_for`)

def wait_for(check: Callable[[], Any], timeout: float, what: str = "condition", interval: float = 0.5) -> Any:
    """Call check() until it returns something truthy and return that; AssertionError after timeout.

    Exceptions raised by check() count as "not yet"; the last one is reported on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as e:  # noqa: BLE001 - a failing probe just means "not yet"
            last = e
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last result: {last!r}")
        time.sleep(interval)


class Kubectl:
    """kubectl against one kubeconfig; failures raise with everything kubectl said."""

    def __init__(self, kubeconfig: str):
        self.kubeconfig = kubeconfig
        self.binary = tools.tool("kubectl")

    def __call__(self, *args: str, input: str | None = None, check: bool = True,
                 timeout: float = 120) -> subprocess.CompletedProcess:
        p = subprocess.run([self.binary, f"--kubeconfig={self.kubeconfig}", *args], input=input,
                           capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def json(self, *args: str, timeout: float = 60) -> Any:
        return json.loads(self(*args, "-o", "json", timeout=timeout).stdout)

    def apply(self, manifest: str | dict, namespace: str | None = None) -> None:
        """kubectl apply of YAML text or of one object given as a dict."""
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        self("apply", *(["-n", namespace] if namespace else []), "-f", "-", input=text)

    def pod(self, namespace: str, name: str) -> dict:
        return self.json("get", "pod", name, "-n", namespace)

    def wait_pod_phase(self, namespace: str, name: str, phases: str | tuple[str, ...], timeout: float = 120) -> dict:
        """Wait until the pod is in one of `phases`; returns the pod. Fails fast on a terminal phase
        that was not asked for."""
        phases = (phases,) if isinstance(phases, str) else phases

        def check():
            pod = self.pod(namespace, name)
            phase = pod.get("status", {}).get("phase")
            if phase in phases:
                return pod
            if phase in ("Succeeded", "Failed"):
                raise AssertionError(f"pod {name} ended {phase}, expected {phases}: {pod['status']}")
            return None

        deadline = time.monotonic() + timeout
        while True:
            try:
                pod = check()
                if pod:
                    return pod
            except AssertionError:
                raise
            except Exception:  # noqa: BLE001 - not created yet etc.
                pass
            if time.monotonic() >= deadline:
                raise AssertionError(f"pod {namespace}/{name} not {phases} after {timeout:.0f}s:\n"
                                     + dump_namespace(self, namespace))
            time.sleep(0.5)


def dump_namespace(kubectl: Kubectl, namespace: str) -> str:
    """Everything useful for a post-mortem of one namespace, as text."""
    out = [f"===== diagnostics for namespace {namespace} ====="]

    def section(title: str, *args: str) -> None:
        p = kubectl(*args, check=False, timeout=30)
        out.append(f"----- {title} -----\n{p.stdout}{p.stderr}")

    section("pods", "get", "pods", "-n", namespace, "-o", "wide")
    section("all", "get", "all", "-n", namespace)
    section("events", "get", "events", "-n", namespace, "--sort-by=.lastTimestamp")
    if kubectl("get", "crd", "ddpjobs.ddp.dev", check=False, timeout=30).returncode == 0:
        section("ddpjobs", "get", "ddpjobs", "-n", namespace, "-o", "yaml")
    section("describe pods", "describe", "pods", "-n", namespace)
    try:
        pods = kubectl.json("get", "pods", "-n", namespace)["items"]
    except Exception:  # noqa: BLE001
        pods = []
    for pod in pods:
        name = pod["metadata"]["name"]
        for cs in pod.get("status", {}).get("containerStatuses", []) + \
                pod.get("status", {}).get("initContainerStatuses", []):
            section(f"logs {name}/{cs['name']}", "logs", "-n", namespace, name, "-c", cs["name"], "--tail=200")
            if cs.get("restartCount"):
                section(f"previous logs {name}/{cs['name']}", "logs", "-n", namespace, name, "-c", cs["name"],
                        "--previous", "--tail=100")
    return "\n".join(out)


@dataclass(frozen=True)
class Cluster:
    kubeconfig: str
    embedded: bool  # hack/cluster.py's cluster on this host (host-level checks are possible)
    kind_name: str | None = None  # set for kind clusters (images go in with `kind load`)
    found: tuple[str, ...] = ()  # what was on the cluster before the session that is not the tests'

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return Kubectl(self.kubeconfig)(*args, **kw)

    @property
    def host_processes(self) -> bool:
        """Its pods' processes are processes of this host's kernel, seen (and signalled) through /proc: the
        embedded cluster's containers, and kind's, whose nodes are containers of a Docker engine on this host."""
        docker_host = os.environ.get("DOCKER_HOST", "")
        return self.embedded or (self.kind_name is not None and (not docker_host or docker_host.startswith("unix://")))


def ensure_image(cluster: Cluster, ref: str, dockerfile: str | Path, context: str | Path,
                 build_args: dict[str, str] | None = None) -> str:
    """Make `ref` available to the cluster's node(s), building it when its inputs changed."""
    if cluster.embedded:
        image_builder.build(dockerfile, ref, context, build_args)
    elif cluster.kind_name and os.environ.get("DDPJOB_IMAGE_BUILDER") == "buildah":
        # offline kind (hack/kind-e2e.sh sets it where Docker cannot pull the python base): buildah builds,
        # the nodes' containerd imports the archive
        image_builder.build(dockerfile, ref, context, build_args, to_containerd_ns=False)
        image_builder.kind_load(ref, cluster.kind_name)
    elif cluster.kind_name:
        args = [a for k, v in (build_args or {}).items() for a in ("--build-arg", f"{k}={v}")]
        subprocess.run(["docker", "build", "-f", str(dockerfile), "-t", ref, *args, str(context)], check=True)
        subprocess.run(["kind", "load", "docker-image", ref, "--name", cluster.kind_name], check=True)
    # any other cluster: the image must already be where its nodes can pull it from
    return ref


def _reachable(kubeconfig: str) -> bool:
    try:
        p = subprocess.run([tools.tool("kubectl"), f"--kubeconfig={kubeconfig}", "get", "--raw", "/readyz",
                            "--request-timeout=5s"], capture_output=True, text=True, timeout=15)
    except (subprocess.TimeoutExpired, tools.ToolNotFound):
        return False
    return p.returncode == 0


def _kind_name(kubeconfig: str) -> str | None:
    p = subprocess.run([tools.tool("kubectl"), f"--kubeconfig={kubeconfig}", "config", "current-context"],
                       capture_output=True, text=True)
    ctx = p.stdout.strip()
    return ctx[len("kind-"):] if ctx.startswith("kind-") else None


SYSTEM_NAMESPACES = {"default", "kube-system", "kube-public", "kube-node-lease"}
TEST_LABEL = "ddpjob.dev/test"  # on every namespace the tests create (create_test_namespace)


def not_the_tests(kubeconfig: str) -> tuple[str, ...]:
    """What the cluster holds that the tests did not make: other namespaces, workloads in default."""
    k = Kubectl(kubeconfig)
    found = [f"namespace {n['metadata']['name']}" for n in k.json("get", "namespaces")["items"]
             if n["metadata"]["name"] not in SYSTEM_NAMESPACES
             and n["metadata"].get("labels", {}).get(TEST_LABEL) != "true"]
    found += [f"default/{o['kind'].lower()} {o['metadata']['name']}"
              for o in k.json("get", "pods,deployments,statefulsets,jobs", "-n", "default")["items"]]
    return tuple(found)


def connect() -> Cluster:
    """The cluster under test (see `cluster`); raises when it cannot be reached or started."""
    named = os.environ.get("DDPJOB_TEST_KUBECONFIG")
    if named and Path(named).resolve() != embedded.KUBECONFIG.resolve():
        if not _reachable(named):
            raise RuntimeError(f"DDPJOB_TEST_KUBECONFIG={named} names a cluster that does not answer")
        os.environ["KUBECONFIG"] = named  # libraries and child processes use the same cluster
        return Cluster(named, embedded=False, kind_name=_kind_name(named))
    if not embedded.is_up():
        embedded.up()  # reuses the host's cluster when another checkout owns it
    # Libraries (kopf, the kubernetes client) and child processes find the cluster the usual way.
    os.environ["KUBECONFIG"] = str(embedded.KUBECONFIG)
    return Cluster(str(embedded.KUBECONFIG), embedded=True)


# --------------------------------------------------------------------------------------------
# fixtures

@pytest.fixture(scope="session")
def cluster() -> Cluster:
    try:
        c = connect()
    except Exception as e:  # noqa: BLE001 - any reason the cluster cannot be used
        msg = f"the cluster under test is not available: {e}"
        if IN_CI:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return Cluster(c.kubeconfig, c.embedded, c.kind_name, found=not_the_tests(c.kubeconfig))


@pytest.fixture(scope="session")
def kubectl(cluster) -> Kubectl:
    return Kubectl(cluster.kubeconfig)


def stop_process(proc: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def create_test_namespace(kubectl: Kubectl, name: str) -> str:
    """Create a labelled test namespace and wait until it accepts pods."""
    kubectl("create", "namespace", name)
    kubectl("label", "namespace", name, "ddpjob.dev/test=true")
    # Pods are refused until the namespace's default ServiceAccount exists.
    wait_for(lambda: kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             60, f"default ServiceAccount in {name}")
    return name


@pytest.fixture
def namespace(request, kubectl) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = create_test_namespace(kubectl, f"t-{base}-{secrets.token_hex(3)}")
    yield name
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(dump_namespace(kubectl, name))
    kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@contextlib.contextmanager
def foreign_operators_paused_in(kubectl: Kubectl):
    """Scale every DDPJob operator Deployment that watches all namespaces (or globs) and does not live in
    a test namespace to 0; on exit, restore the replica count of each one nobody restored meanwhile."""
    test_namespaces = {n["metadata"]["name"] for n in kubectl.json("get", "namespaces")["items"]
                       if n["metadata"].get("labels", {}).get(TEST_LABEL) == "true"}
    paused = []
    for d in kubectl.json("get", "deployments", "-A", "-l", "app.kubernetes.io/name=ddp-operator")["items"]:
        ns, name = d["metadata"]["namespace"], d["metadata"]["name"]
        args = [a for c in d["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])]
        scoped = [a.split("=", 1)[1] for a in args if a.startswith("--namespace=")]
        if ns in test_namespaces or (scoped and not any(set("*?!,") & set(a) for a in scoped)):
            continue  # the tests' own, or one that watches named namespaces only
        replicas = d["spec"].get("replicas", 1)
        if replicas:
            print(f"pausing the DDPJob operator {ns}/{name} (watches every namespace) until the session ends")
            kubectl("scale", "deployment", name, "-n", ns, "--replicas=0")
            paused.append((ns, name, replicas, d["spec"]["selector"]["matchLabels"]))
    try:
        for ns, name, _, labels in paused:
            sel = ",".join(f"{k}={v}" for k, v in labels.items())
            wait_for(lambda: not kubectl.json("get", "pods", "-n", ns, "-l", sel)["items"], 120,
                     f"the pods of {ns}/{name} to stop")
        yield [(ns, name) for ns, name, _, _ in paused]
    finally:
        for ns, name, replicas, _ in paused:
            current = kubectl("get", "deployment", name, "-n", ns, "-o", "jsonpath={.spec.replicas}", check=False)
            if current.returncode == 0 and current.stdout.strip() == "0":  # e.g. a helm upgrade restored it
                kubectl("scale", "deployment", name, "-n", ns, f"--replicas={replicas}", check=False)


@pytest.fixture(scope="session")
def foreign_operators_paused(kubectl):
    with foreign_operators_paused_in(kubectl) as paused:
        yield paused


@pytest.fixture(scope="session")
def shared_operator(cluster, kubectl, request):
    """The one operator of the e2e tests and the cluster benchmarks (tests/e2e/harness.py, DDPJOB_OPERATOR), started
    at its first use and stopped when the session ends: a chart installed here is uninstalled then. One install per
    session, not one per module. The integration and chart tiers, which run operators of their own, are collected
    before the tiers that use it; the cluster-restart tests, after them, leave it running."""
    from tests.e2e import harness
    if harness.operator_mode() == "subprocess":  # helm mode reuses an installed release instead
        request.getfixturevalue("foreign_operators_paused")
    harness.ensure_images(cluster)
    op = harness.Operator(cluster, kubectl).start()
    yield op
    op.stop()


@pytest.fixture(scope="session")
def kueue_operator(shared_operator, cluster):
    """Kueue in the cluster (hack/kueue.py; installed at the first use, removed when the session ends if it was not
    there before) and the shared operator with its Kueue integration on from then on: jobs without a queue label are
    not gated, so the tests and benchmarks after the first Kueue test run against the same operator."""
    from tests.e2e import harness
    mod = harness.kueue_module()
    was_there = mod.release(cluster.kubeconfig) is not None
    harness.log(f"kueue up: {mod.up(cluster.kubeconfig, kind_cluster=cluster.kind_name)}")
    kueue_before = shared_operator.kueue
    yield shared_operator.set_kueue(True)
    if not was_there:
        if not shared_operator.installed_here:  # someone else's release: as it was found
            shared_operator.set_kueue(kueue_before)
        mod.down(cluster.kubeconfig)


@pytest.fixture(name="wait_for")
def wait_for_fixture():
    return wait_for


@pytest.fixture(name="ensure_image", scope="session")
def ensure_image_fixture(cluster):
    """ensure_image(ref, dockerfile, context, build_args=None) for the session's cluster."""
    return lambda ref, dockerfile, context, build_args=None: ensure_image(cluster, ref, dockerfile, context,
                                                                           build_args)


# --------------------------------------------------------------------------------------------
# hooks

def pytest_configure(config):
    config.addinivalue_line("markers", "cluster_restart: stops and restarts the cluster; runs last")


# Each tier's time limit per test (pytest-timeout; it counts the test's fixtures too, so the first test of a tier pays
# for its session fixtures): a hung test fails in minutes, not after half an hour. A test that needs more says so with
# its own @pytest.mark.timeout. docs/testing.md has what each tier takes.
TIER_TIMEOUTS = {"unit": 60, "bootstrap": 900, "trainer": 300, "gpu": 600, "cluster": 600, "integration": 300,
                 "chart": 600, "e2e": 600, "benchmarks": 1500}


def tier_timeout(path: Path) -> int:
    """The time limit of a test in `path` (a file under tests/), by its tier (directory)."""
    parts = path.resolve().relative_to(REPO / "tests").parts
    return TIER_TIMEOUTS.get(parts[0], 600) if len(parts) > 1 else 600


def pytest_collection_modifyitems(config, items):
    # Restarting the cluster wipes its API objects; anything else in the session runs before it.
    items.sort(key=lambda item: item.get_closest_marker("cluster_restart") is not None)
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(tier_timeout(Path(str(item.fspath)))))


# The only reasons a test may skip under CI=true: the CI machine has no GPU. Any other skip there would hide a
# regression behind a green run, so it fails the test instead.
CI_ALLOWED_SKIPS = ("needs a CUDA device",)


def skip_reason(rep) -> str:
    """The reason text of a skipped report (pytest keeps it as (file, line, "Skipped: reason"))."""
    longrepr = rep.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def forbid_skip_in_ci(rep, in_ci: bool = IN_CI) -> None:
    """Under CI, turn a skip whose reason is not allowed into a failure that says why."""
    if not (in_ci and rep.skipped) or hasattr(rep, "wasxfail"):
        return
    reason = skip_reason(rep)
    if not reason.startswith(CI_ALLOWED_SKIPS):
        rep.outcome = "failed"
        rep.longrepr = (f"skipped under CI=true: {reason!r}; only skips starting with {CI_ALLOWED_SKIPS} are "
                        "allowed in CI (tests/conftest.py CI_ALLOWED_SKIPS)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Keep each phase's report on the item so fixtures can tell, in teardown, that the test failed.
    outcome = yield
    rep = outcome.get_result()
    forbid_skip_in_ci(rep)
    setattr(item, f"rep_{rep.when}", rep)
