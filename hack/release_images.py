"""A release's images into a registry (hack/release.py): each image pushed as buildah built it, only the blobs the
registry lacks, and the tags already there found before anything is pushed.

Two ways, by the layers' compression:
- `none` (the default): the image's own manifest, byte for byte, so its layers keep the uncompressed digests that
  containerd holds for an image imported by hack/build-images.sh: a node of this machine that pulls it fetches the
  manifest and finds every blob at home. The image is written as an OCI layout whose layers are hard links into
  containerd's content store where it has them (no copy of the multi-GB torch layer), else rebuilt byte for byte from
  buildah's store (image_import._Store; `buildah push dir:` where that cannot be), and crane pushes the layout:
  a HEAD per blob first, an upload only for those the registry lacks.
- `gzip`: `buildah push`, which compresses every layer, for a public registry whose users pull over the internet
  (half the bytes; a different manifest digest).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from hack import common
from hack.common import BuildError
from hack.image_import import OCI_LAYER, StoreError, _image, _Store, buildah

CONTENT = common.CONTAINERD_ROOT / "io.containerd.content.v1.content" / "blobs" / "sha256"
COMPRESSIONS = ("none", "gzip")
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ABSENT = ("MANIFEST_UNKNOWN", "NAME_UNKNOWN", "NOT_FOUND", "404")  # crane's words for a tag or repository not there

log = common.logger("release")


def loopback(registry: str) -> bool:
    """Whether `registry` (host[:port][/path]) is on this machine: reached over plain HTTP."""
    host = registry.split("/", 1)[0].rsplit(":", 1)[0]
    return host in ("localhost", "127.0.0.1", "[::1]")


def crane(*args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    p = subprocess.run([common.binary("crane"), *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise BuildError(f"crane {' '.join(args[:2])} failed ({p.returncode}):\n{p.stderr.strip()}")
    return p


def tag_digest(ref: str) -> str | None:
    """The digest `ref` (registry/repository:tag) names in its registry; None when the tag or repository is not
    there. BuildError for anything else (registry down, no access): a release never guesses."""
    p = crane("digest", ref, check=False, timeout=60)
    if p.returncode == 0:
        return p.stdout.strip()
    if any(word in p.stderr for word in ABSENT):
        return None
    raise BuildError(f"cannot tell whether {ref} exists: crane digest failed:\n{p.stderr.strip()}")


def pushed_blobs(crane_stderr: str) -> tuple[int, int]:
    """(blobs uploaded, blobs the registry already had) from crane's progress lines."""
    return (len(re.findall(r"pushed blob: ", crane_stderr)),
            len(re.findall(r"(?:existing|mounted) blob: ", crane_stderr)))


def _link_or_none(src: Path, dst: Path, size: int) -> bool:
    try:
        if src.stat().st_size != size:
            return False
        os.link(src, dst)
        return True
    except OSError:  # not there, not readable, or another filesystem
        return False


def write_layout(ref: str, dest: Path) -> tuple[str, int]:
    """buildah's image `ref` as an OCI layout in `dest` (a new directory); returns (its manifest digest, the bytes
    copied rather than linked)."""
    manifest, config, digest = _image(ref)
    layers = json.loads(manifest)["layers"]
    if any(layer["mediaType"] != OCI_LAYER for layer in layers):
        raise BuildError(f"{ref}: only uncompressed layers are pushed byte for byte; use --compression gzip")
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (dest / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    index = {"schemaVersion": 2, "manifests": [{"mediaType": MANIFEST_TYPE, "digest": digest, "size": len(manifest)}]}
    (dest / "index.json").write_text(json.dumps(index))
    (blobs / digest.split(":", 1)[1]).write_bytes(manifest)
    (blobs / json.loads(manifest)["config"]["digest"].split(":", 1)[1]).write_bytes(config)
    copied, store, exported = 0, None, None
    for layer in layers:
        hexd = layer["digest"].split(":", 1)[1]
        target = blobs / hexd
        if target.exists() or _link_or_none(CONTENT / hexd, target, layer["size"]):
            continue
        if exported is not None:  # the store could not give a layer back: every layer from `buildah push dir:`
            shutil.copyfile(exported / hexd, target)
        else:
            try:
                store = store or _Store.open()
                with open(target, "wb") as out:
                    for chunk in store.layer_tar(layer["digest"]):
                        out.write(chunk)
            except StoreError as e:
                log(f"{e}; exporting {ref} with buildah push instead")
                target.unlink(missing_ok=True)
                exported = dest.parent / f"{dest.name}-export"
                buildah("push", "--quiet", "--disable-compression", ref, f"dir:{exported}")
                shutil.copyfile(exported / hexd, target)
        copied += layer["size"]
    if exported is not None:
        shutil.rmtree(exported, ignore_errors=True)
    return digest, copied


def push(src: str, dest: str, compression: str, workdir: Path) -> dict:
    """Push buildah's image `src` to `dest` (registry/repository:tag); returns what was pushed: digest, seconds and,
    for `none`, the blobs uploaded and found and the bytes copied (not linked) into the layout."""
    if compression not in COMPRESSIONS:
        raise BuildError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
    t0 = time.monotonic()
    if compression == "gzip":
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            digestfile = Path(tmp) / "digest"
            tls = ["--tls-verify=false"] if loopback(dest) else []
            buildah("push", "--quiet", *tls, "--digestfile", str(digestfile), src, f"docker://{dest}")
            digest = digestfile.read_text().strip()
        return {"digest": digest, "seconds": round(time.monotonic() - t0, 1)}
    layout = Path(tempfile.mkdtemp(dir=workdir, prefix="layout-"))
    try:
        digest, copied = write_layout(src, layout)
        t_layout = time.monotonic() - t0
        p = crane("push", str(layout), dest)
        uploaded, found = pushed_blobs(p.stderr)
    finally:
        shutil.rmtree(layout, ignore_errors=True)
    remote = tag_digest(dest)
    if remote != digest:
        raise BuildError(f"{dest} names {remote} after the push, not the manifest pushed ({digest})")
    return {"digest": digest, "seconds": round(time.monotonic() - t0, 1), "layout_seconds": round(t_layout, 1),
            "bytes_copied": copied, "blobs_uploaded": uploaded, "blobs_found": found}
