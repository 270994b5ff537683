"""The embedded cluster's components, one at a time: their command lines, starting one detached in
.cluster/ (pid file, log) and stopping it, whether it runs, its memory, and its health probe (HEALTH)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import struct
import subprocess
import time
import urllib.request
from pathlib import Path

from hack.common import (API_PORT, API_URL, AUDIT_LOG, CLUSTER_DOMAIN, CONF, CONTAINERD_SOCK, ETCD_DATA, ETCD_URL,
                         KUBERNETES_SERVICE_IP, LOGS, NODE_IP, NODE_NAME, PIDS, PKI, SERVICE_CIDR, STATE, ClusterError,
                         binary, ctr, kubectl, log, path_env, run)


# --------------------------------------------------------------------------------------------
# waiting on a component

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

def recorded_pid(name: str) -> int | None:
    try:
        return int((PIDS / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead


def is_running(name: str) -> bool:
    pid = recorded_pid(name)
    if not pid or not alive(pid):
        return False
    # guard against pid reuse: the recorded process must still be ours
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(name.encode() in part for part in cmd[:6])


started_here: list[str] = []  # components this process started, in order (a failed `up` stops them)


def start(name: str, argv: list[str]) -> bool:
    """Start a component detached from us (own session) so it outlives `up`; False if already running."""
    if is_running(name):
        return False
    started_here.append(name)
    for d in (LOGS, PIDS):
        d.mkdir(parents=True, exist_ok=True)
    logfile = LOGS / f"{name}.log"
    if logfile.exists():
        logfile.replace(LOGS / f"{name}.log.1")
    with open(logfile, "ab") as out:
        out.write(f"# {time.strftime('%F %T')} {' '.join(argv)}\n".encode())
        out.flush()
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             cwd=STATE, start_new_session=True, env={**os.environ, "PATH": path_env()})
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
    pid = recorded_pid(name)
    t0 = time.monotonic()
    if pid and is_running(name):
        kill_group(name, pid, timeout)
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


def kill_group(name: str, pid: int, timeout: float = 15) -> None:
    """SIGTERM to the component's process group (each component leads its own), SIGKILL after `timeout`; reaped
    when it is our own child (a pytest-started cluster)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        log(f"{name} ignored SIGTERM; killing")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.05)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)



# --------------------------------------------------------------------------------------------
# probes

def ssl_context(client: bool = True, pki: Path = PKI) -> ssl.SSLContext:
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
    return http_ok(f"{API_URL}/readyz", ssl_context())


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
                f"--service-cluster-ip-range={SERVICE_CIDR}", "--controllers=*", "--profiling=false", "--v=1",
                "--node-monitor-grace-period=20s"]  # with the kubelet's 20 s node Lease (configs.py), as on kind
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
# the node

def node_ready() -> bool:
    out = kubectl("get", "node", NODE_NAME, "-o",
                  "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False).stdout
    return out.strip() == "True"
