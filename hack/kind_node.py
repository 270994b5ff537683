#!/usr/bin/env python3
"""A kind node image built offline from the project's own binaries, into hack/docker.py's engine.

    hack/kind_node.py build [--tag ddpjob/kind-node:$KUBE_VERSION]   build it (a no-op when current)
    hack/kind_node.py ref                                             print the tag `build` makes

kind (`kind create cluster --image ...`) needs a node image: a root filesystem that boots systemd in a
privileged container and runs containerd and the kubelet, with kubeadm, the control-plane images and a
CNI manifest inside. kind's own images are pulled from Docker Hub; this one is made here:

- Root filesystems: debootstrap $DEBIAN_SUITE (cached in ~/.cache/ddpjob/kind-rootfs-*), one for the node
  (systemd, Debian's containerd/runc/CNI plugins, iptables, conntrack, ipset) and a small one for the
  images that manage iptables (kube-proxy, kube-router). `docker import` turns each into a base image.
- Binaries from hack/build-binaries.sh's cache: kube (kubelet, kubectl, the control plane, kube-proxy),
  etcd, kube-router, pause (hack/image.py compiles it), and the `kind` target (kind, kubeadm, a CoreDNS with kubeadm's plugins).
- Control-plane images are built under the exact names kubeadm $KUBE_VERSION asks for (see IMAGES),
  FROM scratch where the binary is static and alone, and pre-loaded into the node's containerd (namespace
  k8s.io, unpacked on first use) so `kubeadm init` never pulls. kubeadm's manifests run the control plane
  as `command: [kube-apiserver, ...]`, hence the binaries on PATH in /usr/local/bin; CoreDNS is started
  through its image's entrypoint (/coredns) with `args:` only.
- Networking: /kind/manifests/default-cni.yaml is a kube-router DaemonSet (BGP routes between the nodes
  on the docker bridge, the bridge CNI plugin on each node, NetworkPolicy enforcement), which takes each
  node's pod CIDR from the node object, so no kind templating is needed. Services are kube-proxy's
  (iptables), as on kind's own images. The router's BGP (179) and GoBGP gRPC (50051) ports listen on the
  node addresses, which only the kind network reaches (GHSA-v5mh-h5hx-7v92 concerns that gRPC port).
- Storage: /kind/manifests/default-storage.yaml is a default StorageClass `standard` on the controller
  manager's host-path provisioner (kind's config enables it): volumes live on a node's disk, are not
  shared between nodes, and are meant for tests. kind's local-path provisioner would need a pull.
- The entrypoint (ENTRYPOINT below) prepares the container for systemd on cgroup v1 and v2 hosts:
  read-only /sys, rshared /, the kubelet's cgroup roots, a fresh machine-id, ip_forward, containerd's
  oom_score_adj restricted where CAP_SYS_RESOURCE is missing, pods reaching Docker's embedded DNS, and,
  after `docker start` gave the node a new address, the files naming the old one.
- Not included: crictl (kind uses it only for `kind load docker-image`'s "already present" check and
  `kind export logs`; without it `kind load` imports every time).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

if not __package__:  # run as a script (python hack/kind_node.py): hack.* from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hack import common, image  # noqa: E402  (the cache and the pinned versions; the pause binary, debootstrap)
from hack import docker as engine  # noqa: E402  (hack/docker.py: the engine's socket)
from hack.common import BuildError  # noqa: E402

CACHE = common.CACHE
ROOTFS_REVISION = 1  # bump when a package list or the rootfs post-processing changes
IMAGE_LABEL = "dev.ddpjob.kind-node.inputs"  # hash of everything the node image is made from

NODE_PACKAGES = ["systemd", "systemd-sysv", "containerd", "runc", "containernetworking-plugins", "iptables",
                 "conntrack", "ipset", "iproute2", "ethtool", "kmod", "procps", "ca-certificates"]
NET_PACKAGES = ["iptables", "ipset", "conntrack", "iproute2", "kmod"]
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# kubeadm v1.34's image names (cmd/kubeadm/app/constants: PauseVersion, SupportedEtcdVersion, CoreDNSVersion)
PAUSE_TAG = common.PAUSE_VERSION  # the embedded cluster pins the same pause
ETCD_TAG = "3.6.5-0"
COREDNS_TAG = "v1.12.1"


log = common.logger("kind-node")


def docker(*args: str, stdin=None, capture: bool = True) -> str:
    p = subprocess.run(["docker", "-H", engine.DOCKER_HOST, *args], stdin=stdin, text=True,
                       stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if p.returncode != 0:
        raise BuildError(f"docker {' '.join(args[:3])} failed (exit {p.returncode})"
                         + (f":\n{p.stderr.strip()}" if capture else ""))
    return p.stdout if capture else ""


def image_label(ref: str) -> str | None:
    try:
        out = docker("image", "inspect", "--format", f'{{{{index .Config.Labels "{IMAGE_LABEL}"}}}}', ref)
    except BuildError:
        return None
    return out.strip() or None


# --------------------------------------------------------------------------------------------
# inputs

def binaries(v: dict[str, str]) -> dict[str, Path]:
    """Every binary the image is made from, by name; fails naming the build-binaries target to run."""
    where = {
        "kube": CACHE / f"kube-{v['KUBE_VERSION']}",
        "etcd": CACHE / f"etcd-{v['ETCD_VERSION']}",
        "kube-router": CACHE / f"kube-router-{v['KUBE_ROUTER_VERSION']}",
        "kind": CACHE / f"kind-{v['KIND_VERSION']}",
    }
    wanted = {
        "kubelet": "kube", "kubectl": "kube", "kube-apiserver": "kube", "kube-controller-manager": "kube",
        "kube-scheduler": "kube", "kube-proxy": "kube", "etcd": "etcd", "kube-router": "kube-router",
        "kubeadm": "kind", "coredns": "kind",
    }
    found, missing = {}, set()
    for name, target in wanted.items():
        path = where[target] / name
        if path.is_file() and os.access(path, os.X_OK):
            found[name] = path
        else:
            missing.add(target)
    found["pause"] = image.pause_binary()  # Kubernetes' pause.c, compiled once into the cache
    if missing:
        raise BuildError(f"missing binaries: run `hack/build-binaries.sh {' '.join(sorted(missing))}`")
    return found


def rootfs(name: str, packages: list[str], suite: str) -> Path:
    """A cached debootstrap root filesystem with `packages`, cleaned to look like an image."""
    d = CACHE / f"kind-rootfs-{name}-{suite}-r{ROOTFS_REVISION}"
    if (d / "etc/os-release").exists():
        return d
    tmp = d.with_name(d.name + ".tmp")
    if not (tmp / "etc/os-release").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"debootstrap {suite} for the {name} image (once; a minute or two)")
        image.debootstrap(tmp, packages, suite)
    image.strip_host(tmp)
    tmp.rename(d)
    return d


def import_rootfs(directory: Path, ref: str) -> None:
    if image_label(ref) == directory.name:
        return
    log(f"docker import {directory.name} as {ref}")
    tar = subprocess.Popen(["tar", "-C", str(directory), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    docker("import", "--change", f"ENV {PATH_ENV}", "--change", f"LABEL {IMAGE_LABEL}={directory.name}",
           "-", ref, stdin=tar.stdout)
    if tar.wait() != 0:
        raise BuildError(f"tar of {directory} failed")


def build_context(files: dict[str, tuple[str | Path, int]], dockerfile: str, ref: str, label: str) -> None:
    """`docker build` a context made of `files` (context path -> (text or source file, mode))."""
    with tempfile.TemporaryDirectory(prefix="kind-node-", dir=CACHE) as tmp:
        ctx = Path(tmp)
        for rel, (src, mode) in files.items():
            dst = ctx / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(src, Path):
                shutil.copyfile(src, dst)
            else:
                dst.write_text(src)
            dst.chmod(mode)
        (ctx / "Dockerfile").write_text(dockerfile + f"\nLABEL {IMAGE_LABEL}={label}\n")
        # --network none: no RUN step needs one, and this engine has no default bridge
        docker("build", "--network", "none", "-q", "-t", ref, str(ctx))


# --------------------------------------------------------------------------------------------
# the control-plane and add-on images, pre-loaded into the node

def component_images(v: dict[str, str], bins: dict[str, Path], netbase: str) -> list[str]:
    kube = v["KUBE_VERSION"]
    reg = "registry.k8s.io"
    images = {
        f"{reg}/kube-apiserver:{kube}": ("scratch", "kube-apiserver"),
        f"{reg}/kube-controller-manager:{kube}": ("scratch", "kube-controller-manager"),
        f"{reg}/kube-scheduler:{kube}": ("scratch", "kube-scheduler"),
        f"{reg}/kube-proxy:{kube}": (netbase, "kube-proxy"),
        f"{reg}/etcd:{ETCD_TAG}": ("scratch", "etcd"),
        f"localhost/kube-router:{v['KUBE_ROUTER_VERSION']}": (netbase, "kube-router"),
    }
    refs = []
    for ref, (base, name) in images.items():
        entry = "" if base == "scratch" else f'ENTRYPOINT ["/usr/local/bin/{name}"]\n'
        build_context({name: (bins[name], 0o755)},
                      f"FROM {base}\nCOPY {name} /usr/local/bin/{name}\nENV {PATH_ENV}\n{entry}", ref, name)
        refs.append(ref)
    build_context({"coredns": (bins["coredns"], 0o755)},
                  'FROM scratch\nCOPY coredns /coredns\nEXPOSE 53 53/udp\nENTRYPOINT ["/coredns"]\n',
                  f"{reg}/coredns/coredns:{COREDNS_TAG}", "coredns")
    build_context({"pause": (bins["pause"], 0o755)},
                  'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n',
                  f"{reg}/pause:{PAUSE_TAG}", "pause")
    return refs + [f"{reg}/coredns/coredns:{COREDNS_TAG}", f"{reg}/pause:{PAUSE_TAG}"]


# --------------------------------------------------------------------------------------------
# the node's own files

ENTRYPOINT = r'''#!/bin/bash
# Prepares this container for systemd and the kubelet, then execs the command (/sbin/init).
set -o errexit -o nounset -o pipefail
info() { echo "INFO: $*" >&2; }

# systemd in a container expects a read-only /sys (udev and friends then skip themselves); / is rshared
# so that mounts the kubelet makes for volumes propagate into the pods that use them.
mount -o remount,ro /sys
mount --make-rshared /

# cgroups. v2: the kubelet unit's drop-in delegates controllers once systemd runs. v1: needs a private
# cgroup namespace (kind passes --cgroupns=private), so every hierarchy's root is this container's; the
# kubelet's roots (/kubelet, and /kubelet.slice with the systemd driver) are made bind mounts of
# themselves, as the kubelet and cAdvisor find cgroup roots through /proc/self/mountinfo.
if [[ ! -f /sys/fs/cgroup/cgroup.controllers ]]; then
  if [[ $(grep -E '^[0-9]+:([^:]*,)?cpu(,[^:]*)?:' /proc/self/cgroup | cut -d: -f3) != / ]]; then
    echo "ERROR: cgroup v1 without a private cgroup namespace (docker run --cgroupns=private)" >&2
    exit 1
  fi
  if [[ -d /sys/fs/cgroup/misc ]]; then
    # the kubelet's cgroup v1 code knows no misc controller and fails on it
    umount /sys/fs/cgroup/misc && rmdir /sys/fs/cgroup/misc
    grep -v '^misc' /proc/cgroups >/kind/cgroups && mount --bind /kind/cgroups /proc/cgroups
  fi
  mount --make-rprivate /sys/fs/cgroup
  for hierarchy in $(findmnt -lun -o target -t cgroup); do
    for root in kubelet kubelet.slice; do
      mkdir -p "$hierarchy/$root"
      if [[ $hierarchy == */cpuset ]]; then
        cat "$hierarchy/cpuset.cpus" >"$hierarchy/$root/cpuset.cpus"
        cat "$hierarchy/cpuset.mems" >"$hierarchy/$root/cpuset.mems"
      fi
      mount --bind "$hierarchy/$root" "$hierarchy/$root"
    done
  done
fi

# every node its own identity
rm -f /etc/machine-id && systemd-machine-id-setup >/dev/null
[[ -f /kind/product_uuid ]] || cat /proc/sys/kernel/random/uuid >/kind/product_uuid
for f in /sys/class/dmi/id/product_uuid /sys/devices/virtual/dmi/id/product_uuid; do
  [[ -f $f ]] && mount -o ro,bind /kind/product_uuid "$f"
done

sysctl -q -w net.ipv4.ip_forward=1 net.ipv4.conf.all.route_localnet=1

# Without CAP_SYS_RESOURCE in the bounding set (some sandboxed hosts), no process here may lower an
# oom_score_adj, and runc fails every pod sandbox the kubelet gives -998 ("can't get final child's PID
# from pipe"); containerd then keeps each container's score at least at its own.
if (( (0x$(awk '/^CapBnd:/ {print $2}' /proc/self/status) >> 24 & 1) == 0 )); then
  info "no CAP_SYS_RESOURCE: containerd restricts oom_score_adj"
  sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml
fi

# Docker's embedded DNS answers on 127.0.0.11 in this network namespace only, through DNAT rules Docker
# put in OUTPUT. Pods (and CoreDNS forwarding upstream) use the gateway address instead: the same rules
# are applied to PREROUTING for it, and resolv.conf names it.
gateway=$(ip -4 route show default | awk '{print $3; exit}')
if [[ -n $gateway ]] && grep -q '^nameserver 127.0.0.11' /etc/resolv.conf; then
  iptables-save -t nat \
    | sed -e "s/-d 127.0.0.11/-d $gateway/g" \
          -e 's/^-A OUTPUT \(.*\) -j DOCKER_OUTPUT$/&\n-A PREROUTING \1 -j DOCKER_OUTPUT/' \
          -e "s/--to-source :53/--to-source $gateway:53/g" \
    | iptables-restore
  sed -e "s/127.0.0.11/$gateway/" /etc/resolv.conf >/etc/resolv.conf.new
  cat /etc/resolv.conf.new >/etc/resolv.conf && rm /etc/resolv.conf.new
fi

# After `docker start` the node may have a new address: rewrite the files that name the old one (the
# node's kubelet flags, and on a control plane its manifests and kubeconfigs) and reissue the API
# server's certificate, whose SANs carry it.
ipv4=$(getent ahostsv4 "$(hostname)" | awk '{print $1; exit}')
if [[ -n $ipv4 && -f /kind/old-ipv4 && $(cat /kind/old-ipv4) != "$ipv4" ]]; then
  old=$(cat /kind/old-ipv4)
  info "address changed from $old to $ipv4"
  for f in /etc/kubernetes/manifests/*.yaml /etc/kubernetes/*.conf /kind/kubeadm.conf \
           /var/lib/kubelet/kubeadm-flags.env; do
    [[ -f $f ]] && sed -i "s#\b${old//./\\.}\b#$ipv4#g" "$f"
  done
  if [[ -f /etc/kubernetes/pki/apiserver.crt ]]; then
    rm -f /etc/kubernetes/pki/apiserver.crt /etc/kubernetes/pki/apiserver.key
    kubeadm init phase certs apiserver --config /kind/kubeadm.conf
  fi
fi
[[ -z $ipv4 ]] || echo -n "$ipv4" >/kind/old-ipv4

info "starting $*"
exec "$@"
'''

KUBELET_SERVICE = '''\
[Unit]
Description=kubelet: The Kubernetes Node Agent
# kubeadm writes the config on init/join; until then the unit waits
ConditionPathExists=/var/lib/kubelet/config.yaml
After=containerd.service

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=1s
CPUAccounting=true
MemoryAccounting=true
Slice=kubelet.slice
KillMode=process

[Install]
WantedBy=multi-user.target
'''

# the flags kubeadm expects its kubelet unit to pass (kubeadm's packaging drop-in)
KUBEADM_DROPIN = '''\
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
'''

# kind's kubelet config sets cgroupRoot /kubelet; v2 needs its controllers enabled down to it
CGROUP_DROPIN = '''\
[Service]
ExecStartPre=/bin/sh -euc 'if [ -f /sys/fs/cgroup/cgroup.controllers ]; then for g in "" /kubelet /kubelet.slice; do mkdir -p /sys/fs/cgroup$g; sed -e "s/ / +/g" -e "s/^/+/" </sys/fs/cgroup$g/cgroup.controllers >/sys/fs/cgroup$g/cgroup.subtree_control; done; elif [ ! -d /sys/fs/cgroup/systemd/kubelet ]; then mkdir -p /sys/fs/cgroup/systemd/kubelet; fi'
'''

KUBELET_SLICE = '''\
[Unit]
Description=slice of the kubelet and its pods
Before=slices.target

[Slice]
MemoryAccounting=true
CPUAccounting=true
'''

CNI_MANIFEST = '''\
# kube-router: routes between the nodes (iBGP full mesh over the kind network), the bridge CNI plugin on
# each node (kube-router writes the node's pod CIDR, allocated by the controller manager, into the config)
# and NetworkPolicy enforcement. Services stay with kube-proxy.
apiVersion: v1
kind: ServiceAccount
metadata: {name: kube-router, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: kube-router}
rules:
- apiGroups: [""]
  resources: [namespaces, pods, services, nodes, endpoints]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, create, update]
- apiGroups: [""]
  resources: [services/status]
  verbs: [update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: kube-router}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: kube-router}
subjects: [{kind: ServiceAccount, name: kube-router, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: kube-router-cni, namespace: kube-system}
data:
  10-kuberouter.conflist: |
    {"cniVersion": "0.3.1", "name": "kubernetes", "plugins": [
      {"type": "bridge", "bridge": "kube-bridge", "isDefaultGateway": true, "hairpinMode": true,
       "ipam": {"type": "host-local"}},
      {"type": "portmap", "capabilities": {"portMappings": true}, "snat": true}]}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: kube-router, namespace: kube-system, labels: {k8s-app: kube-router}}
spec:
  selector: {matchLabels: {k8s-app: kube-router}}
  template:
    metadata: {labels: {k8s-app: kube-router}}
    spec:
      serviceAccountName: kube-router
      priorityClassName: system-node-critical
      hostNetwork: true
      tolerations: [{operator: Exists}]
      initContainers:
      - name: install-cni
        image: {image}
        command: [/bin/sh, -c, "cp /cni/10-kuberouter.conflist /etc/cni/net.d/.tmp && mv /etc/cni/net.d/.tmp /etc/cni/net.d/10-kuberouter.conflist"]
        volumeMounts:
        - {name: cni-conf, mountPath: /etc/cni/net.d}
        - {name: cni-template, mountPath: /cni}
      containers:
      - name: kube-router
        image: {image}
        args:
        - --run-router=true
        - --run-firewall=true
        - --run-service-proxy=false
        - --bgp-graceful-restart=true
        env:
        - name: NODE_NAME
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
        - name: POD_NAME
          valueFrom: {fieldRef: {fieldPath: metadata.name}}
        - {name: KUBE_ROUTER_CNI_CONF_FILE, value: /etc/cni/net.d/10-kuberouter.conflist}
        livenessProbe:
          httpGet: {path: /healthz, port: 20244}
          initialDelaySeconds: 10
          periodSeconds: 3
        resources: {requests: {cpu: 50m, memory: 64Mi}}
        securityContext: {privileged: true}
        volumeMounts:
        - {name: lib-modules, mountPath: /lib/modules, readOnly: true}
        - {name: cni-conf, mountPath: /etc/cni/net.d}
        - {name: xtables-lock, mountPath: /run/xtables.lock}
      volumes:
      - {name: lib-modules, hostPath: {path: /lib/modules}}
      - {name: cni-conf, hostPath: {path: /etc/cni/net.d}}
      - {name: cni-template, configMap: {name: kube-router-cni}}
      - {name: xtables-lock, hostPath: {path: /run/xtables.lock, type: FileOrCreate}}
'''

STORAGE_MANIFEST = '''\
# The controller manager's host-path provisioner (kind enables it): a volume is a directory on a node,
# not shared between nodes. Enough for tests; there is no local-path provisioner image offline.
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: standard
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: kubernetes.io/host-path
'''

NODE_DOCKERFILE = '''\
FROM {base}
COPY files/ /
RUN chmod 755 /kind /usr/local/bin/entrypoint \\
 && mkdir -p /opt/cni && ln -sfn /usr/lib/cni /opt/cni/bin \\
 && mkdir -p /etc/kubernetes/manifests /etc/cni/net.d /var/lib/kubelet \\
 && echo "ReadKMsg=no" >>/etc/systemd/journald.conf \\
 && rm -f /etc/systemd/system/*.wants/* /lib/systemd/system/multi-user.target.wants/getty.target \\
 && systemctl enable containerd.service kubelet.service \\
 && systemctl mask systemd-binfmt.service getty.target console-getty.service systemd-udevd.service \\
      systemd-modules-load.service sys-kernel-debug.mount sys-kernel-tracing.mount
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]
'''


def node_files(v: dict[str, str], bins: dict[str, Path], router_image: str) -> dict[str, tuple[str | Path, int]]:
    f: dict[str, tuple[str | Path, int]] = {
        "usr/local/bin/entrypoint": (ENTRYPOINT, 0o755),
        # restrict_oom_score_adj is turned on by ENTRYPOINT where the host needs it
        "etc/containerd/config.toml": (common.containerd_config(f"registry.k8s.io/pause:{PAUSE_TAG}", "/etc/cni/net.d",
                                                                systemd_cgroup=True, restrict_oom_score_adj=False,
                                                                private=False), 0o644),
        "etc/systemd/system/kubelet.service": (KUBELET_SERVICE, 0o644),
        "etc/systemd/system/kubelet.service.d/10-kubeadm.conf": (KUBEADM_DROPIN, 0o644),
        "etc/systemd/system/kubelet.service.d/11-cgroups.conf": (CGROUP_DROPIN, 0o644),
        "etc/systemd/system/kubelet.slice": (KUBELET_SLICE, 0o644),
        "etc/default/kubelet": ("KUBELET_EXTRA_ARGS=--runtime-cgroups=/system.slice/containerd.service\n", 0o644),
        "etc/sysctl.d/10-kind-node.conf": ("net.ipv4.ip_forward=1\nnet.ipv4.conf.all.route_localnet=1\n", 0o644),
        "kind/version": (v["KUBE_VERSION"] + "\n", 0o644),
        "kind/manifests/default-cni.yaml": (CNI_MANIFEST.replace("{image}", router_image), 0o644),
        "kind/manifests/default-storage.yaml": (STORAGE_MANIFEST, 0o644),
    }
    for name in ("kubeadm", "kubelet", "kubectl"):
        f[f"usr/bin/{name}"] = (bins[name], 0o755)
    return f


def inputs_digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# build

def preload(stage: str, images: list[str], ref: str, label: str) -> None:
    """Start `stage` without systemd, import `images` into its containerd (k8s.io, unpacked on
    first use) and commit the result as `ref` with the node's entrypoint."""
    name = f"ddpjob-kind-node-build-{os.getpid()}"
    docker("run", "-d", "--name", name, "--privileged", "--network", "none", "--entrypoint", "sleep", stage,
           "infinity")
    try:
        log(f"pre-loading {len(images)} images into the node's containerd")
        save = subprocess.Popen(["docker", "-H", engine.DOCKER_HOST, "save", *images], stdout=subprocess.PIPE)
        script = textwrap.dedent('''\
            set -e
            containerd >/tmp/containerd.log 2>&1 & pid=$!
            for i in $(seq 100); do [ -S /run/containerd/containerd.sock ] && break; sleep 0.2; done
            ctr --namespace=k8s.io images import --no-unpack --digests - >/dev/null
            ctr --namespace=k8s.io images ls -q
            kill $pid; wait $pid || true
            rm -rf /run/containerd /tmp/containerd.log''')
        out = docker("exec", "-i", name, "bash", "-c", script, stdin=save.stdout)
        if save.wait() != 0:
            raise BuildError("docker save of the component images failed")
        have = set(out.split())
        lacking = [i for i in images if i not in have]
        if lacking:
            raise BuildError(f"the node's containerd lacks {lacking} after the import:\n{out}")
        docker("stop", "-t", "1", name)
        docker("commit", "--change", 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]',
               "--change", "CMD []", "--change", f"LABEL {IMAGE_LABEL}={label}", name, ref)
    finally:
        subprocess.run(["docker", "-H", engine.DOCKER_HOST, "rm", "-f", name], capture_output=True)


def build(tag: str | None = None) -> str:
    v = common.versions()
    ref = tag or default_ref(v)
    bins = binaries(v)
    suite = v.get("DEBIAN_SUITE", "bookworm")
    node_root = rootfs("node", NODE_PACKAGES, suite)
    net_root = rootfs("net", NET_PACKAGES, suite)
    router_image = f"localhost/kube-router:{v['KUBE_ROUTER_VERSION']}"
    files = node_files(v, bins, router_image)
    label = inputs_digest(v, [(k, p.stat().st_size, p.stat().st_mtime_ns) for k, p in sorted(bins.items())],
                          node_root.name, net_root.name,
                          {k: (str(s) if isinstance(s, Path) else hashlib.sha256(s.encode()).hexdigest(), m)
                           for k, (s, m) in files.items()}, NODE_DOCKERFILE, ENTRYPOINT)
    if image_label(ref) == label:
        log(f"{ref} is current")
        return ref
    started = time.monotonic()
    base, netbase = "ddpjob/kind-base:r%d" % ROOTFS_REVISION, "ddpjob/kind-netbase:r%d" % ROOTFS_REVISION
    import_rootfs(node_root, base)
    import_rootfs(net_root, netbase)
    log("building the control-plane and add-on images")
    images = component_images(v, bins, netbase)
    log("building the node")
    stage = f"{ref}-stage"
    build_context({f"files/{k}": s for k, s in files.items()}, NODE_DOCKERFILE.format(base=base), stage, label)
    preload(stage, images, ref, label)
    docker("rmi", stage)
    log(f"built {ref} in {time.monotonic() - started:.0f}s")
    return ref


def default_ref(v: dict[str, str] | None = None) -> str:
    return f"ddpjob/kind-node:{(v or common.versions())['KUBE_VERSION']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the node image into hack/docker.py's engine")
    b.add_argument("--tag", help="image reference (default ddpjob/kind-node:$KUBE_VERSION)")
    sub.add_parser("ref", help="print the default image reference")
    args = ap.parse_args(argv)
    if args.command == "ref":
        print(default_ref())
        return 0
    try:
        print(build(args.tag))
    except (BuildError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
