"""`cluster-down` leaves nothing behind and `cluster-up` works again afterwards.

Marked cluster_restart: tests/conftest.py runs it after every other test of the session, because a
restart wipes the cluster's API objects. It brings the cluster back before it ends.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, embedded

pytestmark = [pytest.mark.cluster, pytest.mark.cluster_restart]

CLUSTER_PY = [sys.executable, str(REPO / "hack" / "cluster.py")]


def cluster_py(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLUSTER_PY, *args], capture_output=True, text=True, timeout=timeout)


def test_down_leaves_nothing_behind_and_up_works_again(cluster, kubectl, testimage):
    if not cluster.embedded:
        pytest.skip("only the embedded cluster is stopped and started by this project")
    # Something on the node to clean up: a running pod with a volume, a sandbox, CNI state.
    kubectl("run", "leftover-check", "-n", "default", f"--image={testimage}", "--restart=Never",
            "--image-pull-policy=Never", "--command", "--", "python3", "/app/probe.py", "sleep")
    kubectl("wait", "pod/leftover-check", "-n", "default", "--for=condition=Ready", "--timeout=120s")

    t0 = time.monotonic()
    down = cluster_py("down")
    assert down.returncode == 0, down.stdout + down.stderr
    print(f"down: {time.monotonic() - t0:.1f}s")
    left = cluster_py("leftovers")
    assert left.returncode == 0, f"left behind after down:\n{left.stdout}{left.stderr}"
    assert embedded.leftovers() == []

    t0 = time.monotonic()
    up = cluster_py("up")
    assert up.returncode == 0, up.stdout + up.stderr
    print(f"up after down: {time.monotonic() - t0:.1f}s")
    status = cluster_py("status")
    assert status.returncode == 0 and "cluster is UP" in status.stdout, status.stdout + status.stderr

    # A fresh cluster (the old pod is gone) that still has the local images and runs pods.
    assert kubectl("get", "pod", "leftover-check", "-n", "default", check=False).returncode != 0
    kubectl("run", "after-restart", "-n", "default", f"--image={testimage}", "--restart=Never",
            "--image-pull-policy=Never", "--command", "--", "python3", "-c", "print('back')")
    kubectl("wait", "pod/after-restart", "-n", "default", "--for=jsonpath={.status.phase}=Succeeded",
            "--timeout=120s")
    kubectl("delete", "pod", "after-restart", "-n", "default", "--wait=false")
