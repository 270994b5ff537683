"""Everything `down` removes from the host, in order (components, containers, mounts, network namespaces,
the bridge, iptables chains, ipsets, cgroups, state directories, sysctls), and `leftovers`: what of it is
still there."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

from hack.common import (BRIDGE, CNI_NETWORK, COMPONENTS, CONTAINERD_ROOT, CONTAINERD_SOCK, CONTAINERD_STATE, ETCD_DATA,
                         KUBELET_ROOT, PIDS, POD_CIDR, REPO, SERVICE_CIDR, STATE, ctr, path_env, run)
from hack.components import containerd_ready, is_running, stop
from hack.host import component_processes, sysctl


def _mounts_under(prefixes: list[str]) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if any(mp == p or mp.startswith(p.rstrip("/") + "/") for p in prefixes):
            out.append(mp)
    return out


def _ours(veth: Path) -> bool:
    """A veth of the embedded cluster's pods: on its bridge, or on none once the bridge is gone. Another bridge's
    (a kind cluster's nodes on Docker's network, say) is someone else's."""
    master = veth / "master"
    return not master.exists() or master.resolve().name == BRIDGE


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
    pids += [pid for pid, _ in component_processes().get(REPO, [])]
    return sorted(set(p for p in pids if p != os.getpid()))


def _clean_iptables(save: str, restore: str) -> None:
    """Drop every KUBE-*/CNI-* chain and every rule that jumps to one, table by table."""
    if not shutil.which(save, path=path_env()):
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
    if not shutil.which("ipset", path=path_env()):
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


def stop_and_clean(purge: bool, keep_etcd: bool = False) -> None:
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
    if shutil.which("conntrack", path=path_env()):
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
    found += [f"interface {p.name}" for p in Path("/sys/class/net").glob("veth*") if _ours(p)]
    for save in ("iptables-save", "ip6tables-save"):
        if shutil.which(save, path=path_env()):
            chains = re.findall(r"^:((?:KUBE|CNI)-\S+)", run([save], check=False).stdout, re.M)
            found += [f"{save} chain {c}" for c in chains]
    found += [f"ipset {n}" for n in _our_ipsets()]
    for p in [Path("/var/lib/cni/networks") / CNI_NETWORK, KUBELET_ROOT, CONTAINERD_STATE.parent,
              Path("/run/containerd/s")]:
        if p.exists():
            found.append(f"path {p}")
    found += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/kubepods")]
    return found
