"""Shared helpers for the chart and manifest tests: the pinned helm binary, rendering, kustomize, and the release
that `make release` pushes into the local registry (the release tests and the upgrade test)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time

import pytest
import yaml

from hack import registry as local_registry
from hack.common import pinned_path
from hack.release_images import tag_digest
from tests import tools

CHART = tools.REPO_ROOT / "helm" / "ddp-operator"
MANIFESTS = tools.REPO_ROOT / "manifests"
SAMPLES = sorted((MANIFESTS / "samples").glob("*.yaml"))
VALUES_ALL = pathlib.Path(__file__).with_name("values-all.yaml")
# `go install` builds of helm do not carry the Kubernetes version they were built against (the
# default capabilities say v1.20); offline rendering states the version we target instead.
KUBE_VERSION = tools.versions()["KUBE_VERSION"]


def run(cmd: list[str], *, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def documents(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="session")
def helm_bin() -> str:
    return tools.tool("helm")


@pytest.fixture(scope="session")
def render(helm_bin):
    """render(*helm template args) -> list of objects of `helm template` for the chart."""
    def _render(*args: str, release: str = "ddp-operator", namespace: str = "ddp-system",
                include_crds: bool = False) -> list[dict]:
        cmd = [helm_bin, "template", release, str(CHART), "--namespace", namespace,
               "--kube-version", KUBE_VERSION, *args]
        if include_crds:
            cmd.append("--include-crds")
        return documents(run(cmd).stdout)
    return _render


@pytest.fixture(scope="session")
def kustomize():
    """kustomize(path) -> list of objects of `kubectl kustomize path`."""
    kubectl = tools.tool("kubectl")

    def _kustomize(path: pathlib.Path) -> list[dict]:
        return documents(run([kubectl, "kustomize", str(path)]).stdout)
    return _kustomize


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str) -> dict:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


AGGREGATE_LABEL = "rbac.authorization.k8s.io/aggregate-to-"


def user_roles(objs: list[dict]) -> list[dict]:
    """The ClusterRoles aggregated into the built-in admin/edit/view (users' access to DDPJobs, not the operator's)."""
    return [o for o in by_kind(objs, "ClusterRole")
            if any(k.startswith(AGGREGATE_LABEL) for k in (o["metadata"].get("labels") or {}))]


def operator_cluster_roles(objs: list[dict]) -> list[dict]:
    """The operator's own ClusterRoles (every ClusterRole but the users')."""
    users = user_roles(objs)
    return [o for o in by_kind(objs, "ClusterRole") if o not in users]


def operator_role(objs: list[dict]) -> dict:
    (role,) = operator_cluster_roles(objs)
    return role


# --- cluster access -------------------------------------------------------------------------------
# tests/conftest.py provides `cluster` (kubeconfig of the cluster under test), `kubectl` and a fresh
# `namespace` per test; this adds helm bound to the same cluster.
@pytest.fixture(scope="session")
def helm(helm_bin, cluster):
    """helm(*args, check=True) -> CompletedProcess of helm against the test cluster."""
    def _helm(*args: str, check: bool = True, timeout: float = 400):
        return run([helm_bin, f"--kubeconfig={cluster.kubeconfig}", *args], check=check, timeout=timeout)
    return _helm


@pytest.fixture(scope="module")
def crd_installed(kubectl):
    """The DDPJob CRD, as every install path ships it (apply is a no-op when it is already there)."""
    from tests.support.kube import wait_crd_established
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(MANIFESTS / "base" / "crd.yaml"))
    wait_crd_established(kubectl, "ddpjobs.ddp.dev")


def _image(ensure_image, name: str) -> None:
    ensure_image(f"localhost/ddp-{name}:0.1.0", tools.REPO_ROOT / name / "Dockerfile", tools.REPO_ROOT)


@pytest.fixture(scope="module")
def operator_image(ensure_image):
    """The operator's image, current with the working tree (a no-op when nothing changed)."""
    _image(ensure_image, "operator")


@pytest.fixture(scope="module")
def images(ensure_image, operator_image):
    """Both images, current with the working tree."""
    _image(ensure_image, "trainer")


REPO = tools.REPO_ROOT
REPOSITORY = "ddpjob"  # the path of the release's repositories in the registry (the release tests, the upgrade test)
TEST_TAG = "-test."  # versions the test releases: <chart version>-test.<unix time>


def _timed(times: dict, name: str, fn, *args, **kwargs):
    t0 = time.monotonic()
    try:
        return fn(*args, **kwargs)
    finally:
        times[name] = round(time.monotonic() - t0, 1)


def _ensure_binaries() -> None:
    """The registry and crane: built behind stage 3 by hack/test.sh, first of its list, so usually there already;
    else built here (a few minutes cold)."""
    if not all(os.access(pinned_path(n), os.X_OK) for n in ("registry", "crane")):
        subprocess.run([str(REPO / "hack" / "build-binaries.sh"), "registry"], check=True)


def _prune(registry: str, keep: str) -> None:
    """Delete the test's earlier releases from the registry (each repository's tags with TEST_TAG but `keep`), so the
    registry's next start collects their blobs while the kept one holds the trainer's layers for the next run (a
    registry the test did not start)."""
    crane = tools.tool("crane")
    for repo in [f"{registry}/ddp-{n}" for n in ("operator", "trainer", "store")] + [f"{registry}/charts/ddp-operator"]:
        tags = subprocess.run([crane, "ls", repo], capture_output=True, text=True).stdout.split()
        for tag in tags:
            if TEST_TAG in tag and tag != keep and (digest := tag_digest(f"{repo}:{tag}")):
                subprocess.run([crane, "delete", f"{repo}@{digest}"], capture_output=True)


@pytest.fixture(scope="session")
def released(cluster):
    """A release made by `make release` into the local registry: (its release.json, the registry's address). One
    per session (the release tests and the upgrade test share it). A registry this fixture started is stopped and its
    storage removed afterwards (the trainer's layers are GiBs; stage 4's kind nodes need the disk next); one that ran
    before keeps the kept release, pruned of the others."""
    if not cluster.embedded:
        pytest.skip("the local registry listens on this machine's loopback, which only the embedded cluster's node "
                    "shares")
    times: dict[str, float] = {}
    _timed(times, "binaries", _ensure_binaries)
    was_running = local_registry.url() is not None
    address = _timed(times, "registry up", local_registry.up)
    registry = f"{address}/{REPOSITORY}"
    version = f"{yaml.safe_load((CHART / 'Chart.yaml').read_text())['version']}{TEST_TAG}{int(time.time())}"
    p = _timed(times, "make release", subprocess.run,
               ["make", "--no-print-directory", "release", f"VERSION={version}", f"REGISTRY={registry}"],
               cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, f"make release failed:\n{p.stderr[-4000:]}"
    record = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"release {version}: {json.dumps(times)}; release.json seconds {record['seconds']}; "
          + ", ".join(f"{n}: {i['seconds']} s, {i.get('blobs_uploaded')} blobs up, {i.get('blobs_found')} found"
                      for n, i in record["images"].items()))
    try:
        yield record, registry
    finally:
        _prune(registry, keep=version)
        if not was_running:
            local_registry.down(purge=True)
        subprocess.run(["rm", "-rf", str(REPO / "dist" / version)], check=False)
