"""End-to-end fixtures: both images on the cluster, the operator running (the Helm chart by default, see
harness.py for DDPJOB_OPERATOR), a namespace per test named ddp-e2e-*, and a post-mortem on failure
(pods, events, descriptions, container logs, the DDPJob, the operator's log).

The cluster and kubectl come from tests/conftest.py: the embedded cluster, or DDPJOB_TEST_KUBECONFIG's (kind)."""

from __future__ import annotations

import pathlib

import pytest

from tests.e2e import harness


def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).parent
    for item in items:
        if here in pathlib.Path(item.fspath).parents:
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def operator(cluster, kubectl, request):
    """The operator for this module's tests; a chart installed here is uninstalled after them (module
    scope, so that tiers collected after this one never meet a cluster-wide operator they did not ask for)."""
    if harness.operator_mode() == "subprocess":  # helm mode reuses an installed release instead
        request.getfixturevalue("foreign_operators_paused")
    harness.ensure_images(cluster)
    op = harness.Operator(cluster, kubectl).start()
    yield op
    op.stop()


@pytest.fixture
def ns(request, kubectl, operator):
    """A fresh ddp-e2e-* namespace; on failure everything in it and the operator's log are printed."""
    name = harness.new_namespace(kubectl, request.node.name)
    yield name
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(harness.diagnostics(kubectl, name, operator))
    harness.delete_namespace(kubectl, name)
