"""Invalid DDPJobs are rejected by the API server itself (schema + CEL rules of the generated CRD), each with a
message that names the offending field, and nothing is created for them."""

from __future__ import annotations

import copy

import pytest
from kubernetes.client.exceptions import ApiException

from ddp_cluster import GROUP, PLURAL, VERSION


def _tpl(**pod):
    return {"spec": {"containers": [{"name": "trainer", "image": "x"}], **pod}}


def _tpl_env(name):
    """A template whose trainer sets `name`, beside an ordinary variable."""
    return {"spec": {"containers": [{"name": "trainer", "image": "x", "env": [
        {"name": "HF_HOME", "value": "/c"}, {"name": name, "value": "1"}]}]}}


# (name suffix, spec patch or callable(body), text the error must contain)
INVALID = [
    ("zero-nodes", {"nodes": 0}, "spec.nodes"),
    ("too-many-nodes", {"nodes": 1001}, "spec.nodes"),
    ("nodes-string", {"nodes": "two"}, "spec.nodes"),
    ("min-above-nodes", {"minNodes": 3}, "spec.minNodes"),
    ("nodes-above-max", {"maxNodes": 1}, "spec.nodes"),
    ("min-above-max", {"nodes": 3, "minNodes": 4, "maxNodes": 3}, "spec.minNodes"),
    ("spares-negative", {"spares": -1}, "spec.spares"),
    ("spares-too-many", {"spares": 101}, "spec.spares"),
    ("spares-too-many-pods", {"nodes": 1000, "spares": 1}, "spec.nodes + spec.spares must be"),
    ("spares-elastic", {"nodes": 2, "minNodes": 1, "maxNodes": 3, "spares": 1},
     "spec.spares needs a fixed-size job"),
    ("nproc-zero", {"nprocPerNode": 0}, "spec.nprocPerNode"),
    ("nproc-word", {"nprocPerNode": "many"}, "spec.nprocPerNode"),
    ("omp-zero", {"ompNumThreads": 0}, "spec.ompNumThreads"),
    ("no-trainer", {"template": {"spec": {"containers": [{"name": "main", "image": "x"}]}}},
     "spec.template.spec.containers"),
    ("no-containers", {"template": {"spec": {"containers": []}}}, "spec.template.spec.containers"),
    ("dup-containers", {"template": {"spec": {"containers": [{"name": "trainer"}, {"name": "trainer"}]}}},
     "spec.template.spec.containers"),
    ("restart-always", {"template": _tpl(restartPolicy="Always")}, "spec.template.spec.restartPolicy"),
    ("own-hostname", {"template": _tpl(hostname="h")}, "hostname"),
    ("port-range", {"torchrun": {"rdzvPort": 70000}}, "spec.torchrun.rdzvPort"),
    ("join-timeout", {"torchrun": {"joinTimeoutSeconds": 0}}, "spec.torchrun.joinTimeoutSeconds"),
    ("keepalive", {"torchrun": {"keepAliveIntervalSeconds": 0}}, "spec.torchrun.keepAliveIntervalSeconds"),
    ("max-restarts", {"torchrun": {"maxRestarts": -1}}, "spec.torchrun.maxRestarts"),
    ("extra-owned", {"torchrun": {"extraArgs": ["--nnodes=4"]}}, "spec.torchrun.extraArgs"),
    ("extra-format", {"torchrun": {"extraArgs": ["nnodes"]}}, "spec.torchrun.extraArgs"),
    # Owned torchrun options in another spelling, and their PET_* variables in the trainer's env.
    ("extra-owned-spelling", {"torchrun": {"extraArgs": ["--nproc-per_node=64"]}}, "spec.torchrun.extraArgs"),
    ("extra-owned-underscore", {"torchrun": {"extraArgs": ["--log-dir=/l", "--master_port=1"]}},
     "spec.torchrun.extraArgs"),
    ("extra-rdzv-prefix", {"torchrun": {"extraArgs": ["--rdzv_timeout=5"]}}, "spec.torchrun.extraArgs"),
    ("extra-space-value", {"torchrun": {"extraArgs": ["--nnodes 4"]}}, "spec.torchrun.extraArgs"),
    ("env-standalone", {"template": _tpl_env("PET_STANDALONE")}, "containers[trainer].env must not set PET_STANDALONE"),
    ("env-node-rank", {"template": _tpl_env("PET_NODE_RANK")}, "containers[trainer].env must not set PET_NODE_RANK"),
    ("env-master-addr", {"template": _tpl_env("PET_MASTER_ADDR")}, "must not set PET_MASTER_ADDR"),
    ("env-nnodes", {"template": _tpl_env("PET_NNODES")}, "must not set PET_NNODES"),
    ("env-rdzv-any", {"template": _tpl_env("PET_RDZV_TIMEOUT")}, "must not set PET_RDZV_*"),
    ("volume-checkpoint", {"template": _tpl(volumes=[{"name": "checkpoint", "emptyDir": {}}]),
                           "checkpoint": {"volume": {"emptyDir": {}}}}, "spec.template.spec.volumes"),
    ("volume-shm", {"template": _tpl(volumes=[{"name": "dshm", "emptyDir": {}}])}, "spec.template.spec.volumes"),
    ("backoff", {"failurePolicy": {"backoffLimit": -1}}, "spec.failurePolicy.backoffLimit"),
    ("exit-code", {"failurePolicy": {"permanentExitCodes": [0]}}, "spec.failurePolicy.permanentExitCodes"),
    ("both-codes", {"failurePolicy": {"permanentExitCodes": [3], "retryableExitCodes": [1]}},
     "spec.failurePolicy"),
    ("clean-policy", {"runPolicy": {"cleanPodPolicy": "Some"}}, "spec.runPolicy.cleanPodPolicy"),
    ("deadline", {"runPolicy": {"activeDeadlineSeconds": 0}}, "spec.runPolicy.activeDeadlineSeconds"),
    ("ttl", {"runPolicy": {"ttlSecondsAfterFinished": -1}}, "spec.runPolicy.ttlSecondsAfterFinished"),
    # Beyond ten years, datetime arithmetic in the operator would overflow (year > 9999) on every pass.
    ("deadline-huge", {"runPolicy": {"activeDeadlineSeconds": 10 ** 12}}, "spec.runPolicy.activeDeadlineSeconds"),
    ("ttl-huge", {"runPolicy": {"ttlSecondsAfterFinished": 10 ** 12}}, "spec.runPolicy.ttlSecondsAfterFinished"),
    ("shm-medium", {"shm": {"medium": "HugePages"}}, "spec.shm.medium"),
    ("shm-size", {"shm": {"sizeLimit": "lots"}}, "spec.shm.sizeLimit"),
    ("ckpt-no-volume", {"checkpoint": {"mountPath": "/c"}}, "spec.checkpoint.volume"),
    ("ckpt-relative", {"checkpoint": {"volume": {"emptyDir": {}}, "mountPath": "c"}}, "spec.checkpoint.mountPath"),
    # The store pod's image and resources (a request above its limit is the operator's InvalidSpec, unit-tested).
    ("store-image", {"rendezvous": {"image": "bad image:1"}}, "spec.rendezvous.image"),
    ("store-quantity", {"rendezvous": {"resources": {"limits": {"memory": "lots"}}}},
     "spec.rendezvous.resources.limits.memory"),
    ("store-negative", {"rendezvous": {"resources": {"requests": {"cpu": -1}}}}, "spec.rendezvous.resources.requests.cpu"),
    ("store-device", {"rendezvous": {"resources": {"limits": {"nvidia.com/gpu": "1"}}}},
     "the store pod takes only cpu, memory, ephemeral-storage"),
    ("no-template", lambda b: b["spec"].pop("template"), "spec.template"),
    ("no-nodes", lambda b: b["spec"].pop("nodes"), "spec.nodes"),
    ("long-name", lambda b: b["metadata"].update(name="a" * 59), "metadata.name"),
]


@pytest.mark.parametrize("case,patch,field", INVALID, ids=[c for c, _, _ in INVALID])
def test_invalid_job_is_rejected_naming_the_field(k, case, patch, field):
    body = k.job_manifest(name="bad")
    if callable(patch):
        patch(body)
    else:
        body["spec"].update(copy.deepcopy(patch))
    with pytest.raises(ApiException) as err:
        k.custom.create_namespaced_custom_object(GROUP, VERSION, k.ns, PLURAL, body)
    assert err.value.status == 422, err.value.body
    assert field in err.value.body, err.value.body
    assert k.jobs() == []
    assert k.pods() == {}


def test_immutable_fields_and_scaling_rules(k):
    k.create_job(name="job", nodes=2)
    with pytest.raises(ApiException) as err:
        k.patch_job("job", {"spec": {"template": {"spec": {"containers": [{"name": "trainer", "image": "y"}]}}}})
    assert err.value.status == 422 and "spec.template is immutable" in err.value.body
    with pytest.raises(ApiException) as err:
        k.patch_job("job", {"spec": {"torchrun": {"rdzvPort": 29500}}})
    assert "spec.torchrun is immutable" in err.value.body
    with pytest.raises(ApiException) as err:
        k.patch_job("job", {"spec": {"rendezvous": {"image": "registry.example/store:2"}}})
    assert "spec.rendezvous is immutable" in err.value.body
    with pytest.raises(ApiException) as err:
        k.patch_job("job", {"spec": {"nodes": 3}})
    assert "elastic range" in err.value.body
    # Mutable: the run policy.
    k.patch_job("job", {"spec": {"runPolicy": {"activeDeadlineSeconds": 600}}})
