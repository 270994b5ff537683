"""The chart's high availability and its users' roles on a real cluster: with replicaCount=2 only the leader is Ready,
so the metrics Service's EndpointSlice routes to it alone, and to the other replica once the leader's Pod is deleted;
a namespace's editors (the built-in `edit`) may create DDPJobs, its viewers (`view`) only read them."""

from __future__ import annotations

import uuid

import pytest

from tests.chart.conftest import CHART, KUBE_VERSION, run
from tests.chart.test_chart_cluster import TINY_JOB
from tests.support.waiting import wait_for

pytestmark = pytest.mark.cluster


def _operator_pods(kubectl, namespace: str, release: str) -> list[dict]:
    """The release's operator Pods that are not on their way out."""
    pods = kubectl.json("get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={release}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def _one_ready(kubectl, namespace: str, release: str, *, besides: str = "") -> str | None:
    """The name of the one Ready Pod of two (not `besides`), None while there is not exactly one."""
    pods = _operator_pods(kubectl, namespace, release)
    ready = [p["metadata"]["name"] for p in pods if _ready(p)]
    return ready[0] if len(pods) == 2 and len(ready) == 1 and ready[0] != besides else None


def _endpoints(kubectl, namespace: str, service: str) -> dict[str, bool]:
    """Pod name -> ready, over the Service's EndpointSlices."""
    slices = kubectl.json("get", "endpointslices", "-n", namespace, "-l", f"kubernetes.io/service-name={service}")
    return {e["targetRef"]["name"]: bool(e.get("conditions", {}).get("ready"))
            for s in slices["items"] for e in s.get("endpoints") or []}


def test_two_replicas_only_the_leader_is_ready_and_behind_the_metrics_service(kubectl, helm, namespace,
                                                                              crd_installed, operator_image):
    release = f"ha-{uuid.uuid4().hex[:6]}"
    service = f"{release}-ddp-operator-metrics"
    # Scoped to the test's namespace (Lease, Roles, watch); nothing cluster-wide.
    helm("install", release, str(CHART), "-n", namespace, "--set", "replicaCount=2", "--set", "rbac.scope=namespace",
         "--set", f"watch.namespaces={{{namespace}}}", "--set", "admissionPolicy.enabled=false",
         "--set", "rbac.aggregateToDefaultRoles=false", "--set", "crds.enabled=false", "--wait", "--timeout", "120s")
    try:
        leader = wait_for(lambda: _one_ready(kubectl, namespace, release), 120, what="one Ready operator Pod of two")
        lease = kubectl.json("get", "lease", "ddp-operator", "-n", namespace)
        assert lease["spec"]["holderIdentity"] == leader  # the Ready one is the one that leads
        # The standby is listed, not ready: the Service sends it nothing.
        wait_for(lambda: (e := _endpoints(kubectl, namespace, service)) and len(e) == 2 and
                 [p for p, ready in e.items() if ready] == [leader], 60, what=f"{service} routes to {leader} alone")

        kubectl("delete", "pod", leader, "-n", namespace, "--wait=false")
        successor = wait_for(lambda: _one_ready(kubectl, namespace, release, besides=leader), 120,
                             what="another operator Pod Ready after the leader's deletion")
        assert kubectl.json("get", "lease", "ddp-operator", "-n", namespace)["spec"]["holderIdentity"] == successor
        wait_for(lambda: [p for p, ready in _endpoints(kubectl, namespace, service).items() if ready] == [successor],
                 60, what=f"{service} routes to {successor} alone")
        print(f"leader {leader} deleted; {successor} leads and alone receives the metrics Service's traffic")
    except Exception:
        print(kubectl("logs", "-n", namespace, "-l", f"app.kubernetes.io/instance={release}", "--tail=40",
                      "--prefix", check=False).stdout)
        raise
    finally:
        helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "120s", check=False)


def test_namespace_editors_may_create_ddpjobs_and_viewers_only_read_them(kubectl, helm_bin, namespace,
                                                                         crd_installed):
    """The chart's user roles, applied alone (an install would add nothing to what is checked here), aggregated by the
    API server into the built-in edit and view; `kubectl auth can-i --as` asks as a user bound to each."""
    release = f"roles-{uuid.uuid4().hex[:6]}"
    roles = run([helm_bin, "template", release, str(CHART), "--kube-version", KUBE_VERSION,
                 "--show-only", "templates/user-roles.yaml"]).stdout
    names = [f"{release}-ddp-operator-edit", f"{release}-ddp-operator-view"]
    kubectl("apply", "-f", "-", input=roles)
    editor, viewer = f"editor-{release}", f"viewer-{release}"
    try:
        kubectl("create", "rolebinding", "editors", "--clusterrole=edit", f"--user={editor}", "-n", namespace)
        kubectl("create", "rolebinding", "viewers", "--clusterrole=view", f"--user={viewer}", "-n", namespace)

        def can(user: str, verb: str, resource: str, *extra: str) -> bool:
            out = kubectl("auth", "can-i", verb, resource, *extra, "-n", namespace, f"--as={user}", check=False)
            return out.stdout.strip() == "yes"
        # Aggregation is the controller manager's, a moment after the roles exist.
        wait_for(lambda: can(editor, "create", "ddpjobs.ddp.dev") and can(viewer, "list", "ddpjobs.ddp.dev"), 60,
                 what="DDPJob rules aggregated into edit and view")
        for verb in ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"):
            assert can(editor, verb, "ddpjobs.ddp.dev"), verb
        assert can(editor, "update", "ddpjobs.ddp.dev", "--subresource=scale")
        assert not can(editor, "patch", "ddpjobs.ddp.dev", "--subresource=status")  # the operator's to write
        for verb in ("get", "list", "watch"):
            assert can(viewer, verb, "ddpjobs.ddp.dev"), verb
        assert can(viewer, "get", "ddpjobs.ddp.dev", "--subresource=status")
        for verb in ("create", "update", "patch", "delete"):
            assert not can(viewer, verb, "ddpjobs.ddp.dev"), verb
        assert not can(viewer, "update", "ddpjobs.ddp.dev", "--subresource=scale")
        # The real request (a server-side dry run: authorized and admitted, nothing created).
        job = TINY_JOB.format(name="by-an-editor")
        kubectl("create", "--dry-run=server", f"--as={editor}", "-n", namespace, "-f", "-", input=job)
        refused = kubectl("create", "--dry-run=server", f"--as={viewer}", "-n", namespace, "-f", "-", input=job,
                          check=False)
        assert refused.returncode != 0 and "forbidden" in refused.stderr, refused.stderr
    finally:
        kubectl("delete", "clusterrole", *names, "--ignore-not-found", check=False)
