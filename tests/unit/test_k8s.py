"""k8s.Api: how a node's state is read (and what a 403, namespace-scoped RBAC, means), the Nodes listed and watched;
request timeouts, 409s, and writes whose answers are read raw."""

import json
import logging
from types import SimpleNamespace

import pytest
from kubernetes.client.exceptions import ApiException

from ddp_operator.k8s import Api


class _Core:
    def __init__(self, result):
        self.result, self.calls = result, 0

    def read_node(self, name, **_):
        self.calls += 1
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def _api(result):
    api = Api.__new__(Api)  # no kubeconfig needed: only .core is used
    api.core, api._nodes_forbidden = _Core(result), False
    return api


def _raw(obj):
    """What a read with _preload_content=False answers: the response, its body in .data."""
    return SimpleNamespace(data=json.dumps(obj).encode())


def _node(ready):
    return _raw({"status": {"conditions": [{"type": "Ready", "status": ready}]}})


def test_ready_not_ready_and_missing():
    assert _api(_node("True")).node_state("n").ready is True
    assert _api(_node("Unknown")).node_state("n").ready is False
    assert _api(ApiException(status=404, reason="Not Found")).node_state("n").ready is False


def test_forbidden_is_unknown_logged_once_and_not_asked_again(caplog):
    api = _api(ApiException(status=403, reason="Forbidden"))
    with caplog.at_level(logging.DEBUG, logger="ddp_operator.k8s"):
        assert api.node_state("n") is None
        assert api.node_state("m") is None
    assert api.core.calls == 1
    assert len([r for r in caplog.records if "permission to read Nodes" in r.message]) == 1


def test_other_errors_are_raised():
    with pytest.raises(ApiException):
        _api(ApiException(status=500, reason="boom")).node_state("n")


# --- timeouts and 409s --------------------------------------------------------------------------------------------
from ddp_operator import k8s  # noqa: E402
from ddp_operator.k8s import ChildConflict  # noqa: E402


class _Recorder:
    """Stands in for a kubernetes API class: records each call, answers with `answer(name, args, kwargs)`."""

    def __init__(self, calls, answer):
        self.calls, self.answer = calls, answer

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, kwargs))
            return self.answer(name, args, kwargs)
        return call


def _recording_api(answer=lambda *_: SimpleNamespace(status=SimpleNamespace(conditions=[]), data=b"{}")):
    calls = []
    api = Api.__new__(Api)
    api.core = api.custom = api.coordination = _Recorder(calls, answer)
    api.client = SimpleNamespace(sanitize_for_serialization=lambda o: {} if o is not None else None)
    api._nodes_forbidden = False
    return api, calls


def _child(kind="Pod", owner_uid="job-uid"):
    return {"kind": kind, "metadata": {"name": "job-0", "namespace": "ns",
                                       "ownerReferences": [{"kind": "DDPJob", "name": "job", "uid": owner_uid}]}}


def test_every_call_has_a_request_timeout():
    api, calls = _recording_api()
    api.create(_child())
    api.create(_child("Service"))
    api.delete_pod("ns", "p", "uid")
    api.delete_pod("ns", "p", "uid", force=True)
    api.delete_pod("ns", "p", "uid", grace_seconds=1)
    api.delete_job("ns", "job", "uid")
    api.patch_status("ns", "job", {"phase": "Running"})
    api.post_event({"metadata": {"name": "job", "namespace": "ns"}}, "Normal", "R", "m", "c")
    api.node_state("n")
    api.list_nodes()
    api.read_lease("ns", "l")
    api.write_lease("ns", {"metadata": {"name": "l"}}, create=True)
    api.write_lease("ns", {"metadata": {"name": "l"}}, create=False)
    assert len(calls) == 13
    for name, kwargs in calls:
        assert 0 < kwargs.get("_request_timeout", 0) <= k8s.REQUEST_TIMEOUT_SECONDS, name
    api.read_lease("ns", "l", timeout=1.5)
    assert calls[-1][1]["_request_timeout"] == 1.5


def test_a_create_answers_the_api_servers_json_unparsed_by_the_clients_models():
    """The created object is read from the raw response: no model is built for it (3 ms of a pod's create)."""
    raw = {"metadata": {"name": "job-0", "uid": "u1", "creationTimestamp": "2026-12-06T08:58:42Z"}}
    api, calls = _recording_api(lambda *_: SimpleNamespace(data=json.dumps(raw).encode()))
    assert api.create(_child()) == raw
    assert calls[-1][1]["_preload_content"] is False


def _conflicting(owner_refs):
    def answer(name, args, kwargs):
        if name.startswith("create_"):
            raise ApiException(status=409, reason="AlreadyExists")
        return SimpleNamespace(metadata=SimpleNamespace(owner_references=owner_refs))
    return _recording_api(answer)


def test_409_on_our_own_child_is_success():
    api, calls = _conflicting([SimpleNamespace(uid="job-uid", kind="DDPJob", name="job")])
    assert api.create(_child()) is None
    assert [c[0] for c in calls] == ["create_namespaced_pod", "read_namespaced_pod"]


@pytest.mark.parametrize("kind", ["Pod", "Service"])
@pytest.mark.parametrize("refs", [None, [SimpleNamespace(uid="other", kind="ReplicaSet", name="web-1")]])
def test_409_on_a_foreign_object_is_a_conflict_naming_it(kind, refs):
    api, _ = _conflicting(refs)
    with pytest.raises(ChildConflict) as err:
        api.create(_child(kind))
    text = str(err.value)
    assert f"{kind.lower()} ns/job-0 already exists and is not owned by this DDPJob" in text
    assert "delete or rename it" in text
    assert ("ReplicaSet web-1" in text) if refs else ("owned by nothing" in text)


def test_node_state_carries_since_when():
    from datetime import datetime, timezone
    since = datetime(2025, 1, 1, tzinfo=timezone.utc)
    node = _raw({"status": {"conditions": [{"type": "MemoryPressure", "status": "False"},
                                           {"type": "Ready", "status": "Unknown",
                                            "lastTransitionTime": "2025-01-01T00:00:00Z"}]}})
    state = _api(node).node_state("n")
    assert state.ready is False and state.since == since and not state.gone
    assert _api(ApiException(status=404, reason="Not Found")).node_state("n").gone
    assert _api(ApiException(status=403, reason="Forbidden")).node_state("n") is None


def test_requests_in_flight_are_bounded_by_a_pool_of_kept_connections(tmp_path, monkeypatch):
    """Past the pool, a request waits for a connection (no new TLS handshake per request, no flood of requests)."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kw = Api().client.rest_client.pool_manager.connection_pool_kw
    assert kw["maxsize"] == k8s.CONNECTIONS and kw["block"] is True
    from ddp_operator.writers import POD_WRITERS
    assert k8s.CONNECTIONS >= 2 * POD_WRITERS  # two passes' pod writers at once, with room for the rest


# --- writes whose answer is not used: no client models, the connection given back ---------------------------------
import http.server  # noqa: E402
import threading  # noqa: E402

from kubernetes import client as kclient  # noqa: E402


class _PodServer(http.server.BaseHTTPRequestHandler):
    """Answers every request with a pod, as the API server answers a delete or a patch; counts connections."""
    protocol_version = "HTTP/1.1"
    connections = 0
    requests: list = []

    def setup(self):
        super().setup()
        type(self).connections += 1

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        type(self).requests.append((self.command, self.path, self.rfile.read(length)))
        body = json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns",
                                                                           "uid": "uid"}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_DELETE = do_PATCH = do_POST = do_PUT = _answer

    def log_message(self, *_):
        pass


def test_deletes_patches_and_events_build_no_models_and_give_their_connection_back(monkeypatch):
    """A force deletion's answer is the deleted pod: the client's models of it cost ~1.2 ms of the operator's CPU per
    pod (255 in a node storm) for an answer nobody reads. The raw answer is read to its end instead, so that the one
    kept-alive connection of a pool of one serves every write (an unread answer would hold it and open another)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PodServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _PodServer.connections, _PodServer.requests = 0, []
    built = []
    monkeypatch.setattr(kclient.ApiClient, "deserialize", lambda self, *a, **k: built.append(a) or None)
    try:
        conf = kclient.Configuration(host=f"http://127.0.0.1:{server.server_port}")
        conf.connection_pool_maxsize = 1
        api = Api.__new__(Api)
        api.core = kclient.CoreV1Api(kclient.ApiClient(conf))
        api.networking = kclient.NetworkingV1Api(api.core.api_client)
        api.delete_pod("ns", "p", "uid", force=True)
        api.delete_pod("ns", "p", "uid", grace_seconds=3)
        api.patch_pod("ns", "p", "uid", {"metadata": {"annotations": {"a": "b"}}})
        api.post_event({"metadata": {"name": "job", "namespace": "ns", "uid": "j"}}, "Warning", "NodeLost", "m", "c")
        api.delete_network_policy("ns", "np", "uid")
        api.patch_network_policy("ns", "np", "uid", {"spec": {}})
        assert api.write_config_map({"metadata": {"name": "h", "namespace": "ns"}, "data": {}}, replace=False)
        assert api.write_config_map({"metadata": {"name": "h", "namespace": "ns", "resourceVersion": "1"},
                                     "data": {}}, replace=True)
    finally:
        server.shutdown()
    assert [(m, p.split("?")[0]) for m, p, _ in _PodServer.requests] == [
        ("DELETE", "/api/v1/namespaces/ns/pods/p"), ("DELETE", "/api/v1/namespaces/ns/pods/p"),
        ("PATCH", "/api/v1/namespaces/ns/pods/p"), ("POST", "/api/v1/namespaces/ns/events"),
        ("DELETE", "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies/np"),
        ("PATCH", "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies/np"),
        ("POST", "/api/v1/namespaces/ns/configmaps"), ("PUT", "/api/v1/namespaces/ns/configmaps/h")]
    assert json.loads(_PodServer.requests[0][2]) == {"preconditions": {"uid": "uid"}, "gracePeriodSeconds": 0}
    assert built == []  # no model of any answer
    assert _PodServer.connections == 1  # every answer read out: the one connection served all eight
