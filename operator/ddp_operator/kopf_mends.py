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

**A start with thousands of objects is quadratic** (kopf 1.45). During the initial listing every object listed makes a
toggle in that set, drops it once indexed and then waits, on the set's one ``asyncio.Condition``, until the set is
empty. Each make and drop calls ``notify_all``, which wakes every object already waiting to test the set again: N
objects cost O(N²) wake-ups before the first handler runs (5,400 pods kept a restarted operator at 100 % CPU for
minutes). The mend gives the operator an "indexed" set whose waiters for "all indexed" sleep on one ``asyncio.Event``
instead, set and cleared as the set changes: a change costs one test of the set, and the waiters wake once, when it
is empty.

**kopf holds every object's whole body while it lists them** (kopf 1.45). Each object listed at the start waits, with
its raw event, until every object is indexed; a burst of events does the same in each object's queue. For pods that is
the whole pod (its spec, managedFields, annotations: tens of KiB once parsed) of every labelled pod at once, the
operator's peak memory. The mend keeps, in the events of the resources given to ``apply()`` (pods), only what the
operator reads of them (``jobs.kept_pod``), before kopf queues them.

**Every object listed at the start waits in a task of its own until all are indexed** (kopf 1.45): its worker, its
queue, its body, patch, three loggers and throttler, for as long as the whole listing takes. With thousands of pods
that is most of a restarted operator's peak memory (about 190 MiB over the running figure at 6,400 pods and 1,100
jobs). The operator's handlers of its children (pods, Services, NetworkPolicies, Kueue Workloads) only ask for their
job's pass, and every job's resume handler runs that pass once the indexes are filled, after every child listed. So
an object of those kinds listed before the operator is indexed is indexed and let go (its index toggle dropped, no
handler run): nothing waits for it. Once the operator is indexed, kopf processes every event as before, a re-listing
after a broken watch included.

**kopf decodes the API server's JSON with the standard library** (kopf 1.45): every watch event's line and every
page of a listing. A restarted operator's event loop spent 16 of its 51 busy seconds there at 10,113 pods. The mend
has kopf's watch stream and aiohttp's ``ClientResponse.json`` (kopf's listings and reads; kopf is aiohttp's only
user here) decode with ``jsondoc.loads``: orjson where installed, the same values either way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import types
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from typing import Any

from kopf._cogs.aiokits import aiotoggles

from ddp_operator import jsondoc

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


class _NotifyingCondition(asyncio.Condition):
    """The set's condition, which tells the set of every change (every ``notify_all``: a toggle made, dropped or
    turned)."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        super().__init__()
        self._on_change = on_change

    def notify_all(self) -> None:
        super().notify_all()
        self._on_change()


class IndexedToggleSet(aiotoggles.ToggleSet):
    """kopf's ``ToggleSet``, whose ``wait_for(True)`` waits on one Event kept equal to ``is_on()``: a waiter wakes
    when the set turns on, not at every change of it."""

    def __init__(self, fn: Callable[[Iterable[bool]], bool]) -> None:
        super().__init__(fn)
        self._on = asyncio.Event()
        self._condition = _NotifyingCondition(self._changed)  # before any toggle shares it
        self._changed()

    def _changed(self) -> None:
        if self.is_on():  # O(1) while it holds toggles that are off: all() stops at the first
            self._on.set()
        else:
            self._on.clear()

    async def wait_for(self, state: bool) -> None:
        if not state:
            return await super().wait_for(state)
        while not self.is_on():
            await self._on.wait()


Kinds = frozenset[tuple[str, str]]  # (API group, plural)


def watcher_indexing_listed_children(watcher: Callable[..., Coroutine[Any, Any, None]], kinds: Kinds
                                     ) -> Callable[..., Coroutine[Any, Any, None]]:
    """``watcher`` (kopf's ``queueing.watcher``), such that an object of `kinds` that its initial listing shows before
    the operator is indexed is only indexed (``index_only``); every other event goes to kopf's processor as before."""
    if getattr(watcher, "_ddpjob_listed_kinds", None) is not None:
        watcher = watcher.__wrapped__  # type: ignore[attr-defined]

    @functools.wraps(watcher)
    async def mended(*args: Any, resource: Any, processor: Callable[..., Any], **kwargs: Any) -> None:
        if (resource.group, resource.plural) in kinds:
            processor = _indexing_listed(processor)
        return await watcher(*args, resource=resource, processor=processor, **kwargs)

    mended._ddpjob_listed_kinds = kinds  # type: ignore[attr-defined]
    return mended


def _indexing_listed(processor: Any) -> Callable[..., Coroutine[Any, Any, str | None]]:
    """kopf's processor (a ``functools.partial`` of ``processing.process_resource_event``), with the events of the
    initial listing that come before the operator is indexed only indexed."""

    async def processing(*, raw_event: Any, resource_indexed: Any = None, operator_indexed: Any = None,
                         **kwargs: Any) -> str | None:
        if raw_event.get("type") is None and resource_indexed is not None and operator_indexed is not None \
                and not operator_indexed.is_on():
            await index_only(processor.keywords, raw_event)
            await operator_indexed.drop_toggle(resource_indexed)
            return None
        return await processor(raw_event=raw_event, resource_indexed=resource_indexed,
                               operator_indexed=operator_indexed, **kwargs)

    return processing


async def index_only(kopf_kwargs: Mapping[str, Any], raw_event: Any) -> None:
    """What kopf's ``process_resource_event`` does with an event before it waits for every object to be indexed: the
    object's memory recalled and its index handlers run (their errors logged by kopf, as there)."""
    from kopf._cogs.structs import bodies
    from kopf._core.actions import loggers
    from kopf._core.engines import indexing

    settings = kopf_kwargs["settings"]
    memory = await kopf_kwargs["memories"].recall(raw_event["object"], noticed_by_listing=True,
                                                  memobase=kopf_kwargs["memobase"])
    body = bodies.Body(raw_event["object"])
    await indexing.index_resource(registry=kopf_kwargs["registry"], indexers=kopf_kwargs["indexers"],
                                  settings=settings, resource=kopf_kwargs["resource"], raw_event=raw_event,
                                  body=body, memo=memory.memo, memory=memory.indexing_memory,
                                  logger=loggers.TerseObjectLogger(body=body, settings=settings))


Slimmers = Mapping[tuple[str, str], Callable[[dict], dict]]  # (API group, plural) -> what is kept of an object
_SLIMMED_TYPES = (None, "ADDED", "MODIFIED", "DELETED")  # None: an object of the initial listing


def watch_slimmed(infinite_watch: Callable[..., AsyncIterator[Any]], slimmers: Slimmers
                  ) -> Callable[..., AsyncIterator[Any]]:
    """``infinite_watch`` (kopf's ``watching.infinite_watch``), such that the objects of the resources in `slimmers`
    come out of it as their slimmer keeps them; bookmarks, errors and other resources' events as they are."""
    if getattr(infinite_watch, "_ddpjob_slimmers", None) is not None:
        infinite_watch = infinite_watch.__wrapped__  # type: ignore[attr-defined]

    @functools.wraps(infinite_watch)
    async def slimmed(*args: Any, resource: Any, **kwargs: Any) -> AsyncIterator[Any]:
        slim = slimmers.get((resource.group, resource.plural))
        async for event in infinite_watch(*args, resource=resource, **kwargs):
            if slim is not None and isinstance(event, dict) and event.get("type") in _SLIMMED_TYPES \
                    and isinstance(event.get("object"), dict):
                event = {**event, "object": slim(event["object"])}
            yield event

    slimmed._ddpjob_slimmers = slimmers  # type: ignore[attr-defined]
    return slimmed


def apply(slimmers: Slimmers | None = None, listed_children: Kinds | None = None) -> None:
    """Install every mend (idempotent; `slimmers` and `listed_children`, the kinds only indexed while the operator
    lists them, replace those given before). Called before kopf starts."""
    from kopf._cogs.clients import watching
    from kopf._core.reactor import orchestration, queueing  # the orchestrator calls queueing.watcher through the module

    if listed_children:
        kopfs = queueing.watcher
        if getattr(kopfs, "_ddpjob_mended", False):  # the outer mend: put this one under it
            kopfs = kopfs.__wrapped__  # type: ignore[attr-defined]
        queueing.watcher = watcher_indexing_listed_children(kopfs, frozenset(listed_children))
    queueing.watcher = watcher_dropping_its_index_toggles(queueing.watcher)
    if slimmers:
        watching.infinite_watch = watch_slimmed(watching.infinite_watch, slimmers)  # queueing calls it by the module
    # The orchestrator makes its "indexed" set with aiotoggles.ToggleSet(all), its only ToggleSet.
    if not getattr(orchestration.aiotoggles, "_ddpjob_mended", False):
        orchestration.aiotoggles = types.SimpleNamespace(**{**vars(aiotoggles), "ToggleSet": IndexedToggleSet,
                                                            "_ddpjob_mended": True})
    decode_with(jsondoc.loads)


def decode_with(loads: Callable[[Any], Any]) -> None:
    """kopf's watch stream (``json.loads`` of each line, in kopf's api module) and aiohttp's ``ClientResponse.json``
    (its ``loads`` keyword's default: kopf passes none) decode with `loads`."""
    import aiohttp
    from kopf._cogs.clients import api

    api.json = types.SimpleNamespace(loads=loads)
    aiohttp.ClientResponse.json.__kwdefaults__["loads"] = loads
