"""What the operator holds in memory of every labelled pod and every job (kopf's indexes, the tombstones): only what
it reads. A pod read through the index means exactly what the pod means (observe_pod, the poller's filter), and
its bulk (annotations, managedFields, the containers' spec) is gone."""

import copy
import json

import kopf
import pytest

from ddp_operator import handlers, names
from ddp_operator.jobs import JobRegistry, _parse_source
from ddp_operator.observed import observe_pod
from ddp_operator.pod import render_trainer_pod
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.spec import parse_job

from ddp_builders import NOW, job_body, later, make_job, pod

BLOB = "x" * 64 * 1024
KEY = ("ml", "mnist")

# The builders' pods, one per kind of state observe_pod tells apart.
STATES = [
    dict(), dict(phase="Pending", ready=False), dict(phase="Pending", waiting="ImagePullBackOff", ready=False),
    dict(exit_code=0, phase="Succeeded"), dict(exit_code=1, phase="Failed", message='{"final": true, "step": 7}'),
    dict(exit_code=137, reason="OOMKilled", finished_at=NOW), dict(restart_count=2, last_exit_code=1,
                                                                  last_message="worker exit 3", waiting="Error"),
    dict(deleting_since=later(3)), dict(disruption="PreemptionByScheduler"), dict(status_reason="Evicted"),
    dict(annotations={names.NODES_ANNOTATION: "3"}), dict(role="rdzv"), dict(group=4, index=1),
    dict(restart_policy="Never", exit_code=2, phase="Running"),
]


def _api_pod(state, render=True):
    """A pod as the API server returns it: the rendered template's spec and bulk the operator never reads."""
    base = pod(f"mnist-{state.get('index', 0)}", **{"index": 0, **state})
    if render:
        job = make_job()
        full = render_rdzv_pod(job, 0) if state.get("role") == "rdzv" else render_trainer_pod(job, 0, 0)
        full["metadata"]["labels"].update(base["metadata"]["labels"])
        full["metadata"].update({k: v for k, v in base["metadata"].items() if k != "labels"})
        full["spec"].update(base["spec"])
        base = {**full, "status": base["status"]}
    meta = base["metadata"]
    meta.setdefault("ownerReferences", [{"apiVersion": names.API_VERSION, "kind": names.KIND, "name": "mnist",
                                         "uid": "0b5c-uid", "controller": True}])
    meta.update(namespace="ml", resourceVersion="123", creationTimestamp="2025-01-01T00:00:00Z",
                managedFields=[{"manager": "kubelet", "fieldsV1": {"f:status": {"f:" + str(i): {}}}}
                               for i in range(200)])
    meta["annotations"] = {**meta.get("annotations", {}), "bench.ddp.dev/blob": BLOB,
                           "kubectl.kubernetes.io/last-applied-configuration": BLOB}
    base["status"].update(hostIP="10.0.0.1", podIP="10.1.0.7", podIPs=[{"ip": "10.1.0.7"}], qosClass="Burstable",
                          startTime="2025-01-01T00:00:01Z")
    for cs in base["status"].get("containerStatuses") or []:
        cs.update(image="localhost/ddp-trainer:0.1.0", imageID="sha256:" + "a" * 64, containerID="containerd://b")
    return base


PODS = [_api_pod(s) for s in STATES] + [_api_pod(s, render=False) for s in STATES]


def _indexed(p):
    [value] = handlers.pods_by_job("ml", p["metadata"]["labels"], kopf.Body(p)).values()
    return value


def _running_trainer(p, uid="0b5c-uid"):
    """The poller's filter (poller._running_trainers), on one pod."""
    s = p.get("status") or {}
    return (s.get("phase") == "Running" and bool(s.get("podIP")) and not p["metadata"].get("deletionTimestamp")
            and p["metadata"].get("labels", {}).get(names.LABEL_ROLE) == names.ROLE_TRAINER
            and any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or []),
            s.get("podIP"), p["metadata"].get("name"))


@pytest.mark.parametrize("p", PODS, ids=[f"{i}" for i in range(len(PODS))])
def test_a_pod_in_the_index_means_what_the_pod_means_without_its_bulk(p):
    kept = _indexed(p)
    assert observe_pod(kept) == observe_pod(p)
    assert observe_pod(kept, gone=True) == observe_pod(p, gone=True)
    assert _running_trainer(kept) == _running_trainer(p)
    assert kept["metadata"]["uid"] == p["metadata"]["uid"]
    assert kept["metadata"]["ownerReferences"] == p["metadata"]["ownerReferences"]
    # The bulk is gone: today every byte of the pod is kept.
    assert "managedFields" not in kept["metadata"]
    assert set(kept["metadata"].get("annotations", {})) <= {names.NODES_ANNOTATION}
    assert set(kept["spec"]) <= {"nodeName", "restartPolicy"}
    assert len(json.dumps(kept)) < 4096, len(json.dumps(kept))


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    else:
        yield path, obj


def _mutated(p, path, value):
    m = copy.deepcopy(p)
    target = m
    for k in path[:-1]:
        target = target[k]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return m


_DELETE = object()


def _variants(value):
    if isinstance(value, bool):
        return [not value, _DELETE]
    if isinstance(value, int):
        return [value + 1, 0, _DELETE]
    return ["zz-changed", "", _DELETE]


def _meaning(p, gone):
    """What observe_pod makes of p; the exception's type where it raises (a malformed timestamp does)."""
    try:
        return observe_pod(p, gone=gone)
    except ValueError as e:
        return type(e).__name__


def test_no_field_observe_pod_or_the_poller_reads_is_dropped():
    """Every leaf of every fixture pod changed or removed in turn: whenever that changes what observe_pod or the
    poller makes of the pod, the index still carries the change (a field they read is never dropped)."""
    checked = 0
    for p in PODS[: len(STATES)]:
        p = copy.deepcopy(p)
        p["metadata"]["managedFields"] = p["metadata"]["managedFields"][:1]
        p["metadata"]["annotations"] = {k: "x" for k in p["metadata"]["annotations"]}
        for path, value in _leaves(p):
            if path == ("metadata", "labels", names.LABEL_JOB_NAME):  # the index's key (kopf's filter)
                continue
            for variant in _variants(value):
                m = _mutated(p, path, variant)
                kept = _indexed(m)
                for gone in (False, True):
                    assert _meaning(kept, gone) == _meaning(m, gone), (path, variant)
                assert _running_trainer(kept) == _running_trainer(m), (path, variant)
                checked += 1
    assert checked > 1000


def test_a_tombstone_keeps_only_what_observe_pod_reads():
    registry = JobRegistry()
    p = PODS[4]
    registry.tombstone(KEY, p)
    [kept] = registry.record(KEY).tombstones.values()
    assert observe_pod(kept, gone=True) == observe_pod(p, gone=True)
    assert "managedFields" not in kept["metadata"] and len(json.dumps(kept)) < 4096


def test_a_job_in_the_index_parses_the_same_without_its_bulk():
    body = job_body()
    body["metadata"].update(
        resourceVersion="9", labels={names.LABEL_QUEUE_NAME: "team-a"},
        managedFields=[{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}] * 100,
        annotations={"kubectl.kubernetes.io/last-applied-configuration": BLOB,
                     f"{names.GROUP}/last-handled-configuration": BLOB})
    body["status"] = {"phase": "Running", "progress": {"step": 3}}
    [kept] = handlers.ddpjobs_by_key("ml", "mnist", kopf.Body(body)).values()
    assert parse_job(kept) == parse_job(body) and _parse_source(kept) == _parse_source(body)
    assert kept["status"] == body["status"]
    assert {k: kept["metadata"][k] for k in ("name", "namespace", "uid", "generation", "resourceVersion")} == \
        {k: body["metadata"][k] for k in ("name", "namespace", "uid", "generation", "resourceVersion")}
    assert "managedFields" not in kept["metadata"] and "annotations" not in kept["metadata"]
    assert len(json.dumps(kept)) < 4096


def test_a_services_and_a_policys_events_mean_to_the_operator_what_the_objects_mean():
    """kopf_mends slims the events of the job's Service and NetworkPolicy to jobs.kept_child: the indexes and handlers
    read the same from them."""
    from ddp_operator.jobs import kept_child
    from ddp_operator.netpol import NetworkPolicyConfig, render_network_policy
    from ddp_operator.service import render_service

    job = make_job()
    for obj in (render_service(job), render_network_policy(job, NetworkPolicyConfig())):
        obj["metadata"].update(uid="child-uid", resourceVersion="7", managedFields=[{"manager": BLOB}],
                               annotations={"bulk": BLOB})
        kept = kept_child(obj)
        assert len(json.dumps(kept)) < 2048, kept
        kw = dict(namespace="ml", name=obj["metadata"]["name"], labels=obj["metadata"]["labels"])
        if obj["kind"] == "NetworkPolicy":
            assert handlers.network_policies_by_job(body=kopf.Body(kept), **kw) == \
                handlers.network_policies_by_job(body=kopf.Body(obj), **kw)
        else:
            assert handlers.services_by_job(body=kopf.Body(kept), **kw) == handlers.services_by_job(body=kopf.Body(obj),
                                                                                                    **kw)


def test_a_jobs_events_lose_only_the_servers_field_bookkeeping():
    from ddp_operator.jobs import kept_job, without_managed_fields

    body = job_body()
    body["metadata"].update(managedFields=[{"manager": "kubectl", "fieldsV1": {"f:spec": BLOB}}],
                            annotations={"ddp.dev/last-handled-configuration": '{"spec": {}}'})
    slim = without_managed_fields(body)
    assert "managedFields" not in slim["metadata"] and "managedFields" in body["metadata"]  # a copy, not an edit
    assert slim["metadata"]["annotations"] == body["metadata"]["annotations"]  # kopf's own state stays
    assert slim["spec"] == body["spec"] and kept_job(slim) == kept_job(body)


def test_the_indexes_are_filled_on_kopfs_event_loop_never_through_its_thread_pool():
    """kopf hands a sync handler to its thread pool and back, for every object a restart lists: the operator's index
    functions are registered to run on kopf's event loop. Here kopf's own indexing, with a thread pool that refuses
    every task, fills each index exactly as the plain function says."""
    import asyncio
    import concurrent.futures
    import logging

    from kopf._cogs.structs import references
    from kopf._core.actions import loggers
    from kopf._core.engines import indexing

    class Refusing(concurrent.futures.ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            raise AssertionError("an index handler was handed to kopf's thread pool")

    settings = kopf.OperatorSettings()
    settings.execution.executor = Refusing(max_workers=1)
    registry = kopf.get_default_registry()
    p = PODS[0]
    resource = references.Resource(group="", version="v1", plural="pods", namespaced=True)
    pod_handlers = [h for h in registry._indexing.get_all_handlers() if h.id == "pods_by_job"]
    assert len(pod_handlers) == 1

    async def index() -> dict:
        indexers = indexing.OperatorIndexers()
        indexers.ensure(registry._indexing.get_all_handlers())
        body = kopf.Body(p)
        await indexing.index_resource(registry=registry, indexers=indexers, settings=settings, resource=resource,
                                      raw_event={"type": None, "object": p}, body=body, memo=kopf.Memo(),
                                      memory=indexing.IndexingMemory(),
                                      logger=loggers.TerseObjectLogger(body=body, settings=settings))
        return {k: list(v) for k, v in indexers.indices["pods_by_job"].items()}

    logging.getLogger("kopf").setLevel(logging.CRITICAL)
    assert asyncio.run(index()) == {("ml", "mnist"): [_indexed(p)]}
