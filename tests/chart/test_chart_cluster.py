"""The chart and manifests on a real API server (Kubernetes 1.34): server-side dry runs of everything we
render, the samples against the installed CRD (CEL rules included), and a real install -> job -> upgrade
-> uninstall of the chart with the operator running as a Pod."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import yaml

from tests.chart.conftest import CHART, KUBE_VERSION, MANIFESTS, SAMPLES, VALUES_ALL, documents

pytestmark = pytest.mark.cluster

def _dump(objs: list[dict]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=False)


def _served(kubectl, api_version: str) -> bool:
    return api_version in kubectl("api-versions").stdout.split()


def _server_dry_run(kubectl, objs: list[dict], namespace: str) -> str:
    return kubectl("apply", "--dry-run=server", "--server-side", "--force-conflicts", "--field-manager=chart-test",
              "-n", namespace, "-f", "-", input=_dump(objs)).stdout


@pytest.mark.parametrize("values", [None, VALUES_ALL], ids=["defaults", "all-options"])
def test_rendered_chart_is_valid_on_the_server(kubectl, render, namespace, values, crd_installed):
    args = ["--set", f"watch.namespaces={{{namespace}}}"] if values else []
    if values:
        args = ["--values", str(values), *args]
    objs = render(*args, release="chart-test", namespace=namespace, include_crds=True)
    # A ServiceMonitor needs prometheus-operator's CRDs; validate it only where they are served.
    skipped = [o for o in objs if o["apiVersion"] == "monitoring.coreos.com/v1" and not _served(kubectl, o["apiVersion"])]
    objs = [o for o in objs if o not in skipped]
    out = _server_dry_run(kubectl, objs, namespace)
    for o in objs:
        assert o["metadata"]["name"] in out, f"{o['kind']}/{o['metadata']['name']} missing from:\n{out}"
    if values:
        assert [o["kind"] for o in skipped] in ([], ["ServiceMonitor"])


def test_kustomize_install_is_valid_on_the_server(kubectl, kustomize, namespace, crd_installed):
    """manifests/ as `kubectl apply -k` would install it (moved into the test namespace: a dry run
    cannot create ddp-system and then objects inside it). The Namespace itself is applied, not
    created: `make demo` may already have made ddp-system on this cluster."""
    objs = kustomize(MANIFESTS)
    _server_dry_run(kubectl, [o for o in objs if o["kind"] == "Namespace"], namespace)
    objs = [o for o in objs if o["kind"] != "Namespace"]
    for o in objs:
        if o["metadata"].get("namespace") == "ddp-system":
            o["metadata"]["namespace"] = namespace
        for subject in o.get("subjects", []):
            subject["namespace"] = namespace
        if o["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            o["metadata"]["name"] = f"{o['metadata']['name']}-{namespace}"
        if o["kind"] == "ClusterRoleBinding":
            o["roleRef"]["name"] = f"{o['roleRef']['name']}-{namespace}"
    _server_dry_run(kubectl, objs, namespace)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_sample_is_accepted_by_the_api_server(kubectl, namespace, sample, crd_installed):
    """Dry-run create: structural schema, defaults and every CEL rule of the CRD apply to the sample."""
    out = kubectl("create", "--dry-run=server", "-n", namespace, "-o", "yaml", "-f", str(sample)).stdout
    job = next(i for i in documents(out) if i["kind"] == "DDPJob")
    # server-side defaults were applied: the sample is what the operator will see
    assert "torchrun" in job["spec"] and "failurePolicy" in job["spec"]


def test_invalid_sample_is_rejected_with_the_field_named(kubectl, namespace, crd_installed):
    job = next(d for d in documents(SAMPLES[0].read_text()) if d["kind"] == "DDPJob")
    job["spec"].update(minNodes=3, nodes=2, maxNodes=4)
    proc = kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-", input=_dump([job]), check=False)
    assert proc.returncode != 0
    assert "minNodes" in proc.stderr, proc.stderr


# --- helm install -> a job -> helm upgrade -> helm uninstall ------------------------------------------
TINY_JOB = """
apiVersion: ddp.dev/v1alpha1
kind: DDPJob
metadata:
  name: {name}
spec:
  nodes: 1
  template:
    spec:
      containers:
        - name: trainer
          image: localhost/ddp-trainer:0.1.0
          imagePullPolicy: IfNotPresent
          command: [python3, -c, "print('tiny job ran')"]
          resources:
            requests: {{cpu: 10m, memory: 64Mi}}
"""


def _wait_phase(kubectl, namespace: str, name: str, phase: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    job: dict = {}
    while time.monotonic() < deadline:
        job = json.loads(kubectl("get", "ddpj", name, "-n", namespace, "-o", "json").stdout)
        current = job.get("status", {}).get("phase")
        if current == phase:
            return job
        assert current != "Failed", f"{name} failed: {job.get('status')}"
        time.sleep(1)
    pods = kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
    events = kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout
    raise AssertionError(f"{name} not {phase} after {timeout}s: {job.get('status')}\n{pods}\n{events}")


def _release_objects(kubectl, release: str, namespace: str) -> list[str]:
    sel = f"app.kubernetes.io/instance={release}"
    found = kubectl("get", "deploy,rs,pods,svc,sa,role,rolebinding", "-n", namespace, "-l", sel, "-o", "name").stdout.split()
    found += kubectl("get", "clusterrole,clusterrolebinding,validatingadmissionpolicy,validatingadmissionpolicybinding",
                     "-l", sel, "-o", "name").stdout.split()
    return found


def test_install_run_upgrade_uninstall(kubectl, helm, namespace, crd_installed, images, foreign_operators_paused):
    """The chart on a real cluster: the operator Pod (uid 1000, read-only root) becomes ready, runs a job
    to Succeeded, survives an upgrade, and uninstall removes everything but the CRD."""
    release = f"ddpop-{uuid.uuid4().hex[:6]}"
    # Scoped to the test's namespace so it never acts on DDPJobs of other tests; the CRD is left to the release
    # that carries it (a second release that tried would fail on its ownership).
    scope = ["--set", f"watch.namespaces={{{namespace}}}", "--set", "rbac.scope=namespace", "--set", "crds.enabled=false"]
    try:
        out = helm("install", release, str(CHART), "-n", namespace, *scope, "--wait", "--timeout", "180s").stdout
        assert "kubectl get ddpj" in out, out  # NOTES tell the user what to do next
        kubectl("rollout", "status", f"deployment/{release}-ddp-operator", "-n", namespace, "--timeout=60s")
        pod = json.loads(kubectl("get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={release}",
                            "-o", "json").stdout)["items"][0]
        assert pod["spec"]["containers"][0]["image"] == "localhost/ddp-operator:0.1.0"
        assert pod["status"]["containerStatuses"][0]["ready"] is True

        kubectl("apply", "-n", namespace, "-f", "-", input=TINY_JOB.format(name="tiny"))
        _wait_phase(kubectl, namespace, "tiny", "Succeeded", timeout=180)

        helm("upgrade", release, str(CHART), "-n", namespace, *scope, "--set", "operator.verbose=true",
             "--wait", "--timeout", "180s")
        assert "REVISION: 2" in helm("status", release, "-n", namespace).stdout
        kubectl("rollout", "status", f"deployment/{release}-ddp-operator", "-n", namespace, "--timeout=60s")
        kubectl("apply", "-n", namespace, "-f", "-", input=TINY_JOB.format(name="tiny-after-upgrade"))
        _wait_phase(kubectl, namespace, "tiny-after-upgrade", "Succeeded", timeout=180)
    except Exception:
        print(kubectl("logs", "-n", namespace, "-l", f"app.kubernetes.io/instance={release}", "--tail=80",
                 check=False).stdout)
        raise
    finally:
        helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "120s", check=False)

    deadline = time.monotonic() + 60
    while _release_objects(kubectl, release, namespace) and time.monotonic() < deadline:
        time.sleep(1)
    assert _release_objects(kubectl, release, namespace) == []
    # Helm never deletes CRDs: the DDPJob API (and users' jobs) stay.
    kubectl("get", "crd", "ddpjobs.ddp.dev")
    assert "tiny" in kubectl("get", "ddpj", "-n", namespace, "-o", "name").stdout


def test_chart_targets_the_cluster_version(kubectl):
    server = json.loads(kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert f"v{server['major']}.{server['minor']}" == ".".join(KUBE_VERSION.split(".")[:2])
