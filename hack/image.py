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
import base64
import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

if not __package__:  # run as a script (python hack/image.py): hack.* from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hack import common, host  # noqa: E402
from hack.common import BuildError  # noqa: E402

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
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


class StoreError(BuildError):
    """buildah's store cannot give a layer back byte for byte (the image then travels via `buildah push`)."""


log = common.logger("image")


def buildah(*args: str, capture: bool = True) -> str:
    if not shutil.which("buildah"):
        raise BuildError("buildah is not installed: run hack/install-deps.sh (Debian package buildah)")
    p = subprocess.run(["buildah", *args], stdout=subprocess.PIPE if capture else None,
                       stderr=subprocess.PIPE if capture else None, text=True)
    if p.returncode != 0:
        raise BuildError(f"buildah {' '.join(args[:2])} failed (exit {p.returncode})"
                         + (f":\n{p.stderr.strip()}" if capture else ""))
    return p.stdout if capture else ""


def check_ref(ref: str) -> None:
    # The CRI normalises short names to docker.io/library/...; a local image must be fully qualified,
    # and :latest would make the kubelet try to pull.
    if not re.fullmatch(r"[a-z0-9.-]+(:\d+)?/[a-z0-9._/-]+:[A-Za-z0-9_.-]+", ref) or ref.endswith(":latest"):
        raise BuildError(f"image ref {ref!r} must be fully qualified with a version tag, "
                         "e.g. localhost/ddp-trainer:0.1.0 (never :latest)")


# --------------------------------------------------------------------------------------------
# containerd side

def _listed(images_ls: str) -> dict[str, str]:
    """ref -> manifest digest, from the output of `ctr images ls`."""
    return {ln.split()[0]: ln.split()[2] for ln in images_ls.splitlines()[1:] if ln.strip()}


def containerd_images() -> dict[str, str]:
    """ref -> manifest digest of everything in the k8s.io namespace (starts containerd if needed)."""
    host.ensure_containerd()
    return _listed(common.ctr("images", "ls").stdout)


def has_image(ref: str) -> bool:
    return ref in containerd_images()


def _image(ref: str) -> tuple[bytes, bytes, str]:
    """buildah's image `ref`: its manifest, its config and the manifest's digest."""
    info = json.loads(buildah("inspect", "--type", "image", ref))
    manifest, config = info["Manifest"].encode(), info["Config"].encode()
    return manifest, config, "sha256:" + hashlib.sha256(manifest).hexdigest()


class _Tee:
    """Writes to every one of `outs`."""

    def __init__(self, outs: list) -> None:
        self._outs = outs

    def write(self, b: bytes) -> None:
        for out in self._outs:
            out.write(b)


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            yield chunk


def _tar_entry(out: _Tee, name: str, size: int, chunks: Iterable[bytes]) -> None:
    """One regular file of a tar archive: its header, `chunks` (`size` bytes in all) and the padding to the next
    512-byte block. BuildError where the chunks are not `size` bytes."""
    entry = tarfile.TarInfo(name)
    entry.size, entry.mtime = size, int(time.time())
    out.write(entry.tobuf(format=tarfile.PAX_FORMAT))
    written = 0
    for chunk in chunks:
        out.write(chunk)
        written += len(chunk)
    if written != entry.size:
        raise BuildError(f"{name}: {written} bytes where {entry.size} were announced")
    out.write(bytes(-entry.size % tarfile.BLOCKSIZE))


def _ctr_import(argvs: list[list[str]], ref: str, image: tuple[bytes, bytes, str], layers: list[dict],
                export_dir: Path | None) -> list[str]:
    """Stream buildah's image `ref` (`image`: what `_image` read of it) into each of `argvs` (`ctr images import
    ... -` commands, run side by side) as an OCI archive that carries `layers` (those the receiving containerd
    lacks); returns their outputs. The archive is made once, whatever the number of receivers. With export_dir (a
    `buildah push dir:` of the image) the layers are read from there; without it they are reproduced from
    buildah's store, and StoreError says the store cannot give one back."""
    manifest, config, digest = image
    if any(layer["mediaType"] != OCI_LAYER for layer in layers):
        raise StoreError(f"{ref}: only uncompressed layers can be imported ({[m['mediaType'] for m in layers]})")
    store = None if export_dir else _Store.open()
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest, "size": len(manifest),
        "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}}]}
    outputs = [tempfile.TemporaryFile() for _ in argvs]  # files, not pipes: a full pipe would stall a writer
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
             for argv, out in zip(argvs, outputs)]

    def read(out) -> str:
        out.seek(0)
        return out.read().decode(errors="replace")

    try:
        # The archive is written here, entry by entry, rather than by tarfile's stream mode, which re-slices its
        # whole buffer for every 10 KB record it writes: 50 MB/s for a multi-GB layer on this machine's cores.
        tee = _Tee([p.stdin for p in procs])
        layout, body = b'{"imageLayoutVersion":"1.0.0"}', json.dumps(index).encode()
        _tar_entry(tee, "oci-layout", len(layout), [layout])
        for layer in layers:
            hexd = layer["digest"].split(":", 1)[1]
            chunks = _file_chunks(export_dir / hexd) if export_dir else store.layer_tar(layer["digest"])
            _tar_entry(tee, f"blobs/sha256/{hexd}", layer["size"], chunks)
        _tar_entry(tee, f"blobs/sha256/{hashlib.sha256(config).hexdigest()}", len(config), [config])
        _tar_entry(tee, f"blobs/sha256/{digest.split(':', 1)[1]}", len(manifest), [manifest])
        _tar_entry(tee, "index.json", len(body), [body])
        tee.write(bytes(2 * tarfile.BLOCKSIZE))  # the end of the archive
        for proc in procs:
            proc.stdin.close()
    except (BrokenPipeError, BuildError) as e:
        for proc in procs:
            proc.kill()
            proc.wait()
        if isinstance(e, StoreError):
            raise
        said = "\n".join(read(out) for out in outputs)
        raise BuildError(f"import of {ref} stopped: {e}\n{said}") from e
    failed = [(argv, read(out)) for argv, out, proc in zip(argvs, outputs, procs) if proc.wait() != 0]
    if failed:
        raise BuildError("".join(f"{' '.join(argv)} failed:\n{said}\n" for argv, said in failed))
    return [read(out) for out in outputs]


def _exported(ref: str, fn):
    """fn(None), or where buildah's store cannot give a layer back, fn(dir) over a `buildah push dir:` of `ref`."""
    try:
        return fn(None)
    except StoreError as e:
        log(f"{e}; exporting {ref} with buildah push instead")
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="export-") as tmp:
        buildah("push", "--quiet", "--disable-compression", ref, f"dir:{tmp}/image")
        return fn(Path(tmp) / "image")


def to_containerd(ref: str, export_dir: Path | None = None) -> str:
    """Put buildah's image `ref` into the embedded cluster's containerd under the same name; returns the
    manifest digest. Only the layers containerd lacks travel, and containerd keeps their blobs: the next
    import of a changed image sends its top layer only."""
    image = _image(ref)
    manifest, _, digest = image
    if containerd_images().get(ref) == digest:
        return digest
    layers = json.loads(manifest)["layers"]
    have = set(common.ctr("content", "ls", "-q").stdout.split())
    missing = [layer for layer in layers if layer["digest"] not in have]
    log(f"importing {ref}: {len(missing)} of {len(layers)} layers "
        f"({sum(m['size'] for m in missing) / 2**20:.1f} MiB) are new to containerd")
    host.ensure_containerd()
    out, = _ctr_import([["ctr", "--address", common.CONTAINERD_SOCK, "--namespace", common.K8S_NAMESPACE,
                         "images", "import", "-"]], ref, image, missing, export_dir)
    if containerd_images().get(ref) != digest:
        raise BuildError(f"import finished but containerd does not list {ref} at {digest}:\n{out}")
    return digest


class _Store:
    """buildah's overlay store, read-only: a layer's tar, rebuilt from its files and its tar-split record."""

    def __init__(self, root: Path, layers: dict[str, str]) -> None:
        self.root, self.layers = root, layers  # layers: uncompressed digest -> layer id

    @classmethod
    def open(cls) -> "_Store":
        store = json.loads(buildah("info"))["store"]
        if store.get("GraphDriverName") != "overlay":
            raise StoreError(f"buildah's storage driver is {store.get('GraphDriverName')}, not overlay")
        root = Path(store["GraphRoot"])
        layers: dict[str, str] = {}
        for path in (root / "overlay-layers" / "layers.json", Path(store["RunRoot"]) / "overlay-layers" /
                     "volatile-layers.json"):
            for layer in json.loads(path.read_text()) if path.exists() else []:
                if layer.get("diff-digest"):
                    layers.setdefault(layer["diff-digest"], layer["id"])
        return cls(root, layers)

    def layer_tar(self, digest: str) -> Iterator[bytes]:
        """The layer's tar, as buildah wrote it when it committed the layer; BuildError if it is not."""
        layer = self.layers.get(digest)
        split = self.root / "overlay-layers" / f"{layer}.tar-split.gz"
        if layer is None or not split.exists():
            raise StoreError(f"layer {digest} has no tar-split record in {self.root}")
        files, h = self.root / "overlay" / layer / "diff", hashlib.sha256()
        with gzip.open(split, "rt") as records:
            for line in records:
                entry = json.loads(line)
                if entry["type"] == 2:  # raw tar bytes: headers, padding, the end of the archive
                    chunk = base64.b64decode(entry.get("payload") or "")
                    h.update(chunk)
                    yield chunk
                elif entry.get("size"):  # a regular file's content
                    name = base64.b64decode(entry["name_raw"]) if entry.get("name_raw") else entry["name"].encode()
                    with open(files / os.fsdecode(name).lstrip("/"), "rb") as f:
                        left = entry["size"]
                        while left > 0 and (chunk := f.read(min(left, 4 << 20))):
                            left -= len(chunk)
                            h.update(chunk)
                            yield chunk
                    if left:
                        raise StoreError(f"layer {digest}: {entry['name']} is shorter than recorded")
        if "sha256:" + h.hexdigest() != digest:
            raise StoreError(f"layer {digest} rebuilt with digest sha256:{h.hexdigest()}")


def import_image(ref: str) -> str:
    """to_containerd, falling back to `buildah push dir:` when the store cannot give a layer back."""
    return _exported(ref, lambda export_dir: to_containerd(ref, export_dir))


def archive(ref: str, path: str | Path) -> None:
    """Write buildah's image `ref` to `path` as a docker-archive named `ref` (what `kind load image-archive`
    and `docker load` read); layers stay uncompressed."""
    Path(path).unlink(missing_ok=True)
    buildah("push", "--quiet", ref, f"docker-archive:{path}:{ref}")


def _node_ctr(node: str) -> list[str]:
    return ["docker", "exec", "-i", node, "ctr", "--namespace", common.K8S_NAMESPACE]


def kind_snapshotter(node: str) -> str:
    """The snapshotter the kubelet's images use on kind node `node` (`containerd config dump`; overlayfs unless
    the node's config names another, as kind does on filesystems overlayfs cannot sit on)."""
    dump = subprocess.run(["docker", "exec", node, "containerd", "config", "dump"], check=True,
                          capture_output=True, text=True).stdout
    named = re.findall(r"""^\s*snapshotter\s*=\s*["']([^"']+)["']""", dump, re.M)
    return named[0] if named else "overlayfs"


def kind_load(ref: str, cluster_name: str, nodes: list[str] | None = None, kind: str = "kind") -> None:
    """Put buildah's image `ref` on the nodes of kind cluster `cluster_name` (all of them by default): the
    offline way in, where Docker cannot build (no base image to pull).

    What `kind load image-archive` does (`ctr images import` in each node), without its two copies on disk:
    the archive is made once and streamed from buildah's store into every node at once, never written, and
    the layers' blobs are dropped from the node's content store once unpacked (the kubelet runs the unpacked
    snapshots; containerd's `discard_unpacked_layers` leaves pulled images the same way). A 5 GB image then
    costs a node 5 GB, not 10, and the host no 5 GB archive."""
    nodes = nodes or subprocess.run([kind, "get", "nodes", "--name", cluster_name], check=True,
                                    capture_output=True, text=True).stdout.split()
    image = _image(ref)
    manifest, _, digest = image
    layers = json.loads(manifest)["layers"]
    todo = []
    for node in nodes:
        listed = subprocess.run(_node_ctr(node) + ["images", "ls"], check=True, capture_output=True, text=True).stdout
        if _listed(listed).get(ref) == digest:
            log(f"{ref} is already on {node}")
        else:
            todo.append(node)
    if not todo:
        return
    log(f"streaming {ref} ({sum(m['size'] for m in layers) / 2**30:.2f} GiB) into {', '.join(todo)}")
    argvs = [_node_ctr(node) + ["images", "import", "--digests", f"--snapshotter={kind_snapshotter(node)}", "-"]
             for node in todo]
    _exported(ref, lambda export_dir: _ctr_import(argvs, ref, image, layers, export_dir))
    for node in todo:
        subprocess.run(_node_ctr(node) + ["content", "rm", *(layer["digest"] for layer in layers)], check=True,
                       capture_output=True)


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
