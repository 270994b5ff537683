"""hack/kwok.py: the fake nodes and the kwok controller's command line keep the simulation's rules (every fake pod IP
on loopback, no real workload on a fake node, kwok's heartbeat inside the node controller's grace period), and the
Stages it writes are the ones a pod and a node need."""

from __future__ import annotations

import ipaddress
import json

import yaml

from hack import components, kwok
from hack.common import versions


def test_every_fake_node_gets_its_own_loopback_pod_cidr():
    cidrs = [ipaddress.ip_network(kwok.fake_pod_cidr(i)) for i in range(4096)]
    assert len(set(cidrs)) == 4096
    assert all(c.subnet_of(ipaddress.ip_network("127.0.0.0/8")) and c.prefixlen == 24 for c in cidrs)
    assert ipaddress.ip_network(kwok.DEFAULT_CIDR).subnet_of(ipaddress.ip_network("127.0.0.0/8"))
    try:
        kwok.fake_pod_cidr(4096)
    except ValueError:
        pass
    else:
        raise AssertionError("a 4,097th node must not reuse a podCIDR")


def test_a_fake_node_is_marked_for_kwok_and_tainted_against_real_workloads():
    node = kwok.node(7)
    meta, spec = node["metadata"], node["spec"]
    assert meta["name"] == "kwok-0007"
    assert meta["labels"]["type"] == "kwok"
    assert meta["annotations"] == {"kwok.x-k8s.io/node": "fake"}
    assert spec["taints"] == [{"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}]
    assert spec["podCIDR"] == spec["podCIDRs"][0] == "127.16.7.0/24"
    assert node["status"]["capacity"] == {"cpu": "8", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}


def test_the_controller_runs_pinned_with_loopback_addresses_and_a_heartbeat_inside_the_grace_period():
    argv = kwok.argv()
    assert argv[:3] == ["nice", "-n", "-5"]
    argv = argv[3:]
    assert argv[0] == str(kwok.binary())
    assert f"kwok-{versions()['KWOK_VERSION']}" in argv[0] and versions()["KWOK_VERSION"] == "v0.8.0"
    flags = dict(a.split("=", 1) for a in argv[1:])
    assert flags["--manage-nodes-with-annotation-selector"] == "kwok.x-k8s.io/node=fake"
    assert ipaddress.ip_network(flags["--cidr"]).subnet_of(ipaddress.ip_network("127.0.0.0/8"))
    assert ipaddress.ip_address(flags["--node-ip"]).is_loopback
    # kwok renews a Lease every quarter of its duration; the controller manager waits 20 s (hack/components.py)
    assert int(flags["--node-lease-duration-seconds"]) / 4 < 20
    assert "--node-monitor-grace-period=20s" in components.argv_for("kube-controller-manager")
    assert flags["--server-address"] == "" and flags["--node-port"] == "0"  # kwok serves nothing on this machine


def test_the_stages_make_nodes_ready_pods_running_and_deleted_pods_gone():
    stages = {d["metadata"]["name"]: d for d in yaml.safe_load_all(kwok.stages())}
    assert set(stages) == {"ddp-node-ready", "ddp-pod-running", "ddp-pod-delete"}
    assert all(d["kind"] == "Stage" and d["apiVersion"] == "kwok.x-k8s.io/v1alpha1" for d in stages.values())
    running = stages["ddp-pod-running"]["spec"]
    assert running["resourceRef"] == {"apiGroup": "v1", "kind": "Pod"}
    assert "phase: Running" in running["next"]["statusTemplate"]
    assert "PodIPWith .spec.nodeName" in running["next"]["statusTemplate"]
    assert stages["ddp-pod-delete"]["spec"]["next"] == {"delete": True}
    assert '"pods": "110"' in stages["ddp-node-ready"]["spec"]["next"]["statusTemplate"]


def test_only_loopback_addresses_pass_the_network_rule():
    assert kwok.is_loopback("127.16.3.9")
    for ip in ("10.88.0.5", "10.0.0.7", "192.168.1.1", "172.16.0.1", "", None, "not-an-ip", "::1"):
        assert not kwok.is_loopback(ip), ip


def test_not_ready_since_reads_the_ready_condition():
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    lost = {"status": {"conditions": [{"type": "Ready", "status": "Unknown",
                                       "lastTransitionTime": "2026-01-01T00:00:10Z"}]}}
    assert kwok.not_ready_since(ready) is None
    assert kwok.not_ready_since(lost) == 1767225610.0
    assert kwok.not_ready_since({}) is None


def test_a_fake_node_made_again_never_finds_its_old_lease(monkeypatch):
    """The garbage collector deletes a deleted node's Lease some time later; a node of the same name made meanwhile
    found it, kwok renewed it under the old UID and failed for good, and the node never turned Ready."""
    calls, have = [], [0]

    def kubectl(*args, **kw):
        calls.append(args)
        have.append(1)
        listing = "lease.coordination.k8s.io/vm\n" + "".join(f"lease.coordination.k8s.io/{kwok.node_name(i)}\n"
                                                            for i in (0, 1))  # 1: its node was deleted before
        return type("P", (), {"stdout": listing if args[:2] == ("get", "lease") else ""})()
    monkeypatch.setattr(kwok, "kubectl", kubectl)
    monkeypatch.setattr(kwok, "nodes_json", lambda: [
        {"metadata": {"name": kwok.node_name(i)}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        for i in sorted(set(have))])
    kwok.create_nodes(2)
    leases = [c for c in calls if c[:2] == ("delete", "lease")]
    assert leases and kwok.node_name(1) in leases[0] and kwok.node_name(0) not in leases[0] and "vm" not in leases[0]
    assert calls.index(leases[0]) < next(i for i, c in enumerate(calls) if c[0] == "create")


def test_a_lost_node_is_taken_from_kwok_by_its_lease_and_given_back(monkeypatch):
    """kwok 0.8 drops the update of a node that stops matching its annotation selector: it went on acting on the
    node's pods (deleting them by name, replacements included). A Lease held by another holder, unexpired, is what
    makes a node read-only to kwok; giving the node back deletes that Lease so kwok makes its own again."""
    calls = []
    monkeypatch.setattr(kwok, "kubectl", lambda *args, **kw: calls.append(args))
    names = [kwok.node_name(i) for i in range(3)]
    kwok.unmanage(names)
    patch = next(c for c in calls if c[:2] == ("patch", "lease"))
    assert all(n in patch for n in names) and "kube-node-lease" in patch
    spec = json.loads(patch[patch.index("-p") + 1])["spec"]
    assert spec == {"holderIdentity": kwok.LOST_HOLDER, "leaseDurationSeconds": kwok.LOST_LEASE_SECONDS}
    assert "renewTime" not in spec  # the last heartbeat stays the kubelet's last one
    assert kwok.LOST_LEASE_SECONDS > 600  # unexpired for the whole scenario: kwok may take an expired Lease back
    calls.clear()
    kwok.manage(names)
    deleted = next(c for c in calls if c[:2] == ("delete", "lease"))
    assert all(n in deleted for n in names)
    assert calls.index(deleted) < next(i for i, c in enumerate(calls) if c[0] == "annotate")
