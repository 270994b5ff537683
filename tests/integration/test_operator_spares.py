"""Hot spares (spec.spares) against the real API server: the pods, the status and `kubectl get`'s NODES column,
and `kubectl scale`, which the pods follow through their size annotation. The test plays the kubelet."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from ddp_cluster import GROUP, PLURAL, VERSION, wait_for

PODS = {"job-0", "job-1", "job-2", "job-rdzv"}
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


def _nodes_column(k) -> str:
    """The NODES cell of `kubectl get ddpj job` (the API server's table, as kubectl asks for it)."""
    api = k.custom.api_client
    method, url, headers, _, _ = api.param_serialize(
        method="GET", resource_path=f"/apis/{GROUP}/{VERSION}/namespaces/{k.ns}/{PLURAL}/job",
        header_params={"Accept": TABLE}, auth_settings=["BearerToken"])
    response = api.call_api(method, url, header_params=headers)
    response.read()
    table = json.loads(response.data)
    names = [c["name"] for c in table["columnDefinitions"]]
    return table["rows"][0]["cells"][names.index("Nodes")]


def _env(pod) -> dict[str, str]:
    trainer = next(c for c in pod.spec.containers if c.name == "trainer")
    return {e.name: e.value for e in trainer.env or []}


def _told(pods) -> dict[str, str | None]:
    return {n: (p.metadata.annotations or {}).get("ddp.dev/nodes") for n, p in pods.items() if n != "job-rdzv"}


def test_spares_are_extra_pods_shown_apart_and_scale_is_followed(k):
    k.create_job(spares=1)
    pods = k.wait_pods(PODS)
    for name in ("job-0", "job-1", "job-2"):
        env = _env(pods[name])
        # every pod is the same trainer: the rendezvous (of exactly spec.nodes) decides which ones train
        assert env["PET_NNODES"] == "2:2" and env["PET_RDZV_BACKEND"] == "ddpjob-c10d", env
        assert env["DDPJOB_NODES_FILE"] == "/etc/ddpjob/nodes", env
    assert _told(pods) == {"job-0": "2", "job-1": "2", "job-2": "2"}
    status = wait_for(lambda: k.status() if k.status().get("nodes", {}).get("active") == 2 else None,
                      what="status counts")
    assert status["nodesReady"] == "0/2 +0" and status["spares"]["desired"] == 1
    k.run_all()
    status = wait_for(lambda: k.status() if k.status().get("nodesReady") == "2/2 +1" else None,
                      what="2/2 +1")
    assert status["phase"] == "Running" and status["nodes"]["desired"] == 2
    assert status["spares"] == {"desired": 1, "running": 1, "ready": 1}
    assert _nodes_column(k) == "2/2 +1"
    # `kubectl scale ddpj/job --replicas=3`: every pod is told 3 (the rendezvous follows the annotation) and a
    # fourth pod joins, created with it; NODES counts 3 training places and the spare
    k.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, k.ns, PLURAL, "job", {"spec": {"replicas": 3}},
                                                  _content_type="application/merge-patch+json")
    scale = k.custom.get_namespaced_custom_object_scale(GROUP, VERSION, k.ns, PLURAL, "job")
    assert scale["spec"]["replicas"] == 3
    uids = {n: p.metadata.uid for n, p in k.pods().items()}
    pods = k.wait_pods(PODS | {"job-3"})
    wait_for(lambda: _told(k.pods()) == {f"job-{i}": "3" for i in range(4)} or None, what="every pod told 3")
    assert all(k.pods()[n].metadata.uid == uid for n, uid in uids.items()), "a running pod was replaced"
    assert _env(pods["job-3"])["PET_NNODES"] == "3:3"
    k.run_all()
    wait_for(lambda: k.status().get("nodesReady") == "3/3 +1" or None, what="3/3 +1")
    assert k.status().get("restarts", 0) == 0, "a scale is not a failure"
    # and back to 2: the fourth pod goes, the others are told 2
    k.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, k.ns, PLURAL, "job", {"spec": {"replicas": 2}},
                                                  _content_type="application/merge-patch+json")
    wait_for(lambda: "job-3" not in k.pods() or k.pods()["job-3"].metadata.deletion_timestamp or None,
             what="job-3 deleted")
    wait_for(lambda: {n: v for n, v in _told(k.pods()).items() if n != "job-3"} ==
             {f"job-{i}": "2" for i in range(3)} or None, what="every pod told 2")
    wait_for(lambda: k.status().get("nodesReady") == "2/2 +1" or None, what="2/2 +1 again")
    # a lost pod (whichever it was) is replaced; while it is away the column shows no spare ready
    k.set_phase("job-1", "Failed", exit_code=137)
    wait_for(lambda: k.status().get("infraRestarts") == 1, what="the failure counted (exit 137: infraBackoffLimit)")
    wait_for(lambda: "job-1" in k.pods() and k.pods()["job-1"].status.phase == "Pending", what="job-1 recreated")
    assert k.status()["nodesReady"] == "2/2 +0" and k.status()["phase"] == "Running"
    k.set_phase("job-1", "Running")
    wait_for(lambda: k.status().get("nodesReady") == "2/2 +1", what="the spare replenished")
    assert k.status()["infraRestarts"] == 1
