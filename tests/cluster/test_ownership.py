"""One embedded cluster per host: a second checkout reuses it and cannot stop it.

A "second clone" is a copy of hack/ in a temporary directory: hack/cluster.py takes its checkout from
its own path, so the copy behaves as another clone of the repository on the same machine. Neither
test stops the running cluster; they check that nothing of it changed. (A failed `up` and the port
check need the host without a cluster: they are part of the restart test, test_down_up.py.)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hack import cluster as embedded
from tests.support.suite import IN_CI, REPO

pytestmark = pytest.mark.cluster


def second_clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "hack", clone / "hack", ignore=shutil.ignore_patterns("__pycache__"))
    return clone


def cluster_py(checkout: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(checkout / "hack" / "cluster.py"), *args], capture_output=True,
                          text=True, timeout=timeout)


def host_cluster(cluster) -> dict:
    """The owner record of the running embedded cluster (these tests need the embedded one)."""
    if not cluster.embedded:
        msg = "the cluster under test is not this host's embedded cluster"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    o = embedded.owner()
    assert o is not None, "the embedded cluster is up but no checkout owns it"
    return o


def snapshot() -> dict:
    """What a second clone must not change: the component processes and the shared host state."""
    return {"components": embedded._component_processes(),
            "bridge": Path(f"/sys/class/net/{embedded.BRIDGE}").exists(),
            "containerd socket": Path(embedded.CONTAINERD_SOCK).exists(),
            "owner": embedded.owner()}


def test_up_in_a_second_clone_reuses_the_running_cluster(cluster, kubectl, tmp_path):
    o = host_cluster(cluster)
    before = snapshot()
    clone = second_clone(tmp_path)

    up = cluster_py(clone, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    lines = [ln for ln in up.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"belongs to {o['repo']}" in lines[0] and "reusing it" in lines[0], up.stdout
    kubeconfig = clone / ".cluster" / "kubeconfig"
    assert kubeconfig.is_symlink() and kubeconfig.resolve() == (Path(o["repo"]) / ".cluster" / "kubeconfig").resolve()
    # the clone reaches the cluster through it
    ready = subprocess.run([kubectl.binary, f"--kubeconfig={kubeconfig}", "get", "--raw", "/readyz"],
                           capture_output=True, text=True, timeout=60)
    assert ready.stdout.strip() == "ok", ready.stdout + ready.stderr
    # status from the clone names the owner
    status = cluster_py(clone, "status")
    assert f"belongs to {o['repo']}" in status.stdout, status.stdout + status.stderr

    assert snapshot() == before, "a second clone's `up` changed the running cluster"
    assert not (clone / ".cluster" / "pki").exists(), "the clone made PKI of its own"


def test_down_in_a_second_clone_stops_nothing(cluster, kubectl, tmp_path):
    o = host_cluster(cluster)
    before = snapshot()
    clone = second_clone(tmp_path)
    assert cluster_py(clone, "up").returncode == 0

    down = cluster_py(clone, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"belongs to {o['repo']}" in down.stdout and "nothing stopped" in down.stdout, down.stdout
    assert not (clone / ".cluster" / "kubeconfig").exists(), "the clone's link to the owner's kubeconfig stays"

    assert snapshot() == before, "a second clone's `down` touched the running cluster"
    assert kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
    nodes = kubectl.json("get", "nodes")["items"]
    assert all({c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"] == "True" for n in nodes)
    # the host's containerd still answers (image imports of every checkout go through it)
    assert embedded.containerd_ready()
    assert os.path.exists(embedded.CONTAINERD_SOCK)
