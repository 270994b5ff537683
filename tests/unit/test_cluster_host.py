"""hack/cluster.py's host checks that need no cluster: which checkout runs components, and who holds a
port the cluster needs. (The real start/stop paths are tested in tests/cluster.)"""
from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from hack import cluster as embedded


@pytest.fixture
def fake_component(tmp_path):
    """A process named `etcd` running in <tmp>/checkout/.cluster, as start() runs components."""
    state = tmp_path / "checkout" / ".cluster"
    state.mkdir(parents=True)
    proc = subprocess.Popen(["etcd", "60"], executable="sleep", cwd=state)
    deadline = time.monotonic() + 5
    while b"etcd" not in open(f"/proc/{proc.pid}/cmdline", "rb").read() and time.monotonic() < deadline:
        time.sleep(0.01)
    yield state.parent, proc.pid
    proc.kill()
    proc.wait()


def test_components_are_found_by_the_checkout_they_run_in(fake_component):
    checkout, pid = fake_component
    assert (pid, "etcd") in embedded._component_processes()[checkout.resolve()]


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_a_taken_port_is_reported_in_one_line_with_its_holder(monkeypatch, proto):
    kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        if proto == "tcp":
            s.listen()
        port = s.getsockname()[1]
        spec = ("127.0.0.1", port) if proto == "tcp" else ("127.0.0.1", "udp", port)
        monkeypatch.setitem(embedded.PORTS, "etcd", [spec])
        with pytest.raises(embedded.ClusterError) as e:
            embedded._check_ports(["etcd"])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot start etcd: 127.0.0.1:{port}/{proto} is in use by pid {os.getpid()} ("), msg
    # free again: no complaint
    embedded._check_ports(["etcd"])


def test_a_wildcard_listener_counts_as_taken(monkeypatch):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setitem(embedded.PORTS, "kube-apiserver", [(embedded.NODE_IP, port)])
        with pytest.raises(embedded.ClusterError, match=f"{embedded.NODE_IP}:{port}/tcp is in use"):
            embedded._check_ports(["kube-apiserver"])
