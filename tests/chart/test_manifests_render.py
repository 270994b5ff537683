"""manifests/ without a cluster: kustomize renders, the base matches the chart, samples fit the CRD."""

from __future__ import annotations

import jsonschema
import pytest
import yaml

from tests.chart.conftest import MANIFESTS, SAMPLES, by_kind, documents, one, operator_role, user_roles

CRD_FILE = MANIFESTS / "base" / "crd.yaml"


def test_kustomize_renders_the_whole_install(kustomize):
    objs = kustomize(MANIFESTS)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                     "Deployment",
                     "Namespace", "Service", "ServiceAccount", "ValidatingAdmissionPolicy",
                     "ValidatingAdmissionPolicyBinding"]
    for o in objs:
        if o["kind"] not in {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                             *ADMISSION_KINDS}:
            assert o["metadata"]["namespace"] == "ddp-system", o["metadata"]
    assert one(objs, "CustomResourceDefinition")["metadata"]["name"] == "ddpjobs.ddp.dev"


# Cluster-scoped, but not in the schema kustomize knows: its `namespace:` sets one on them, which the API server
# drops (metadata.namespace of a cluster-scoped object is cleared on create).
ADMISSION_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def _strip(obj):
    """Drop what legitimately differs between Helm and kustomize output (labels, annotations)."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in {"labels", "annotations"}}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def test_base_matches_the_chart_defaults(kustomize, render):
    """The raw manifests are the chart with default values: RBAC rules and the Pod spec agree."""
    base = kustomize(MANIFESTS / "base")
    chart = render(release="ddp-operator", namespace="ddp-system")
    assert _strip(operator_role(base)["rules"]) == _strip(operator_role(chart)["rules"])
    # The users' roles (aggregated into admin/edit and view): the chart's, named after the default release.
    assert {r["metadata"]["name"]: _strip(r) for r in user_roles(base)} == {
        r["metadata"]["name"]: _strip(r) for r in user_roles(chart)}
    base_pod = one(base, "Deployment")["spec"]["template"]["spec"]
    chart_pod = one(chart, "Deployment")["spec"]["template"]["spec"]
    chart_pod.pop("automountServiceAccountToken", None)
    assert _strip(base_pod) == _strip(chart_pod)
    assert one(base, "Deployment")["spec"]["strategy"] == one(chart, "Deployment")["spec"]["strategy"]
    assert _strip(one(base, "Service")["spec"]) == _strip(one(chart, "Service")["spec"])
    # The admission policy that keeps the job labels to the operator: the same rule, for the same ServiceAccount.
    for kind in ADMISSION_KINDS:
        ours = one(base, kind)
        ours["metadata"].pop("namespace", None)
        assert _strip(ours) == _strip(one(chart, kind)), kind


def test_chart_crd_is_the_generated_one(render):
    """The chart installs the CRD of manifests/ (templates/crd.yaml, so `helm upgrade` updates it), kept by
    `helm uninstall`; a second release leaves it out (crds.enabled=false)."""
    chart_crd = one(render(), "CustomResourceDefinition")
    assert chart_crd["metadata"]["annotations"].pop("helm.sh/resource-policy") == "keep"
    if not chart_crd["metadata"]["annotations"]:
        del chart_crd["metadata"]["annotations"]
    assert chart_crd == yaml.safe_load(CRD_FILE.read_text()), "run `make generate`"
    assert by_kind(render("--set", "crds.enabled=false"), "CustomResourceDefinition") == []


def _ddpjob_schema() -> dict:
    crd = yaml.safe_load(CRD_FILE.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
    return version["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_sample_fits_the_crd_schema(sample):
    """Structural check against the CRD's OpenAPI schema (CEL rules are checked by the API server)."""
    jobs = [d for d in documents(sample.read_text()) if d["kind"] == "DDPJob"]
    assert len(jobs) == 1
    job = jobs[0]
    jsonschema.validate(job, _ddpjob_schema())
    containers = job["spec"]["template"]["spec"]["containers"]
    trainer = next(c for c in containers if c["name"] == "trainer")
    # torchrun itself, or the same torchrun tuned for fast recovery (trainer/ddp_trainer/launch.py)
    assert trainer["command"][0] == "torchrun" or trainer["command"][:3] == ["python", "-m", "ddp_trainer.launch"]
    assert trainer["image"] == "localhost/ddp-trainer:0.1.0"
    assert trainer["imagePullPolicy"] == "IfNotPresent"


def test_samples_cover_the_documented_cases():
    jobs = {p.stem: next(d for d in documents(p.read_text()) if d["kind"] == "DDPJob") for p in SAMPLES}
    assert set(jobs) == {"digits", "elastic", "gpu", "plain-script", "spares"}
    assert jobs["digits"]["spec"]["nodes"] == 2
    assert jobs["digits"]["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "python", "-m", "ddp_trainer.launch", "-m", "ddp_trainer.examples.digits"]
    e = jobs["elastic"]["spec"]
    assert (e["minNodes"], e["nodes"], e["maxNodes"]) == (1, 2, 3)
    sp = jobs["spares"]["spec"]
    assert (sp["nodes"], sp["spares"]) == (2, 1) and "minNodes" not in sp and "maxNodes" not in sp
    assert sp["template"] == jobs["digits"]["spec"]["template"]
    g = jobs["gpu"]["spec"]
    assert g["nprocPerNode"] == "auto"
    assert g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] >= 1
    plain = documents((MANIFESTS / "samples" / "plain-script.yaml").read_text())
    script = one(plain, "ConfigMap")["data"]["train.py"]
    assert "ddp_trainer" not in script
    compile(script, "train.py", "exec")
    assert by_kind(plain, "DDPJob")[0]["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "torchrun", "/scripts/train.py"]
