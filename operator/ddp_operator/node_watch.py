"""The cluster's Nodes, watched: each node's readiness for the node-loss and stuck-Terminating rules, with no read per
pod.

A pass looks up the node of every pod that is not Ready (plan.node_lost_candidates) and of every pod stuck
Terminating. A starting 1,000-node job's pods are all not Ready while they start, so each of its passes read up to
250 nodes one by one: 1.1-1.6 s of a pass (docs/scale.md). Here one thread lists the Nodes once, a page at a time,
then follows a watch of them, and keeps per node only its NodeState (observed.observe_node: Ready, since when), not
the Node. A lookup is a dict read.

NodeStates is what a pass asks: the watched state, or, where the watch cannot vouch for it, the node read (each node
at most once per READ_SECONDS, as before the watch). The watch cannot vouch:
- until the first listing is complete, and once the watch has been silent longer than FRESH_SECONDS (a watch request
  ends every WATCH_SECONDS and the next resumes from the last resourceVersion, bookmarks included, so a live watch
  is never that silent): a state may be stale;
- for a node the watch does not hold: a pod may be bound to a node created a moment ago whose ADDED event has not
  come yet, and a pod is never force-deleted because of a node the watch merely missed;
- with no permission to list or watch Nodes (an older ClusterRole, the chart's rbac.scope=namespace): the watch stops
  after the first 403, and every state is read (k8s.Api.node_state, which says None when that is forbidden too).

Every event is validated (parse_event): one that is not a well-formed Node event is dropped and counted in the log,
never raised; the watch goes on. A failed request or an error the API server ends a watch with is retried after
RETRY_SECONDS, and a watch request that ended within MIN_WATCH_SECONDS is not followed by the next at once: an API
server that answers oddly never gets a loop of requests from here.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from kubernetes.client.exceptions import ApiException

from ddp_operator import jsondoc, metrics
from ddp_operator.observed import NodeState, observe_node
from ddp_operator.read_cache import ReadCache

log = logging.getLogger(__name__)

WATCH_SECONDS = 60  # each watch request's length: the API server ends it, and the next resumes where it stopped
FRESH_SECONDS = WATCH_SECONDS + 30.0  # watched states are used only while the watch spoke this recently
RETRY_SECONDS = 5.0  # after a failed listing or watch request
MIN_WATCH_SECONDS = 1.0  # a watch request that ends sooner is not followed by the next at once (no request loop)
MAX_NAME = 253  # a Node's name is a DNS subdomain
READ_SECONDS = 5.0  # a node's state read (not watched) is reused: one read per node, not per pod


class WatchError(Exception):
    """The API server ended a watch with an error other than an expired resourceVersion."""


@dataclass(frozen=True)
class WatchEvent:
    """One line of a watch, validated. kind: ADDED, MODIFIED, DELETED, BOOKMARK, EXPIRED (the resourceVersion is
    too old: list again) or ERROR (any other error the API server ends the watch with: retried after a while)."""
    kind: str
    name: str = ""
    state: NodeState | None = None
    resource_version: str = ""


def _metadata(node: Any) -> Mapping[str, Any]:
    meta = node.get("metadata") if isinstance(node, Mapping) else None
    return meta if isinstance(meta, Mapping) else {}


def _name(node: Any) -> str:
    name = _metadata(node).get("name")
    return name if isinstance(name, str) and 0 < len(name) <= MAX_NAME else ""


def _version(node: Any) -> str:
    rv = _metadata(node).get("resourceVersion")
    return rv if isinstance(rv, str) and rv.isascii() and 0 < len(rv) <= 64 else ""


def parse_event(line: bytes | str) -> WatchEvent | None:
    """A watch line as a WatchEvent; None if it is not a well-formed Node event."""
    try:
        doc = jsondoc.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, Mapping):
        return None
    kind, obj = doc.get("type"), doc.get("object")
    if kind == "ERROR":  # a Status: 410 Gone when the watch's resourceVersion is no longer kept
        code = obj.get("code") if isinstance(obj, Mapping) else None
        return WatchEvent("EXPIRED" if code == 410 else "ERROR")
    if kind == "BOOKMARK":
        rv = _version(obj)
        return WatchEvent(kind, resource_version=rv) if rv else None
    if kind not in ("ADDED", "MODIFIED", "DELETED"):
        return None
    name, rv = _name(obj), _version(obj)
    if not name or not rv:
        return None
    return WatchEvent(kind, name, observe_node(None if kind == "DELETED" else obj), rv)


class NodeWatch:
    """The states of the cluster's Nodes as a watch shows them (module doc). `state(name)` is safe from any thread;
    `run()` is the watch's own thread, until `stop` is set."""

    def __init__(self, api: Any, stop: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self._stop = stop
        self._clock = clock
        self._states: dict[str, NodeState] = {}
        self._heard_at: float | None = None  # when the watch last spoke (None: not listed yet, or given up)
        self.dropped = 0  # malformed events, dropped

    def state(self, name: str) -> NodeState | None:
        """The node's watched state; None when it is not to be trusted or not held (module doc): read the node."""
        heard = self._heard_at
        if heard is None or self._clock() - heard > FRESH_SECONDS:
            return None
        return self._states.get(name)

    def __len__(self) -> int:
        return len(self._states)

    def run(self) -> None:
        version = ""
        while not self._stop.is_set():
            try:
                if not version:
                    version = self.relist()
                started = self._clock()
                version = self.follow(version)
                if self._clock() - started < MIN_WATCH_SECONDS:
                    self._stop.wait(MIN_WATCH_SECONDS)
            except ApiException as e:
                if e.status == 403:
                    self._heard_at = None
                    metrics.NODES_WATCHED.set(0)
                    log.info("no permission to list or watch Nodes (%s %s): each node a pass needs is read instead",
                             e.status, e.reason)
                    return
                if e.status == 410:  # a listing's continue token or the watch's version expired
                    version = ""
                    continue
                log.warning("node watch: %s %s; retrying in %.0f s", e.status, e.reason, RETRY_SECONDS)
                self._stop.wait(RETRY_SECONDS)
            except Exception as e:  # noqa: BLE001 - a dropped connection, a timeout: the watch goes on
                log.warning("node watch: %s: %s; retrying in %.0f s", type(e).__name__, e, RETRY_SECONDS)
                self._stop.wait(RETRY_SECONDS)

    def relist(self) -> str:
        """List every Node (page by page) into a fresh map; its resourceVersion, to watch from."""
        states: dict[str, NodeState] = {}
        after, version = "", ""
        while True:
            items, version, after = self.api.list_nodes(after)
            for node in items:
                name = _name(node)
                if name:
                    states[name] = observe_node(node)
            if not after:
                break
        self._states = states  # one assignment: a lookup sees the old map or the new one
        self._heard_at = self._clock()
        metrics.NODES_WATCHED.set(len(states))
        log.info("node watch: %d nodes listed", len(states))
        return version

    def follow(self, version: str) -> str:
        """One watch request from `version`: apply its events; the version to resume from ("" to list again)."""
        self._heard_at = self._clock()
        return self.apply(self.api.watch_nodes(version, WATCH_SECONDS), version)

    def apply(self, lines: Iterable[bytes], version: str) -> str:
        for line in lines:
            self._heard_at = self._clock()
            event = parse_event(line)
            if event is None:
                self.dropped += 1
                log.debug("node watch: dropped a malformed event (%d so far)", self.dropped)
                continue
            if event.kind == "EXPIRED":
                return ""
            if event.kind == "ERROR":
                raise WatchError("the API server ended the node watch with an error")
            if event.kind == "DELETED":
                self._states.pop(event.name, None)
            elif event.state is not None:
                self._states[event.name] = event.state
            version = event.resource_version
            metrics.NODES_WATCHED.set(len(self._states))
            if self._stop.is_set():
                break
        return version


class NodeStates:
    """A node's state for a pass: watched, or read where the watch cannot vouch for it (module doc). `run` is the
    watch's thread; every other method is safe from any thread."""

    def __init__(self, api: Any, stop: threading.Event) -> None:
        self.api = api
        self.watch = NodeWatch(api, stop)
        self.reads = ReadCache(READ_SECONDS)

    def run(self) -> None:
        self.watch.run()

    def get(self, name: str) -> NodeState | None:
        """The node's state; None if Nodes may not be read (namespace-scoped RBAC)."""
        state = self.watch.state(name)
        return state if state is not None else self.reads.get(name, self._read)

    def _read(self, name: str) -> NodeState | None:
        metrics.NODE_READS.inc()
        return self.api.node_state(name)

    def ready(self, name: str) -> bool | None:
        """False if the node is gone or its Ready condition is not True; None if Nodes may not be read."""
        state = self.get(name)
        return None if state is None else state.ready

    def prune(self) -> None:
        self.reads.prune()
