"""node_watch.py: the Nodes listed and watched, so that a pass reads no node per pod (issue 28: a starting 1,000-node
job's passes read 250 nodes each, 1.1-1.6 s a pass), and what a state from the watch is trusted for."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client as kclient
from kubernetes.client.exceptions import ApiException

from ddp_builders import job_body
from fake_api import fake_reconciler
from test_leader import Clock

from ddp_operator.k8s import Api
from ddp_operator.node_watch import FRESH_SECONDS, NodeWatch, WatchEvent, parse_event
from ddp_operator.observed import NodeState


def _node(name, ready="True", rv="1", since="2026-12-07T10:00:00Z"):
    return {"metadata": {"name": name, "resourceVersion": rv},
            "status": {"conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": since}]}}


def _line(kind, obj):
    return json.dumps({"type": kind, "object": obj}).encode()


# --- events, validated ---------------------------------------------------------------------------------------------
def test_node_events_become_states():
    added = parse_event(_line("ADDED", _node("n1", rv="7")))
    assert added.kind == "ADDED" and added.name == "n1" and added.resource_version == "7"
    assert added.state.ready is True and added.state.since is not None
    assert parse_event(_line("MODIFIED", _node("n1", ready="Unknown", rv="8"))).state.ready is False
    gone = parse_event(_line("DELETED", _node("n1", rv="9")))
    assert gone.state.gone and not gone.state.ready
    assert parse_event(_line("BOOKMARK", {"metadata": {"resourceVersion": "12"}})) == WatchEvent(
        "BOOKMARK", resource_version="12")
    assert parse_event(_line("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"})).kind == "EXPIRED"
    assert parse_event(_line("ERROR", {"code": 500})).kind == parse_event(_line("ERROR", "odd")).kind == "ERROR"


@pytest.mark.parametrize("line", [
    b"not json", b"[1, 2]", b'"ADDED"', _line("ADDED", "a string"), _line("ADDED", {"metadata": {}}),
    _line("ADDED", {"metadata": {"name": "n1"}}),                       # no resourceVersion
    _line("ADDED", {"metadata": {"name": 7, "resourceVersion": "1"}}),  # a name that is not a string
    _line("ADDED", {"metadata": {"name": "n" * 254, "resourceVersion": "1"}}),
    _line("ADDED", {"metadata": {"name": "n1", "resourceVersion": ["1"]}}),
    _line("SURPRISE", _node("n1")), _line("BOOKMARK", {"metadata": {}}),
])
def test_a_malformed_event_is_dropped_not_raised(line):
    assert parse_event(line) is None


def test_a_node_with_odd_conditions_is_not_ready():
    event = parse_event(_line("ADDED", {"metadata": {"name": "n1", "resourceVersion": "1"},
                                        "status": {"conditions": "Ready"}}))
    assert event.state == NodeState(ready=False)


# --- the watch, on a fake API ----------------------------------------------------------------------------------------
class _Nodes:
    """list_nodes in pages of two; watch_nodes answers the next scripted list of lines (or raises it)."""

    def __init__(self, nodes, watches=(), list_error=None):
        self.nodes, self.watches, self.list_error = nodes, list(watches), list_error
        self.lists, self.watched_from = 0, []

    def list_nodes(self, after=""):
        if self.list_error is not None:
            raise self.list_error
        self.lists += after == ""
        start = int(after or 0)
        rest = str(start + 2) if start + 2 < len(self.nodes) else ""
        return self.nodes[start:start + 2], "100", rest

    def watch_nodes(self, version, seconds):
        self.watched_from.append(version)
        script = self.watches.pop(0) if self.watches else ApiException(status=500, reason="no more watches")
        if isinstance(script, Exception):
            raise script
        return iter(script)


def test_listing_then_events_keep_each_nodes_state():
    api = _Nodes([_node(f"n{i}") for i in range(5)], [[
        _line("MODIFIED", _node("n1", ready="False", rv="101")),
        b"{garbage",
        _line("DELETED", _node("n2", rv="102")),
        _line("ADDED", _node("n9", rv="103")),
        _line("BOOKMARK", {"metadata": {"resourceVersion": "150"}}),
    ]])
    watch = NodeWatch(api, threading.Event(), clock=Clock())
    assert watch.state("n0") is None  # not listed yet: read the node
    version = watch.relist()
    assert version == "100" and len(watch) == 5 and watch.state("n0").ready is True
    assert watch.follow(version) == "150"
    assert api.watched_from == ["100"]
    assert watch.state("n1").ready is False and watch.state("n9").ready is True
    assert watch.state("n2") is None  # deleted: not held, so the caller reads it (and finds it gone)
    assert watch.dropped == 1


def test_a_silent_watch_is_not_trusted():
    clock = Clock()
    watch = NodeWatch(_Nodes([_node("n0")]), threading.Event(), clock=clock)
    watch.relist()
    clock.t += FRESH_SECONDS - 1
    assert watch.state("n0").ready is True
    clock.t += 2
    assert watch.state("n0") is None


def test_an_expired_version_lists_again_and_a_failed_request_is_retried(monkeypatch):
    monkeypatch.setattr("ddp_operator.node_watch.RETRY_SECONDS", 0.01)
    monkeypatch.setattr("ddp_operator.node_watch.MIN_WATCH_SECONDS", 0.01)
    stop = threading.Event()
    expired = [_line("ERROR", {"kind": "Status", "code": 410})]
    api = _Nodes([_node("n0"), _node("n1")], [expired, ConnectionResetError("reset"), ApiException(status=410)])
    real = api.watch_nodes

    def watch_nodes(version, seconds):
        if len(api.watched_from) == 3:
            stop.set()
        return real(version, seconds)
    api.watch_nodes = watch_nodes
    watch = NodeWatch(api, stop)
    thread = threading.Thread(target=watch.run)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()
    # listed, watched (410 in the stream: list again), watched (reset: retried from the same version), watched (410).
    assert api.lists >= 2 and api.watched_from[:3] == ["100", "100", "100"]


def test_no_permission_to_list_nodes_stops_the_watch_and_every_node_is_read(caplog):
    caplog.set_level(logging.INFO, logger="ddp_operator.node_watch")
    watch = NodeWatch(_Nodes([], list_error=ApiException(status=403, reason="Forbidden")), threading.Event())
    thread = threading.Thread(target=watch.run)
    thread.start()
    thread.join(5)
    assert not thread.is_alive() and watch.state("n0") is None
    assert any("no permission to list or watch Nodes" in r.message for r in caplog.records)


# --- the pass: watched states, no reads -----------------------------------------------------------------------------
def _starting(nodes):
    """A job whose trainer pods are bound to nodes and not Ready yet (starting): each is a node-loss candidate."""
    r = fake_reconciler(job_body(nodes=nodes))
    key = ("ml", "mnist")
    r.reconcile(*key)
    for i, pod in enumerate(r.indexes["pods_by_job"][key]):
        pod["metadata"]["resourceVersion"] = "2"
        pod["spec"]["nodeName"] = f"node-{i}"
        pod["status"] = {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]}
    reads = []
    real = r.api.node_state
    r.api.node_state = lambda name: reads.append(name) or real(name)
    return r, key, reads


def test_a_starting_jobs_pass_reads_no_node_the_watch_holds():
    r, key, reads = _starting(50)
    r.reconcile(*key)
    assert len(reads) == 51  # no watch: every candidate's node read (the store pod's too)
    r, key, reads = _starting(50)
    r.nodes.watch = NodeWatch(_Nodes([_node(f"node-{i}") for i in range(51)]), threading.Event())
    r.nodes.watch.relist()
    r.reconcile(*key)
    assert reads == []


def test_a_node_the_watch_does_not_hold_is_read():
    r, _, reads = _starting(1)
    r.nodes.watch = NodeWatch(_Nodes([_node("node-0", ready="False")]), threading.Event())
    r.nodes.watch.relist()
    assert r.nodes.get("node-0").ready is False and r.nodes.ready("node-0") is False and reads == []
    assert r.nodes.get("node-new").ready is True and reads == ["node-new"]  # the fake API's answer


# --- k8s.Api: the listing and the watch's lines, over HTTP ----------------------------------------------------------
class _NodeServer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    queries: list = []

    def do_GET(self):
        query = parse_qs(urlparse(self.path).query)
        type(self).queries.append(query)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if query.get("watch") == ["true"]:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            body = _line("ADDED", _node("a")) + b"\n" + _line("MODIFIED", _node("b", ready="False"))
            for chunk in (body[:15], body[15:70], body[70:] + b"\n", b"\n"):  # lines split across chunks
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
            return
        body = json.dumps({"metadata": {"resourceVersion": "5", "continue": "next"}, "items": [_node("a")]}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


def test_the_api_lists_a_page_and_streams_the_watchs_lines():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NodeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _NodeServer.queries = []
    try:
        api = Api.__new__(Api)
        api.core = kclient.CoreV1Api(kclient.ApiClient(kclient.Configuration(
            host=f"http://127.0.0.1:{server.server_port}")))
        items, version, after = api.list_nodes("token")
        assert [n["metadata"]["name"] for n in items] == ["a"] and version == "5" and after == "next"
        lines = list(api.watch_nodes("5", 60))
    finally:
        server.shutdown()
    assert [parse_event(line).name for line in lines] == ["a", "b"]
    listing, watching = _NodeServer.queries
    assert listing["continue"] == ["token"] and "limit" in listing
    assert watching["resourceVersion"] == ["5"] and watching["allowWatchBookmarks"] == ["true"]
    assert watching["timeoutSeconds"] == ["60"]


def test_a_watch_that_ends_at_once_or_with_an_error_is_not_asked_again_in_a_loop(monkeypatch):
    """An API server that ends every watch at once, or with an error, gets at most one watch request a second (or
    one per RETRY_SECONDS after an error), never a tight loop of them."""
    monkeypatch.setattr("ddp_operator.node_watch.RETRY_SECONDS", 0.3)
    monkeypatch.setattr("ddp_operator.node_watch.MIN_WATCH_SECONDS", 0.2)
    stop = threading.Event()
    error = [_line("ERROR", {"kind": "Status", "code": 500, "reason": "InternalError"})]
    api = _Nodes([_node("n0")], [[], [], error, []] * 100)
    watch = NodeWatch(api, stop)
    thread = threading.Thread(target=watch.run)
    thread.start()
    time.sleep(1.5)
    stop.set()
    thread.join(5)
    # 1.5 s: two empty watches (0.2 s each), an error (0.3 s), an empty one, and so on: about 5, never hundreds.
    assert 3 <= len(api.watched_from) <= 8, len(api.watched_from)
    assert watch.state("n0").ready is True
