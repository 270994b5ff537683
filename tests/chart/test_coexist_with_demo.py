"""`make demo` then `make test` on the same cluster: an operator release the tests did not install and that
watches every namespace (the demo's) is paused while tests run operators of their own, then restored.

The chart is installed here exactly as the demo installs it (default values: every namespace), in a
namespace without the tests' label, under a release name of its own. Pods need not become ready (the
image may not be on the node when this runs alone): what is checked is the Deployment's scale, and that its admission
policy lets the tests' operators label pods in the test namespaces meanwhile (and only meanwhile)."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.chart.conftest import CHART
from tests.support.kube import foreign_operators_paused_in
from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster


USER = "coexist-user"  # a namespace editor, not system:masters (the chart's policy lets that group through)


def _may_create_pods(kubectl, namespace: str) -> None:
    kubectl("create", "rolebinding", f"{USER}-edit", "--clusterrole=edit", f"--user={USER}", "-n", namespace)


def _labelling_refused(kubectl, namespace: str) -> bool:
    """Whether the admission policy refuses USER (not the paused release's operator) a pod with the DDPJob labels
    in `namespace` (a server-side dry run: admission runs, nothing is created)."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "labelled", "labels": {"ddp.dev/job-name": "someone"}},
           "spec": {"nodeSelector": {"ddp.dev/test-node": "nowhere"}, "containers": [{"name": "c", "image": "x"}]}}
    p = kubectl("create", "--dry-run=server", f"--as={USER}", "-n", namespace, "-f", "-", input=json.dumps(pod),
                check=False)
    assert p.returncode == 0 or "are set only by the ddp-operator" in p.stderr, p.stderr
    return p.returncode != 0


def test_a_cluster_wide_operator_the_tests_did_not_install_is_paused_then_restored(kubectl, helm, namespace):
    release = f"coexist-{uuid.uuid4().hex[:6]}"
    ns = f"ddp-coexist-{uuid.uuid4().hex[:6]}"  # unlabelled: to the fixtures it is the user's
    deployment = f"{release}-ddp-operator"
    sel = f"app.kubernetes.io/instance={release}"
    try:
        # --take-ownership, as the demo: the CRD (the chart carries it) may belong to another release already.
        helm("install", release, str(CHART), "-n", ns, "--create-namespace", "--take-ownership", "--timeout", "120s")
        wait_for(lambda: kubectl.json("get", "pods", "-n", ns, "-l", sel)["items"], 60, f"a pod of {deployment}")
        for n in (namespace, ns):
            _may_create_pods(kubectl, n)
        wait_for(lambda: _labelling_refused(kubectl, namespace), 30, "the release's admission policy in force")

        with foreign_operators_paused_in(kubectl) as paused:
            assert (ns, deployment) in paused
            spec = kubectl.json("get", "deployment", deployment, "-n", ns)["spec"]
            assert spec["replicas"] == 0
            assert kubectl.json("get", "pods", "-n", ns, "-l", sel)["items"] == []
            # The tests' operators may label pods in the test namespaces; everywhere else the policy still holds.
            wait_for(lambda: not _labelling_refused(kubectl, namespace), 30, "the test namespace left out")
            assert _labelling_refused(kubectl, ns)

        assert kubectl.json("get", "deployment", deployment, "-n", ns)["spec"]["replicas"] == 1
        wait_for(lambda: _labelling_refused(kubectl, namespace), 30, "the policy's whole scope back")
        wait_for(lambda: kubectl.json("get", "pods", "-n", ns, "-l", sel)["items"], 60, f"{deployment} back")
    finally:
        helm("uninstall", release, "-n", ns, "--wait", "--timeout", "120s", check=False)
        kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


def test_an_operator_that_watches_named_namespaces_is_left_alone(kubectl, helm):
    release = f"coexist-{uuid.uuid4().hex[:6]}"
    ns = f"ddp-coexist-{uuid.uuid4().hex[:6]}"
    deployment = f"{release}-ddp-operator"
    try:
        helm("install", release, str(CHART), "-n", ns, "--create-namespace", "--timeout", "120s",
             "--set", f"watch.namespaces={{{ns}}}", "--set", "rbac.scope=namespace", "--set", "crds.enabled=false")
        with foreign_operators_paused_in(kubectl) as paused:
            assert (ns, deployment) not in paused
            assert kubectl.json("get", "deployment", deployment, "-n", ns)["spec"]["replicas"] == 1
    finally:
        helm("uninstall", release, "-n", ns, "--wait", "--timeout", "120s", check=False)
        kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)
