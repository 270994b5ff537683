"""kopf_mends: kopf's own orchestration (real watcher tasks, real toggle sets) with only the API's watch stream replaced
by one whose first listing never ends in the namespace that is then deleted."""

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


async def _indexed_after_a_namespace_vanished() -> bool:
    async def processor(**_):
        pass

    ensemble = orchestration.Ensemble(operator_indexed=aiotoggles.ToggleSet(all),
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


def test_mended_kopf_runs_handlers_again_once_the_vanished_namespaces_watcher_ended(stream):
    kopf_mends.apply()
    assert asyncio.run(_indexed_after_a_namespace_vanished()) is True


def test_mend_is_applied_once():
    original = queueing.watcher
    try:
        kopf_mends.apply()
        once = queueing.watcher
        kopf_mends.apply()
        assert queueing.watcher is once and once is not original
    finally:
        queueing.watcher = original
