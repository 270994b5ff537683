"""Whole-object golden YAML for every child the operator creates (tests/unit/golden/*.yaml).

Regenerate after an intended change with `UPDATE_GOLDEN=1 pytest tests/unit/test_render.py` and review the diff.
"""

import os
import pathlib

import pytest
import yaml

from ddp_operator import names
from ddp_operator.pod import render_trainer_pod
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.netpol import NetworkPolicyConfig, render_network_policy
from ddp_operator.service import render_service
from ddp_operator.spec import parse_job

from ddp_builders import job_body, make_job

GOLDEN = pathlib.Path(__file__).parent / "golden"


def _full_job():
    body = job_body(
        nodes=3, minNodes=2, maxNodes=4, nprocPerNode="auto",
        torchrun={"rdzvPort": 29500, "extraArgs": ["--log-dir=/tmp/torchrun", "--redirects=3", "--no-python"]},
        shm={"sizeLimit": "2Gi"},
        checkpoint={"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}, "mountPath": "/ckpt"},
    )
    spec = body["spec"]["template"]
    spec["metadata"] = {"labels": {"team": "vision"}, "annotations": {"note": "golden"}}
    spec["spec"]["nodeSelector"] = {"pool": "gpu"}
    spec["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    container = spec["spec"]["containers"][0]
    container["imagePullPolicy"] = "IfNotPresent"
    container["resources"] = {"limits": {"nvidia.com/gpu": 2, "cpu": "8"}}
    container["env"] = [{"name": "OMP_NUM_THREADS", "value": "2"}, {"name": "HF_HOME", "value": "/cache"}]
    spec["spec"]["containers"].append({"name": "sidecar", "image": "busybox:1.36"})
    # A hardened template: the store pod must come out as hardened as the trainers.
    spec["spec"]["automountServiceAccountToken"] = True
    spec["spec"]["runtimeClassName"] = "gvisor"
    spec["spec"]["hostUsers"] = False
    spec["spec"]["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000,
                                       "seccompProfile": {"type": "RuntimeDefault"}}
    container["securityContext"] = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    return parse_job(body)


CASES = {
    "trainer-pod-default": lambda: render_trainer_pod(make_job(), 0, 0),
    "trainer-pod-full": lambda: render_trainer_pod(_full_job(), 2, 1),
    "rdzv-pod-default": lambda: render_rdzv_pod(make_job(), 0),
    "rdzv-pod-full": lambda: render_rdzv_pod(_full_job(), 1),
    "service-default": lambda: render_service(make_job()),
    "networkpolicy-default": lambda: render_network_policy(make_job(), NetworkPolicyConfig(
        operator_namespace="ddp-system",
        operator_labels=(("app.kubernetes.io/instance", "ddp-operator"), ("app.kubernetes.io/name", "ddp-operator")))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case):
    rendered = yaml.safe_dump(CASES[case](), sort_keys=False, width=120)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(rendered)
    assert rendered == path.read_text(), f"{path} differs; UPDATE_GOLDEN=1 to accept"


def test_pod_names_hostname_and_subdomain():
    pod = render_trainer_pod(make_job(), 1, 0)
    assert pod["metadata"]["name"] == "mnist-1"
    assert pod["spec"]["hostname"] == "mnist-1" and pod["spec"]["subdomain"] == "mnist"
    assert pod["spec"]["restartPolicy"] == "OnFailure"


def test_template_restart_policy_never_is_kept():
    """Never opts out of in-place restarts: every container failure ends the pod, which the operator replaces."""
    job = make_job(template={"spec": {"restartPolicy": "Never", "containers": [
        {"name": "trainer", "image": "x", "command": ["torchrun", "t.py"]}]}})
    assert render_trainer_pod(job, 0, 0)["spec"]["restartPolicy"] == "Never"


def test_user_shm_mount_is_kept():
    body = job_body()
    c = body["spec"]["template"]["spec"]
    c["containers"][0]["volumeMounts"] = [{"name": "myshm", "mountPath": "/dev/shm"}]
    c["volumes"] = [{"name": "myshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}]
    pod = render_trainer_pod(parse_job(body), 0, 0)
    assert [v["name"] for v in pod["spec"]["volumes"] if v["name"] != names.DIAGNOSTICS_VOLUME] == ["myshm"]


def test_rendering_does_not_mutate_the_spec():
    job = _full_job()
    before = yaml.safe_dump(dict(job.spec.template))
    render_trainer_pod(job, 0, 0)
    render_rdzv_pod(job, 0)
    assert yaml.safe_dump(dict(job.spec.template)) == before


def test_user_cpu_request_is_kept():
    body = job_body()
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "2"}}
    pod = render_trainer_pod(parse_job(body), 0, 0)
    assert pod["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "2"}}


def test_service_is_headless_and_publishes_not_ready():
    svc = render_service(make_job())
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {names.LABEL_JOB_NAME: "mnist"}
