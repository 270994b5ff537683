"""`cluster-down` leaves nothing behind, a failed `up` neither, and `cluster-up` works again afterwards.

Marked cluster_restart: tests/conftest.py runs it after every other test of the session, because a
restart wipes the cluster's API objects. It brings the cluster back before it ends. It leaves a
cluster as it found it: it runs only when this checkout owns the host's cluster and the cluster held
nothing but the tests' own namespaces when the session began (`make demo` then `make test` keeps the
demo); otherwise it says why it did not run (and fails when CI=true, where the cluster is the CI's).

While the host has no cluster it also checks the two ways an `up` fails (from a second clone, a copy of
hack/ in a temporary directory, so this checkout's state is not involved):
- a port it needs is taken by something else: one line naming the port and the process, nothing started;
- a component fails after containerd started: everything it started is stopped (no containerd left
  holding its database lock), and the next `up` works.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hack import cluster as embedded
from tests.support.kube import create_test_namespace
from tests.support.suite import IN_CI, REPO

pytestmark = [pytest.mark.cluster, pytest.mark.cluster_restart]

def cluster_py(*args: str, checkout: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(checkout / "hack" / "cluster.py"), *args], capture_output=True,
                          text=True, timeout=timeout)


def not_here(msg: str) -> None:
    if IN_CI:
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def second_clone(tmp_path: Path, broken: str | None = None) -> tuple[Path, dict]:
    """A copy of hack/ and, with `broken`, a cache of the pinned binaries where that one exits at once."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "hack", clone / "hack", ignore=shutil.ignore_patterns("__pycache__"))
    env: dict = {}
    if broken:
        cache = tmp_path / "cache"
        cache.mkdir()
        real = embedded.pinned_path(broken)
        for entry in embedded.CACHE.iterdir():  # the real cache, linked; the broken one's directory copied
            if entry != real.parent:
                (cache / entry.name).symlink_to(entry)
                continue
            (cache / entry.name).mkdir()
            for f in entry.iterdir():
                (cache / entry.name / f.name).symlink_to(f)
        fake = cache / real.parent.name / real.name
        fake.unlink()
        fake.write_text(f"#!/bin/sh\necho '{broken}: broken on purpose by test_down_up' >&2\nexit 1\n")
        fake.chmod(0o755)
        env["DDPJOB_CACHE"] = str(cache)
    return clone, env


def test_down_leaves_nothing_behind_a_failed_up_neither_and_up_works_again(cluster, kubectl, namespace,
                                                                          testimage, tmp_path):
    if not cluster.embedded:
        not_here("only the embedded cluster is stopped and started by this project")
    o = embedded.owner()
    if o is None or Path(o["repo"]).resolve() != REPO.resolve():
        not_here(f"the host's cluster belongs to {o and o['repo']}, not to this checkout: not restarting it")
    if cluster.found:
        not_here("not restarting the cluster: it holds what the tests did not make ("
                 + ", ".join(cluster.found) + "); `make demo-down` first, or run the restart test on an empty cluster")

    # Something on the node to clean up: a running pod with a volume, a sandbox, CNI state.
    kubectl("run", "leftover-check", "-n", namespace, f"--image={testimage}", "--restart=Never",
            "--image-pull-policy=Never", "--command", "--", "python3", "/app/probe.py", "sleep")
    kubectl("wait", "pod/leftover-check", "-n", namespace, "--for=condition=Ready", "--timeout=120s")

    t0 = time.monotonic()
    down = cluster_py("down")
    assert down.returncode == 0, down.stdout + down.stderr
    print(f"down: {time.monotonic() - t0:.1f}s")
    left = cluster_py("leftovers")
    assert left.returncode == 0, f"left behind after down:\n{left.stdout}{left.stderr}"
    assert embedded.leftovers() == []
    assert embedded.owner() is None and not embedded.OWNER_FILE.exists()

    try:
        # A port taken by something else: one line that names it, nothing started, nothing claimed.
        clone, _ = second_clone(tmp_path / "ports")
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 2379))
            s.listen()
            p = cluster_py("up", checkout=clone)
        assert p.returncode != 0
        err = p.stderr.strip().splitlines()[-1]
        assert f"cannot start etcd: 127.0.0.1:2379/tcp is in use by pid {os.getpid()} (" in err, p.stderr
        assert embedded._component_processes() == {} and not embedded.OWNER_FILE.exists()

        # A component that fails after containerd started: what the failed up started is stopped.
        clone, env = second_clone(tmp_path / "broken", broken="kube-apiserver")
        p = subprocess.run([sys.executable, str(clone / "hack" / "cluster.py"), "up"], capture_output=True,
                           text=True, timeout=300, env={**os.environ, **env})
        assert p.returncode != 0, p.stdout + p.stderr
        assert "kube-apiserver exited" in p.stderr and "broken on purpose" in p.stderr, p.stderr
        assert "up failed: stopping what it started (containerd, etcd, kube-apiserver)" in p.stderr, p.stderr
        assert embedded._component_processes() == {}, "a failed up left components running"
        embedded._check_containerd_db_free()  # raises, naming the holder, if a containerd still holds it
        assert embedded.leftovers() == []
        assert not embedded.OWNER_FILE.exists()
    finally:
        # The host gets its cluster back whatever happened above.
        t0 = time.monotonic()
        up = cluster_py("up")
        print(f"up after down: {time.monotonic() - t0:.1f}s")
    assert up.returncode == 0, up.stdout + up.stderr
    status = cluster_py("status")
    assert status.returncode == 0 and "cluster is UP" in status.stdout, status.stdout + status.stderr
    assert Path(embedded.owner()["repo"]).resolve() == REPO.resolve()

    # A fresh cluster (the old pod is gone) that still has the local images and runs pods.
    create_test_namespace(kubectl, namespace)  # the fixture's namespace went with the old cluster
    assert kubectl("get", "pod", "leftover-check", "-n", namespace, check=False).returncode != 0
    kubectl("run", "after-restart", "-n", namespace, f"--image={testimage}", "--restart=Never",
            "--image-pull-policy=Never", "--command", "--", "python3", "-c", "print('back')")
    kubectl("wait", "pod/after-restart", "-n", namespace, "--for=jsonpath={.status.phase}=Succeeded",
            "--timeout=120s")
