"""`make release` against a real registry, then both ways a user installs a release, on the embedded cluster.

hack/registry.py runs CNCF Distribution's registry on 127.0.0.1 (the cluster's containerd pulls from it over plain
HTTP); `make release VERSION=<unique>` builds the images (buildah's layer cache: seconds once stage 1 built them),
pushes them and the chart there, and writes dist/<version>/manifests.yaml. Then (a) `helm install oci://...` of the
chart and (b) `kubectl apply --server-side -f manifests.yaml` each install an operator that runs a small DDPJob to
Succeeded, and every container of it, the operator's, the trainer's and the rendezvous store's, runs an image pulled
from that registry at the digest pushed (the pod's imageID names the registry).

Each install watches one namespace of its own, ddp-rel-* (tests/support/suite.py: the shared e2e operator excludes
them; any other operator that would handle it is paused meanwhile) and leaves the cluster-wide CRD to the release
that carries it: (a) with crds.enabled=false, (b) with the CRD of manifests.yaml applied as a server-side dry run
only. Both are cluster tests of the chart tier, stage 3a of `make test`, where no other operator runs: a second
operator and its admission policy must never be installed beside the e2e tier.

Each test prints what its parts took; the release's own figures are in dist/<version>/release.json.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess

import pytest
import yaml

from tests.chart.conftest import REPO, REPOSITORY, _timed, documents
from tests.support.kube import create_test_namespace, dump_namespace, foreign_operators_paused_in, wait_crd_established
from tests.support.suite import RELEASE_NS_PREFIX
from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster

JOB = """
apiVersion: ddp.dev/v1alpha1
kind: DDPJob
metadata:
  name: {name}
spec:
  nodes: 1
  runPolicy:
    cleanPodPolicy: None  # the pods stay, for their images to be read
  template:
    spec:
      containers:
        - name: trainer
          image: {image}
          imagePullPolicy: Always  # resolved at the registry, whatever this node holds
          command: [python3, -c, "print('released job ran')"]
          resources:
            requests: {{cpu: 10m, memory: 64Mi}}
"""


@pytest.fixture(scope="module")
def crd(released, kubectl) -> dict:
    """The release's CRD (from its manifests.yaml); applied only where the cluster has none yet (this test run
    alone on a fresh cluster): else it belongs to the release that carries it, and is left alone."""
    record, _ = released
    crd = next(d for d in documents(open(record["manifests"]).read()) if d["kind"] == "CustomResourceDefinition")
    if kubectl("get", "crd", crd["metadata"]["name"], check=False).returncode != 0:
        kubectl("apply", "--server-side", "--field-manager=ddp-release-test", "-f", "-", input=yaml.safe_dump(crd))
        wait_crd_established(kubectl, crd["metadata"]["name"])
    return crd


@pytest.fixture
def release_ns(kubectl, crd):
    """A namespace of the release's own (ddp-rel-*), with every other operator that would handle it paused."""
    ns = create_test_namespace(kubectl, f"{RELEASE_NS_PREFIX}{secrets.token_hex(3)}")
    try:
        with foreign_operators_paused_in(kubectl, ns):
            yield ns
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


def _from_registry(kubectl, namespace: str, selector: str, registry: str, digests: dict[str, str]) -> list[str]:
    """Every container of the pods matching `selector` (init containers too): its image names the registry, and the
    image it runs was pulled from there at the digest pushed (status.containerStatuses[].imageID). Returns
    "pod/container" of each."""
    seen = []
    for pod in kubectl.json("get", "pods", "-n", namespace, "-l", selector)["items"]:
        status = pod["status"]
        statuses = {s["name"]: s for s in status.get("containerStatuses", []) + status.get("initContainerStatuses", [])}
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            where = f"{pod['metadata']['name']}/{c['name']}"
            assert c["image"].startswith(f"{registry}/"), f"{where} runs {c['image']}, not an image of {registry}"
            name = c["image"][len(registry) + 1:].split(":")[0].split("@")[0]
            # Pulled from the registry at the pushed digest. (Where this node pulled the same image from the registry
            # at an earlier port, the kubelet may name that one: the same repository and digest, on the loopback.)
            image_id = statuses[c["name"]]["imageID"]
            assert image_id == f"{registry}/{name}@{digests[name]}" or re.fullmatch(
                rf"127\.0\.0\.1:\d+/{REPOSITORY}/{name}@{digests[name]}", image_id), f"{where} ran {image_id}"
            seen.append(where)
    return seen


def _run_job(kubectl, namespace: str, record: dict, registry: str) -> list[str]:
    """A one-pod DDPJob on the release's trainer image, to Succeeded; the containers of its pods, checked."""
    trainer = record["images"]["trainer"]["ref"]
    kubectl("apply", "-n", namespace, "-f", "-", input=JOB.format(name="released", image=trainer))

    def succeeded():
        phase = kubectl.json("get", "ddpj", "released", "-n", namespace).get("status", {}).get("phase")
        assert phase != "Failed", f"the job failed:\n{dump_namespace(kubectl, namespace)}"
        return phase == "Succeeded"
    wait_for(succeeded, 180, "the released job to succeed", fatal=AssertionError)
    digests = {f"ddp-{n}": i["digest"] for n, i in record["images"].items()}
    seen = _from_registry(kubectl, namespace, "ddp.dev/job-name=released", registry, digests)
    roles = {p["metadata"]["labels"].get("ddp.dev/role") for p in
             kubectl.json("get", "pods", "-n", namespace, "-l", "ddp.dev/job-name=released")["items"]}
    assert roles == {"trainer", "rdzv"}, roles  # the trainer's pod and the rendezvous store's
    return seen


def _operator_checked(kubectl, namespace: str, record: dict, registry: str) -> list[str]:
    digests = {f"ddp-{n}": i["digest"] for n, i in record["images"].items()}
    return _from_registry(kubectl, namespace, "app.kubernetes.io/name=ddp-operator", registry, digests)


def test_helm_install_from_the_registry_runs_a_job_on_the_released_images(released, release_ns, kubectl, helm):
    record, registry = released
    release, times = f"rel-{secrets.token_hex(3)}", {}
    try:
        installed = _timed(times, "helm install", helm, "install", release, record["chart"]["ref"], "--version",
               record["version"], "--plain-http", "-n", release_ns, "--set", f"watch.namespaces={{{release_ns}}}",
               "--set", "rbac.scope=namespace", "--set", "crds.enabled=false", "--wait", "--timeout", "180s")
        # The install notes' sample job runs the release's trainer image, not a locally built one.
        assert f"image: {record['images']['trainer']['ref']}\n" in installed.stdout, installed.stdout
        operator = _operator_checked(kubectl, release_ns, record, registry)
        job = _timed(times, "job", _run_job, kubectl, release_ns, record, registry)
        print(f"helm install of {record['chart']['ref']} {record['version']}: {json.dumps(times)}; "
              f"from the registry: {operator + job}")
    except AssertionError:
        print(dump_namespace(kubectl, release_ns))
        raise
    finally:
        helm("uninstall", release, "-n", release_ns, "--wait", "--timeout", "120s", check=False)


def _scoped(text: str, ns: str) -> tuple[list[dict], dict]:
    """manifests.yaml moved into namespace `ns` and scoped to it (the operator watches `ns` only, its admission
    policy binds there only, its cluster-scoped objects are named for `ns`): (the objects to apply, the CRD)."""
    docs = documents(text.replace("ddp-system", ns))
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition")
    objs = [d for d in docs if d["kind"] not in ("Namespace", "CustomResourceDefinition")]
    for o in objs:
        if o["kind"] in ("ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                         "ValidatingAdmissionPolicyBinding"):
            o["metadata"]["name"] += f"-{ns}"
        if o["kind"] == "ClusterRoleBinding":
            o["roleRef"]["name"] += f"-{ns}"
        if o["kind"] == "ValidatingAdmissionPolicyBinding":
            o["spec"]["policyName"] += f"-{ns}"
            o["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
        if o["kind"] == "Deployment":
            o["spec"]["template"]["spec"]["containers"][0]["args"].insert(0, f"--namespace={ns}")
    return objs, crd


def test_manifests_yaml_installs_the_same_operator(released, release_ns, kubectl):
    record, registry = released
    text = open(record["manifests"]).read()
    kinds = [d["kind"] for d in documents(text)]
    assert kinds[:3] == ["Namespace", "ServiceAccount", "CustomResourceDefinition"] and "Deployment" in kinds, kinds
    objs, scoped_crd = _scoped(text, release_ns)
    times: dict[str, float] = {}
    applied = yaml.safe_dump_all(objs)
    try:
        kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=yaml.safe_dump(scoped_crd))
        _timed(times, "kubectl apply", kubectl, "apply", "--server-side", "--field-manager=ddp-release-test", "-f", "-",
               input=applied)
        _timed(times, "rollout", kubectl, "rollout", "status", "deployment/ddp-operator", "-n", release_ns,
               "--timeout=180s", timeout=200)
        operator = _operator_checked(kubectl, release_ns, record, registry)
        job = _timed(times, "job", _run_job, kubectl, release_ns, record, registry)
        print(f"kubectl apply of {record['manifests']}: {json.dumps(times)}; from the registry: {operator + job}")
    except AssertionError:
        print(dump_namespace(kubectl, release_ns))
        raise
    finally:
        kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=applied, check=False)


def test_the_release_refuses_its_own_version_again(released):
    """A release is immutable: the same version again is refused before anything is built."""
    record, registry = released
    p = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "hack/release.py", record["version"], "--registry",
                        registry], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 1 and "already in the registry: a release is immutable" in p.stderr, p.stderr
    assert "STEP" not in p.stderr  # nothing was built
