"""Reads of cluster-wide objects reused for a while: a node's state for the node-loss rule (one read per node, not per
pod), a Kueue ResourceFlavor or WorkloadPriorityClass (they rarely change). Thread-safe: passes run side by side.

A pass that needs many names reads the missing ones side by side (`get_many`): the node-storm pass of a 1,000-node
job read the 50 lost nodes one round trip after the other, 0.9 s before it acted. A name being read for one pass is
not read again for another that asks meanwhile: that one waits for the same read (a restarted operator's first
passes all ask at once).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterable

from ddp_operator.writers import side_by_side


class ReadCache:
    """What a read returned per name, reused for `seconds` (cluster-wide objects, not per job)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.entries: dict[str, tuple[Any, float]] = {}  # name -> (what was read, when)
        self._reading: dict[str, Future] = {}  # name -> the read in flight
        self._guard = threading.Lock()

    def get(self, name: str, read: Callable[[str], Any]) -> Any:
        """read(name), or what it returned less than `seconds` ago."""
        return self.get_many([name], read)[name]

    def get_many(self, names: Iterable[str], read: Callable[[str], Any]) -> dict[str, Any]:
        """{name: read(name)} for each of `names`, reused where read less than `seconds` ago; the others read side by
        side, each once however many passes ask. A failed read raises (in every pass that waited for it)."""
        now = time.monotonic()
        found: dict[str, Any] = {}
        mine: list[str] = []
        pending: dict[str, Future] = {}  # names read now, by this pass or another
        with self._guard:
            for name in dict.fromkeys(names):
                cached = self.entries.get(name)
                if cached is not None and now - cached[1] < self.seconds:
                    found[name] = cached[0]
                    continue
                if name not in self._reading:
                    self._reading[name] = Future()
                    mine.append(name)
                pending[name] = self._reading[name]
        side_by_side(lambda name: self._read(name, read), mine, "ddp-reads")
        return found | {name: future.result() for name, future in pending.items()}

    def _read(self, name: str, read: Callable[[str], Any]) -> None:
        at = time.monotonic()
        try:
            value = read(name)
        except BaseException as e:
            with self._guard:
                future = self._reading.pop(name)
            future.set_exception(e)
            raise
        with self._guard:
            self.entries[name] = (value, at)
            future = self._reading.pop(name)
        future.set_result(value)

    def prune(self) -> None:
        now = time.monotonic()
        with self._guard:
            for name in [n for n, (_, at) in self.entries.items() if now - at >= self.seconds]:
                del self.entries[name]
