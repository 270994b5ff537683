"""A fresh machine has no Go: hack/build-binaries.sh fetches the pinned toolchain itself.

Runs the real path: `go` removed from PATH, an empty DDPJOB_CACHE, the toolchain zip from the module
proxy checked against the hash pinned in hack/versions.env, then one pinned component (etcd, the
cheapest: ~70 MB download, tens of seconds with a warm Go module and build cache) built with it.
The module cache (GOMODCACHE) and Go's build cache stay the user's: they do not decide which Go runs.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from tests import tools

REPO = tools.REPO_ROOT
V = tools.versions()


def path_without_go() -> str:
    """PATH minus every directory that holds a `go` (e.g. /usr/local/go/bin)."""
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not os.access(os.path.join(d, "go"), os.X_OK)]
    return os.pathsep.join(keep)


def fresh_env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GOROOT", "GOTOOLCHAIN", "DDPJOB_GO")}
    env.update(PATH=path_without_go(), DDPJOB_CACHE=str(cache), **extra)
    return env


def test_build_binaries_bootstraps_the_pinned_go_without_go_on_path(tmp_path):
    cache = tmp_path / "cache"
    env = fresh_env(cache)
    assert shutil.which("go", path=env["PATH"]) is None
    t0 = time.monotonic()
    p = subprocess.run([str(REPO / "hack" / "build-binaries.sh"), "etcd"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=1200)
    elapsed = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    print(f"bootstrap + etcd build: {elapsed:.0f}s")

    goroot = cache / f"go-{V['GO_VERSION']}"
    assert f"verified golang.org/toolchain@v0.0.1-go{V['GO_VERSION']}.linux-" in p.stderr, p.stderr
    go = goroot / "bin" / "go"
    version = subprocess.run([str(go), "version"], capture_output=True, text=True, env={**env, "GOTOOLCHAIN": "local"})
    assert version.stdout.startswith(f"go version go{V['GO_VERSION']} "), version.stdout + version.stderr

    etcd = cache / f"etcd-{V['ETCD_VERSION']}" / "etcd"
    out = subprocess.run([str(etcd), "--version"], capture_output=True, text=True, timeout=30)
    assert f"etcd Version: {V['ETCD_VERSION'].lstrip('v')}" in out.stdout, out.stdout + out.stderr
    # built by the bootstrapped toolchain, not by some other Go
    built = subprocess.run([str(go), "version", str(etcd)], capture_output=True, text=True,
                           env={**env, "GOTOOLCHAIN": "local"})
    assert built.stdout.strip().endswith(f"go{V['GO_VERSION']}"), built.stdout + built.stderr

    # A second run reuses the toolchain: no download.
    again = subprocess.run([sys.executable, str(REPO / "hack" / "install-go.py")], env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.strip() == str(goroot), again.stdout + again.stderr
    assert "downloading" not in again.stderr

    # hack/image.py (the pause image, built at the first `cluster up`) finds the same Go without PATH's.
    found = subprocess.run([sys.executable, "-c", "import image; print(image.go_binary())"], env=env,
                           cwd=REPO / "hack", capture_output=True, text=True, timeout=120)
    assert found.returncode == 0 and found.stdout.strip() == str(go), found.stdout + found.stderr


def test_a_tampered_toolchain_zip_is_refused(tmp_path):
    """A proxy that serves other bytes than the checksum database recorded: nothing is installed."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, "amd64")
    mod = f"v0.0.1-go{V['GO_VERSION']}.linux-{arch}"
    at = tmp_path / "proxy" / "golang.org" / "toolchain" / "@v"
    at.mkdir(parents=True)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"golang.org/toolchain@{mod}/bin/go", "#!/bin/sh\necho go version go0 evil\n")
    (at / f"{mod}.zip").write_bytes(buf.getvalue())
    cache = tmp_path / "cache"
    p = subprocess.run([sys.executable, str(REPO / "hack" / "install-go.py")],
                       env=fresh_env(cache, DDPJOB_GO="pinned", GOPROXY=f"file://{tmp_path / 'proxy'}"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "checksum mismatch" in p.stderr and "refusing" in p.stderr, p.stderr
    assert p.stdout == ""
    assert not (cache / f"go-{V['GO_VERSION']}").exists()
    assert list(cache.iterdir()) == []  # the download and the staging directory are gone too


def fake_go(bindir: Path, version: str, goroot: str) -> None:
    bindir.mkdir(parents=True)
    (bindir / "go").write_text(f"#!/bin/sh\n[ \"$1\" = env ] && printf '%s\\n%s\\n' {goroot} {version}\n")
    (bindir / "go").chmod(0o755)


def test_a_go_older_than_the_minimum_is_passed_over_and_a_new_enough_one_is_used(tmp_path):
    """Debian's own Go (1.19) cannot build the pinned components; a Go at GO_MIN_VERSION or newer can."""
    cache = tmp_path / "cache"
    pinned = cache / f"go-{V['GO_VERSION']}"  # an installed pinned toolchain: no download needed
    fake_go(pinned / "bin", f"go{V['GO_VERSION']}", str(pinned))
    arch = "ARM64" if os.uname().machine == "aarch64" else "AMD64"
    (pinned / ".ddpjob-verified").write_text(V[f"GO_TOOLCHAIN_SUM_{arch}"] + "\n")

    fake_go(tmp_path / "old" / "bin", "go1.19.8", "/usr/lib/go-1.19")
    env = fresh_env(cache)
    env["PATH"] = f"{tmp_path / 'old' / 'bin'}{os.pathsep}{env['PATH']}"
    p = subprocess.run([sys.executable, str(REPO / "hack" / "install-go.py")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == str(pinned), p.stdout + p.stderr
    assert f"go1.19.8 on PATH is older than go{V['GO_MIN_VERSION']}" in p.stderr

    fake_go(tmp_path / "new" / "bin", f"go{V['GO_MIN_VERSION']}", "/opt/go")
    env["PATH"] = f"{tmp_path / 'new' / 'bin'}{os.pathsep}{env['PATH']}"
    p = subprocess.run([sys.executable, str(REPO / "hack" / "install-go.py")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "/opt/go", p.stdout + p.stderr
