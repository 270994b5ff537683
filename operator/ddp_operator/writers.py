"""How a pass's writes go out: a run of pod creates or deletes side by side, and a pass's Events.

One write after the other cost a round trip each: a pass that created 1,000 pods waited 1,000 round trips, and a node
storm's pass that posted an Event per lost pod (206) held the job's force deletions back 3.4 s. Here they go out
POD_WRITERS at a time (the API client keeps k8s.CONNECTIONS connections for them). A pass's few Events keep their
order (`kubectl describe` reads them as the story of the pass); past EVENTS_IN_ORDER they go side by side too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

# A pass's pod creates (or deletes) in flight at once: with 8 the API server's latency, not its CPU, bounded one job
POD_WRITERS = 32  # of 1,000 pods at 48 creates/s on the kwok simulation; 78/s with 32 (docs/scale.md)
EVENTS_IN_ORDER = 8  # a pass's Events are posted one after the other up to this many


def side_by_side(act: Callable[[Any], None], items: list, name: str) -> None:
    """`act` on each of `items`, POD_WRITERS at a time (one alone in the caller's thread); the first exception is
    raised once every write ended."""
    if len(items) == 1:
        act(items[0])
    elif items:
        with ThreadPoolExecutor(min(POD_WRITERS, len(items)), thread_name_prefix=name) as pool:
            list(pool.map(act, items))


def post_in_order(post: Callable[[Any], None], events: list) -> None:
    """A pass's Events: in order, or side by side past EVENTS_IN_ORDER."""
    if len(events) > EVENTS_IN_ORDER:
        side_by_side(post, events, "ddp-events")
        return
    for event in events:
        post(event)
