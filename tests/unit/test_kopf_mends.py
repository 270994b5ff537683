"""kopf_mends: kopf's own orchestration (real watcher tasks, real toggle sets) with only the API's watch stream replaced
by one whose first listing never ends in the namespace that is then deleted; kopf's "indexed" toggle set driven as
its initial listing drives it, counting how often its waiters test it."""

from __future__ import annotations

import asyncio

import kopf
import pytest
from kopf._cogs.aiokits import aiotoggles
from kopf._cogs.clients import watching
from kopf._cogs.structs import references
from kopf._core.reactor import orchestration, queueing

from ddp_operator import kopf_mends

JOBS = references.Resource(group="ddp.example.com", version="v1", plural="ddpjobs", namespaced=True)
LISTED_AT_ONCE = "team-a"  # its listing ends at once
VANISHES = "team-b"  # deleted while its first listing is still under way


def _watch_stream(**kwargs):
    async def stream():
        if kwargs["namespace"] == LISTED_AT_ONCE:
            yield watching.Bookmark.LISTED
        await asyncio.Event().wait()  # a listing (or a watch) that is still under way
        yield watching.Bookmark.LISTED
    return stream()


async def _indexed_after_a_namespace_vanished(toggle_set=aiotoggles.ToggleSet) -> bool:
    async def processor(**_):
        pass

    ensemble = orchestration.Ensemble(operator_indexed=toggle_set(all),
                                      operator_paused=aiotoggles.ToggleSet(any),
                                      peering_missing=aiotoggles.Toggle())
    namespaces = {LISTED_AT_ONCE, VANISHES}
    await orchestration.spawn_missing_watchers(
        processor=processor, settings=kopf.OperatorSettings(), indexed_resources={JOBS}, watched_resources={JOBS},
        watched_namespaces=namespaces, ensemble=ensemble)
    try:
        for _ in range(100):
            await asyncio.sleep(0)  # the watchers start; team-a's listing ends
        assert not ensemble.operator_indexed.is_on(), "team-b's listing is still under way"
        await orchestration.terminate_redundancies(remaining_resources={JOBS},
                                                   remaining_namespaces={LISTED_AT_ONCE, None}, ensemble=ensemble)
        return ensemble.operator_indexed.is_on()
    finally:
        await orchestration.terminate_redundancies(remaining_resources=set(), remaining_namespaces=set(),
                                                   ensemble=ensemble)


@pytest.fixture
def stream(monkeypatch):
    monkeypatch.setattr(watching, "infinite_watch", _watch_stream)
    monkeypatch.setattr(queueing, "watcher", queueing.watcher)  # restored after the test, mended or not


def test_kopf_still_blocks_every_handler_when_a_namespace_vanishes_before_its_listing(stream):
    """The defect the mend exists for. When a kopf release fixes it, this fails: drop the mend then."""
    assert asyncio.run(_indexed_after_a_namespace_vanished()) is False


@pytest.mark.parametrize("toggle_set", [aiotoggles.ToggleSet, kopf_mends.IndexedToggleSet])
def test_mended_kopf_runs_handlers_again_once_the_vanished_namespaces_watcher_ended(stream, toggle_set):
    kopf_mends.apply()
    assert asyncio.run(_indexed_after_a_namespace_vanished(toggle_set)) is True


def test_mend_is_applied_once(monkeypatch):
    original = queueing.watcher
    monkeypatch.setattr(orchestration, "aiotoggles", aiotoggles)
    try:
        kopf_mends.apply()
        once, toggles = queueing.watcher, orchestration.aiotoggles
        kopf_mends.apply()
        assert queueing.watcher is once and once is not original
        assert orchestration.aiotoggles is toggles and toggles.ToggleSet is kopf_mends.IndexedToggleSet
        assert toggles.Toggle is aiotoggles.Toggle  # the rest of the module as it was
    finally:
        queueing.watcher = original


# --- a start with N objects listed ------------------------------------------------------------------------------
async def _tests_of_the_set_during_a_listing(toggle_set, objects: int) -> int:
    """kopf's initial listing as queueing.py and processing.py drive the "indexed" set: the listing holds a toggle;
    each object listed makes one, drops it once indexed and waits for the whole set to turn on (every object
    indexed) before its handlers run. Returns how often the set was tested; every object's wait must end."""
    indexed = toggle_set(all)
    tests = 0
    is_on = indexed.is_on

    def counted() -> bool:
        nonlocal tests
        tests += 1
        return is_on()
    indexed.is_on = counted

    async def object_listed(toggle):
        await indexed.drop_toggle(toggle)
        await indexed.wait_for(True)

    listing = await indexed.make_toggle(name="listing")
    waiting = []
    for _ in range(objects):
        waiting.append(asyncio.create_task(object_listed(await indexed.make_toggle())))
        await asyncio.sleep(0)  # its worker runs before the next object arrives
    assert not indexed.is_on() and not any(t.done() for t in waiting), "no handler runs before the listing ends"
    await indexed.drop_toggle(listing)
    await asyncio.wait_for(asyncio.gather(*waiting), 30)
    return tests


def test_kopf_tests_its_indexed_set_quadratically_in_the_objects_listed():
    """The defect the mend exists for: every change wakes every waiter. When a kopf release fixes it, this fails."""
    assert asyncio.run(_tests_of_the_set_during_a_listing(aiotoggles.ToggleSet, 400)) > 400 ** 2 / 4


@pytest.mark.parametrize("objects", [400, 4000])
def test_mended_indexed_set_is_tested_a_few_times_per_object(objects):
    assert asyncio.run(_tests_of_the_set_during_a_listing(kopf_mends.IndexedToggleSet, objects)) <= 5 * objects


# --- what kopf holds of each object ---------------------------------------------------------------------------
PODS = references.Resource(group="", version="v1", plural="pods", namespaced=True)


def _pod(i: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"job-{i}", "namespace": "ml", "uid": f"uid-{i}", "labels": {"ddp.dev/job-name": "job"},
                         "annotations": {"bulk": "x" * 65536}, "managedFields": [{"manager": "kubelet"}] * 20},
            "spec": {"nodeName": "n1", "containers": [{"name": "trainer", "image": "i", "env": [{"name": "A"}] * 50}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1"}}


def _events_through(slimmers, resource, events) -> list:
    async def stream(**_):
        for e in events:
            yield e

    async def collect():
        return [e async for e in kopf_mends.watch_slimmed(stream, slimmers)(
            settings=kopf.OperatorSettings(), resource=resource, namespace=None)]
    return asyncio.run(collect())


def test_pod_events_reach_kopf_as_the_operator_keeps_them():
    from ddp_operator.jobs import kept_pod

    listed, added, deleted = ({"type": t, "object": _pod(i)} for i, t in enumerate((None, "ADDED", "DELETED")))
    error = {"type": "ERROR", "object": {"kind": "Status", "code": 410}}
    out = _events_through({("", "pods"): kept_pod}, PODS,
                          [listed, watching.Bookmark.LISTED, added, error, {"type": "BOOKMARK"}, deleted])
    assert [e if isinstance(e, watching.Bookmark) else e["type"] for e in out] == \
        [None, watching.Bookmark.LISTED, "ADDED", "ERROR", "BOOKMARK", "DELETED"]
    for e, i in ((out[0], 0), (out[2], 1), (out[5], 2)):
        assert e["object"] == kept_pod(_pod(i)) and "annotations" not in e["object"]["metadata"]
        assert e["object"]["metadata"]["uid"] == f"uid-{i}" and e["object"]["metadata"]["labels"]
    assert out[3] is error  # not an object of the resource: as it came


def test_other_resources_events_are_left_whole():
    from ddp_operator.jobs import kept_pod

    job = {"type": "ADDED", "object": {"metadata": {"name": "job", "uid": "u", "annotations": {"a": "b"}},
                                       "spec": {"nodes": 2}}}
    assert _events_through({("", "pods"): kept_pod}, JOBS, [job]) == [job]


def test_the_slimmed_stream_is_installed_once(monkeypatch):
    from ddp_operator.jobs import kept_pod

    monkeypatch.setattr(watching, "infinite_watch", watching.infinite_watch)
    monkeypatch.setattr(queueing, "watcher", queueing.watcher)
    monkeypatch.setattr(orchestration, "aiotoggles", aiotoggles)
    original = watching.infinite_watch
    kopf_mends.apply(slimmers={("", "pods"): kept_pod})
    once = watching.infinite_watch
    kopf_mends.apply(slimmers={("", "pods"): kept_pod})
    assert watching.infinite_watch is not once and watching.infinite_watch.__wrapped__ is original  # not nested
    kopf_mends.apply()
    assert watching.infinite_watch.__wrapped__ is original  # no slimmers given: the ones before stay


async def _bytes_held_per_pod_while_listing(pods: int) -> float:
    """kopf's own watcher (mended as the operator mends it) lists `pods` pods whose listing does not end: each
    object's worker waits, with its event, as processing.py waits until every object is indexed. Returns the memory
    allocated meanwhile (tracemalloc) per pod."""
    import gc
    import tracemalloc

    async def listing(**_):
        for i in range(pods):
            yield {"type": None, "object": _pod(i)}
        await asyncio.Event().wait()  # the listing is still under way

    async def processor(raw_event, operator_indexed, resource_indexed, **_):
        if resource_indexed is not None:
            await operator_indexed.drop_toggle(resource_indexed)
        await operator_indexed.wait_for(True)  # every object indexed: never, here
        return raw_event and None

    watching.infinite_watch = listing
    from ddp_operator.jobs import kept_pod
    kopf_mends.apply(slimmers={("", "pods"): kept_pod})
    ensemble = orchestration.Ensemble(operator_indexed=aiotoggles.ToggleSet(all),
                                      operator_paused=aiotoggles.ToggleSet(any), peering_missing=aiotoggles.Toggle())
    gc.collect()
    tracemalloc.start()
    try:
        await orchestration.spawn_missing_watchers(
            processor=processor, settings=kopf.OperatorSettings(), indexed_resources={PODS}, watched_resources={PODS},
            watched_namespaces={None}, ensemble=ensemble)
        for _ in range(50):
            await asyncio.sleep(0.01)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
        return held / pods
    finally:
        tracemalloc.stop()
        await orchestration.terminate_redundancies(remaining_resources=set(), remaining_namespaces=set(),
                                                   ensemble=ensemble)


def test_a_listing_holds_what_the_operator_keeps_of_each_pod_not_the_pod(monkeypatch):
    monkeypatch.setattr(watching, "infinite_watch", watching.infinite_watch)
    monkeypatch.setattr(queueing, "watcher", queueing.watcher)
    monkeypatch.setattr(orchestration, "aiotoggles", aiotoggles)
    per_pod = asyncio.run(_bytes_held_per_pod_while_listing(300))
    assert per_pod < 16 * 1024, f"{per_pod:.0f} bytes held per pod listed (the pod's annotation alone is 64 KiB)"


# --- the children a restart lists are only indexed ----------------------------------------------------------------
async def _a_restart(mended: bool, pods: int = 3) -> dict:
    """kopf's own orchestration, watchers and processor (``process_resource_event`` with a registry of an index and an
    event handler per kind) lists `pods` pods and one job, whose listing ends only when the test says so. Returns
    what the handlers saw before and after the operator was indexed, and what the pods' index held."""
    import functools

    from kopf._core.actions import lifecycles
    from kopf._core.engines import indexing
    from kopf._core.reactor import inventory, processing

    registry = kopf.OperatorRegistry()
    handled: list[tuple[str, object, str]] = []
    for resource in (PODS, JOBS):
        kopf.index(resource.group, resource.version, resource.plural, id=f"{resource.plural}_by_name",
                   registry=registry)(lambda name, **_: {name: True})
        kopf.on.event(resource.group, resource.version, resource.plural, registry=registry)(
            lambda name, type, resource, **_: handled.append((resource.plural, type, name)))
    indexers = indexing.OperatorIndexers()
    indexers.ensure(registry._indexing.get_all_handlers())
    settings = kopf.OperatorSettings()
    processor = functools.partial(processing.process_resource_event, lifecycle=lifecycles.all_at_once,
                                  registry=registry, settings=settings, indexers=indexers,
                                  memories=inventory.ResourceMemories(), memobase=kopf.Memo(),
                                  event_queue=asyncio.Queue())
    jobs_listed, later = asyncio.Event(), {PODS.plural: asyncio.Queue(), JOBS.plural: asyncio.Queue()}

    async def stream(resource, **_):
        if resource == PODS:
            for i in range(pods):
                yield {"type": None, "object": _pod(i)}
        else:
            yield {"type": None, "object": {"metadata": {"name": "job", "namespace": "ml", "uid": "job-uid"}}}
            await jobs_listed.wait()
        yield watching.Bookmark.LISTED
        while True:
            yield await later[resource.plural].get()

    watching.infinite_watch = stream
    if mended:
        kopf_mends.apply(listed_children={("", "pods")})
    ensemble = orchestration.Ensemble(operator_indexed=aiotoggles.ToggleSet(all),
                                      operator_paused=aiotoggles.ToggleSet(any), peering_missing=aiotoggles.Toggle())
    try:
        await orchestration.spawn_missing_watchers(
            processor=processor, settings=settings, indexed_resources={PODS, JOBS}, watched_resources={PODS, JOBS},
            watched_namespaces={None}, ensemble=ensemble)
        await asyncio.sleep(0.2)
        seen = {"while listing": list(handled), "pods indexed": sorted(indexers.indices["pods_by_name"])}
        jobs_listed.set()
        await asyncio.sleep(0.2)
        seen["once indexed"] = list(handled)
        later[PODS.plural].put_nowait({"type": "MODIFIED", "object": _pod(1)})
        later[PODS.plural].put_nowait({"type": None, "object": _pod(2)})  # a re-listing after a broken watch
        await asyncio.sleep(0.2)
        seen["after"] = handled[len(seen["once indexed"]):]
        return seen
    finally:
        await orchestration.terminate_redundancies(remaining_resources=set(), remaining_namespaces=set(),
                                                   ensemble=ensemble)


@pytest.fixture
def kopfs_own(monkeypatch):
    monkeypatch.setattr(watching, "infinite_watch", watching.infinite_watch)
    monkeypatch.setattr(queueing, "watcher", queueing.watcher)
    monkeypatch.setattr(orchestration, "aiotoggles", aiotoggles)


def test_kopf_holds_every_listed_pod_until_the_operator_is_indexed_and_then_handles_it(kopfs_own):
    """The defect the mend exists for: each listed pod waited (in a task of its own) for the job's listing."""
    seen = asyncio.run(_a_restart(mended=False))
    assert seen["while listing"] == [] and seen["pods indexed"] == ["job-0", "job-1", "job-2"]
    assert sorted(seen["once indexed"]) == [("ddpjobs", None, "job"), *(("pods", None, f"job-{i}") for i in range(3))]


def test_a_listed_child_is_indexed_and_let_go_and_its_later_events_are_handled(kopfs_own):
    seen = asyncio.run(_a_restart(mended=True))
    assert seen["pods indexed"] == ["job-0", "job-1", "job-2"], "indexed at once, as before"
    assert seen["while listing"] == []
    assert seen["once indexed"] == [("ddpjobs", None, "job")], "the job (not a listed child) waited and was handled"
    assert seen["after"] == [("pods", "MODIFIED", "job-1"), ("pods", None, "job-2")], \
        "once the operator is indexed, every event is handled, a re-listing's too"


def test_the_listed_children_mend_is_installed_once(kopfs_own):
    original = queueing.watcher
    kopf_mends.apply(listed_children={("", "pods")})
    kopf_mends.apply(listed_children={("", "services")})
    outer = queueing.watcher
    assert outer.__wrapped__.__wrapped__ is original  # not nested
    assert outer.__wrapped__._ddpjob_listed_kinds == {("", "services")}
    kopf_mends.apply()
    assert queueing.watcher is outer  # nothing given: the kinds before stay
