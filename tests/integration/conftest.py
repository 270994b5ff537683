"""Integration fixtures: the real API server of the embedded cluster, the operator running as a subprocess
(`python -m ddp_operator`, watching only namespaces named ddp-it-*), a namespace per test. Pods of the test jobs
select a node that does not exist, so nothing runs them: the tests play the kubelet by patching pod status.
"""

from __future__ import annotations

import pathlib
import uuid

import pytest
import yaml

from ddp_cluster import CRD, KUBECONFIG, NS_PREFIX, Cluster, Operator, _api, _reachable, wait_for


def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).parent
    for item in items:
        if here in pathlib.Path(item.fspath).parents:
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture(scope="session")
def api():
    if not _reachable():
        pytest.skip(f"no reachable cluster at {KUBECONFIG} (start it with `hack/cluster.py up`)")
    from kubernetes import client
    api = _api()
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
def operator(api, tmp_path_factory):
    op = Operator(tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()


@pytest.fixture
def k(api, operator, request):
    """A fresh namespace ddp-it-<random> watched by the test operator; dumped on failure, then deleted."""
    from kubernetes import client
    ns = NS_PREFIX + uuid.uuid4().hex[:8]
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": ns}})
    cluster = Cluster(api, ns)
    yield cluster
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    if failed:
        print(f"\n--- namespace {ns} ---\n{cluster.dump()}\n--- operator log ---\n{operator.log_tail()}")
    core.delete_namespace(ns)
