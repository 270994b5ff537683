"""Hot spares (spec.spares) against the real API server: the pods, the status and `kubectl get`'s NODES column,
and `kubectl scale` refused with a message that says why. The test plays the kubelet."""

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


def test_spares_are_extra_pods_shown_apart_and_scale_is_refused(k):
    k.create_job(spares=1)
    pods = k.wait_pods(PODS)
    for name in ("job-0", "job-1", "job-2"):
        env = _env(pods[name])
        # every pod is the same trainer: the rendezvous (of exactly spec.nodes) decides which ones train
        assert env["PET_NNODES"] == "2:2" and env["PET_RDZV_BACKEND"] == "ddpjob-c10d", env
    status = wait_for(lambda: k.status() if k.status().get("nodes", {}).get("active") == 2 else None,
                      what="status counts")
    assert status["nodesReady"] == "0/2 +0" and status["spares"]["desired"] == 1
    k.run_all()
    status = wait_for(lambda: k.status() if k.status().get("nodesReady") == "2/2 +1" else None,
                      what="2/2 +1")
    assert status["phase"] == "Running" and status["nodes"]["desired"] == 2
    assert status["spares"] == {"desired": 1, "running": 1, "ready": 1}
    assert _nodes_column(k) == "2/2 +1"
    # `kubectl scale ddpj/job --replicas=3`: refused, and the message says why
    with pytest.raises(ApiException) as err:
        k.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, k.ns, PLURAL, "job",
                                                      {"spec": {"replicas": 3}},
                                                      _content_type="application/merge-patch+json")
    assert err.value.status == 422 and "spec.nodes cannot change on a job with spec.spares" in err.value.body
    scale = k.custom.get_namespaced_custom_object_scale(GROUP, VERSION, k.ns, PLURAL, "job")
    assert scale["spec"]["replicas"] == 2
    # a lost pod (whichever it was) is replaced; while it is away the column shows no spare ready
    k.set_phase("job-1", "Failed", exit_code=137)
    wait_for(lambda: k.status().get("restarts") == 1, what="the failure counted")
    wait_for(lambda: "job-1" in k.pods() and k.pods()["job-1"].status.phase == "Pending", what="job-1 recreated")
    assert k.status()["nodesReady"] == "2/2 +0" and k.status()["phase"] == "Running"
    k.set_phase("job-1", "Running")
    wait_for(lambda: k.status().get("nodesReady") == "2/2 +1", what="the spare replenished")
    assert k.status()["restarts"] == 1
