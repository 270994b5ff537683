"""Integration fixtures: the real API server of the embedded cluster, the operator running as a subprocess
(`python -m ddp_operator`, watching only namespaces named ddp-it-*, so it never meets another suite's jobs),
a namespace per test (the shared `cluster` fixture of tests/conftest.py provides the cluster). Pods of the test jobs
select a node that does not exist, so nothing runs them: the tests play the kubelet by patching pod status.
"""

from __future__ import annotations

import pathlib
import uuid

import pytest
import yaml

from ddp_cluster import CRD, NS_PREFIX, JobNamespace, Operator, _api, wait_for
from tests.support.kube import foreign_operators_paused_in


def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).parent
    for item in items:
        if here in pathlib.Path(item.fspath).parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def api(cluster):
    """A kubernetes ApiClient for the suite's cluster (tests/conftest.py brings it up) with the CRD applied."""
    from kubernetes import client
    api = _api(cluster.kubeconfig)
    # Server-side apply of the generated CRD: creates or updates it, whoever installed it before.
    crd = yaml.safe_load(CRD.read_text())
    ext = client.ApiextensionsV1Api(api)
    ext.patch_custom_resource_definition(crd["metadata"]["name"], crd, field_manager="ddp-integration-tests",
                                         force=True, _content_type="application/apply-patch+yaml")
    wait_for(lambda: any(c.type == "Established" and c.status == "True"
                         for c in (ext.read_custom_resource_definition(crd["metadata"]["name"]).status.conditions
                                   or [])), 30, what="CRD Established")
    return api


@pytest.fixture(scope="session")
def operators_watching_ours_paused(kubectl):
    """Other DDPJob operators that would handle ddp-it-* namespaces, scaled to 0 for the session; one that excludes
    them (the e2e tests' shared operator: chart value watch.exclude) keeps running, so these tests can run beside
    the e2e tier."""
    with foreign_operators_paused_in(kubectl, namespace=NS_PREFIX + "any") as paused:
        yield paused


@pytest.fixture(scope="session")
def operator(api, cluster, tmp_path_factory, operators_watching_ours_paused):
    op = Operator(tmp_path_factory.mktemp("operator") / "operator.log", cluster.kubeconfig)
    op.start()
    yield op
    op.stop()


@pytest.fixture
def k(api, operator, request):
    """A fresh namespace ddp-it-<random> watched by the test operator; dumped on failure, then deleted."""
    from kubernetes import client
    ns = NS_PREFIX + uuid.uuid4().hex[:8]
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": ns, "labels": {"ddpjob.dev/test": "true"}}})
    # Pods are refused until the namespace's default ServiceAccount exists.
    wait_for(lambda: core.list_namespaced_service_account(ns, field_selector="metadata.name=default").items,
             60, what=f"default ServiceAccount in {ns}")
    jobs = JobNamespace(api, ns)
    yield jobs
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    if failed:
        print(f"\n--- namespace {ns} ---\n{jobs.dump()}\n--- operator log ---\n{operator.log_tail()}")
    core.delete_namespace(ns)
