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
import json
import os
import sys
import time
from pathlib import Path

if not __package__:  # run as a script (python hack/cluster.py): hack.* from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hack import image  # noqa: E402
from hack.common import (COMPONENTS, CONTAINERD_SOCK, CONTROL_PLANE, K8S_NAMESPACE, KUBECONFIG, NODE_NAME,  # noqa: E402
                         OWNER_FILE, REPO, ClusterError, binary, kubectl, log)
from hack.components import (HEALTH, api_ready, argv_for, is_running, node_ready, recorded_pid, rss_kib,  # noqa: E402
                             start, started_here, stop, wait_for)
from hack.configs import BOOTSTRAP_RBAC, write_configs  # noqa: E402
from hack.faults import SINGLE, restart_component, start_component, stop_component  # noqa: E402
from hack.host import (check_ports, claim, ensure_containerd, locked, other_owner, owner_line,  # noqa: E402
                       prepare_host, release, reuse)
from hack.teardown import leftovers, stop_and_clean  # noqa: E402

# What tests/ and tests/tools.py read from here, as they did when this file held everything (the
# underscored ones under their names from then).
from hack.common import BRIDGE, CACHE, NODE_IP, ctr, pinned_path, versions  # noqa: E402,F401
from hack.components import containerd_ready  # noqa: E402,F401
from hack.host import PORTS, audit_log, owner  # noqa: E402,F401
from hack.host import check_containerd_db_free as _check_containerd_db_free  # noqa: E402,F401
from hack.host import check_ports as _check_ports  # noqa: E402,F401
from hack.host import component_processes as _component_processes  # noqa: E402,F401


def up() -> dict[str, float]:
    with locked():
        other = other_owner()
        if other:
            return reuse(other)
        was_running = [n for n in COMPONENTS if is_running(n)]
        if not was_running or not OWNER_FILE.exists():
            claim()
        del started_here[:]
        try:
            return _up()
        except BaseException:
            # A failed start stops what it started: a containerd left behind would hold its database
            # lock, and every later `up` from any checkout would hang on it. When nothing ran before,
            # the host is cleaned as by `down` (the etcd data stays); components that were already
            # running (a degraded cluster being repaired) are left alone.
            if started_here:
                log(f"up failed: stopping what it started ({', '.join(started_here)})")
                try:
                    if was_running:
                        for name in reversed(started_here):
                            stop(name)
                    else:
                        stop_and_clean(False, keep_etcd=True)
                except Exception as e:  # noqa: BLE001 - report the original failure
                    log(f"cleanup after the failed up failed too: {e}")
            if not was_running:
                release()
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
    check_ports([n for n in COMPONENTS if not is_running(n)])
    prepare_host()
    write_configs()
    step("host prepared, PKI and configs written")

    ensure_containerd()
    image.ensure_pause()
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
    wait_for(f"node {NODE_NAME} Ready", node_ready, 120, "kubelet", interval=0.5)
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

def down(purge: bool = False) -> None:
    with locked():
        other = other_owner()
        if other:
            if KUBECONFIG.is_symlink():  # this checkout's own link to the owner's kubeconfig
                KUBECONFIG.unlink()
            print(f"{owner_line(other)}, not to this checkout: nothing stopped "
                  f"(`make cluster-down` in {other['repo']} stops it)")
            return
        stop_and_clean(purge)
        release()


# --------------------------------------------------------------------------------------------
# status

def status() -> dict:
    comps = {}
    for name in COMPONENTS:
        pid = recorded_pid(name)
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
    image.build(ctx / "Dockerfile", ref, ctx)
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


def is_up() -> bool:
    return all(is_running(n) for n in COMPONENTS) and api_ready() and node_ready()


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
            other = other_owner()
            if other:
                print(f"{owner_line(other)}: `make cluster-status` there shows it")
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
