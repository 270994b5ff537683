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
- The entrypoint (ENTRYPOINT, hack/kind_node_files.py) prepares the container for systemd on cgroup v1 and v2 hosts:
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
from hack.kind_node_files import (CGROUP_DROPIN, CNI_MANIFEST, ENTRYPOINT, KUBEADM_DROPIN,  # noqa: E402
                                  KUBELET_SERVICE, KUBELET_SLICE, NODE_DOCKERFILE, STORAGE_MANIFEST)

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
# the node's own files (their text: hack/kind_node_files.py)

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
