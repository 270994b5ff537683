#!/usr/bin/env python3
"""The embedded single-node Kubernetes cluster: upstream components run as host processes.

    hack/cluster.py up        start (or finish starting) the cluster; a no-op when it is up
    hack/cluster.py down      stop it and remove every trace from the host (images are kept)
    hack/cluster.py down --purge   also forget images, PKI and the containerd image store
    hack/cluster.py status [--json]   component health and memory
    hack/cluster.py figures           idle memory and local-image pod start time (JSON)
    hack/cluster.py leftovers         what `down` should have removed but is still there
    hack/cluster.py restart|stop|start COMPONENT   one component of the running cluster (fault
                                      injection: `restart apiserver`, `stop kubelet` ... `start kubelet`)
    hack/cluster.py kubectl ARGS...   kubectl with the cluster's admin kubeconfig
    hack/cluster.py ctr ARGS...       ctr against the cluster's containerd, namespace k8s.io

Layout (why each piece is where it is):
- Binaries come from hack/build-binaries.sh's cache (~/.cache/ddpjob, override DDPJOB_CACHE);
  containerd, runc and the CNI plugins from Debian.
- `.cluster/` at the repository root holds everything per-checkout: PKI, kubeconfigs, component
  configs, logs (including the API audit log), pid files and the etcd data.
- containerd gets its own socket/root/state (/run/ddpjob, /var/lib/ddpjob/containerd) so it never
  fights a system containerd; its image store survives `down` the way a node's image cache does.
- One cluster per host (fixed bridge, ports and containerd socket): the checkout whose `up` started
  it owns it, recorded in /var/lib/ddpjob/owner.json (and visible as its components' working
  directory, <checkout>/.cluster). `up` from another checkout reuses it (.cluster/kubeconfig becomes
  a link to the owner's); `down` there stops nothing. A failed `up` stops what it started.
- `restart`/`stop`/`start COMPONENT` act on the host's cluster whichever checkout owns it: they change
  no configuration, so they are safe from any checkout. `stop` records the component's exact command
  line, working directory and environment (read from /proc) in <owner>/.cluster/pids/<name>.stopped.json;
  `start` and `restart` relaunch exactly that, with the owner's pid file and log. containerd is not
  offered (it holds every container); `up` starts whatever is stopped, `down` stops everything.
- Networking: the CNI bridge `cni0` owns 10.88.0.1/16 and is created before anything starts. That
  address is the node IP: the API server, kubelet and CoreDNS listen on it (pods reach all three),
  etcd and health endpoints stay on loopback. Nothing listens on the host's real interfaces.
  Pods reach the API through the `kubernetes` ClusterIP (10.0.0.1) via kube-proxy (iptables mode),
  and resolve names through CoreDNS on the host (kubelet clusterDNS = the bridge IP).
- NetworkPolicies: the bridge plugin enforces none, so kube-router runs its firewall controller only
  (no routing, no service proxy): iptables chains KUBE-ROUTER-*/KUBE-POD-FW-*/KUBE-NWPLCY-* and ipsets
  KUBE-*, on bridged traffic too (br_netfilter). It always lets the node reach its own pods (kubelet
  probes, the API server's pod proxy, a host-process operator); namespaces without a policy stay open.

Standard library only, so `python3 hack/cluster.py` works before the virtualenv exists.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE = REPO / ".cluster"
PKI = STATE / "pki"
CONF = STATE / "config"
LOGS = STATE / "logs"
PIDS = STATE / "pids"
ETCD_DATA = STATE / "etcd"
KUBECONFIG = STATE / "kubeconfig"
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

# What each component listens on (checked before it starts: a clear message instead of its own
# `bind: address already in use` at the end of its flags). "udp" marks CoreDNS's UDP socket.
PORTS = {
    "etcd": [("127.0.0.1", 2379), ("127.0.0.1", 2380), ("127.0.0.1", 2381)],
    "kube-apiserver": [(NODE_IP, API_PORT)],
    "kube-controller-manager": [("127.0.0.1", 10257)],
    "kube-scheduler": [("127.0.0.1", 10259)],
    "coredns": [(NODE_IP, 53), (NODE_IP, "udp", 53)],
    "kube-proxy": [("127.0.0.1", 10256), ("127.0.0.1", 10249)],
    "kubelet": [(NODE_IP, 10250), ("127.0.0.1", 10248)],
}

# Host values the kubelet/kube-proxy change; saved at the first `up`, restored by `down`.
TOUCHED_SYSCTLS = ["net.ipv4.ip_forward", "vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops"]
# Bridged pod-to-pod frames pass iptables only with this on; kube-router's policies depend on it.
BRIDGE_NF_SYSCTL = "net.bridge.bridge-nf-call-iptables"


class ClusterError(RuntimeError):
    """A step failed; the message already carries the relevant log tail."""


# --------------------------------------------------------------------------------------------
# small helpers

def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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
             "helm": f"helm-{v['HELM_VERSION']}", "kube-router": f"kube-router-{v['KUBE_ROUTER_VERSION']}"}
    if name.startswith("kube") and name not in where:
        return CACHE / f"kube-{v['KUBE_VERSION']}" / name
    return CACHE / where[name] / name if name in where else None


def binary(name: str) -> str:
    """Path of a built component (kube-*, kubectl, etcd, coredns, helm) or a system tool."""
    path = pinned_path(name)
    if path is None:
        found = shutil.which(name, path=_path_env())
        if not found:
            raise ClusterError(f"{name} not found on PATH; run hack/install-deps.sh")
        return found
    if not os.access(path, os.X_OK):
        raise ClusterError(f"{path} is missing; run hack/build-binaries.sh")
    return str(path)


def _path_env() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin",
                            "/usr/bin", "/sbin", "/bin"])


def run(argv: list[str], check: bool = True, input: str | None = None, timeout: float = 120,
        quiet: bool = False) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PATH": _path_env()})
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


def log_tail(name: str, lines: int = 40) -> str:
    f = LOGS / f"{name}.log"
    if not f.exists():
        return f"(no log {f})"
    tail = f.read_text(errors="replace").splitlines()[-lines:]
    return f"--- last {len(tail)} lines of {f} ---\n" + "\n".join(tail)


def wait_for(what: str, check, timeout: float, component: str | None = None, interval: float = 0.25):
    """Poll check() until it returns a truthy value; fail with the component's log tail."""
    deadline = time.monotonic() + timeout
    last_err = None
    while time.monotonic() < deadline:
        if component and not is_running(component):
            raise ClusterError(f"{component} exited while waiting for {what}\n{log_tail(component)}")
        try:
            result = check()
            if result:
                return result
        except Exception as e:  # noqa: BLE001 - any failure just means "not yet"
            last_err = e
        time.sleep(interval)
    detail = f" (last error: {last_err})" if last_err else ""
    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}{detail}\n"
                       + (log_tail(component) if component else ""))


# --------------------------------------------------------------------------------------------
# processes

def _pid(name: str) -> int | None:
    try:
        return int((PIDS / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead


def is_running(name: str) -> bool:
    pid = _pid(name)
    if not pid or not _alive(pid):
        return False
    # guard against pid reuse: the recorded process must still be ours
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(name.encode() in part for part in cmd[:6])


_started: list[str] = []  # components this process started, in order (a failed `up` stops them)


def start(name: str, argv: list[str]) -> bool:
    """Start a component detached from us (own session) so it outlives `up`; False if already running."""
    if is_running(name):
        return False
    _started.append(name)
    for d in (LOGS, PIDS):
        d.mkdir(parents=True, exist_ok=True)
    logfile = LOGS / f"{name}.log"
    if logfile.exists():
        logfile.replace(LOGS / f"{name}.log.1")
    with open(logfile, "ab") as out:
        out.write(f"# {time.strftime('%F %T')} {' '.join(argv)}\n".encode())
        out.flush()
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             cwd=STATE, start_new_session=True, env={**os.environ, "PATH": _path_env()})
    # Until the child has exec'd (and the kernel has set up its new arguments), /proc shows our own
    # or an empty cmdline and is_running() would say "not running".
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and p.poll() is None:
        try:
            if Path(argv[0]).name.encode() in Path(f"/proc/{p.pid}/cmdline").read_bytes():
                break
        except OSError:
            break
        time.sleep(0.002)
    (PIDS / f"{name}.pid").write_text(str(p.pid))
    return True


def stop(name: str, timeout: float = 15) -> None:
    pid = _pid(name)
    t0 = time.monotonic()
    if pid and is_running(name):
        _kill_group(name, pid, timeout)
        if time.monotonic() - t0 > 2:
            log(f"{name} took {time.monotonic() - t0:.1f}s to stop")
    (PIDS / f"{name}.pid").unlink(missing_ok=True)


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kib(pid: int) -> int:
    """Resident memory of a component: its process plus, for containerd (started under tini), the
    daemon itself; never the shims and pods that tini adopts as subreaper."""
    total = _rss(pid)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)
                comm = fields[0].split("(", 1)[1]
                if int(fields[1].split()[1]) == pid and comm == "containerd":
                    total += _rss(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return total


# --------------------------------------------------------------------------------------------
# PKI and kubeconfigs (openssl CLI; EC keys are quick to make)

def _cert(name: str, cn: str, orgs: tuple[str, ...] = (), sans: tuple[str, ...] = ()) -> None:
    key, crt = PKI / f"{name}.key", PKI / f"{name}.crt"
    if crt.exists() and key.exists():
        return
    subj = "".join(f"/O={o}" for o in orgs) + f"/CN={cn}"
    ext = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
           "extendedKeyUsage=serverAuth,clientAuth"]
    if sans:
        ext.append("subjectAltName=" + ",".join(sans))
    extfile = write(PKI / f"{name}.ext", "\n".join(ext) + "\n")
    run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key)])
    csr = run(["openssl", "req", "-new", "-key", str(key), "-subj", subj]).stdout
    run(["openssl", "x509", "-req", "-CA", str(PKI / "ca.crt"), "-CAkey", str(PKI / "ca.key"),
         "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "3650", "-extfile", str(extfile),
         "-out", str(crt)], input=csr)
    extfile.unlink()
    key.chmod(0o600)


def ensure_pki() -> None:
    PKI.mkdir(parents=True, exist_ok=True)
    if not (PKI / "ca.crt").exists():
        run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(PKI / "ca.key"), "-out", str(PKI / "ca.crt"), "-days", "3650",
             "-subj", "/CN=ddpjob-cluster-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"])
    if not (PKI / "sa.key").exists():  # service-account token signing key (RS256, the common choice)
        run(["openssl", "genrsa", "-out", str(PKI / "sa.key"), "2048"])
        run(["openssl", "rsa", "-in", str(PKI / "sa.key"), "-pubout", "-out", str(PKI / "sa.pub")])
    sans = ("DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
            f"DNS:kubernetes.default.svc.{CLUSTER_DOMAIN}", "DNS:localhost", "IP:127.0.0.1", f"IP:{NODE_IP}",
            f"IP:{KUBERNETES_SERVICE_IP}")
    _cert("apiserver", "kube-apiserver", sans=sans)
    # Client identities, each the user name the built-in RBAC bindings expect.
    _cert("admin", "kubernetes-admin", orgs=("system:masters",))
    _cert("apiserver-kubelet-client", "kube-apiserver-kubelet-client", orgs=("system:masters",))
    _cert("controller-manager", "system:kube-controller-manager")
    _cert("scheduler", "system:kube-scheduler")
    _cert("kube-proxy", "system:kube-proxy")
    _cert("coredns", "system:coredns")  # bound to a ClusterRole in bootstrap_rbac()
    _cert("kube-router", "system:kube-router")  # likewise
    _cert(f"node-{NODE_NAME}", f"system:node:{NODE_NAME}", orgs=("system:nodes",), sans=(f"IP:{NODE_IP}",))


def kubeconfig_text(user: str, cert: str) -> str:
    b64 = lambda p: base64.b64encode((PKI / p).read_bytes()).decode()  # noqa: E731
    return textwrap.dedent(f"""\
        apiVersion: v1
        kind: Config
        clusters:
        - name: ddpjob
          cluster:
            server: {API_URL}
            certificate-authority-data: {b64("ca.crt")}
        users:
        - name: {user}
          user:
            client-certificate-data: {b64(cert + ".crt")}
            client-key-data: {b64(cert + ".key")}
        contexts:
        - name: ddpjob
          context: {{cluster: ddpjob, user: {user}, namespace: default}}
        current-context: ddpjob
        """)


def _restricted_oom_score() -> bool:
    """True when this root cannot lower an oom_score_adj (no CAP_SYS_RESOURCE, as on our VMs)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return not int(line.split()[1], 16) & (1 << 24)  # CAP_SYS_RESOURCE
    return False


def write_configs() -> None:
    """Write every kubeconfig and component config; cheap and deterministic, so done on each `up`."""
    ensure_pki()
    write(KUBECONFIG, kubeconfig_text("admin", "admin"), 0o600)
    for name, cert in [("controller-manager", "controller-manager"), ("scheduler", "scheduler"),
                       ("kube-proxy", "kube-proxy"), ("coredns", "coredns"), ("kube-router", "kube-router"),
                       ("kubelet", f"node-{NODE_NAME}")]:
        write(CONF / f"{name}.kubeconfig", kubeconfig_text(name, cert), 0o600)

    # Audit: metadata of every write (who changed what, when); reads are too chatty to keep.
    # The operator's API-load benchmark reads this file.
    write(CONF / "audit-policy.yaml", textwrap.dedent("""\
        apiVersion: audit.k8s.io/v1
        kind: Policy
        omitStages: [RequestReceived]
        rules:
        - level: None
          verbs: [get, list, watch]
        - level: Metadata
        """))

    write(CONF / "containerd.toml", textwrap.dedent(f"""\
        # containerd for the embedded cluster: private socket/root/state, Debian's CNI plugins,
        # a locally built pause image, cgroupfs (no systemd here).
        version = 2
        root = "{CONTAINERD_ROOT}"
        state = "{CONTAINERD_STATE}"
        [grpc]
          address = "{CONTAINERD_SOCK}"
        [ttrpc]
          address = "{CONTAINERD_SOCK}.ttrpc"
        [plugins."io.containerd.grpc.v1.cri"]
          sandbox_image = "{PAUSE_IMAGE}"
          enable_selinux = false
          # root here lacks CAP_SYS_RESOURCE, so runc cannot give the pause container the kubelet's
          # oom_score_adj of -998; clamp to containerd's own score instead of failing every sandbox.
          restrict_oom_score_adj = {"true" if _restricted_oom_score() else "false"}
          [plugins."io.containerd.grpc.v1.cri".containerd]
            snapshotter = "overlayfs"
            default_runtime_name = "runc"
            [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
              runtime_type = "io.containerd.runc.v2"
              [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
                SystemdCgroup = false
                Root = "{RUNC_ROOT}"
          [plugins."io.containerd.grpc.v1.cri".cni]
            bin_dir = "{CNI_BIN_DIR}"
            conf_dir = "{CONF / 'cni'}"
            max_conf_num = 1
        """))

    # One bridge network; the bridge IP is the pods' gateway, DNS server and API endpoint.
    write(CONF / "cni" / "10-ddpjob.conflist", json.dumps({
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }, indent=2) + "\n")

    write(CONF / "kube-scheduler.yaml", textwrap.dedent(f"""\
        apiVersion: kubescheduler.config.k8s.io/v1
        kind: KubeSchedulerConfiguration
        clientConnection:
          kubeconfig: {CONF / 'scheduler.kubeconfig'}
        leaderElection:
          leaderElect: false
        """))

    write(CONF / "kubelet.yaml", textwrap.dedent(f"""\
        apiVersion: kubelet.config.k8s.io/v1beta1
        kind: KubeletConfiguration
        address: {NODE_IP}
        port: 10250
        readOnlyPort: 0
        healthzBindAddress: 127.0.0.1
        healthzPort: 10248
        authentication:
          anonymous: {{enabled: false}}
          webhook: {{enabled: true}}
          x509: {{clientCAFile: {PKI / 'ca.crt'}}}
        authorization:
          mode: Webhook
        containerRuntimeEndpoint: unix://{CONTAINERD_SOCK}
        cgroupDriver: cgroupfs          # no systemd on these machines; containerd uses cgroupfs too
        failSwapOn: false
        failCgroupV1: false             # the machines are cgroup v1
        clusterDNS: [{NODE_IP}]         # CoreDNS runs on the host, on the bridge address
        clusterDomain: {CLUSTER_DOMAIN}
        # The pause and local images cannot be pulled again: never garbage-collect images.
        imageGCHighThresholdPercent: 100
        imageGCLowThresholdPercent: 99
        # Small disks must not evict the test pods.
        evictionHard:
          memory.available: 100Mi
          nodefs.available: 1%
          nodefs.inodesFree: 1%
          imagefs.available: 1%
        serializeImagePulls: false
        rotateCertificates: false
        serverTLSBootstrap: false
        maxPods: 110
        """))

    write(CONF / "kube-proxy.yaml", textwrap.dedent(f"""\
        apiVersion: kubeproxy.config.k8s.io/v1alpha1
        kind: KubeProxyConfiguration
        mode: iptables
        clientConnection:
          kubeconfig: {CONF / 'kube-proxy.kubeconfig'}
        hostnameOverride: {NODE_NAME}
        clusterCIDR: {POD_CIDR}
        healthzBindAddress: 127.0.0.1:10256
        metricsBindAddress: 127.0.0.1:10249
        nodePortAddresses: ["{NODE_IP}/32"]   # never expose NodePorts on the host's real interfaces
        iptables:
          localhostNodePorts: false          # would flip route_localnet on the host
        conntrack:                           # leave the host's conntrack sysctls alone
          maxPerCore: 0
          min: 0
          tcpEstablishedTimeout: 0s
          tcpCloseWaitTimeout: 0s
        """))

    # CoreDNS: only cluster.local and reverse zones, short TTLs so a replaced pod is found quickly;
    # no forwarding (pods in tests need no outside names).
    write(CONF / "Corefile", textwrap.dedent(f"""\
        {CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
            bind {NODE_IP}
            errors
            kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
                kubeconfig {CONF / 'coredns.kubeconfig'}
                pods insecure
                ttl 5
            }}
            cache 5
        }}
        """))


BOOTSTRAP_RBAC = """\
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "ddpjob:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "ddpjob:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "ddpjob:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:coredns"}
---
# kube-router's informers (it starts them all, whichever controllers run) and its own Node.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "ddpjob:kube-router"}
rules:
- apiGroups: [""]
  resources: [pods, namespaces, nodes, services, endpoints]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "ddpjob:kube-router"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "ddpjob:kube-router"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:kube-router"}
"""


# --------------------------------------------------------------------------------------------
# probes

def _ssl_context(client: bool = True, pki: Path = PKI) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if client:
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return ctx


def http_ok(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 2) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - any failure is "not healthy"
        return False


def https_insecure_ok(url: str) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return http_ok(url, ctx)


def api_ready() -> bool:
    return http_ok(f"{API_URL}/readyz", _ssl_context())


def dns_query(name: str, server: str = NODE_IP, timeout: float = 1.0) -> list[str]:
    """Minimal A-record lookup over UDP (stdlib only); returns the addresses, [] for no answer."""
    qid = int.from_bytes(os.urandom(2), "big")
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    q += struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(q, (server, 53))
        resp = s.recv(4096)
    _, flags, _, ancount, _, _ = struct.unpack(">HHHHHH", resp[:12])
    if flags & 0xF:  # rcode
        return []
    pos = len(q)  # the answer section follows the echoed question
    out = []
    for _ in range(ancount):
        while resp[pos] != 0 and resp[pos] & 0xC0 != 0xC0:  # owner name
            pos += resp[pos] + 1
        pos += 2 if resp[pos] & 0xC0 == 0xC0 else 1
        rtype, _, _, rdlen = struct.unpack(">HHIH", resp[pos:pos + 10])
        pos += 10
        if rtype == 1 and rdlen == 4:
            out.append(socket.inet_ntoa(resp[pos:pos + 4]))
        pos += rdlen
    return out


def kube_router_ready() -> bool:
    """Its firewall chains are hooked into FILTER's INPUT/FORWARD/OUTPUT: the policy controller has started
    (kube-router's own /healthz would listen on every interface, so it is off)."""
    rules = run(["iptables", "-w", "-S"], check=False, quiet=True).stdout.splitlines()
    return all(any(r.startswith(f"-A {builtin} ") and r.endswith(f"-j KUBE-ROUTER-{builtin}") for r in rules)
               for builtin in ("INPUT", "FORWARD", "OUTPUT"))


def containerd_ready() -> bool:
    return Path(CONTAINERD_SOCK).exists() and ctr("version", check=False, timeout=10).returncode == 0


HEALTH = {
    "containerd": containerd_ready,
    "etcd": lambda: http_ok("http://127.0.0.1:2379/health"),
    "kube-apiserver": api_ready,
    "kube-controller-manager": lambda: https_insecure_ok("https://127.0.0.1:10257/healthz"),
    "kube-scheduler": lambda: https_insecure_ok("https://127.0.0.1:10259/healthz"),
    "coredns": lambda: dns_query(f"kubernetes.default.svc.{CLUSTER_DOMAIN}") == [KUBERNETES_SERVICE_IP],
    "kube-proxy": lambda: http_ok("http://127.0.0.1:10256/healthz"),
    "kube-router": kube_router_ready,
    "kubelet": lambda: http_ok("http://127.0.0.1:10248/healthz"),
}


# --------------------------------------------------------------------------------------------
# host preparation

def sysctl(key: str, value: str | None = None) -> str:
    path = Path("/proc/sys") / key.replace(".", "/")
    if value is not None:
        path.write_text(value)
    return path.read_text().strip()


def prepare_host() -> None:
    if os.geteuid() != 0:
        raise ClusterError("the embedded cluster needs root (it runs containerd, the kubelet and iptables)")
    if not (Path("/proc/sys") / BRIDGE_NF_SYSCTL.replace(".", "/")).exists():
        raise ClusterError("br_netfilter is not loaded (no /proc/sys/net/bridge): run `modprobe br_netfilter`; "
                           "NetworkPolicies between pods on the bridge are enforced only with it")
    saved = STATE / "sysctl-saved.json"
    if not saved.exists():
        write(saved, json.dumps({k: sysctl(k) for k in TOUCHED_SYSCTLS + [BRIDGE_NF_SYSCTL]}))
    sysctl("net.ipv4.ip_forward", "1")  # pods reach the outside and each other through the bridge
    sysctl(BRIDGE_NF_SYSCTL, "1")
    for key, minimum in [("fs.inotify.max_user_instances", 512), ("fs.inotify.max_user_watches", 524288)]:
        if int(sysctl(key)) < minimum:
            sysctl(key, str(minimum))
    # The bridge exists before anything binds to its address (API server, kubelet, CoreDNS);
    # the CNI bridge plugin adopts it.
    if not Path(f"/sys/class/net/{BRIDGE}").exists():
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    if NODE_IP not in run(["ip", "-4", "addr", "show", "dev", BRIDGE]).stdout:
        run(["ip", "addr", "add", f"{NODE_IP}/16", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])
    for d in (LOGS, PIDS, ETCD_DATA, CONTAINERD_STATE.parent, KUBELET_ROOT):
        d.mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------------------------
# component command lines

def argv_for(name: str) -> list[str]:
    if name == "containerd":
        # tini -s makes itself the subreaper: orphaned shims are reaped even though PID 1 is not an init.
        return [binary("tini"), "-s", "-g", "--", binary("containerd"), "--config", str(CONF / "containerd.toml")]
    if name == "etcd":
        return [binary("etcd"), "--name", "ddpjob", "--data-dir", str(ETCD_DATA),
                "--listen-client-urls", ETCD_URL, "--advertise-client-urls", ETCD_URL,
                "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                "--initial-cluster", "ddpjob=http://127.0.0.1:2380", "--listen-metrics-urls", "http://127.0.0.1:2381",
                "--unsafe-no-fsync",  # test cluster: durability is not worth the latency
                "--quota-backend-bytes", str(2 << 30), "--log-level", "warn"]
    if name == "kube-apiserver":
        return [binary("kube-apiserver"),
                f"--bind-address={NODE_IP}", f"--advertise-address={NODE_IP}", f"--secure-port={API_PORT}",
                f"--etcd-servers={ETCD_URL}",
                f"--tls-cert-file={PKI / 'apiserver.crt'}", f"--tls-private-key-file={PKI / 'apiserver.key'}",
                f"--client-ca-file={PKI / 'ca.crt'}",
                f"--kubelet-client-certificate={PKI / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={PKI / 'apiserver-kubelet-client.key'}",
                "--kubelet-preferred-address-types=InternalIP",  # the hostname resolves to 127.0.0.1
                "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--service-account-issuer=https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
                f"--service-account-key-file={PKI / 'sa.pub'}",
                f"--service-account-signing-key-file={PKI / 'sa.key'}",
                f"--audit-policy-file={CONF / 'audit-policy.yaml'}", f"--audit-log-path={AUDIT_LOG}",
                "--audit-log-maxsize=200", "--audit-log-maxbackup=1",
                "--profiling=false", "--v=1"]
    if name == "kube-controller-manager":
        kc = CONF / "controller-manager.kubeconfig"
        return [binary("kube-controller-manager"), f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1", "--leader-elect=false", "--use-service-account-credentials",
                f"--service-account-private-key-file={PKI / 'sa.key'}",
                f"--root-ca-file={PKI / 'ca.crt'}",  # feeds kube-root-ca.crt in every namespace
                f"--cluster-signing-cert-file={PKI / 'ca.crt'}", f"--cluster-signing-key-file={PKI / 'ca.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}", "--controllers=*", "--profiling=false", "--v=1"]
    if name == "kube-scheduler":
        kc = CONF / "scheduler.kubeconfig"
        return [binary("kube-scheduler"), f"--config={CONF / 'kube-scheduler.yaml'}",
                f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1", "--profiling=false", "--v=1"]
    if name == "coredns":
        return [binary("coredns"), "-conf", str(CONF / "Corefile")]
    if name == "kube-proxy":
        return [binary("kube-proxy"), f"--config={CONF / 'kube-proxy.yaml'}", "--v=1"]
    if name == "kube-router":
        # The NetworkPolicy controller alone: kube-proxy serves Services and the bridge routes pods.
        # Health and metrics ports off (they would listen on every interface; see kube_router_ready).
        return [binary("kube-router"), f"--kubeconfig={CONF / 'kube-router.kubeconfig'}",
                f"--hostname-override={NODE_NAME}", "--run-firewall=true", "--run-router=false",
                "--run-service-proxy=false", "--run-loadbalancer=false", "--enable-cni=false",
                "--enable-ipv6=false", f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--health-port=0", "--metrics-port=0", "--v=1"]
    if name == "kubelet":
        return [binary("kubelet"), f"--config={CONF / 'kubelet.yaml'}",
                f"--kubeconfig={CONF / 'kubelet.kubeconfig'}", f"--hostname-override={NODE_NAME}",
                f"--node-ip={NODE_IP}", "--v=1"]
    raise KeyError(name)


# --------------------------------------------------------------------------------------------
# up

def ensure_containerd() -> None:
    """containerd alone is enough for image imports (hack/image.py), cluster up or not."""
    if containerd_ready():  # ours, or the one of the checkout that owns the host's cluster
        return
    if os.geteuid() != 0:
        raise ClusterError("containerd needs root")
    with _locked():
        other = _other_owner()
        if other:
            raise ClusterError(f"{_owner_line(other)}; its containerd is not answering: "
                               f"run `make cluster-status` or `make cluster-down` in {other['repo']}")
        if not is_running("containerd"):
            _check_containerd_db_free()
            _claim()  # containerd is the first component: whoever starts it owns the host's cluster
        write_configs()
        CONTAINERD_STATE.parent.mkdir(parents=True, exist_ok=True)
        started = start("containerd", argv_for("containerd"))
        try:
            wait_for("containerd socket", containerd_ready, 30, "containerd")
        except BaseException:
            if started:  # never leave a containerd behind that holds its database lock
                stop("containerd")
            raise


def _node_ready() -> bool:
    out = kubectl("get", "node", NODE_NAME, "-o",
                  "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False).stdout
    return out.strip() == "True"


_lock_depth = 0


@contextlib.contextmanager
def _locked():
    """One up/down at a time on the host (parallel pytest sessions and other checkouts may all try to
    start the one cluster); re-entrant within this process."""
    global _lock_depth
    STATE.mkdir(parents=True, exist_ok=True)
    if _lock_depth:
        _lock_depth += 1
        try:
            yield
        finally:
            _lock_depth -= 1
        return
    try:
        HOST_STATE.mkdir(parents=True, exist_ok=True)
        lockfile = HOST_STATE / "lock"
        open(lockfile, "a").close()
    except OSError:  # not root: nothing host-wide can be started anyway
        lockfile = STATE / ".lock"
    with open(lockfile, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        _lock_depth = 1
        try:
            yield
        finally:
            _lock_depth = 0


# --------------------------------------------------------------------------------------------
# ownership: one cluster per host

def _component_processes() -> dict[Path, list[tuple[int, str]]]:
    """Running cluster components on this host, by checkout: start() runs each one in its
    checkout's .cluster/, so a cluster is found even without (or with a stale) owner record."""
    names = set(COMPONENTS) | {"tini"}
    found: dict[Path, list[tuple[int, str]]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(d / "cwd").removesuffix(" (deleted)")
            if not cwd.endswith("/.cluster") or not _alive(int(d.name)):
                continue
            name = Path((d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")).name
        except OSError:
            continue
        if name in names:
            found.setdefault(Path(cwd).parent, []).append((int(d.name), name))
    return found


def owner() -> dict | None:
    """The checkout whose cluster runs on this host: {"repo", "pid", "since", "components"}; None
    when no component of any checkout runs."""
    try:
        rec = json.loads(OWNER_FILE.read_text())
    except (OSError, ValueError):
        rec = {}
    running = _component_processes()
    if not running:
        return None
    repo = Path(rec["repo"]) if rec.get("repo") else None
    if repo not in running:  # no record (a cluster started before records existed) or a stale one
        repo, rec = sorted(running)[0], {}
    return {"repo": str(repo), "pid": rec.get("pid"), "since": rec.get("since"),
            "components": sorted({name for _, name in running[repo]})}


def audit_log() -> Path:
    """The API server's audit log of the embedded cluster running on this host: in the owning checkout, which is not
    this one when this checkout reuses another's cluster."""
    o = owner()
    return Path(o["repo"]) / AUDIT_LOG.relative_to(REPO) if o else AUDIT_LOG


def _other_owner() -> dict | None:
    o = owner()
    return o if o and Path(o["repo"]).resolve() != REPO.resolve() else None


def _owner_line(o: dict) -> str:
    since = f", up since {o['since']} by pid {o['pid']}" if o.get("since") else ""
    return f"the embedded cluster of this host belongs to {o['repo']}{since}"


def _claim() -> None:
    HOST_STATE.mkdir(parents=True, exist_ok=True)
    OWNER_FILE.write_text(json.dumps({"repo": str(REPO), "pid": os.getpid(),
                                      "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")


def _release() -> None:
    try:
        if Path(json.loads(OWNER_FILE.read_text())["repo"]).resolve() == REPO.resolve():
            OWNER_FILE.unlink()
    except (OSError, ValueError, KeyError):
        pass


def _reuse(o: dict) -> dict[str, float]:
    """`up` in a checkout that does not own the host's cluster: use the owner's, if it is healthy."""
    state = Path(o["repo"]) / ".cluster"
    try:
        ready = http_ok(f"{API_URL}/readyz", _ssl_context(pki=state / "pki"))
    except (OSError, ssl.SSLError):  # its PKI is not readable from here
        ready = False
    if not ready:
        raise ClusterError(f"{_owner_line(o)} and it is not ready (running: {', '.join(o['components'])}): "
                           f"run `make cluster-up` or `make cluster-down` in {o['repo']}")
    STATE.mkdir(parents=True, exist_ok=True)
    if KUBECONFIG.is_symlink() or KUBECONFIG.exists():
        KUBECONFIG.unlink()
    KUBECONFIG.symlink_to(state / "kubeconfig")
    print(f"{_owner_line(o)}; reusing it (`make cluster-down` there frees the host for this checkout); "
          f"export KUBECONFIG={KUBECONFIG}")
    return {}


# --------------------------------------------------------------------------------------------
# host conflicts: ports and containerd's database

def _listeners() -> dict[tuple[str, str, int], int]:
    """(proto, address, port) -> socket inode of every listening TCP / bound UDP socket (IPv4 and
    IPv6 wildcards as 0.0.0.0)."""
    out = {}
    for proto, f in (("tcp", "tcp"), ("tcp", "tcp6"), ("udp", "udp"), ("udp", "udp6")):
        try:
            lines = Path(f"/proc/net/{f}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if proto == "tcp" and cols[3] != "0A":  # LISTEN
                continue
            addr_hex, port_hex = cols[1].split(":")
            if len(addr_hex) == 8:
                addr = socket.inet_ntoa(bytes.fromhex(addr_hex)[::-1])
            elif addr_hex == "0" * 32:
                addr = "0.0.0.0"
            elif addr_hex[:24] == "0000000000000000FFFF0000":  # v4-mapped
                addr = socket.inet_ntoa(bytes.fromhex(addr_hex[24:])[::-1])
            else:
                continue
            out[(proto, addr, int(port_hex, 16))] = int(cols[9])
    return out


def _socket_holder(inode: int) -> str:
    """'pid N (command line)' of the process that holds a socket, or 'an unknown process'."""
    target = f"socket:[{inode}]"
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                if os.readlink(fd) == target:
                    cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                    return f"pid {d.name} ({cmd[:80]})"
        except OSError:
            continue
    return "an unknown process"


def _check_ports(names: list[str]) -> None:
    """Fail with one line when a port one of `names` needs is taken by something else."""
    listening = _listeners()
    for name in names:
        for spec in PORTS.get(name, []):
            addr, proto, port = (spec[0], "tcp", spec[1]) if len(spec) == 2 else spec
            inode = listening.get((proto, addr, port)) or listening.get((proto, "0.0.0.0", port))
            if inode is not None:
                raise ClusterError(f"cannot start {name}: {addr}:{port}/{proto} is in use by {_socket_holder(inode)}; "
                                   "stop it and run `make cluster-up` again")


def _check_containerd_db_free() -> None:
    """A containerd left running (e.g. by a failed start) holds its boltdb lock: a second one would
    wait 30 s on `waiting for response from boltdb open` and fail without saying why."""
    db = str(CONTAINERD_ROOT / "io.containerd.metadata.v1.bolt" / "meta.db")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == db for fd in (d / "fd").iterdir()):
                cwd = os.readlink(d / "cwd")
                raise ClusterError(f"containerd's database {db} is held by pid {d.name} (started in {cwd}): "
                                   f"run `make cluster-down` in {Path(cwd).parent}, or kill {d.name}")
        except OSError:
            continue


def up() -> dict[str, float]:
    with _locked():
        other = _other_owner()
        if other:
            return _reuse(other)
        was_running = [n for n in COMPONENTS if is_running(n)]
        if not was_running or not OWNER_FILE.exists():
            _claim()
        del _started[:]
        try:
            return _up()
        except BaseException:
            # A failed start stops what it started: a containerd left behind would hold its database
            # lock, and every later `up` from any checkout would hang on it. When nothing ran before,
            # the host is cleaned as by `down` (the etcd data stays); components that were already
            # running (a degraded cluster being repaired) are left alone.
            if _started:
                log(f"up failed: stopping what it started ({', '.join(_started)})")
                try:
                    if was_running:
                        for name in reversed(_started):
                            stop(name)
                    else:
                        _down(False, keep_etcd=True)
                except Exception as e:  # noqa: BLE001 - report the original failure
                    log(f"cleanup after the failed up failed too: {e}")
            if not was_running:
                _release()
            raise


def _up() -> dict[str, float]:
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def step(label: str) -> None:
        timings[label] = round(time.monotonic() - t0, 2)
        log(f"{label} ({timings[label]:.1f}s)")

    for tool in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy",
                 "kubectl", "etcd", "coredns", "containerd", "runc", "tini", "iptables", "conntrack", "openssl",
                 "kube-router", "ipset"):
        binary(tool)  # fail before touching the host if anything is missing
    _check_ports([n for n in COMPONENTS if not is_running(n)])
    prepare_host()
    write_configs()
    step("host prepared, PKI and configs written")

    ensure_containerd()
    subprocess.run([sys.executable, str(Path(__file__).with_name("image.py")), "pause"], check=True,
                   stdout=subprocess.DEVNULL)
    step("containerd up, pause image present")

    if start("etcd", argv_for("etcd")):
        wait_for("etcd /health", HEALTH["etcd"], 30, "etcd")
    if start("kube-apiserver", argv_for("kube-apiserver")):
        wait_for("kube-apiserver /readyz", api_ready, 120, "kube-apiserver")
    step("etcd and kube-apiserver ready")
    kubectl("apply", "-f", "-", input=BOOTSTRAP_RBAC)

    for name in ("kube-controller-manager", "kube-scheduler", "coredns", "kube-proxy", "kubelet"):
        start(name, argv_for(name))
    wait_for("kubelet /healthz", HEALTH["kubelet"], 60, "kubelet")
    wait_for(f"node {NODE_NAME} Ready", _node_ready, 120, "kubelet", interval=0.5)
    step("node Ready")
    wait_for("kube-proxy synced", HEALTH["kube-proxy"], 60, "kube-proxy")
    # After the node exists (kube-router reads its own Node for the node IP); pods started before its
    # first sync are covered by that sync.
    start("kube-router", argv_for("kube-router"))
    wait_for("kube-router firewall chains", HEALTH["kube-router"], 60, "kube-router")
    wait_for("kube-controller-manager healthy", HEALTH["kube-controller-manager"], 60, "kube-controller-manager")
    wait_for("kube-scheduler healthy", HEALTH["kube-scheduler"], 60, "kube-scheduler")
    wait_for("default ServiceAccount", lambda: kubectl("get", "serviceaccount", "default", "-n", "default",
                                                       check=False).returncode == 0, 60, "kube-controller-manager")
    wait_for("kube-root-ca.crt ConfigMap", lambda: kubectl("get", "configmap", "kube-root-ca.crt", "-n", "default",
                                                           check=False).returncode == 0, 60, "kube-controller-manager")
    wait_for("CoreDNS answering kubernetes.default", HEALTH["coredns"], 60, "coredns")
    step("cluster ready")
    print(f"cluster up in {time.monotonic() - t0:.1f}s; export KUBECONFIG={KUBECONFIG}")
    return timings


# --------------------------------------------------------------------------------------------
# down

def _mounts_under(prefixes: list[str]) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if any(mp == p or mp.startswith(p.rstrip("/") + "/") for p in prefixes):
            out.append(mp)
    return out


def _our_stray_processes() -> list[int]:
    """Shims, pause and container processes left once containerd is gone (found by /proc scan)."""
    pids = []
    cgroup_roots = [p for p in Path("/sys/fs/cgroup").glob("*/kubepods")]
    for root in cgroup_roots:
        for procs in root.rglob("cgroup.procs"):
            try:
                pids += [int(x) for x in procs.read_text().split()]
            except OSError:
                pass
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmd and CONTAINERD_SOCK.encode() in cmd:
                pids.append(int(d.name))
    # components of this checkout whose pid file is gone (they run in its .cluster/)
    pids += [pid for pid, _ in _component_processes().get(REPO, [])]
    return sorted(set(p for p in pids if p != os.getpid()))


def _clean_iptables(save: str, restore: str) -> None:
    """Drop every KUBE-*/CNI-* chain and every rule that jumps to one, table by table."""
    if not shutil.which(save, path=_path_env()):
        return
    dump = run([save], check=False).stdout
    ours = re.compile(r"(^:(KUBE|CNI)-)|(^-A (KUBE|CNI)-)|(\s-[jg] (KUBE|CNI)-)")
    table: list[str] = []
    for line in dump.splitlines():
        if line.startswith("*"):
            table = [line]
        elif line == "COMMIT" and table:
            kept = [ln for ln in table if not ours.search(ln)]
            if len(kept) != len(table):
                run([restore, "-w"], input="\n".join(kept + ["COMMIT", ""]))
            table = []
        elif table:
            table.append(line)


def _our_ipsets() -> list[str]:
    """kube-router's ipsets (KUBE-SRC-*, KUBE-DST-*, KUBE-ROUTER-*, `inet6:` for IPv6)."""
    if not shutil.which("ipset", path=_path_env()):
        return []
    names = run(["ipset", "list", "-n"], check=False, quiet=True).stdout.split()
    return [n for n in names if n.removeprefix("inet6:").startswith("KUBE-")]


def _remove_cgroups() -> None:
    for root in Path("/sys/fs/cgroup").glob("*/kubepods"):
        for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [root]:
            try:
                d.rmdir()
            except OSError:
                pass


def down(purge: bool = False) -> None:
    with _locked():
        other = _other_owner()
        if other:
            if KUBECONFIG.is_symlink():  # this checkout's own link to the owner's kubeconfig
                KUBECONFIG.unlink()
            print(f"{_owner_line(other)}, not to this checkout: nothing stopped "
                  f"(`make cluster-down` in {other['repo']} stops it)")
            return
        _down(purge)
        _release()


def _down(purge: bool, keep_etcd: bool = False) -> None:
    t0 = time.monotonic()
    for name in ("kubelet", "kube-router", "kube-proxy", "kube-scheduler", "kube-controller-manager", "coredns"):
        stop(name)
    # Remove every container while containerd still runs (the CRI path would need the kubelet);
    # the CNI cleanup this skips (IPAM files, iptables chains, veths) is done below by hand.
    if is_running("containerd") and containerd_ready():
        tasks = [ln.split()[0] for ln in ctr("tasks", "ls", check=False).stdout.splitlines()[1:] if ln.strip()]
        for t in tasks:
            ctr("tasks", "kill", "-s", "SIGKILL", t, check=False)
        for t in tasks:
            ctr("tasks", "delete", "-f", t, check=False)
        containers = ctr("containers", "ls", "-q", check=False).stdout.split()
        if containers:
            ctr("containers", "delete", *containers, check=False)
    # The API server sometimes lingers ~15 s after its graceful shutdown has finished (with CRDs
    # installed); its state is about to be wiped anyway, so do not wait long.
    stop("kube-apiserver", timeout=3)
    for name in ("etcd", "containerd"):
        stop(name)
    for pid in _our_stray_processes():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while _our_stray_processes() and time.monotonic() < deadline:
        time.sleep(0.1)

    # Mounts: pod volumes (tmpfs), sandbox /dev/shm, container rootfs, network namespaces.
    netns = [str(p) for p in Path("/run/netns").glob("cni-*")] if Path("/run/netns").exists() else []
    prefixes = [str(KUBELET_ROOT), str(CONTAINERD_STATE.parent), str(CONTAINERD_ROOT), *netns,
                *[s.replace("/run/", "/var/run/") for s in netns]]
    for mp in sorted(_mounts_under(prefixes), key=lambda m: -m.count("/")):
        run(["umount", "-l", mp], check=False)
    for ns in netns:
        Path(ns).unlink(missing_ok=True)
    for path in [KUBELET_ROOT, Path("/var/log/pods"), Path("/var/log/containers"), CONTAINERD_STATE.parent,
                 Path("/var/lib/cni/networks") / CNI_NETWORK, *([] if keep_etcd else [ETCD_DATA]), PIDS,
                 CONTAINERD_ROOT / "io.containerd.grpc.v1.cri" / "sandboxes",
                 CONTAINERD_ROOT / "io.containerd.grpc.v1.cri" / "containers"]:
        shutil.rmtree(path, ignore_errors=True)
    for f in Path("/var/lib/cni/results").glob(f"{CNI_NETWORK}-*") if Path("/var/lib/cni/results").exists() else []:
        f.unlink(missing_ok=True)
    # containerd 1.6 puts shim sockets and ctr fifos under /run/containerd whatever its state dir;
    # remove that tree only when no system containerd lives there.
    sysdir = Path("/run/containerd")
    if sysdir.exists() and not (sysdir / "containerd.sock").exists():
        shutil.rmtree(sysdir, ignore_errors=True)

    # Network: the bridge (its veths died with the pods' namespaces), our iptables chains, conntrack.
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        run(["ip", "link", "delete", BRIDGE], check=False)
    _clean_iptables("iptables-save", "iptables-restore")
    _clean_iptables("ip6tables-save", "ip6tables-restore")
    for name in _our_ipsets():  # only once no iptables rule refers to them
        run(["ipset", "destroy", name], check=False)
    if shutil.which("conntrack", path=_path_env()):
        for flt in (["-s", POD_CIDR], ["-d", SERVICE_CIDR]):
            run(["conntrack", "-D", *flt], check=False, quiet=True)
    _remove_cgroups()
    saved = STATE / "sysctl-saved.json"
    if saved.exists():
        for k, v in json.loads(saved.read_text()).items():
            try:
                sysctl(k, v)
            except OSError:
                pass
        saved.unlink()
    if purge:
        shutil.rmtree(CONTAINERD_ROOT, ignore_errors=True)
        shutil.rmtree(STATE, ignore_errors=True)
    print(f"cluster down in {time.monotonic() - t0:.1f}s")


def leftovers() -> list[str]:
    """Everything `down` promises to remove that is still on the host (empty list = clean)."""
    found = []
    for pid in _our_stray_processes():
        found.append(f"process {pid}")
    for name in COMPONENTS:
        if is_running(name):
            found.append(f"component {name}")
    found += [f"mount {m}" for m in _mounts_under([str(KUBELET_ROOT), str(CONTAINERD_STATE.parent),
                                                   str(CONTAINERD_ROOT)])] + [f"mount {m}" for m in _mounts_under(["/run/netns"]) if "/cni-" in m]
    if Path("/run/netns").exists():
        found += [f"netns {p.name}" for p in Path("/run/netns").glob("cni-*")]
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        found.append(f"interface {BRIDGE}")
    found += [f"interface {p.name}" for p in Path("/sys/class/net").glob("veth*")]
    for save in ("iptables-save", "ip6tables-save"):
        if shutil.which(save, path=_path_env()):
            chains = re.findall(r"^:((?:KUBE|CNI)-\S+)", run([save], check=False).stdout, re.M)
            found += [f"{save} chain {c}" for c in chains]
    found += [f"ipset {n}" for n in _our_ipsets()]
    for p in [Path("/var/lib/cni/networks") / CNI_NETWORK, KUBELET_ROOT, CONTAINERD_STATE.parent,
              Path("/run/containerd/s")]:
        if p.exists():
            found.append(f"path {p}")
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/kubepods")]
    return found


# --------------------------------------------------------------------------------------------
# status

def status() -> dict:
    comps = {}
    for name in COMPONENTS:
        pid = _pid(name)
        running = is_running(name)
        healthy = False
        if running:
            try:
                healthy = bool(HEALTH[name]())
            except Exception:  # noqa: BLE001
                healthy = False
        comps[name] = {"pid": pid if running else None, "running": running, "healthy": healthy,
                       "rss_mib": round(rss_kib(pid) / 1024, 1) if running and pid else 0.0}
    cp = sum(comps[n]["rss_mib"] for n in CONTROL_PLANE)
    node = sum(comps[n]["rss_mib"] for n in COMPONENTS)
    return {"up": all(c["healthy"] for c in comps.values()), "kubeconfig": str(KUBECONFIG),
            "components": comps, "control_plane_rss_mib": round(cp, 1), "all_components_rss_mib": round(node, 1)}


def print_status(st: dict) -> None:
    print(f"{'component':<25}{'pid':>8}  {'state':<10}{'RSS MiB':>9}")
    for name, c in st["components"].items():
        state = "healthy" if c["healthy"] else ("unhealthy" if c["running"] else "stopped")
        print(f"{name:<25}{c['pid'] or '-':>8}  {state:<10}{c['rss_mib']:>9.1f}")
    print(f"control plane (etcd, apiserver, controller-manager, scheduler, coredns) RSS: "
          f"{st['control_plane_rss_mib']:.0f} MiB; all components: {st['all_components_rss_mib']:.0f} MiB")
    print(f"cluster is {'UP' if st['up'] else 'DOWN or degraded'}; KUBECONFIG={st['kubeconfig']}")


def figures(runs: int = 3) -> dict:
    """Numbers for the record: idle memory and how fast a local-image pod starts (JSON)."""
    ref = "localhost/ddp-testimage:0.1.0"
    ctx = REPO / "tests" / "cluster" / "testimage"
    subprocess.run([sys.executable, str(Path(__file__).with_name("image.py")), "build", "-f", str(ctx / "Dockerfile"),
                    "-t", ref, str(ctx)], check=True)
    st = status()
    ns = "ddpjob-figures"
    kubectl("create", "namespace", ns, check=False)
    wait_for("default ServiceAccount", lambda: kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0, 30)
    times = []
    for i in range(runs):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"start-{i}"},
               "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                        "containers": [{"name": "main", "image": ref, "imagePullPolicy": "Never",
                                        "args": ["sleep"]}]}}
        t0 = time.monotonic()
        kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pod))
        wait_for(f"pod start-{i} Running", lambda: kubectl("get", "pod", f"start-{i}", "-n", ns, "-o",
                 "jsonpath={.status.phase}", check=False).stdout == "Running", 120, interval=0.05)
        times.append(round(time.monotonic() - t0, 2))
    kubectl("delete", "namespace", ns, "--wait=false")
    return {"idle_control_plane_rss_mib": st["control_plane_rss_mib"],
            "idle_all_components_rss_mib": st["all_components_rss_mib"],
            "rss_mib": {n: c["rss_mib"] for n, c in st["components"].items()},
            "pod_to_running_s": times, "pod_to_running_median_s": sorted(times)[len(times) // 2]}


# --------------------------------------------------------------------------------------------
# one component at a time (fault injection): restart / stop / start

ALIASES = {"apiserver": "kube-apiserver", "controller-manager": "kube-controller-manager",
           "scheduler": "kube-scheduler", "proxy": "kube-proxy"}
SINGLE = [n for n in COMPONENTS if n != "containerd"]  # containerd holds every container: never alone


def component_name(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in SINGLE:
        raise ClusterError(f"unknown component {name!r}: one of {', '.join(SINGLE)} "
                           f"(aliases: {', '.join(ALIASES)})")
    return name


def _host_state() -> Path:
    """.cluster/ of the checkout whose cluster runs on this host (this one when none runs)."""
    o = owner()
    return Path(o["repo"]) / ".cluster" if o else STATE


def _running_component(name: str) -> tuple[int, Path] | None:
    """(pid, its checkout's .cluster/) of a running component of this host's cluster: the process
    leading its own session (start() makes every component one), not a child it spawned."""
    for repo, procs in _component_processes().items():
        for pid, n in procs:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if n == name and int(stat[3]) == pid:  # session id == pid
                return pid, repo / ".cluster"
    return None


def _launch_record(pid: int) -> dict:
    proc = Path(f"/proc/{pid}")
    argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0")[:-1]]
    env = dict(e.decode(errors="replace").split("=", 1) for e in (proc / "environ").read_bytes().split(b"\0")
               if b"=" in e)
    return {"argv": argv, "cwd": os.readlink(proc / "cwd").removesuffix(" (deleted)"), "env": env}


def _kill_group(name: str, pid: int, timeout: float = 15) -> None:
    """SIGTERM to the component's process group (each component leads its own), SIGKILL after `timeout`; reaped
    when it is our own child (a pytest-started cluster)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        log(f"{name} ignored SIGTERM; killing")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.05)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _component_healthy(name: str, state: Path) -> bool:
    if name == "kube-apiserver":  # the owner's PKI, which may not be this checkout's
        return http_ok(f"{API_URL}/readyz", _ssl_context(pki=state / "pki"))
    return bool(HEALTH[name]())


def stop_component(name: str) -> dict:
    """Stop one component of the host's cluster, remembering how to start it again."""
    name = component_name(name)
    found = _running_component(name)
    if found is None:
        raise ClusterError(f"{name} is not running")
    pid, state = found
    rec = _launch_record(pid)
    (state / "pids" / f"{name}.stopped.json").write_text(json.dumps(rec) + "\n")
    t0 = time.monotonic()
    _kill_group(name, pid)
    (state / "pids" / f"{name}.pid").unlink(missing_ok=True)
    log(f"stopped {name} (pid {pid}, {time.monotonic() - t0:.1f}s)")
    return rec


def start_component(name: str, rec: dict | None = None, timeout: float = 120) -> int:
    """Start one stopped component again exactly as it ran; wait until it is healthy. Returns its pid."""
    name = component_name(name)
    found = _running_component(name)
    if found is not None:
        log(f"{name} is already running (pid {found[0]})")
        return found[0]
    state = _host_state()
    saved = state / "pids" / f"{name}.stopped.json"
    if rec is None and saved.exists():
        rec = json.loads(saved.read_text())
    if rec is None:
        if state != STATE:
            raise ClusterError(f"{name} was not stopped by `hack/cluster.py stop`: run `make cluster-up` in "
                               f"{state.parent}")
        rec = {"argv": argv_for(name), "cwd": str(STATE), "env": {**os.environ, "PATH": _path_env()}}
    state = Path(rec["cwd"])
    (state / "logs").mkdir(parents=True, exist_ok=True)
    with open(state / "logs" / f"{name}.log", "ab") as out:
        out.write(f"# {time.strftime('%F %T')} started again by hack/cluster.py start\n".encode())
        out.flush()
        p = subprocess.Popen(rec["argv"], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             cwd=state, start_new_session=True, env=rec["env"])
    (state / "pids").mkdir(parents=True, exist_ok=True)
    (state / "pids" / f"{name}.pid").write_text(str(p.pid))
    saved.unlink(missing_ok=True)
    t0 = time.monotonic()
    deadline = t0 + timeout
    while not _component_healthy(name, state):
        if p.poll() is not None:
            raise ClusterError(f"{name} exited ({p.returncode}) after starting again; see {state / 'logs' / name}.log")
        if time.monotonic() > deadline:
            raise ClusterError(f"{name} not healthy {timeout:.0f}s after starting again")
        time.sleep(0.1)
    log(f"started {name} (pid {p.pid}), healthy after {time.monotonic() - t0:.1f}s")
    return p.pid


def restart_component(name: str) -> int:
    return start_component(name, stop_component(name))


def is_up() -> bool:
    return all(is_running(n) for n in COMPONENTS) and api_ready() and _node_ready()


# --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up")
    d = sub.add_parser("down")
    d.add_argument("--purge", action="store_true", help="also delete images, PKI and .cluster/")
    s = sub.add_parser("status")
    s.add_argument("--json", action="store_true")
    sub.add_parser("leftovers", help="list host state `down` should have removed")
    sub.add_parser("figures", help="idle memory and local-image pod start time, as JSON")
    for verb in ("restart", "stop", "start"):
        c = sub.add_parser(verb, help=f"{verb} one component of the running cluster (fault injection)")
        c.add_argument("component", help=f"one of {', '.join(SINGLE)} (or apiserver, scheduler, ...)")
    for passthrough in ("kubectl", "ctr"):
        p = sub.add_parser(passthrough)
        p.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "up":
            up()
        elif a.cmd == "down":
            down(a.purge)
        elif a.cmd == "status":
            other = _other_owner()
            if other:
                print(f"{_owner_line(other)}: `make cluster-status` there shows it")
            st = status()
            print(json.dumps(st, indent=2)) if a.json else print_status(st)
            return 0 if st["up"] else 1
        elif a.cmd == "leftovers":
            left = leftovers()
            print("\n".join(left) or "nothing left behind")
            return 1 if left else 0
        elif a.cmd == "figures":
            print(json.dumps(figures(), indent=2))
        elif a.cmd in ("restart", "stop", "start"):
            if os.geteuid() != 0:
                raise ClusterError("the cluster's components run as root")
            {"restart": restart_component, "stop": stop_component, "start": start_component}[a.cmd](a.component)
        elif a.cmd == "kubectl":
            os.execv(binary("kubectl"), ["kubectl", f"--kubeconfig={KUBECONFIG}", *a.args])
        elif a.cmd == "ctr":
            os.execvp("ctr", ["ctr", "--address", CONTAINERD_SOCK, "--namespace", K8S_NAMESPACE, *a.args])
    except ClusterError as e:
        print(f"\nERROR: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
