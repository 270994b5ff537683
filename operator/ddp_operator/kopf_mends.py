"""Mends for kopf defects that would stop the operator; each names the defect, and ``apply()`` installs them all.

**A watched namespace that vanishes early blocks every handler forever** (kopf 1.45). kopf holds all handlers until
the indexes are filled: each watcher of an indexed resource (DDPJobs and pods here) registers a toggle in the
operator-wide "indexed" set, and drops it when its first listing is over; each object seen before that registers
one too, dropped once its index handlers ran. Handlers run only while the set holds no toggle. When a namespace the
operator watches by pattern (``--namespace 'team-*'``) is deleted before its watchers' first listing ends,
kopf cancels those watchers but leaves their toggles in the set (it drops only the pause toggles), so from then on
no handler of any job runs, and nothing says why. It takes a busy API server or a namespace created and deleted in
quick succession, which is what CI systems and test suites do.

The mend wraps kopf's per-resource watcher: every toggle a watcher (or one of its workers) put in the set and that is
still there when the watcher ends is dropped. A watcher ends only when kopf stops watching its namespace or resource
(or the operator stops), and then nobody can ever drop those toggles: the objects they wait for are no longer
watched.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

log = logging.getLogger("ddp_operator.kopf_mends")


class _RecordingToggleSet:
    """A view of kopf's ``operator_indexed`` toggle set that remembers the toggles made through it."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.made: list[Any] = []

    async def make_toggle(self, *args: Any, **kwargs: Any) -> Any:
        toggle = await self._real.make_toggle(*args, **kwargs)
        self.made.append(toggle)
        return toggle

    def __getattr__(self, name: str) -> Any:  # is_on, is_off, wait_for, drop_toggle(s): the real set's
        return getattr(self._real, name)

    # dunder methods are looked up on the class, not through __getattr__
    def __contains__(self, toggle: object) -> bool:
        return toggle in self._real

    def __iter__(self):
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)


def watcher_dropping_its_index_toggles(watcher: Callable[..., Coroutine[Any, Any, None]]
                                       ) -> Callable[..., Coroutine[Any, Any, None]]:
    """``watcher`` (kopf's ``queueing.watcher``), such that the index toggles it leaves behind are dropped when it
    ends, however it ends (cancelled before its first listing is over, above all)."""
    if getattr(watcher, "_ddpjob_mended", False):
        return watcher

    @functools.wraps(watcher)
    async def mended(*args: Any, operator_indexed: Any = None, resource_indexed: Any = None, **kwargs: Any) -> None:
        if operator_indexed is None:
            return await watcher(*args, operator_indexed=operator_indexed, resource_indexed=resource_indexed, **kwargs)
        recording = _RecordingToggleSet(operator_indexed)
        try:
            return await watcher(*args, operator_indexed=recording, resource_indexed=resource_indexed, **kwargs)
        finally:
            left = _still_in(operator_indexed, [resource_indexed, *recording.made])
            if left:
                await operator_indexed.drop_toggles(left)
                log.info("kopf watcher for %s in %s ended before indexing: dropped %d index toggle(s) it left",
                         kwargs.get("resource"), kwargs.get("namespace"), len(left))

    mended._ddpjob_mended = True  # type: ignore[attr-defined]
    return mended


def _still_in(toggles: Any, candidates: Iterable[Any]) -> list[Any]:
    return [t for t in candidates if t is not None and t in toggles]


def apply() -> None:
    """Install every mend (idempotent). Called before kopf starts."""
    from kopf._core.reactor import queueing  # the orchestrator calls queueing.watcher through the module

    queueing.watcher = watcher_dropping_its_index_toggles(queueing.watcher)
