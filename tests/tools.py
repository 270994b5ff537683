"""Where the pinned command-line tools live, for tests and benchmarks.

hack/build-binaries.sh builds each Go tool into <cache>/<name>-<version>/ (cache: $DDPJOB_CACHE or
~/.cache/ddpjob) with the versions pinned in hack/versions.env; hack/cluster.py owns that layout and
this module asks it. Tests get the exact pinned binary, or a clear failure that says how to build it; a
same-named binary on PATH is only a fallback (kind users bring their own kubectl).
"""

from __future__ import annotations

import os
import pathlib
import shutil

from hack import cluster as _cluster

REPO_ROOT = _cluster.REPO
versions = _cluster.versions


class ToolNotFound(RuntimeError):
    """A pinned tool is not built yet; the message says how to build it."""


def find_tool(name: str) -> str | None:
    """Path of the pinned build of `name`, else the one on PATH, else None."""
    path = _cluster.pinned_path(name)
    if path is not None and os.access(path, os.X_OK):
        return str(path)
    return shutil.which(name)


def tool(name: str) -> str:
    """Like find_tool, but raises ToolNotFound with the command that builds it."""
    path = find_tool(name)
    if path is None:
        hint = ("run `hack/build-binaries.sh`" if _cluster.pinned_path(name) is not None
                else f"install {name}")
        raise ToolNotFound(f"{name} not found in {_cluster.CACHE} or on PATH: {hint}")
    return path
