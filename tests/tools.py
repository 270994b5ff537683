"""Where the pinned command-line tools live, for tests and benchmarks.

hack/build-binaries.sh builds each Go tool into <cache>/<name>-<version>/ (cache: $DDPJOB_CACHE or
~/.cache/ddpjob) with the versions pinned in hack/versions.env. Tests ask for a tool by name and get
that exact binary, or a clear failure that says how to build it; a same-named binary on PATH is only a
fallback for the tools nobody pins (and for kind users, who bring their own kubectl).
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
VERSIONS_FILE = REPO_ROOT / "hack" / "versions.env"

# tool -> (cache directory prefix, versions.env key, build-binaries.sh component)
_PINNED = {
    "helm": ("helm", "HELM_VERSION", "helm"),
    "kubeconform": ("kubeconform", "KUBECONFORM_VERSION", "kubeconform"),
    "kubectl": ("kube", "KUBE_VERSION", "kube"),
    "kube-apiserver": ("kube", "KUBE_VERSION", "kube"),
    "kube-controller-manager": ("kube", "KUBE_VERSION", "kube"),
    "kube-scheduler": ("kube", "KUBE_VERSION", "kube"),
    "kubelet": ("kube", "KUBE_VERSION", "kube"),
    "kube-proxy": ("kube", "KUBE_VERSION", "kube"),
    "etcd": ("etcd", "ETCD_VERSION", "etcd"),
    "coredns": ("coredns", "COREDNS_VERSION", "coredns"),
}


class ToolNotFound(RuntimeError):
    """A pinned tool is not built yet; the message says how to build it."""


@functools.cache
def versions() -> dict[str, str]:
    """KEY=value pairs of hack/versions.env."""
    out = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip().strip('"')
    return out


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DDPJOB_CACHE") or pathlib.Path.home() / ".cache" / "ddpjob")


def find_tool(name: str) -> str | None:
    """Path of the pinned build of `name`, else the one on PATH, else None."""
    if name in _PINNED:
        prefix, key, _ = _PINNED[name]
        path = cache_root() / f"{prefix}-{versions()[key]}" / name
        if os.access(path, os.X_OK):
            return str(path)
    return shutil.which(name)


def tool(name: str) -> str:
    """Like find_tool, but raises ToolNotFound with the command that builds it."""
    path = find_tool(name)
    if path is None:
        component = _PINNED.get(name, (None, None, None))[2]
        hint = f"run `hack/build-binaries.sh {component}`" if component else f"install {name}"
        raise ToolNotFound(f"{name} not found in {cache_root()} or on PATH: {hint}")
    return path
