"""placement.py: a job's trainer pods are spread over nodes by default (ScheduleAnyway), merged into what the template
says; the template's own placement by host wins; node avoidance (plan/avoid.py) is added beside it, clobbering
nothing."""

from __future__ import annotations

import copy

import pytest

from ddp_operator import names
from ddp_operator.placement import default_spread, placed_by_template
from ddp_operator.plan import CREATE, plan
from ddp_operator.plan.avoid import kept_off
from ddp_operator.pod import render_trainer_pod
from ddp_operator.spec import parse_job

from ddp_builders import NOW, job_body, make_job, observed

HOST = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"
DEFAULT = {"maxSkew": 1, "topologyKey": HOST, "whenUnsatisfiable": "ScheduleAnyway",
           "labelSelector": {"matchLabels": {names.LABEL_JOB_NAME: "mnist", names.LABEL_ROLE: names.ROLE_TRAINER}},
           "nodeTaintsPolicy": "Honor"}


def _job(**pod_spec):
    body = job_body()
    template = body["spec"]["template"]
    annotations = pod_spec.pop("annotations", None)
    if annotations is not None:
        template["metadata"] = {"annotations": annotations}
    template["spec"].update(copy.deepcopy(pod_spec))
    return parse_job(body)


def _anti(kind, key, required=False):
    term = {"topologyKey": key, "labelSelector": {"matchLabels": {"app": "x"}}}
    if required:
        return {kind: {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {kind: {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "podAffinityTerm": term}]}}


def test_trainer_pods_are_spread_over_nodes_by_default():
    job = make_job()
    assert default_spread(job) == DEFAULT
    for index in (0, 1):
        spec = render_trainer_pod(job, index, 0)["spec"]
        assert spec["topologySpreadConstraints"] == [DEFAULT]
        assert "affinity" not in spec  # a spread, not an affinity: nothing of the template's affinity is touched


def test_the_templates_other_constraints_are_kept_and_ours_appended():
    zone = {"maxSkew": 2, "topologyKey": ZONE, "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"team": "a"}}}
    spec = render_trainer_pod(_job(topologySpreadConstraints=[zone], affinity=_anti("podAntiAffinity", ZONE)), 0, 0)[
        "spec"]
    assert spec["topologySpreadConstraints"] == [zone, DEFAULT]
    assert spec["affinity"] == _anti("podAntiAffinity", ZONE)  # another key: the template's, untouched


@pytest.mark.parametrize("pod_spec", [
    {"topologySpreadConstraints": [{"maxSkew": 3, "topologyKey": HOST, "whenUnsatisfiable": "DoNotSchedule"}]},
    {"affinity": _anti("podAntiAffinity", HOST)},
    {"affinity": _anti("podAntiAffinity", HOST, required=True)},
    {"affinity": _anti("podAffinity", HOST)},  # packing pods onto hosts is a decision too
    {"annotations": {names.SPREAD_ANNOTATION: "false"}},
    {"annotations": {names.SPREAD_ANNOTATION: "False"}},
], ids=["own-spread-on-host", "preferred-anti-affinity", "required-anti-affinity", "affinity", "switched-off",
        "switched-off-capitalised"])
def test_a_template_that_places_its_pods_by_host_gets_nothing_added(pod_spec):
    job = _job(**pod_spec)
    rendered = render_trainer_pod(job, 0, 0)["spec"]
    template = job.spec.template["spec"]
    assert rendered.get("topologySpreadConstraints") == template.get("topologySpreadConstraints")
    assert rendered.get("affinity") == template.get("affinity")


def test_hostile_placement_fields_are_read_without_raising():
    # spec.py rejects these before any render (template.py); the reader alone never raises on them either.
    for spec in ({"affinity": "x"}, {"affinity": {"podAntiAffinity": []}}, {"topologySpreadConstraints": [1, "x"]},
                 {"affinity": {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [1, {}]}}}):
        assert placed_by_template(spec, {}) is False
    assert placed_by_template({}, {names.SPREAD_ANNOTATION: "true"}) is False


def test_avoidance_is_added_beside_the_templates_affinity_and_the_spread():
    """The template's node affinity (required and preferred) and pod anti-affinity stay; avoidance appends its
    preference; the default spread stays."""
    own = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 5, "preference": {"matchExpressions": [{"key": "fast", "operator": "Exists"}]}}]},
        **_anti("podAntiAffinity", ZONE)}
    job = _job(affinity=own)
    pod = render_trainer_pod(job, 1, 0)
    avoided = kept_off(pod, ["bad-node"])
    affinity = avoided["spec"]["affinity"]
    assert affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == \
        own["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
        own["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0],
        {"weight": 100, "preference": {"matchFields": [
            {"key": "metadata.name", "operator": "NotIn", "values": ["bad-node"]}]}}]
    assert affinity["podAntiAffinity"] == own["podAntiAffinity"]
    assert avoided["spec"]["topologySpreadConstraints"] == [DEFAULT]
    assert pod["spec"]["affinity"] == own  # kept_off works on a copy
    # A template whose affinity is null: avoidance still adds its preference.
    null = kept_off(render_trainer_pod(_job(affinity=None), 0, 0), ["bad-node"])
    assert len(null["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]) == 1


def test_every_pod_a_fresh_job_creates_is_spread_and_the_store_is_not_counted():
    p = plan(make_job(), {}, observed(service_exists=False), NOW)
    pods = {a.name: a.body for a in p.actions if a.verb == CREATE and a.kind == "Pod"}
    assert [pods[n]["spec"]["topologySpreadConstraints"] for n in ("mnist-0", "mnist-1")] == [[DEFAULT], [DEFAULT]]
    # The store's pod is not a trainer: the constraint's selector does not count it, and it gets none itself.
    assert pods["mnist-rdzv"]["metadata"]["labels"][names.LABEL_ROLE] == names.ROLE_RDZV
    assert "topologySpreadConstraints" not in pods["mnist-rdzv"]["spec"]
