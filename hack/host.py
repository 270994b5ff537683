"""The host's side of the embedded cluster: its preparation (sysctls, the bridge), the lock that serialises
up/down, which checkout owns the host's one cluster (/var/lib/ddpjob/owner.json), what would stop a start
(ports, containerd's database), and containerd itself, the first component, which claims the host."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import ssl
import time
from pathlib import Path

from hack.common import (API_PORT, API_URL, AUDIT_LOG, BRIDGE, COMPONENTS, CONTAINERD_ROOT, CONTAINERD_STATE, ETCD_DATA,
                         HOST_STATE, KUBECONFIG, KUBELET_ROOT, LOGS, NODE_IP, OWNER_FILE, PIDS, REPO, STATE,
                         ClusterError, run, write)
from hack.components import alive, argv_for, containerd_ready, http_ok, is_running, ssl_context, start, stop, wait_for
from hack.configs import write_configs

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
# containerd, which claims the host

def ensure_containerd() -> None:
    """containerd alone is enough for image imports (hack/image.py), cluster up or not."""
    if containerd_ready():  # ours, or the one of the checkout that owns the host's cluster
        return
    if os.geteuid() != 0:
        raise ClusterError("containerd needs root")
    with locked():
        other = other_owner()
        if other:
            raise ClusterError(f"{owner_line(other)}; its containerd is not answering: "
                               f"run `make cluster-status` or `make cluster-down` in {other['repo']}")
        if not is_running("containerd"):
            check_containerd_db_free()
            claim()  # containerd is the first component: whoever starts it owns the host's cluster
        write_configs()
        CONTAINERD_STATE.parent.mkdir(parents=True, exist_ok=True)
        started = start("containerd", argv_for("containerd"))
        try:
            wait_for("containerd socket", containerd_ready, 30, "containerd")
        except BaseException:
            if started:  # never leave a containerd behind that holds its database lock
                stop("containerd")
            raise



_lock_depth = 0


@contextlib.contextmanager
def locked():
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

def component_processes() -> dict[Path, list[tuple[int, str]]]:
    """Running cluster components on this host, by checkout: start() runs each one in its
    checkout's .cluster/, so a cluster is found even without (or with a stale) owner record."""
    names = set(COMPONENTS) | {"tini"}
    found: dict[Path, list[tuple[int, str]]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(d / "cwd").removesuffix(" (deleted)")
            if not cwd.endswith("/.cluster") or not alive(int(d.name)):
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
    running = component_processes()
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


def other_owner() -> dict | None:
    o = owner()
    return o if o and Path(o["repo"]).resolve() != REPO.resolve() else None


def owner_line(o: dict) -> str:
    since = f", up since {o['since']} by pid {o['pid']}" if o.get("since") else ""
    return f"the embedded cluster of this host belongs to {o['repo']}{since}"


def claim() -> None:
    HOST_STATE.mkdir(parents=True, exist_ok=True)
    OWNER_FILE.write_text(json.dumps({"repo": str(REPO), "pid": os.getpid(),
                                      "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")


def release() -> None:
    try:
        if Path(json.loads(OWNER_FILE.read_text())["repo"]).resolve() == REPO.resolve():
            OWNER_FILE.unlink()
    except (OSError, ValueError, KeyError):
        pass


def reuse(o: dict) -> dict[str, float]:
    """`up` in a checkout that does not own the host's cluster: use the owner's, if it is healthy."""
    state = Path(o["repo"]) / ".cluster"
    try:
        ready = http_ok(f"{API_URL}/readyz", ssl_context(pki=state / "pki"))
    except (OSError, ssl.SSLError):  # its PKI is not readable from here
        ready = False
    if not ready:
        raise ClusterError(f"{owner_line(o)} and it is not ready (running: {', '.join(o['components'])}): "
                           f"run `make cluster-up` or `make cluster-down` in {o['repo']}")
    STATE.mkdir(parents=True, exist_ok=True)
    if KUBECONFIG.is_symlink() or KUBECONFIG.exists():
        KUBECONFIG.unlink()
    KUBECONFIG.symlink_to(state / "kubeconfig")
    print(f"{owner_line(o)}; reusing it (`make cluster-down` there frees the host for this checkout); "
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


def check_ports(names: list[str]) -> None:
    """Fail with one line when a port one of `names` needs is taken by something else."""
    listening = _listeners()
    for name in names:
        for spec in PORTS.get(name, []):
            addr, proto, port = (spec[0], "tcp", spec[1]) if len(spec) == 2 else spec
            inode = listening.get((proto, addr, port)) or listening.get((proto, "0.0.0.0", port))
            if inode is not None:
                raise ClusterError(f"cannot start {name}: {addr}:{port}/{proto} is in use by {_socket_holder(inode)}; "
                                   "stop it and run `make cluster-up` again")


def check_containerd_db_free() -> None:
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
