"""Images from buildah's store into a containerd: the embedded cluster's (`to_containerd`, `import_image`) or the
nodes of a kind cluster (`kind_load`), as an OCI archive streamed once, carrying only the layers the receiver
lacks, each rebuilt byte for byte from buildah's store (`_Store`), or from `buildah push dir:` where it cannot
be. Also `archive` (a docker-archive for `kind load image-archive`) and `buildah` itself."""
from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

from hack import common, host
from hack.common import BuildError

CACHE = common.CACHE
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
    the archive is streamed from buildah's store into each node in turn, never written, and
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
    # One node after the other: a node holds the image twice until its blobs are dropped (the content store, then the
    # unpacked snapshots), so streaming into every node at once needed twice the image per node free at the same
    # time (~22 GB for the trainer on two workers, beside make test's own use of the disk); one at a time, one
    # node's second copy at most.
    for node in todo:
        log(f"streaming {ref} ({sum(m['size'] for m in layers) / 2**30:.2f} GiB) into {node}")
        argvs = [_node_ctr(node) + ["images", "import", "--digests", f"--snapshotter={kind_snapshotter(node)}", "-"]]
        _exported(ref, lambda export_dir, argvs=argvs: _ctr_import(argvs, ref, image, layers, export_dir))
        subprocess.run(_node_ctr(node) + ["content", "rm", *(layer["digest"] for layer in layers)], check=True,
                       capture_output=True)
