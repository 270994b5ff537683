"""What every hack/ script shares: the repository's paths (from this file's place, so a copy of hack/ is a
checkout of its own), the pinned versions (hack/versions.env), the embedded cluster's network plan and
containerd, the errors, the run/log helpers, and containerd's config (the embedded cluster's and a kind node's).

Standard library only, so the scripts run before the virtualenv exists.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
STATE = REPO / ".cluster"
PKI = STATE / "pki"
CONF = STATE / "config"
LOGS = STATE / "logs"
PIDS = STATE / "pids"
ETCD_DATA = STATE / "etcd"
KUBECONFIG = STATE / "kubeconfig"
REGISTRY_HOSTS_DIR = CONF / "certs.d"  # containerd's registry hosts (config_path): <host:port>/hosts.toml
AUDIT_LOG = LOGS / "audit.log"

CACHE = Path(os.environ.get("DDPJOB_CACHE", Path.home() / ".cache" / "ddpjob"))

# Network plan. The bridge address doubles as the node IP and the cluster DNS address.
BRIDGE = "cni0"
NODE_IP = "10.88.0.1"
POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.0.0.0/24"
KUBERNETES_SERVICE_IP = "10.0.0.1"
CLUSTER_DOMAIN = "cluster.local"
CNI_NETWORK = "ddpjob"
API_PORT = 6443
API_URL = f"https://{NODE_IP}:{API_PORT}"
ETCD_URL = "http://127.0.0.1:2379"

# containerd: private socket/root/state; the root (image store) is kept across down/up.
CONTAINERD_ROOT = Path("/var/lib/ddpjob/containerd")
CONTAINERD_STATE = Path("/run/ddpjob/containerd")
CONTAINERD_SOCK = "/run/ddpjob/containerd.sock"
RUNC_ROOT = "/run/ddpjob/runc"  # runc's own state (default /run/containerd/runc)
K8S_NAMESPACE = "k8s.io"  # containerd namespace the CRI plugin uses
# Host-wide, beside the image store (it survives `down`, unlike /run/ddpjob): which checkout owns the
# cluster, and the lock that serialises up/down across checkouts.
HOST_STATE = CONTAINERD_ROOT.parent
OWNER_FILE = HOST_STATE / "owner.json"
KUBELET_ROOT = Path("/var/lib/kubelet")
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
PAUSE_VERSION = "3.10.1"  # the pause version Kubernetes 1.34 ships
PAUSE_IMAGE = f"localhost/pause:{PAUSE_VERSION}"

NODE_NAME = os.environ.get("DDPJOB_NODE_NAME") or socket.gethostname().split(".")[0].lower()

# Start order; `down` stops in reverse (kubelet first, so it cannot restart containers).
COMPONENTS = ["containerd", "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
              "coredns", "kube-proxy", "kube-router", "kubelet"]
CONTROL_PLANE = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "coredns"]


class ClusterError(RuntimeError):
    """A step failed; the message already carries the relevant log tail."""


class BuildError(RuntimeError):
    """An image build (hack/image.py, hack/kind_node.py) failed; the message says which step."""


# --------------------------------------------------------------------------------------------
# small helpers

def logger(name: str) -> Callable[[str], None]:
    """A log function whose lines on stderr name the script: `[name HH:MM:SS] message`."""
    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return log


log = logger("cluster")


def versions() -> dict[str, str]:
    out = {}
    for line in (REPO / "hack" / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


def pinned_path(name: str) -> Path | None:
    """Where hack/build-binaries.sh puts the pinned build of `name`; None for tools nobody pins."""
    v = versions()
    where = {"etcd": f"etcd-{v['ETCD_VERSION']}", "coredns": f"coredns-{v['COREDNS_VERSION']}",
             "helm": f"helm-{v['HELM_VERSION']}", "kube-router": f"kube-router-{v['KUBE_ROUTER_VERSION']}",
             "prometheus": f"prometheus-{v['PROMETHEUS_VERSION']}", "registry": f"registry-{v['DISTRIBUTION_VERSION']}",
             "crane": f"crane-{v['GGCR_VERSION']}"}
    if name.startswith("kube") and name not in where:
        return CACHE / f"kube-{v['KUBE_VERSION']}" / name
    return CACHE / where[name] / name if name in where else None


def binary(name: str) -> str:
    """Path of a built component (kube-*, kubectl, etcd, coredns, helm) or a system tool."""
    path = pinned_path(name)
    if path is None:
        found = shutil.which(name, path=path_env())
        if not found:
            raise ClusterError(f"{name} not found on PATH; run hack/install-deps.sh")
        return found
    if not os.access(path, os.X_OK):
        raise ClusterError(f"{path} is missing; run hack/build-binaries.sh")
    return str(path)


def path_env() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin",
                            "/usr/bin", "/sbin", "/bin"])


def run(argv: list[str], check: bool = True, input: str | None = None, timeout: float = 120,
        quiet: bool = False) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PATH": path_env()})
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stderr.strip() or p.stdout.strip()}")
    if not quiet and p.returncode != 0:
        log(f"(ignored) {' '.join(argv[:4])}...: {p.stderr.strip()[:200]}")
    return p


def kubectl(*args: str, check: bool = True, input: str | None = None, timeout: float = 60):
    return run([binary("kubectl"), f"--kubeconfig={KUBECONFIG}", *args], check=check, input=input,
               timeout=timeout, quiet=True)


def ctr(*args: str, check: bool = True, input: str | None = None, timeout: float = 600, namespace=K8S_NAMESPACE):
    return run(["ctr", "--address", CONTAINERD_SOCK, "--namespace", namespace, *args], check=check,
               input=input, timeout=timeout, quiet=True)


def write(path: Path, text: str, mode: int = 0o644) -> Path:
    """Write only when the content changes: kube-proxy exits when its config file is rewritten."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():  # .cluster/kubeconfig linked to another checkout's cluster: never write through
        path.unlink()
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    path.chmod(mode)
    return path


# --------------------------------------------------------------------------------------------
# containerd's config

CONTAINERD_CONFIG = """\
# containerd of a Kubernetes node (hack/common.py): the CRI plugin, runc, overlayfs, Debian's CNI plugins.
version = 2
{private}[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  enable_selinux = false
  # Where root lacks CAP_SYS_RESOURCE, runc cannot give the pause container the kubelet's oom_score_adj of
  # -998; clamp to containerd's own score instead of failing every sandbox.
  restrict_oom_score_adj = {restrict_oom_score_adj}
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = {systemd_cgroup}
{runc_root}  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin_dir}"
    conf_dir = "{cni_conf_dir}"
    max_conf_num = 1
{registry}"""

# Registry hosts: one <host:port>/hosts.toml per registry, read at each pull, so a registry added later (hack/registry.py)
# needs no restart of containerd. Without a hosts.toml a loopback registry is reached over plain HTTP, any other over
# HTTPS (containerd's defaults).
REGISTRY_CONFIG = """\
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{config_path}"
"""


def containerd_config(sandbox_image: str, cni_conf_dir: str | Path, *, systemd_cgroup: bool,
                      restrict_oom_score_adj: bool, private: bool, registry_hosts: str | Path | None = None) -> str:
    """containerd's config.toml, the embedded cluster's (hack/configs.py) and a kind node's (hack/kind_node.py).
    private: the embedded cluster's own root, state, socket and runc state, so that it never meets a system
    containerd; a kind node's containerd is alone in its container and keeps containerd's defaults.
    registry_hosts: the directory of the registries' hosts.toml files (REGISTRY_HOSTS_DIR for the embedded cluster)."""
    return CONTAINERD_CONFIG.format(
        private=(f'root = "{CONTAINERD_ROOT}"\nstate = "{CONTAINERD_STATE}"\n[grpc]\n  address = "{CONTAINERD_SOCK}"\n'
                 f'[ttrpc]\n  address = "{CONTAINERD_SOCK}.ttrpc"\n') if private else "",
        sandbox_image=sandbox_image, restrict_oom_score_adj=str(restrict_oom_score_adj).lower(),
        systemd_cgroup=str(systemd_cgroup).lower(), runc_root=f'        Root = "{RUNC_ROOT}"\n' if private else "",
        cni_bin_dir=CNI_BIN_DIR, cni_conf_dir=cni_conf_dir,
        registry=REGISTRY_CONFIG.format(config_path=registry_hosts) if registry_hosts else "")
