#!/usr/bin/env python3
"""Container images without a Docker engine or a registry: buildah builds them, containerd runs them.

    hack/image.py build -f Dockerfile -t localhost/NAME:TAG [--build-arg K=V]... [--target STAGE] [--no-import] CONTEXT
    hack/image.py archive REF FILE   write buildah's image REF as a docker-archive (`kind load image-archive`)
    hack/image.py kind-load REF --name CLUSTER [--nodes a,b]   stream buildah's image REF into a kind cluster's nodes
    hack/image.py pause            build and import the pause image the cluster's containerd uses
    hack/image.py ls               images in containerd's k8s.io namespace
    hack/image.py has REF          exit 0 when REF is in containerd

`build` runs `buildah bud --isolation chroot --layers` (Debian's buildah: no daemon, no registry), so a
Dockerfile is built as Docker builds it: one cached layer per step, `RUN --mount=type=cache` included.
The image then goes into containerd's `k8s.io` namespace, where the kubelet finds it, as an OCI archive
that carries only the layers containerd lacks: a change to the project's sources re-imports the small top
layer, never the multi-GB torch layer. A missing layer is reproduced byte for byte from buildah's store
(the layer's files and its tar-split record, which is how buildah exports it too); containerd checks it
against the layer's digest, and where that fast path fails (another storage driver, say) the layers come
from `buildah push dir:` instead. Layers stay uncompressed: gzip of a multi-GB torch layer costs minutes
on 2 cores and buys nothing locally.

Base images that cannot be pulled here are committed into buildah's store first, under the names the
Dockerfiles use, from a debootstrap root filesystem:
    python:3.11[-slim][-bookworm], debian:bookworm[-slim], debian:12[-slim]
        -> Debian $DEBIAN_SUITE minbase + python3, python3-venv, ca-certificates, netbase
           (Debian's python3 is /usr/bin/python3; /usr/local/bin/python{,3} link to it, as in the
           python image; `python3 -m venv` works, system pip is deliberately absent)
Any other FROM is pulled by buildah as usual, where a registry is reachable.

Build-time only (never in the image): the host's CA bundle is bound over the image's
/etc/ssl/certs/ca-certificates.crt for RUN steps (TLS-intercepting proxies; Debian's pip reads that file),
and buildah passes the proxy variables itself. Reclaim buildah's disk with `buildah rmi --prune`
(it drops the layer cache too).
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script (python hack/image.py): hack.* from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hack import common  # noqa: E402
from hack.common import BuildError  # noqa: E402
from hack.image_import import archive, buildah, containerd_images, has_image, import_image, kind_load  # noqa: E402
from hack.image_import import _Store  # noqa: E402,F401  (tests/cluster/test_image_builder.py reads layers with it)

CACHE = common.CACHE
LOCK = CACHE / "image-build.lock"
OLD_BUILD_CACHE = CACHE / "image-build"  # the step snapshots of the builder this file replaced

BASE_REVISION = 1  # bump when BASE_PACKAGES or the post-processing below changes
BASE_LABEL = "dev.ddpjob.base-revision"
BASE_PACKAGES = ["python3", "python3-venv", "ca-certificates", "netbase"]
DEBIAN_MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_IMAGES = [  # Dockerfile FROM references the Debian base stands in for
    r"(docker\.io/)?(library/)?python:3\.11(\.\d+)?(-slim)?(-bookworm)?",
    r"(docker\.io/)?(library/)?debian:(bookworm|12)(-slim)?",
]
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


log = common.logger("image")


def check_ref(ref: str) -> None:
    # The CRI normalises short names to docker.io/library/...; a local image must be fully qualified,
    # and :latest would make the kubelet try to pull.
    if not re.fullmatch(r"[a-z0-9.-]+(:\d+)?/[a-z0-9._/-]+:[A-Za-z0-9_.-]+", ref) or ref.endswith(":latest"):
        raise BuildError(f"image ref {ref!r} must be fully qualified with a version tag, "
                         "e.g. localhost/ddp-trainer:0.1.0 (never :latest)")


# --------------------------------------------------------------------------------------------
# base images

def base_rootfs_path() -> Path:
    suite = common.versions().get("DEBIAN_SUITE", "bookworm")
    return CACHE / f"rootfs-{suite}-v{BASE_REVISION}"


def debootstrap(target: Path, packages: list[str], suite: str) -> None:
    """A Debian `suite` minbase root filesystem with `packages` in `target` (hack/kind_node.py's too)."""
    subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, str(target),
                    DEBIAN_MIRROR], check=True, stdout=subprocess.DEVNULL)


def strip_host(root: Path) -> None:
    """Make a debootstrapped root filesystem look like an image, not a host: no apt caches, no host resolver or
    hostname."""
    for p in ["var/cache/apt/archives", "var/lib/apt/lists"]:
        for f in (root / p).glob("*"):
            if f.is_file():
                f.unlink()
    for f in (root / "var/cache/apt").glob("*.bin"):
        f.unlink()
    (root / "etc/resolv.conf").write_text("")
    (root / "etc/hostname").unlink(missing_ok=True)


def base_rootfs() -> Path:
    """The cached Debian base root filesystem, made on first use (call with the build lock held)."""
    suite = common.versions().get("DEBIAN_SUITE", "bookworm")
    d = base_rootfs_path()
    if (d / "etc" / "os-release").exists() and not d.with_suffix(".tmp").exists():
        return d
    tmp = d.with_suffix(".tmp")
    if not (tmp / "usr" / "bin" / "python3").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"debootstrap {suite} minbase + {' '.join(BASE_PACKAGES)} (once; about 2 minutes)")
        debootstrap(tmp, BASE_PACKAGES, suite)
    strip_host(tmp)
    for name in ("python", "python3"):  # as in the python image
        link = tmp / "usr/local/bin" / name
        if not link.is_symlink():
            link.symlink_to("/usr/bin/python3")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d


def from_refs(text: str, build_args: dict[str, str] | None = None) -> list[str]:
    """The images a Dockerfile's stages start FROM (not its own stage names, not scratch), with the ARGs
    declared before the first FROM expanded."""
    args, refs, stages = {}, [], set()
    for line in text.splitlines():
        if not refs and not stages and (m := re.match(r"\s*ARG\s+(\w+)(?:=(\S*))?\s*$", line, re.IGNORECASE)):
            args[m.group(1)] = (build_args or {}).get(m.group(1), m.group(2) or "")
        m = re.match(r"\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if m:
            ref = re.sub(r"\$\{?(\w+)\}?", lambda v: args.get(v.group(1), ""), m.group(1))
            if ref.lower() not in stages and ref != "scratch":
                refs.append(ref)
            if m.group(2):
                stages.add(m.group(2).lower())
    return refs


def base_name(ref: str) -> str | None:
    """The fully qualified name buildah gives `ref` when it is one of BASE_IMAGES, else None."""
    if not any(re.fullmatch(p, ref) for p in BASE_IMAGES):
        return None
    short = re.sub(r"^(docker\.io/)?(library/)?", "", ref)
    return f"docker.io/library/{short}"


def ensure_bases(dockerfile: Path, build_args: dict[str, str] | None = None) -> None:
    """Commit the Debian base under every BASE_IMAGES name the Dockerfile starts FROM (once per revision)."""
    for ref in from_refs(dockerfile.read_text(), build_args):
        name = base_name(ref)
        if name is None:
            continue
        try:
            labels = json.loads(buildah("inspect", "--type", "image", name))["OCIv1"]["config"].get("Labels") or {}
        except BuildError:
            labels = {}
        if labels.get(BASE_LABEL) == str(BASE_REVISION):
            continue
        log(f"committing the Debian base as {name}")
        container = buildah("from", "scratch").strip()
        try:
            buildah("add", "--quiet", container, str(base_rootfs()), "/")
            buildah("config", "--env", f"PATH={BASE_PATH}", "--env", "LANG=C.UTF-8", "--cmd", "python3",
                    "--label", f"{BASE_LABEL}={BASE_REVISION}", "--os", "linux", "--arch", "amd64", container)
            buildah("commit", "--quiet", container, name)
        finally:
            buildah("rm", container)


# --------------------------------------------------------------------------------------------
# build

def build(dockerfile: str | Path, ref: str, context: str | Path, build_args: dict[str, str] | None = None,
          target: str | None = None, to_containerd_ns: bool = True) -> str:
    """Build a Dockerfile with buildah and put it into containerd's k8s.io namespace as `ref`; returns the
    manifest digest (the same for the same inputs: buildah's layer cache). to_containerd_ns=False leaves
    it in buildah's store only (for kind, which gets it through `archive`)."""
    check_ref(ref)
    if os.geteuid() != 0:
        raise BuildError("image builds need root (buildah, containerd)")
    t0 = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    # One build at a time per machine: builds share the base, buildah's cache and two CPU cores.
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if OLD_BUILD_CACHE.exists():
            log(f"removing {OLD_BUILD_CACHE} (the step snapshots of the builder before buildah)")
            shutil.rmtree(OLD_BUILD_CACHE, ignore_errors=True)
        dockerfile = Path(dockerfile)
        ensure_bases(dockerfile, build_args)
        argv = ["bud", "--isolation", "chroot", "--layers", "--pull=false", "-f", str(dockerfile), "-t", ref]
        if HOST_CA_BUNDLE.exists():
            argv += ["-v", f"{HOST_CA_BUNDLE}:/etc/ssl/certs/ca-certificates.crt:ro"]
        for k, v in (build_args or {}).items():
            argv += ["--build-arg", f"{k}={v}"]
        if target:
            argv += ["--target", target]
        buildah(*argv, str(context), capture=False)
        if to_containerd_ns:
            digest = import_image(ref)
        else:
            manifest = json.loads(buildah("inspect", "--type", "image", ref))["Manifest"].encode()
            digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    log(f"{ref} {digest[:19]} ready in {time.monotonic() - t0:.1f}s")
    return digest


# --------------------------------------------------------------------------------------------
# pause image

def go_binary() -> str:
    """The Go hack/build-binaries.sh builds with: a new enough one on PATH, else the pinned toolchain
    (hack/install-go.py; a fresh machine has no `go` on PATH)."""
    goroot = subprocess.run([sys.executable, str(Path(__file__).with_name("install-go.py"))],
                            stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    return str(Path(goroot) / "bin" / "go")


def pause_binary() -> Path:
    """Kubernetes' own pause.c, compiled statically once into the cache (touches no containerd)."""
    kube = common.versions()["KUBE_VERSION"]
    out = CACHE / f"pause-{common.PAUSE_VERSION}"
    binary = out / "pause"
    if not binary.exists():
        go = go_binary()
        modcache = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True,
                                  check=True).stdout.strip()
        src = Path(modcache) / f"k8s.io/kubernetes@{kube}/build/pause/linux/pause.c"
        if not src.exists():
            subprocess.run([go, "mod", "download", f"k8s.io/kubernetes@{kube}"], check=True,
                           env={**os.environ, "GOFLAGS": "-mod=mod"}, cwd=tempfile.gettempdir())
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-Os", "-static", "-Wall", "-Werror", f'-DVERSION=v{common.PAUSE_VERSION}-ddpjob',
                        "-o", str(binary), str(src)], check=True)
        subprocess.run(["strip", str(binary)], check=False)
    return binary


def ensure_pause() -> str:
    """Build Kubernetes' own pause.c statically and import it as common.PAUSE_IMAGE (no pull possible)."""
    ref = common.PAUSE_IMAGE
    if has_image(ref):
        return ref
    binary = pause_binary()
    container = buildah("from", "scratch").strip()
    try:
        buildah("copy", "--quiet", container, str(binary), "/pause")
        buildah("config", "--entrypoint", '["/pause"]', "--user", "65535:65535", "--os", "linux", "--arch", "amd64",
                container)
        buildah("commit", "--quiet", container, ref)
    finally:
        buildah("rm", container)
    import_image(ref)
    log(f"imported {ref}")
    return ref


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("-f", "--file", help="Dockerfile (default CONTEXT/Dockerfile)")
    b.add_argument("-t", "--tag", required=True, help="fully qualified ref, e.g. localhost/name:0.1.0")
    b.add_argument("--build-arg", action="append", default=[], metavar="K=V")
    b.add_argument("--target")
    b.add_argument("--no-import", action="store_true", help="leave the image in buildah's store (kind)")
    b.add_argument("context")
    ar = sub.add_parser("archive")
    ar.add_argument("ref")
    ar.add_argument("path")
    kl = sub.add_parser("kind-load", help="stream buildah's image into the nodes of a kind cluster")
    kl.add_argument("ref")
    kl.add_argument("--name", required=True, help="the kind cluster")
    kl.add_argument("--nodes", default="", help="comma-separated node names (default: every node)")
    kl.add_argument("--kind", default="kind", help="the kind binary")
    sub.add_parser("pause")
    sub.add_parser("ls")
    h = sub.add_parser("has")
    h.add_argument("ref")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            args = dict(kv.partition("=")[::2] for kv in a.build_arg)
            build(a.file or Path(a.context) / "Dockerfile", a.tag, a.context, args, a.target,
                  to_containerd_ns=not a.no_import)
        elif a.cmd == "archive":
            archive(a.ref, a.path)
        elif a.cmd == "kind-load":
            kind_load(a.ref, a.name, [n for n in a.nodes.split(",") if n], a.kind)
        elif a.cmd == "pause":
            print(ensure_pause())
        elif a.cmd == "ls":
            for ref, digest in sorted(containerd_images().items()):
                if not ref.startswith("sha256:"):
                    print(f"{ref}\t{digest}")
        elif a.cmd == "has":
            return 0 if has_image(a.ref) else 1
    except (BuildError, common.ClusterError, subprocess.CalledProcessError) as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
