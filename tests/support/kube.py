"""The cluster under test and the means to use it, for the fixtures of tests/conftest.py, tests/e2e/harness.py and
the benchmark programs: which cluster (`connect`), kubectl bound to it (`Kubectl`), images on its nodes
(`ensure_image`), labelled test namespaces, a namespace's post-mortem (`dump_namespace`), what on the cluster is not
the tests' (`not_the_tests`), and other DDPJob operators paused while the tests run their own."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hack import cluster as embedded  # hack/cluster.py
from hack import image as image_builder  # hack/image.py
from tests import tools
from tests.support.waiting import WaitTimeout, wait_for


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

        # An AssertionError (a terminal phase not asked for; kubectl failing, e.g. no such pod) ends the wait at once.
        try:
            return wait_for(check, timeout, f"pod {namespace}/{name} {phases}", fatal=AssertionError)
        except WaitTimeout:
            raise AssertionError(f"pod {namespace}/{name} not {phases} after {timeout:.0f}s:\n"
                                 + dump_namespace(self, namespace)) from None


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


def wait_crd_established(kubectl: Kubectl, name: str, timeout: float = 60) -> None:
    """Wait until CRD `name` is Established. (`kubectl wait --for=condition=Established` fails at once on a CRD
    created a moment ago, whose status has no conditions yet.)"""
    def established():
        crd = kubectl.json("get", "crd", name)
        return any(c.get("type") == "Established" and c.get("status") == "True"
                   for c in (crd.get("status") or {}).get("conditions") or [])
    wait_for(established, timeout, f"CRD {name} Established")


def create_test_namespace(kubectl: Kubectl, name: str) -> str:
    """Create a labelled test namespace and wait until it accepts pods."""
    kubectl("create", "namespace", name)
    kubectl("label", "namespace", name, "ddpjob.dev/test=true")
    # Pods are refused until the namespace's default ServiceAccount exists.
    wait_for(lambda: kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             60, f"default ServiceAccount in {name}")
    return name


def watches(patterns: list[str], namespace: str) -> bool:
    """Whether an operator started with these `--namespace` patterns handles `namespace` (none: every one). kopf's
    rule for each pattern: comma-separated globs; a leading exclusion (`!x`) implies `*` before it; an inclusion
    after the first matches only what the first matched; an exclusion un-matches."""
    def one(pattern: str) -> bool:
        globs = [g.strip() for g in pattern.split(",")]
        if globs[0].startswith("!"):
            globs.insert(0, "*")
        matches = first = fnmatch.fnmatch(namespace, globs[0])
        for glob in globs[1:]:
            if glob.startswith("!"):
                matches = matches and not fnmatch.fnmatch(namespace, glob[1:])
            else:
                matches = matches or (first and fnmatch.fnmatch(namespace, glob))
        return matches
    return not patterns or any(one(p) for p in patterns)


@contextlib.contextmanager
def foreign_operators_paused_in(kubectl: Kubectl, namespace: str | None = None):
    """Scale every DDPJob operator Deployment that watches all namespaces (or globs) and does not live in
    a test namespace to 0; on exit, restore the replica count of each one nobody restored meanwhile. With
    `namespace` (one the tests will use), only those whose patterns handle it: e.g. the e2e tests' shared operator,
    which excludes the integration tests' `ddp-it-*`, keeps running beside them.

    A paused release's admission policy would still refuse the tests' operators the DDPJob pod labels in every
    namespace it covers (e.g. `make demo`'s release, before the chart tier installs a release of its own): its
    binding leaves the test namespaces out until the release is restored (_policy_bindings_narrowed)."""
    test_namespaces = {n["metadata"]["name"] for n in kubectl.json("get", "namespaces")["items"]
                       if n["metadata"].get("labels", {}).get(TEST_LABEL) == "true"}
    paused = []
    for d in kubectl.json("get", "deployments", "-A", "-l", "app.kubernetes.io/name=ddp-operator")["items"]:
        ns, name = d["metadata"]["namespace"], d["metadata"]["name"]
        args = [a for c in d["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])]
        scoped = [a.split("=", 1)[1] for a in args if a.startswith("--namespace=")]
        if ns in test_namespaces or (scoped and not any(set("*?!,") & set(a) for a in scoped)):
            continue  # the tests' own, or one that watches named namespaces only
        if namespace is not None and not watches(scoped, namespace):
            continue  # it leaves the tests' namespaces alone
        replicas = d["spec"].get("replicas", 1)
        if replicas:
            print(f"pausing the DDPJob operator {ns}/{name} (watches every namespace) until the session ends")
            kubectl("scale", "deployment", name, "-n", ns, "--replicas=0")
            paused.append((ns, name, replicas, d["spec"]["selector"]["matchLabels"]))
    instances = [labels.get("app.kubernetes.io/instance") for _, _, _, labels in paused]
    try:
        for ns, name, _, labels in paused:
            sel = ",".join(f"{k}={v}" for k, v in labels.items())
            wait_for(lambda: not kubectl.json("get", "pods", "-n", ns, "-l", sel)["items"], 120,
                     f"the pods of {ns}/{name} to stop")
        with _policy_bindings_narrowed(kubectl, [i for i in instances if i]):
            yield [(ns, name) for ns, name, _, _ in paused]
    finally:
        for ns, name, replicas, _ in paused:
            current = kubectl("get", "deployment", name, "-n", ns, "-o", "jsonpath={.spec.replicas}", check=False)
            if current.returncode == 0 and current.stdout.strip() == "0":  # e.g. a helm upgrade restored it
                kubectl("scale", "deployment", name, "-n", ns, f"--replicas={replicas}", check=False)


@contextlib.contextmanager
def _policy_bindings_narrowed(kubectl: Kubectl, instances: list[str]):
    """The admission policy bindings of the paused releases `instances` that cover every namespace leave out the
    test namespaces (TEST_LABEL) meanwhile; each is given back the scope it had, unless someone changed it."""
    narrowed, not_tests = [], [{"key": TEST_LABEL, "operator": "DoesNotExist"}]
    for instance in instances:
        bindings = kubectl.json("get", "validatingadmissionpolicybindings",
                                "-l", f"app.kubernetes.io/name=ddp-operator,app.kubernetes.io/instance={instance}")
        for b in bindings["items"]:
            if b["spec"].get("matchResources", {}).get("namespaceSelector", {}).get("matchExpressions"):
                continue  # scoped to named namespaces: it leaves the tests' alone
            name = b["metadata"]["name"]
            print(f"leaving the test namespaces out of the paused release's admission policy binding {name}")
            kubectl("patch", "validatingadmissionpolicybinding", name, "--type=merge", "-p", json.dumps(
                {"spec": {"matchResources": {"namespaceSelector": {"matchExpressions": not_tests}}}}))
            narrowed.append((name, b["spec"].get("matchResources")))
    try:
        yield
    finally:
        for name, scope in narrowed:
            now = kubectl("get", "validatingadmissionpolicybinding", name, "-o", "json", check=False)
            if now.returncode != 0 or (json.loads(now.stdout)["spec"].get("matchResources", {})
                                       .get("namespaceSelector", {}).get("matchExpressions") != not_tests):
                continue  # deleted, or scoped anew (e.g. by a helm upgrade) meanwhile
            patch = ([{"op": "replace", "path": "/spec/matchResources", "value": scope}] if scope is not None
                     else [{"op": "remove", "path": "/spec/matchResources"}])
            kubectl("patch", "validatingadmissionpolicybinding", name, "--type=json", "-p", json.dumps(patch),
                    check=False)
