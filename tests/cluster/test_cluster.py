"""The cluster behaves like a real one: what the operator and the trainer pods rely on.

Runs against the embedded cluster (hack/cluster.py) or the DDPJOB_TEST_KUBECONFIG cluster; the checks that reach
into the node from the host (killing a container's process) need the embedded one.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster

TEST_IMAGE = "localhost/ddp-testimage:0.1.0"  # built by the `testimage` fixture (tests/cluster/conftest.py)


def pod_manifest(name: str, args: list[str], *, restart: str = "Never", pull: str = "IfNotPresent",
                 command: list[str] | None = None, labels: dict | None = None, spec: dict | None = None,
                 container: dict | None = None) -> dict:
    """A one-container Pod of the test image; `args` go to its entrypoint (probe.py) unless command is set."""
    main = {"name": "main", "image": TEST_IMAGE, "imagePullPolicy": pull, "args": args,
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}}, **(container or {})}
    if command:
        main["command"] = command
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 5, "containers": [main],
                     **(spec or {})}}


def terminated(pod: dict) -> dict:
    return pod["status"]["containerStatuses"][0]["state"]["terminated"]


# 1 ------------------------------------------------------------------------------------------

def test_node_ready_readyz_and_versions(kubectl):
    nodes = kubectl.json("get", "nodes")["items"]
    assert nodes, "the cluster has no node"
    for node in nodes:
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", f"node {node['metadata']['name']} not Ready: {node['status']['conditions']}"
    assert kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
    versions = json.loads(kubectl("version", "-o", "json").stdout)
    assert versions["clientVersion"]["gitVersion"].startswith("v1.34."), versions["clientVersion"]
    assert versions["serverVersion"]["gitVersion"].startswith("v1.34."), versions["serverVersion"]
    assert versions["serverVersion"]["minor"] == "34"


# 2 ------------------------------------------------------------------------------------------

def test_local_image_pod_runs_python_to_completion(kubectl, namespace, testimage):
    kubectl.apply(pod_manifest("ok", ["import sys; print('hello from', sys.version.split()[0])"],
                               command=["python3", "-c"]), namespace)
    pod = kubectl.wait_pod_phase(namespace, "ok", "Succeeded", timeout=120)
    assert terminated(pod)["exitCode"] == 0
    assert "hello from 3.11" in kubectl("logs", "-n", namespace, "ok").stdout


def test_local_image_pod_exit_code_3_is_failed(kubectl, namespace, testimage):
    # pull policy Never: the image can only come from the node's containerd
    kubectl.apply(pod_manifest("three", ["import sys; sys.exit(3)"], command=["python3", "-c"], pull="Never"),
                  namespace)
    pod = kubectl.wait_pod_phase(namespace, "three", "Failed", timeout=120)
    assert terminated(pod)["exitCode"] == 3
    assert terminated(pod)["reason"] == "Error"


# 3 ------------------------------------------------------------------------------------------

def test_headless_service_resolves_and_connects_before_ready(kubectl, namespace, testimage):
    """Pod b finds pod a by its stable DNS name and talks to it while a is not Ready: what torchrun
    rendezvous needs from the operator's headless Service (publishNotReadyAddresses)."""
    kubectl.apply(textwrap.dedent("""\
        apiVersion: v1
        kind: Service
        metadata: {name: grp}
        spec:
          clusterIP: None
          publishNotReadyAddresses: true
          selector: {app: grp}
          ports: [{name: rdzv, port: 29400}]
        """), namespace)
    never_ready = {"readinessProbe": {"exec": {"command": ["false"]}, "periodSeconds": 2}}
    kubectl.apply(pod_manifest("a", ["serve", "29400"], labels={"app": "grp"},
                               spec={"hostname": "a", "subdomain": "grp"}, container=never_ready), namespace)
    kubectl.wait_pod_phase(namespace, "a", "Running", timeout=120)
    fqdn = f"a.grp.{namespace}.svc.cluster.local"
    kubectl.apply(pod_manifest("b", ["connect", fqdn, "29400", "90"], labels={"app": "grp"},
                               spec={"hostname": "b", "subdomain": "grp"}), namespace)
    pod_b = kubectl.wait_pod_phase(namespace, "b", "Succeeded", timeout=150)
    a = kubectl.pod(namespace, "a")
    assert {c["type"]: c["status"] for c in a["status"]["conditions"]}["Ready"] == "False"
    assert terminated(pod_b)["exitCode"] == 0
    assert f"{fqdn} -> {a['status']['podIP']}:29400 said pong" in kubectl("logs", "-n", namespace, "b").stdout
    assert f"connection from {pod_b['status']['podIP']}" in kubectl("logs", "-n", namespace, "a").stdout


# 4 ------------------------------------------------------------------------------------------

def test_service_account_lists_pods_in_cluster_and_is_refused_elsewhere(kubectl, namespace, testimage):
    kubectl.apply(textwrap.dedent(f"""\
        apiVersion: v1
        kind: ServiceAccount
        metadata: {{name: lister}}
        ---
        apiVersion: rbac.authorization.k8s.io/v1
        kind: Role
        metadata: {{name: pod-reader}}
        rules:
        - {{apiGroups: [""], resources: [pods], verbs: [get, list]}}
        ---
        apiVersion: rbac.authorization.k8s.io/v1
        kind: RoleBinding
        metadata: {{name: lister-reads-pods}}
        roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-reader}}
        subjects: [{{kind: ServiceAccount, name: lister, namespace: {namespace}}}]
        """), namespace)
    kubectl.apply(pod_manifest("client", ["sleep"], restart="Always", spec={"serviceAccountName": "lister"}),
                  namespace)
    kubectl.wait_pod_phase(namespace, "client", "Running", timeout=120)

    # In-cluster config: KUBERNETES_SERVICE_HOST (the ClusterIP, via kube-proxy) + the projected token.
    ok = kubectl("exec", "-n", namespace, "client", "--", "python3", "/app/probe.py", "api-list-pods", namespace,
                 check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout) == {"status": 200, "pods": ["client"], "message": None}

    for path in (f"/api/v1/namespaces/{namespace}/secrets", "/api/v1/namespaces/default/pods"):
        denied = kubectl("exec", "-n", namespace, "client", "--", "python3", "/app/probe.py", "api-get", path,
                         check=False)
        assert denied.returncode == 3, denied.stdout + denied.stderr
        body = json.loads(denied.stdout)
        assert body["status"] == 403
        assert f"system:serviceaccount:{namespace}:lister" in body["message"]


# 5 ------------------------------------------------------------------------------------------

def container_pids(pod: dict) -> list[int]:
    """Host PIDs of a pod's main container, found through /proc (the container's cgroup path holds
    the pod UID and the container ID under the kubelet's cgroupfs layout)."""
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    uid = pod["metadata"]["uid"]
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cg = (d / "cgroup").read_text()
            except OSError:
                continue
            if f"pod{uid}/{cid}" in cg:
                pids.append(int(d.name))
    return pids


@pytest.fixture
def host_access(cluster):
    if not cluster.embedded:
        pytest.skip("needs the embedded cluster: the test reaches container processes from the host")


def test_sigkill_from_host_fails_or_restarts_the_container(kubectl, namespace, testimage, host_access):
    kubectl.apply(pod_manifest("once", ["sleep"], restart="Never"), namespace)
    kubectl.apply(pod_manifest("always", ["sleep"], restart="Always"), namespace)
    for name in ("once", "always"):
        pod = kubectl.wait_pod_phase(namespace, name, "Running", timeout=120)
        pids = wait_for(lambda: container_pids(kubectl.pod(namespace, name)), 30, f"{name}'s process on the host")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    once = kubectl.wait_pod_phase(namespace, "once", "Failed", timeout=60)
    assert terminated(once)["exitCode"] == 137  # 128 + SIGKILL, as the kubelet reports it

    def restarted():
        st = kubectl.pod(namespace, "always")["status"]
        cs = st["containerStatuses"][0]
        return st["phase"] == "Running" and cs["restartCount"] >= 1 and "running" in cs["state"] and cs

    cs = wait_for(restarted, 90, "the Always pod's container to be restarted")
    assert cs["lastState"]["terminated"]["exitCode"] == 137


def test_force_delete_removes_pod_and_its_processes(kubectl, namespace, testimage, host_access):
    kubectl.apply(pod_manifest("doomed", ["sleep"], restart="Always"), namespace)
    pod = kubectl.wait_pod_phase(namespace, "doomed", "Running", timeout=120)
    pids = wait_for(lambda: container_pids(pod), 30, "the container's process on the host")
    kubectl("delete", "pod", "doomed", "-n", namespace, "--grace-period=0", "--force")
    # The API object is gone at once (no graceful termination) ...
    gone = kubectl("get", "pod", "doomed", "-n", namespace, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    # ... and the kubelet then kills the container on the node.
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 60, "the container's processes to exit")


# 6 ------------------------------------------------------------------------------------------

def test_garbage_collector_deletes_owned_pods(kubectl, namespace, testimage):
    kubectl("create", "configmap", "owner", "-n", namespace)
    owner_uid = kubectl.json("get", "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    for name in ("child-1", "child-2"):
        manifest = pod_manifest(name, ["sleep"], restart="Always")
        manifest["metadata"]["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}]
        kubectl.apply(manifest, namespace)
    kubectl("create", "configmap", "bystander", "-n", namespace)
    kubectl.apply(pod_manifest("unowned", ["sleep"], restart="Always"), namespace)

    kubectl("delete", "configmap", "owner", "-n", namespace)  # background propagation, the default
    wait_for(lambda: not [p for p in kubectl.json("get", "pods", "-n", namespace)["items"]
                          if p["metadata"]["name"].startswith("child-")], 90, "owned pods to be collected")
    assert kubectl("get", "pod", "unowned", "-n", namespace, check=False).returncode == 0


def test_local_image_pod_reaches_running_quickly(kubectl, namespace, testimage):
    """Not a benchmark (hack/cluster.py figures prints the number); guards against a slow regression."""
    start = time.monotonic()
    kubectl.apply(pod_manifest("quick", ["sleep"], restart="Always"), namespace)
    kubectl.wait_pod_phase(namespace, "quick", "Running", timeout=60)
    elapsed = time.monotonic() - start
    print(f"pod from a local image Running after {elapsed:.1f}s")
    assert elapsed < 30


# 7 ------------------------------------------------------------------------------------------

CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close(); print('open')\n"
           "except OSError as e:\n"
           "    print('blocked', e)\n")


def test_network_policies_are_enforced(cluster, kubectl, namespace, testimage):
    """A NetworkPolicy admits only the peers it names, a namespace without one stays open, and the node
    still reaches the pods: what every DDPJob's policy relies on (the embedded cluster runs kube-router)."""
    kubectl.apply(pod_manifest("server", ["serve", "29400"], labels={"app": "server"}), namespace)
    kubectl.apply(pod_manifest("friend", ["sleep"], labels={"role": "friend"}), namespace)
    kubectl.apply(pod_manifest("stranger", ["sleep"]), namespace)
    ip = kubectl.wait_pod_phase(namespace, "server", "Running", timeout=120)["status"]["podIP"]
    for name in ("friend", "stranger"):
        kubectl.wait_pod_phase(namespace, name, "Running", timeout=120)

    def reach(pod: str) -> str:
        return kubectl("exec", "-n", namespace, pod, "--", "python3", "-c", CONNECT, ip, "29400").stdout.strip()

    assert reach("stranger") == "open", "without a policy every pod is reachable"
    kubectl.apply({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "server"},
                   "spec": {"podSelector": {"matchLabels": {"app": "server"}}, "policyTypes": ["Ingress"],
                            "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "friend"}}}]}]}},
                  namespace)
    try:
        blocked = wait_for(lambda: (lambda r: r.startswith("blocked") and r)(reach("stranger")), 60,
                           "the policy to refuse the stranger")
    except AssertionError as e:
        raise AssertionError(f"NetworkPolicies are not enforced (no enforcer? hack/cluster.py runs kube-router): "
                             f"{e}") from None
    assert reach("friend") == "open"
    print(f"stranger: {blocked}")
    if cluster.embedded:  # the node is this host: it (kubelet probes, the API server's pod proxy) gets through
        with socket.create_connection((ip, 29400), timeout=5) as s:
            assert s.recv(16).strip() == b"pong"
