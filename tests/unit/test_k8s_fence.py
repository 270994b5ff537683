"""k8s.Api: every call carries a request timeout (all of them, found by inspection, not a hand-kept list), and a
replica whose Lease is not renewed in time -- paused, partitioned, replaced by a standby -- writes nothing."""

import inspect
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from ddp_operator import k8s
from ddp_operator.k8s import Api

from test_k8s import _Recorder
from test_leader import Clock, FakeApi as LeaseStore


def _child(kind="Pod"):
    return {"kind": kind, "metadata": {"name": "job-0", "namespace": "ns",
                                       "ownerReferences": [{"kind": "DDPJob", "name": "job", "uid": "job-uid"}]}}


def _config_map():
    return {"kind": "ConfigMap", "metadata": {"name": "job-history", "namespace": "ns"}, "data": {}}


JOB = {"metadata": {"name": "job", "namespace": "ns", "uid": "u"}}

# Every public method of Api, called once.
CALLS = {
    "create": lambda api: [api.create(_child(kind)) for kind in ("Pod", "Service", "NetworkPolicy", "Workload")],
    "delete_pod": lambda api: (api.delete_pod("ns", "p", "uid"), api.delete_pod("ns", "p", "uid", force=True)),
    "patch_pod": lambda api: api.patch_pod("ns", "p", "uid", {"metadata": {"annotations": {"a": "1"}}}),
    "delete_network_policy": lambda api: api.delete_network_policy("ns", "np", "uid"),
    "patch_network_policy": lambda api: api.patch_network_policy("ns", "np", "uid", {"spec": {"ingress": []}}),
    "delete_job": lambda api: api.delete_job("ns", "job", "uid"),
    "delete_workload": lambda api: api.delete_workload("ns", "wl", "uid"),
    "patch_workload": lambda api: (api.patch_workload("ns", "wl", "uid", {}),
                                   api.patch_workload("ns", "wl", "uid", {}, status=True)),
    "resource_flavor": lambda api: api.resource_flavor("f"),
    "workload_priority": lambda api: api.workload_priority("p"),
    "patch_status": lambda api: api.patch_status("ns", "job", {"phase": "Running"}),
    "post_event": lambda api: api.post_event(JOB, "Normal", "R", "m", "c"),
    "node_state": lambda api: api.node_state("n"),
    "list_nodes": lambda api: api.list_nodes(),
    "watch_nodes": lambda api: list(api.watch_nodes("1", 60)),
    "read_config_map": lambda api: api.read_config_map("ns", "job-history"),
    "write_config_map": lambda api: (api.write_config_map(_config_map(), replace=False),
                                     api.write_config_map(_config_map(), replace=True)),
    "read_lease": lambda api: api.read_lease("ns", "l"),
    "write_lease": lambda api: (api.write_lease("ns", {"metadata": {"name": "l"}}, create=True),
                                api.write_lease("ns", {"metadata": {"name": "l"}}, create=False)),
}
WRITES = {"create", "delete_pod", "patch_pod", "delete_network_policy", "patch_network_policy", "delete_job",
          "delete_workload", "patch_workload", "patch_status", "post_event", "write_config_map"}


def _answer(name, args, kwargs):
    if name.startswith("get_cluster_custom_object"):
        return {"spec": {}, "value": 1}
    if name.startswith("create_namespaced_custom_object"):
        return {}
    return SimpleNamespace(status=SimpleNamespace(conditions=[]), data=b"{}", stream=lambda **_: iter([b"{}\n"]),
                           release_conn=lambda: None)


def _api(fence=None):
    calls = []
    api = Api.__new__(Api)
    api.core = api.custom = api.coordination = api.networking = _Recorder(calls, _answer)
    api.client = SimpleNamespace(sanitize_for_serialization=lambda o: {} if o is not None else None)
    api._nodes_forbidden = False
    api.fence = fence
    return api, calls


def test_every_api_call_has_a_request_timeout():
    public = {n for n, f in inspect.getmembers(Api, inspect.isfunction) if not n.startswith("_")}
    assert public == set(CALLS), f"call every method of Api here: {public ^ set(CALLS)}"
    for name, call in CALLS.items():
        api, calls = _api()
        call(api)
        assert calls, name
        for method, kwargs in calls:
            timeout = kwargs.get("_request_timeout", 0)
            if name == "watch_nodes":  # (connect, read): a watch's answer is as long as it asked the server for
                connect, read = timeout
                assert 0 < connect <= k8s.REQUEST_TIMEOUT_SECONDS and kwargs["timeout_seconds"] < read <= 120
                continue
            assert 0 < timeout <= k8s.REQUEST_TIMEOUT_SECONDS, (name, method)


def _leaders():
    """Two electors on one Lease with one fake clock: `a` leads."""
    from ddp_operator.leader import LeaderElector
    store, clock = LeaseStore(), Clock()

    def elector(identity):
        return LeaderElector(store, "ops", "ddp-operator", identity, clock=clock,
                             wall=lambda: datetime.now(timezone.utc), on_lost=lambda: None)
    a, b = elector("a"), elector("b")
    assert a.try_acquire() and not b.try_acquire()
    return a, b, clock


def test_a_leader_writes_within_what_is_left_of_its_lease():
    a, _, clock = _leaders()
    clock.t += 4
    api, calls = _api(fence=a.valid_for)
    for name in WRITES:
        CALLS[name](api)
    assert calls and all(kwargs["_request_timeout"] == pytest.approx(a.renew_deadline_seconds - 4)
                         for _, kwargs in calls)


def test_a_replica_that_could_not_renew_in_time_writes_nothing():
    a, b, clock = _leaders()
    clock.t += a.renew_deadline_seconds  # paused: no renewal ran; the renewer has not noticed yet
    api, calls = _api(fence=a.valid_for)
    for name in WRITES:
        with pytest.raises(k8s.NotLeading):
            CALLS[name](api)
    assert calls == []
    # Reads still work (nothing they do can harm the new leader).
    api.node_state("n")
    assert [c[0] for c in calls] == ["read_node"]


def test_a_replica_that_saw_another_holder_writes_nothing_and_the_new_leader_does():
    a, b, clock = _leaders()
    clock.t += 16  # `a` paused past the lease: `b` takes over
    assert b.try_acquire()
    a._renewed_at = clock.t  # even a renewal that seemed to succeed just before...
    assert not a.try_acquire()  # ...meets b's record: a has lost it
    stale, calls = _api(fence=a.valid_for)
    with pytest.raises(k8s.NotLeading):
        stale.patch_status("ns", "job", {"phase": "Failed"})
    assert calls == []
    fresh, calls = _api(fence=b.valid_for)
    fresh.patch_status("ns", "job", {"phase": "Running"})
    assert [c[0] for c in calls] == ["patch_namespaced_custom_object_status"]
