#!/usr/bin/env python3
"""Finds or installs the Go toolchain that hack/build-binaries.sh builds the cluster with.

    hack/install-go.py            print the GOROOT to build with (stdout); progress goes to stderr

A fresh Debian 12 has no Go, and its own package (1.19) is far too old for the pinned components
(etcd v3.6 declares `go 1.26.0`). So:
- a `go` on PATH at least GO_MIN_VERSION (hack/versions.env) is used as it is;
- otherwise the pinned GO_VERSION is fetched once as the module golang.org/toolchain
  v0.0.1-go<GO_VERSION>.linux-<arch> (the zip `go` itself downloads for GOTOOLCHAIN switching) from
  the first URL in $GOPROXY (default https://proxy.golang.org; file:// works too), checked against
  the h1: hash pinned in hack/versions.env (the checksum database's go.sum line for that module), and
  unpacked into <cache>/go-<GO_VERSION>/ (cache: $DDPJOB_CACHE or ~/.cache/ddpjob).
DDPJOB_GO=pinned skips the PATH lookup. Only the standard library, before any virtualenv exists.
"""
from __future__ import annotations

import base64
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("DDPJOB_CACHE", Path.home() / ".cache" / "ddpjob"))
DEFAULT_PROXY = "https://proxy.golang.org"
ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class InstallError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[go] {msg}", file=sys.stderr, flush=True)


def versions() -> dict[str, str]:
    out = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


def version_tuple(v: str) -> tuple[int, ...]:
    """'go1.26.8' / '1.26' / 'go1.26rc1' -> (1, 26, 8) / (1, 26, 0) / (1, 26, 0)."""
    nums = [int(n) for n in re.findall(r"\d+", v.removeprefix("go").split("rc")[0].split("beta")[0])[:3]]
    return tuple(nums + [0] * (3 - len(nums)))


def go_on_path() -> tuple[str, str] | None:
    """(GOROOT, version) of the `go` on PATH, or None."""
    go = shutil.which("go")
    if not go:
        return None
    try:
        out = subprocess.run([go, "env", "GOROOT", "GOVERSION"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "GOTOOLCHAIN": "local"}, check=True).stdout.split()
    except (subprocess.SubprocessError, OSError):
        return None
    return (out[0], out[1]) if len(out) == 2 else None


def module_version(go_version: str, arch: str) -> str:
    return f"v0.0.1-go{go_version}.linux-{arch}"


def proxies() -> list[str]:
    """The URLs of $GOPROXY in order ('direct' and 'off' have no zip to offer)."""
    raw = os.environ.get("GOPROXY") or DEFAULT_PROXY
    urls = [p.strip().rstrip("/") for p in re.split(r"[,|]", raw)]
    urls = [u for u in urls if u and u not in ("direct", "off")]
    if not urls:
        raise InstallError(f"GOPROXY={raw!r} names no proxy; the toolchain zip comes from a module proxy")
    return urls


def download(mod_version: str, dest: Path) -> str:
    """Fetch the toolchain zip into dest from the first proxy that has it; returns the URL."""
    errors = []
    for proxy in proxies():
        url = f"{proxy}/golang.org/toolchain/@v/{mod_version}.zip"
        log(f"downloading {url}")
        try:
            with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as out:
                shutil.copyfileobj(r, out, 1 << 20)
            return url
        except urllib.error.HTTPError as e:
            errors.append(f"{url}: HTTP {e.code}")
            if e.code not in (404, 410):  # like go: only "not found" falls through to the next proxy
                break
        except (urllib.error.URLError, OSError) as e:
            errors.append(f"{url}: {e}")
            break
    raise InstallError("cannot download the Go toolchain: " + "; ".join(errors))


def h1_of_zip(path: Path) -> str:
    """The go.sum hash of a module zip (golang.org/x/mod/sumdb/dirhash.Hash1): sha256 over the sorted
    lines '<sha256 hex>  <file name>\\n' of every file in the zip."""
    lines = []
    with zipfile.ZipFile(path) as z:
        for name in sorted(i.filename for i in z.infolist() if not i.is_dir()):
            h = hashlib.sha256()
            with z.open(name) as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            lines.append(f"{h.hexdigest()}  {name}\n")
    return "h1:" + base64.b64encode(hashlib.sha256("".join(lines).encode()).digest()).decode()


def unpack(zpath: Path, prefix: str, dest: Path) -> None:
    """Extract the files under `prefix/` into dest; like `go`, make bin/ and pkg/tool/ executable
    (module zips carry no file modes)."""
    with zipfile.ZipFile(zpath) as z:
        for info in z.infolist():
            if info.is_dir() or not info.filename.startswith(prefix + "/"):
                continue
            rel = info.filename[len(prefix) + 1:]
            if rel.startswith("/") or ".." in Path(rel).parts:
                raise InstallError(f"unsafe path in the toolchain zip: {info.filename}")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    for sub in ("bin", "pkg/tool"):
        for f in (dest / sub).rglob("*"):
            if f.is_file():
                f.chmod(0o755)


def install_pinned(v: dict[str, str]) -> Path:
    go_version = v["GO_VERSION"]
    arch = ARCHES.get(platform.machine().lower())
    if arch is None:
        raise InstallError(f"no pinned Go toolchain for {platform.machine()} (amd64 and arm64 only)")
    want = v.get(f"GO_TOOLCHAIN_SUM_{arch.upper()}")
    if not want:
        raise InstallError(f"hack/versions.env has no GO_TOOLCHAIN_SUM_{arch.upper()}")
    goroot = CACHE / f"go-{go_version}"
    stamp = goroot / ".ddpjob-verified"
    if (goroot / "bin" / "go").exists() and stamp.exists() and stamp.read_text().strip() == want:
        return goroot
    CACHE.mkdir(parents=True, exist_ok=True)
    mod_version = module_version(go_version, arch)
    with tempfile.TemporaryDirectory(prefix=f"go-{go_version}.", dir=CACHE) as tmp:
        zpath = Path(tmp) / "toolchain.zip"
        url = download(mod_version, zpath)
        got = h1_of_zip(zpath)
        if got != want:
            raise InstallError(f"checksum mismatch for {url}: got {got}, hack/versions.env pins {want}; "
                               "refusing to use it")
        log(f"verified golang.org/toolchain@{mod_version} {got}")
        staged = Path(tmp) / "go"
        unpack(zpath, f"golang.org/toolchain@{mod_version}", staged)
        (staged / ".ddpjob-verified").write_text(want + "\n")
        out = subprocess.run([str(staged / "bin" / "go"), "version"], capture_output=True, text=True,
                             env={**os.environ, "GOTOOLCHAIN": "local", "GOROOT": str(staged)})
        if f"go{go_version} " not in out.stdout:
            raise InstallError(f"the unpacked toolchain does not run: {out.stdout}{out.stderr}")
        shutil.rmtree(goroot, ignore_errors=True)
        staged.rename(goroot)
    log(f"Go {go_version} installed in {goroot}")
    return goroot


def main() -> int:
    v = versions()
    try:
        if os.environ.get("DDPJOB_GO") != "pinned":
            found = go_on_path()
            if found and version_tuple(found[1]) >= version_tuple(v["GO_MIN_VERSION"]):
                print(found[0])
                return 0
            if found:
                log(f"{found[1]} on PATH is older than go{v['GO_MIN_VERSION']}; using the pinned go{v['GO_VERSION']}")
        print(install_pinned(v))
    except (InstallError, OSError, zipfile.BadZipFile) as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
