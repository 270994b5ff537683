"""spec.rendezvous and the store pod it renders: the store image (the job's, else the operator's --store-image) with its
own entrypoint, IfNotPresent, requests and limits merged per resource with the defaults; quantities, resource names,
requests above limits and image references checked, each bad value a SpecError naming the field (condition InvalidSpec
and a Warning Event, never an exception in a pass); the CRD admits the same forms."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest

from ddp_operator import crd, names
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.rdzv_spec import DEFAULT_STORE_IMAGE, quantity
from ddp_operator.spec import SpecError, parse_job

from ddp_builders import job_body
from fake_api import FakeApi, fake_reconciler

DEFAULTS = crd.DEFAULTS["rendezvous"]["resources"]


def _store(rendezvous=None, **spec):
    body = job_body(**spec) if rendezvous is None else job_body(rendezvous=rendezvous, **spec)
    return render_rdzv_pod(parse_job(body), 0)["spec"]["containers"][0]


def test_the_store_runs_its_own_image_with_its_entrypoint_requests_and_limits():
    c = _store()
    assert c["image"] == DEFAULT_STORE_IMAGE == "localhost/ddp-store:0.1.0"
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert "command" not in c and "args" not in c  # the store image's ENTRYPOINT
    assert {"name": names.ENV_RDZV_PORT, "value": "29400"} in c["env"]
    assert c["resources"] == DEFAULTS and set(c["resources"]["limits"]) == {"cpu", "memory"}
    assert c["readinessProbe"] == {"tcpSocket": {"port": 29400}, "periodSeconds": 2}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # the trainer's image and pull policy are not the store's
    template = job_body()["spec"]["template"]
    template["spec"]["containers"][0]["imagePullPolicy"] = "Never"
    assert _store(template=template)["imagePullPolicy"] == "IfNotPresent"


def test_the_jobs_image_else_the_operators():
    assert _store({"image": "registry.example/team/store:2@sha256:" + "a" * 64})["image"].startswith(
        "registry.example/team/store:2@sha256:")
    from ddp_operator.reconciler import Config, Reconciler

    body = job_body()
    index = {"ddpjobs_by_key": {("ml", "mnist"): [body]}, "pods_by_job": {}, "services_by_job": {}}
    r = Reconciler(FakeApi(index), Config(store_image="mirror.example/ddp-store:0.1.0"))
    r.indexes = index
    r.reconcile("ml", "mnist")
    store = next(p for p in index["pods_by_job"][("ml", "mnist")]
                 if p["metadata"]["labels"][names.LABEL_ROLE] == names.ROLE_RDZV)
    assert store["spec"]["containers"][0]["image"] == "mirror.example/ddp-store:0.1.0"


def test_the_operator_reads_its_store_image_from_a_flag_or_the_environment(monkeypatch):
    from ddp_operator.__main__ import parse_args

    monkeypatch.delenv(names.ENV_STORE_IMAGE, raising=False)
    assert parse_args([]).store_image == DEFAULT_STORE_IMAGE
    monkeypatch.setenv(names.ENV_STORE_IMAGE, "registry.example/ddp-store:1.2")
    assert parse_args([]).store_image == "registry.example/ddp-store:1.2"
    assert parse_args(["--store-image", "other.example/s:3"]).store_image == "other.example/s:3"
    with pytest.raises(SystemExit):
        parse_args(["--store-image", "not an image"])


@pytest.mark.parametrize("given, expected", [
    ({}, DEFAULTS),
    # a resource named replaces the default's, the others stay
    ({"limits": {"memory": "512Mi"}}, {"requests": DEFAULTS["requests"], "limits": {"cpu": "1", "memory": "512Mi"}}),
    ({"requests": {"cpu": "500m", "ephemeral-storage": "1Gi"}, "limits": {"cpu": 2, "ephemeral-storage": "2Gi"}},
     {"requests": {"cpu": "500m", "memory": "64Mi", "ephemeral-storage": "1Gi"},
      "limits": {"cpu": 2, "memory": "256Mi", "ephemeral-storage": "2Gi"}}),
    # a defaulted request above the job's limit is lowered to it; a defaulted limit below its request raised to it
    ({"limits": {"memory": "32Mi", "cpu": "5m"}}, {"requests": {"cpu": "5m", "memory": "32Mi"},
                                                   "limits": {"cpu": "5m", "memory": "32Mi"}}),
    ({"requests": {"memory": "1Gi", "cpu": "1500m"}}, {"requests": {"cpu": "1500m", "memory": "1Gi"},
                                                       "limits": {"cpu": "1500m", "memory": "1Gi"}}),
    ({"requests": {"memory": "1e8"}, "limits": {"memory": "100M"}},  # equal: allowed
     {"requests": {"cpu": "10m", "memory": "1e8"}, "limits": {"cpu": "1", "memory": "100M"}}),
])
def test_resources_merge_per_resource_with_the_defaults(given, expected):
    assert _store({"resources": given})["resources"] == expected


@pytest.mark.parametrize("rendezvous, path", [
    ({"image": "has space:1"}, "spec.rendezvous.image"),
    ({"image": "UPPER/Case"}, "spec.rendezvous.image"),
    ({"image": 7}, "spec.rendezvous.image"),
    ("store", "spec.rendezvous"),
    ({"resources": []}, "spec.rendezvous.resources"),
    ({"resources": {"limits": "1"}}, "spec.rendezvous.resources.limits"),
    ({"resources": {"limits": {"memory": "lots"}}}, "spec.rendezvous.resources.limits.memory"),
    ({"resources": {"requests": {"cpu": "-1"}}}, "spec.rendezvous.resources.requests.cpu"),
    ({"resources": {"requests": {"cpu": True}}}, "spec.rendezvous.resources.requests.cpu"),
    ({"resources": {"limits": {"nvidia.com/gpu": "1"}}}, "spec.rendezvous.resources.limits.nvidia.com/gpu"),
    ({"resources": {"limits": {"cpu": "0"}}}, "spec.rendezvous.resources.limits.cpu"),
    ({"resources": {"requests": {"memory": "300Mi"}, "limits": {"memory": "256Mi"}}},
     "spec.rendezvous.resources.requests.memory"),
    ({"resources": {"requests": {"cpu": "1.5"}, "limits": {"cpu": "1200m"}}}, "spec.rendezvous.resources.requests.cpu"),
])
def test_a_bad_value_is_a_spec_error_naming_the_field_and_an_invalid_spec_condition(rendezvous, path):
    body = job_body(rendezvous=rendezvous)
    with pytest.raises(SpecError) as e:
        parse_job(body)
    assert e.value.field == path, e.value
    r = fake_reconciler(body)
    r.reconcile("ml", "mnist")
    status = r.api.patches[-1][1]
    assert (status["phase"], status["reason"]) == (names.PHASE_FAILED, names.REASON_INVALID_SPEC)
    assert status["message"].startswith(f"{path}: ")
    assert [e[1:] for e in r.api.events] == [("Warning", names.REASON_INVALID_SPEC, status["message"])]
    assert r.api.creates == []


@pytest.mark.parametrize("text, value", [
    ("50m", Decimal("0.05")), ("1", Decimal(1)), (2, Decimal(2)), ("64Mi", Decimal(64 * 2 ** 20)),
    ("1.5Gi", Decimal(3 * 2 ** 29)), ("1e3", Decimal(1000)), ("100M", Decimal(10 ** 8)), (".5", Decimal("0.5")),
    ("+3k", Decimal(3000)), ("-1", None), ("1Qi", None), ("", None), (None, None), (1.5, None), ("1 Gi", None),
])
def test_quantities_are_read_as_kubernetes_reads_them(text, value):
    assert quantity(text) == value


def test_the_crd_admits_the_same_forms():
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rendezvous = schema["properties"]["rendezvous"]["properties"]
    image = rendezvous["image"]["pattern"]
    assert re.match(image, DEFAULT_STORE_IMAGE) and not re.match(image, "has space:1")
    limits = rendezvous["resources"]["properties"]["limits"]
    pattern = limits["additionalProperties"]["pattern"]
    assert all(re.match(pattern, q) for q in ("50m", "1", "64Mi", "1e3")) and not re.match(pattern, "-1")
    assert limits["x-kubernetes-validations"][0]["rule"] == "self.all(k, k in ['cpu', 'memory', 'ephemeral-storage'])"
    assert any(r.get("fieldPath") == ".rendezvous" and "oldSelf.rendezvous" in r["rule"]
               for r in schema["x-kubernetes-validations"]), "spec.rendezvous must be immutable"
