"""Reads of cluster-wide objects reused for a while: a node's state the node watch cannot vouch for (one read per node,
not per pod; node_watch.py), a Kueue ResourceFlavor or WorkloadPriorityClass (they rarely change). Thread-safe:
passes run side by side."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class ReadCache:
    """What a read returned per name, reused for `seconds` (cluster-wide objects, not per job)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.entries: dict[str, tuple[Any, float]] = {}  # name -> (what was read, when)
        self._guard = threading.Lock()

    def get(self, name: str, read: Callable[[str], Any]) -> Any:
        """read(name), or what it returned less than `seconds` ago."""
        now = time.monotonic()
        with self._guard:
            cached = self.entries.get(name)
        if cached is not None and now - cached[1] < self.seconds:
            return cached[0]
        value = read(name)
        with self._guard:
            self.entries[name] = (value, now)
        return value

    def prune(self) -> None:
        now = time.monotonic()
        with self._guard:
            for name in [n for n, (_, at) in self.entries.items() if now - at >= self.seconds]:
                del self.entries[name]
