"""Hostile spec.template values (the CRD admits any pod template): each becomes condition Failed reason InvalidSpec
and a Warning Event whose message names the field, and nothing is created; never an exception in the pass."""

import logging

import pytest

from ddp_operator import jobs, names
from ddp_operator.pod import render_trainer_pod
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.spec import SpecError, parse_job

from fake_api import fake_reconciler
from ddp_builders import job_body

T = "spec.template"
TRAINER = f"{T}.spec.containers[trainer]"


def _trainer(**fields):
    return lambda t: t["spec"]["containers"][0].update(fields)


def _pod(**fields):
    return lambda t: t["spec"].update(fields)


def _meta(**fields):
    return lambda t: t.setdefault("metadata", {}).update(fields)


# (id, how the template is changed, the path the message must name)
HOSTILE = [
    ("resources-string", _trainer(resources="x"), f"{TRAINER}.resources"),
    ("resources-null", _trainer(resources=None), f"{TRAINER}.resources"),
    ("resources-limits-list", _trainer(resources={"limits": {"cpu": []}}), f"{TRAINER}.resources.limits[cpu]"),
    ("resources-requests-string", _trainer(resources={"requests": "1"}), f"{TRAINER}.resources.requests"),
    ("gpu-object", _trainer(resources={"limits": {"nvidia.com/gpu": {}}}),
     f"{TRAINER}.resources.limits[nvidia.com/gpu]"),
    ("ports-int", _trainer(ports=[29500]), f"{TRAINER}.ports[0]"),
    ("ports-string", _trainer(ports="29500"), f"{TRAINER}.ports"),
    ("port-string", _trainer(ports=[{"containerPort": "x"}]), f"{TRAINER}.ports[0].containerPort"),
    ("volume-mounts-string", _trainer(volumeMounts=["a"]), f"{TRAINER}.volumeMounts[0]"),
    ("volume-mount-path", _trainer(volumeMounts=[{"name": "a", "mountPath": 1}]),
     f"{TRAINER}.volumeMounts[0].mountPath"),
    ("security-context-string", _trainer(securityContext="x"), f"{TRAINER}.securityContext"),
    ("capabilities-drop-string", _trainer(securityContext={"capabilities": {"drop": "ALL"}}),
     f"{TRAINER}.securityContext.capabilities.drop"),
    ("run-as-user-string", _trainer(securityContext={"runAsUser": "0"}), f"{TRAINER}.securityContext.runAsUser"),
    ("env-int", _trainer(env=[1]), f"{TRAINER}.env[0]"),
    ("env-string", _trainer(env="A=1"), f"{TRAINER}.env"),
    ("env-name-int", _trainer(env=[{"name": 1}]), f"{TRAINER}.env[0].name"),
    ("env-value-int", _trainer(env=[{"name": "A", "value": 1}]), f"{TRAINER}.env[A].value"),
    ("image-int", _trainer(image=5), f"{TRAINER}.image"),
    ("image-pull-policy-list", _trainer(imagePullPolicy=[]), f"{TRAINER}.imagePullPolicy"),
    ("command-string", _trainer(command="torchrun"), f"{TRAINER}.command"),
    ("containers-object", _pod(containers={}), f"{T}.spec.containers"),
    ("container-string", lambda t: t["spec"]["containers"].append("sidecar"), f"{T}.spec.containers[1]"),
    ("container-name-int", lambda t: t["spec"]["containers"].append({"name": 3}), f"{T}.spec.containers[1].name"),
    ("sidecar-resources", lambda t: t["spec"]["containers"].append({"name": "side", "resources": "x"}),
     f"{T}.spec.containers[side].resources"),
    ("init-containers-string", _pod(initContainers="x"), f"{T}.spec.initContainers"),
    ("node-selector-list", _pod(nodeSelector=[]), f"{T}.spec.nodeSelector"),
    ("node-selector-value", _pod(nodeSelector={"zone": 1}), f"{T}.spec.nodeSelector[zone]"),
    ("tolerations-string", _pod(tolerations="x"), f"{T}.spec.tolerations"),
    ("tolerations-int", _pod(tolerations=[1]), f"{T}.spec.tolerations[0]"),
    ("volumes-string", _pod(volumes="x"), f"{T}.spec.volumes"),
    ("volume-int", _pod(volumes=[1]), f"{T}.spec.volumes[0]"),
    ("volume-no-name", _pod(volumes=[{"emptyDir": {}}]), f"{T}.spec.volumes[0].name"),
    ("image-pull-secrets-string", _pod(imagePullSecrets="x"), f"{T}.spec.imagePullSecrets"),
    ("pod-security-context-list", _pod(securityContext=[]), f"{T}.spec.securityContext"),
    ("automount-string", _pod(automountServiceAccountToken="yes"), f"{T}.spec.automountServiceAccountToken"),
    ("service-account-int", _pod(serviceAccountName=1), f"{T}.spec.serviceAccountName"),
    ("restart-policy-list", _pod(restartPolicy=[]), f"{T}.spec.restartPolicy"),
    ("dns-config-string", _pod(dnsConfig="x"), f"{T}.spec.dnsConfig"),
    ("affinity-string", _pod(affinity="x"), f"{T}.spec.affinity"),
    ("anti-affinity-list", _pod(affinity={"podAntiAffinity": []}), f"{T}.spec.affinity.podAntiAffinity"),
    ("anti-affinity-preferred-string", _pod(affinity={"podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": "x"}}),
     f"{T}.spec.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution"),
    ("affinity-required-int", _pod(affinity={"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [1]}}),
     f"{T}.spec.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"),
    ("node-affinity-preferred-object", _pod(affinity={"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": {}}}),
     f"{T}.spec.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution"),
    ("topology-spread-string", _pod(topologySpreadConstraints="x"), f"{T}.spec.topologySpreadConstraints"),
    ("topology-spread-int", _pod(topologySpreadConstraints=[1]), f"{T}.spec.topologySpreadConstraints[0]"),
    ("metadata-string", lambda t: t.update(metadata="x"), f"{T}.metadata"),
    ("labels-int-value", _meta(labels={"team": 1}), f"{T}.metadata.labels[team]"),
    ("annotations-list", _meta(annotations=[]), f"{T}.metadata.annotations"),
    ("template-string", lambda t: t.clear() or t.update(spec="x"), f"{T}.spec"),
]


def _reconcile(body):
    r = fake_reconciler(body)
    result = r.reconcile("ml", "mnist")  # raises on today's code for most cases
    return r.api, result


def _hostile_body(change):
    body = job_body()
    change(body["spec"]["template"])
    return body


@pytest.mark.parametrize("change, path", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_hostile_template_value_is_invalid_spec_naming_the_field(change, path):
    api, result = _reconcile(_hostile_body(change))
    status = api.patches[-1][1]
    assert (status["phase"], status["reason"]) == (names.PHASE_FAILED, names.REASON_INVALID_SPEC)
    assert status["message"].startswith(f"{path}: "), status["message"]
    failed = next(c for c in status["conditions"] if c["type"] == names.COND_FAILED)
    assert (failed["status"], failed["reason"]) == ("True", names.REASON_INVALID_SPEC)
    assert [e[1:] for e in api.events] == [("Warning", names.REASON_INVALID_SPEC, status["message"])]
    assert api.creates == [] and result.actions == ()


@pytest.mark.parametrize("change, path", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_the_parser_names_the_field(change, path):
    with pytest.raises(SpecError) as e:
        parse_job(_hostile_body(change))
    assert e.value.field == path


def test_a_valid_template_with_every_checked_field_still_parses_and_renders():
    body = job_body()
    body["spec"]["template"]["metadata"] = {"labels": {"team": "a"}, "annotations": {"note": "x"}}
    body["spec"]["template"]["spec"].update(
        nodeSelector={"zone": "a"}, tolerations=[{"key": "gpu", "operator": "Exists"}], volumes=[{"name": "data",
        "emptyDir": {}}], imagePullSecrets=[{"name": "reg"}], securityContext={"runAsNonRoot": True},
        automountServiceAccountToken=None, serviceAccountName="sa", initContainers=[{"name": "init", "image": "x"}],
        affinity=None, topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "x"}])
    body["spec"]["template"]["spec"]["containers"][0].update(
        env=[{"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        ports=[{"containerPort": 8080, "name": "http"}], volumeMounts=[{"name": "data", "mountPath": "/data"}],
        resources={"limits": {"cpu": 2, "memory": "1Gi", "nvidia.com/gpu": "1"}, "requests": {"cpu": "500m"}},
        securityContext={"runAsUser": 1000, "capabilities": {"drop": ["ALL"]}}, command=["torchrun"], args=[])
    api, result = _reconcile(body)
    assert api.patches[-1][1]["phase"] == names.PHASE_PENDING and all(e[1] == "Normal" for e in api.events)
    assert result.actions
    job = parse_job(body)
    assert render_trainer_pod(job, 0, 0)["spec"]["containers"][0]["env"][-1]["name"] == "B"
    security = render_rdzv_pod(job, 0)["spec"]["containers"][0]["securityContext"]
    assert (security["runAsUser"], security["capabilities"]["drop"]) == (1000, ["ALL"])


def test_an_unforeseen_error_in_parse_or_render_is_invalid_spec_with_a_traceback(monkeypatch, caplog):
    def broken(*_a, **_k):
        raise KeyError("surprise")

    monkeypatch.setattr(jobs, "render_trainer_pod", broken)
    with caplog.at_level(logging.ERROR, logger="ddp_operator"):
        api, result = _reconcile(job_body())
    status = api.patches[-1][1]
    assert (status["phase"], status["reason"]) == (names.PHASE_FAILED, names.REASON_INVALID_SPEC)
    assert status["message"].startswith("spec.template: ") and "KeyError" in status["message"]
    assert [e[1:] for e in api.events] == [("Warning", names.REASON_INVALID_SPEC, status["message"])]
    assert api.creates == [] and result.actions == ()
    assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)
