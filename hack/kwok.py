#!/usr/bin/env python3
"""kwok (sigs.k8s.io/kwok) against the embedded cluster: fake Nodes kept Ready and the pods bound to them moved
through their lifecycle without a kubelet, for the control-plane simulation (tests/benchmarks/scale_sim.py).

    hack/kwok.py up                 start the kwok controller (a host process; a no-op when it runs)
    hack/kwok.py down               delete every fake node, stop the controller
    hack/kwok.py nodes N            make the fake nodes kwok-0000 ... kwok-<N-1> (the missing ones)
    hack/kwok.py delete-nodes       delete every fake node (label type=kwok)
    hack/kwok.py status             the controller's pid and the fake nodes, Ready or not

- The binary is hack/build-binaries.sh's `kwok` target (KWOK_VERSION in hack/versions.env, never built by
  default). kwokctl is not used (it downloads binaries): the controller runs with flags and a config file this
  module writes (.cluster/config/kwok.yaml) holding its Stages, ours: a node is made Ready once, its heartbeat is
  its Lease (--node-lease-duration-seconds, renewed every quarter of it, well inside the controller manager's
  20 s node-monitor-grace-period), a pod bound to a fake node goes straight to Running with every container
  running (one status write per pod), and a pod being deleted is removed. Its log is .cluster/logs/kwok.log.
- kwok manages only the nodes carrying the annotation kwok.x-k8s.io/node=fake. A fake node has a realistic size
  (8 CPU, 64 GiB, 110 pods), the label type=kwok and the taint kwok.x-k8s.io/node=fake:NoSchedule, so no real
  workload lands there: a simulated job's template tolerates the taint and selects type=kwok.
- Network rule: every fake pod's IP is a loopback address. Each fake node gets its own spec.podCIDR, a /24 of
  127.16.0.0/12 (fake_pod_cidr), and kwok hands out pod IPs from the node's podCIDR (its --cidr, used only for a node
  without one, is loopback too): whatever is sent to a fake pod (the operator's progress and hang probes) stays on
  this machine, and a connection to a fake pod is refused at once unless a test listens there.
- `unmanage(names)` takes nodes from kwok as a node whose kubelet stopped: their Leases are handed to another holder
  (kwok neither renews them nor acts on their pods any more); `manage(names)` gives them back.

Standard library only (hack/ rule), like hack/cluster.py.
"""
from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

if not __package__:  # run as a script (python hack/kwok.py): hack.* from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hack import components  # noqa: E402
from hack.common import CACHE, CONF, KUBECONFIG, LOGS, ClusterError, binary as tool, logger, run, versions, write  # noqa: E402

log = logger("kwok")

NAME = "kwok"  # the component's name: .cluster/pids/kwok.pid, .cluster/logs/kwok.log
CONFIG = CONF / "kwok.yaml"
LOG = LOGS / f"{NAME}.log"
NODE_PREFIX = "kwok-"
NODE_LABEL = ("type", "kwok")
MANAGED_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
CAPACITY = {"cpu": "8", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
# Fake pods' addresses: loopback only. Node i gets the /24 number i of FAKE_PODS (4,096 nodes at most).
FAKE_PODS = ipaddress.ip_network("127.16.0.0/12")
DEFAULT_CIDR = "127.15.0.0/16"  # kwok's --cidr, for a node without a podCIDR (none of ours)
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
NODE_IP = "127.0.0.1"  # the fake nodes' InternalIP: nothing is served there
LEASE_SECONDS = 40  # renewed every 10 s
BATCH = 250  # nodes per kubectl call
# unmanage(): a lost node's Lease is handed to this holder, unexpired for this long (kwok leaves such a node alone).
LOST_HOLDER = "ddp-sim-node-lost"
LOST_LEASE_SECONDS = 3600


# The cluster kwok and the fake nodes are in: the embedded cluster's, unless fake_nodes() is given another kubeconfig.
_target = [KUBECONFIG]


def kubectl(*args: str, input: str | None = None, timeout: float = 60):
    return run([tool("kubectl"), f"--kubeconfig={_target[0]}", *args], input=input, timeout=timeout, quiet=True)


def binary() -> Path:
    """The pinned kwok controller (hack/build-binaries.sh kwok)."""
    return CACHE / f"kwok-{versions()['KWOK_VERSION']}" / "kwok"


# --------------------------------------------------------------------------------------------
# the stages and the controller's command line

_NODE_READY = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: ddp-node-ready
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'NotIn'
      values: ['True']
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      {{ range NodeConditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type | Quote }}
      {{ end }}
      addresses:
      - address: {{ NodeIP | Quote }}
        type: InternalIP
      - address: {{ .metadata.name | Quote }}
        type: Hostname
      allocatable: {CAPACITY}
      capacity: {CAPACITY}
      nodeInfo:
        architecture: amd64
        operatingSystem: linux
        kubeletVersion: fake
        kubeProxyVersion: fake
        containerRuntimeVersion: fake
        kernelVersion: fake
      phase: Running
"""

_POD_RUNNING = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: ddp-pod-running
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.podIP'
      operator: 'DoesNotExist'
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {type: PodScheduled, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
      {{ if .spec.initContainers }}
      initContainerStatuses:
      {{ range .spec.initContainers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        restartCount: 0
        {{ if eq (or .restartPolicy "") "Always" }}
        ready: true
        started: true
        state: {running: {startedAt: {{ $now | Quote }}}}
        {{ else }}
        ready: true
        started: false
        state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}
        {{ end }}
      {{ end }}
      {{ end }}
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        restartCount: 0
        started: true
        state: {running: {startedAt: {{ $now | Quote }}}}
      {{ end }}
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
      phase: Running
      startTime: {{ $now | Quote }}
"""

_POD_DELETE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: ddp-pod-delete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
    - key: '.metadata.finalizers'
      operator: 'DoesNotExist'
  next:
    delete: true
"""


def stages() -> str:
    """The controller's config file: our Stages (a node made Ready once, a pod Running at once, a deleted pod
    removed), as YAML documents."""
    capacity = json.dumps(CAPACITY)
    return "---\n".join([_NODE_READY.replace("{CAPACITY}", capacity), _POD_RUNNING, _POD_DELETE])


def argv(kubeconfig: Path = KUBECONFIG, config: Path = CONFIG) -> list[str]:
    """The kwok controller's command line against `kubeconfig`."""
    key, value = MANAGED_ANNOTATION
    # At a higher priority than the rest of this machine's work: on a busy 2-core machine a starved kwok renews its
    # nodes' Leases late, and the node controller turns them NotReady (a real kubelet has its own machine).
    return ["nice", "-n", "-5", str(binary()), f"--kubeconfig={kubeconfig}", f"--config={config}",
            f"--manage-nodes-with-annotation-selector={key}={value}", f"--cidr={DEFAULT_CIDR}",
            f"--node-ip={NODE_IP}", f"--node-lease-duration-seconds={LEASE_SECONDS}", "--node-port=0",
            "--server-address="]


def running() -> bool:
    return components.is_running(NAME)


def up(kubeconfig: Path = KUBECONFIG) -> None:
    """Start the controller (a no-op when it runs)."""
    if not binary().exists():
        raise ClusterError(f"{binary()} is missing: run `hack/build-binaries.sh kwok`")
    write(CONFIG, stages())
    if components.start(NAME, argv(kubeconfig)):
        time.sleep(1)
        if not running():
            raise ClusterError(f"kwok exited at once:\n{components.log_tail(NAME)}")
        log(f"kwok {versions()['KWOK_VERSION']} started (log: {LOG})")


def down() -> None:
    """Delete every fake node, then stop the controller."""
    delete_nodes()
    components.stop(NAME)


# --------------------------------------------------------------------------------------------
# fake nodes

def fake_pod_cidr(i: int) -> str:
    """Node i's podCIDR: the i-th /24 of FAKE_PODS (loopback)."""
    subnets = 2 ** (24 - FAKE_PODS.prefixlen)
    if not 0 <= i < subnets:
        raise ValueError(f"node index {i} out of range: {subnets} fake nodes at most")
    return str(ipaddress.ip_network((int(FAKE_PODS.network_address) + (i << 8), 24)))


def node_name(i: int) -> str:
    return f"{NODE_PREFIX}{i:04d}"


def node(i: int) -> dict:
    """Fake node i as created: kwok's annotation, our label and taint, its own loopback podCIDR."""
    cidr = fake_pod_cidr(i)
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node_name(i), "labels": {NODE_LABEL[0]: NODE_LABEL[1],
                                                          "kubernetes.io/hostname": node_name(i),
                                                          "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"},
                         "annotations": {MANAGED_ANNOTATION[0]: MANAGED_ANNOTATION[1]}},
            "spec": {"taints": [dict(TAINT)], "podCIDR": cidr, "podCIDRs": [cidr]},
            "status": {"capacity": dict(CAPACITY), "allocatable": dict(CAPACITY)}}


def is_loopback(ip: str | None) -> bool:
    """Whether `ip` is an IPv4 loopback address (the network rule every fake pod's IP must keep)."""
    try:
        return ipaddress.ip_address(ip or "") in LOOPBACK
    except ValueError:
        return False


def nodes_json() -> list[dict]:
    label = "=".join(NODE_LABEL)
    return json.loads(kubectl("get", "nodes", "-l", label, "-o", "json", timeout=120).stdout)["items"]


def ready(item: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (item.get("status") or {}).get("conditions") or [])


def create_nodes(count: int, timeout: float = 300) -> list[str]:
    """Fake nodes 0 .. count-1 (the missing ones created), every one Ready within `timeout`; their names."""
    have = {n["metadata"]["name"] for n in nodes_json()}
    missing = [node(i) for i in range(count) if node_name(i) not in have]
    delete_leases([n["metadata"]["name"] for n in missing])
    for start in range(0, len(missing), BATCH):
        items = missing[start:start + BATCH]
        kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
                timeout=300)
    names = [node_name(i) for i in range(count)]
    want = set(names)
    deadline = time.monotonic() + timeout
    while True:
        not_ready = want - {n["metadata"]["name"] for n in nodes_json() if ready(n)}
        if not not_ready:
            return names
        if time.monotonic() > deadline:
            raise ClusterError(f"{len(not_ready)} fake nodes not Ready after {timeout:.0f}s "
                               f"(e.g. {sorted(not_ready)[:3]}); kwok's log: {LOG}")
        time.sleep(1)


def delete_nodes() -> int:
    """Delete every fake node (label type=kwok); how many there were. Their pods go with them (the pod GC)."""
    items = nodes_json()
    if items:  # one request (a delete collection): a thousand one by one take minutes on a busy machine
        kubectl("delete", "--raw", f"/api/v1/nodes?labelSelector={NODE_LABEL[0]}%3D{NODE_LABEL[1]}", timeout=300)
    return len(items)


def delete_leases(names: list[str]) -> None:
    """Delete the node Leases left of `names` (the garbage collector deletes a node's Lease some time after the node):
    a node of the same name made meanwhile found its old Lease, kwok took it for the new node's, and renewing it
    failed for good (its UID precondition names an object that is gone), so that node never turned Ready. One list;
    a delete only for those still there (kubectl reads every name it is given first, a few a second)."""
    listed = kubectl("get", "lease", "-n", "kube-node-lease", "-o", "name").stdout.split()
    left = sorted({item.rsplit("/", 1)[-1] for item in listed} & set(names))
    for start in range(0, len(left), BATCH):
        kubectl("delete", "lease", "-n", "kube-node-lease", "--ignore-not-found", "--wait=false",
                *left[start:start + BATCH], timeout=300)


def lost_lease_patch() -> str:
    """The merge patch that hands a node's Lease to LOST_HOLDER for LOST_LEASE_SECONDS, its renewTime kept (the node
    controller sees no heartbeat after it, as for a kubelet that stopped)."""
    return json.dumps({"spec": {"holderIdentity": LOST_HOLDER, "leaseDurationSeconds": LOST_LEASE_SECONDS}})


def unmanage(names: list[str]) -> float:
    """Take `names` from kwok, as a node whose kubelet stopped: nothing renews their Lease and nothing acts on their
    pods any more. Returns when they were taken (epoch seconds).

    Removing the annotation kwok selects nodes by is not enough: kwok 0.8 filters its node watch on its side and
    drops the update of a node that stops matching, so it went on managing the node, and its stage deleted the node's
    pods as they were deleted, by name, without the UID precondition a kubelet sends. A pod the operator force-deleted
    and made again at once was deleted a second time that way (105 of 200 in a node storm). What kwok does honour is
    its Lease: a node whose Lease another holder holds, unexpired, is read-only to it (no stage runs for its pods),
    and it does not renew that Lease. The annotation goes too, so a kwok started again leaves these nodes alone."""
    at = time.time()
    key = MANAGED_ANNOTATION[0]
    for start in range(0, len(names), BATCH):
        kubectl("annotate", "nodes", *names[start:start + BATCH], f"{key}-", timeout=300)
        kubectl("patch", "lease", "-n", "kube-node-lease", *names[start:start + BATCH], "--type=merge",
                "-p", lost_lease_patch(), timeout=300)
    return at


def manage(names: list[str]) -> None:
    """Give `names` back to kwok, which makes them Ready again: their Leases deleted (kwok, which still tries them,
    makes a Lease of its own at its next renewal and manages the node from then on), the annotation back."""
    key, value = MANAGED_ANNOTATION
    for start in range(0, len(names), BATCH):
        kubectl("delete", "lease", "-n", "kube-node-lease", "--ignore-not-found", "--wait=false",
                *names[start:start + BATCH], timeout=300)
        kubectl("annotate", "nodes", *names[start:start + BATCH], f"{key}={value}", "--overwrite", timeout=300)


def not_ready_since(item: dict) -> float | None:
    """When a node's Ready condition last left True (epoch seconds); None while it is Ready or says nothing."""
    for c in (item.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") != "True" and c.get("lastTransitionTime"):
            stamp = datetime.strptime(c["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ")
            return stamp.replace(tzinfo=timezone.utc).timestamp()
    return None


@contextlib.contextmanager
def fake_nodes(count: int, kubeconfig: Path = KUBECONFIG) -> Iterator[list[str]]:
    """kwok running and `count` fake nodes Ready for the block; afterwards every fake node deleted and kwok stopped
    (the suite shares the cluster)."""
    _target[0] = Path(kubeconfig)
    try:
        up(kubeconfig)
        yield create_nodes(count)
    finally:
        try:
            delete_nodes()
        finally:
            components.stop(NAME)


def status() -> dict:
    items = nodes_json() if KUBECONFIG.exists() else []
    return {"running": running(), "pid": components.recorded_pid(NAME), "binary": str(binary()),
            "nodes": len(items), "ready": sum(1 for n in items if ready(n)), "log": str(LOG)}


def main(args: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up")
    sub.add_parser("down")
    n = sub.add_parser("nodes")
    n.add_argument("count", type=int)
    sub.add_parser("delete-nodes")
    sub.add_parser("status")
    a = ap.parse_args(args)
    try:
        if a.cmd == "up":
            up()
        elif a.cmd == "down":
            down()
        elif a.cmd == "nodes":
            print(len(create_nodes(a.count)))
        elif a.cmd == "delete-nodes":
            print(delete_nodes())
        else:
            print(json.dumps(status(), indent=2))
    except ClusterError as e:
        print(f"\nERROR: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
