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


@pytest.fixture
def operator(shared_operator):
    """The session's operator (tests/conftest.py `shared_operator`): installed once, not once per module."""
    return shared_operator


@pytest.fixture
def ns(request, kubectl, operator):
    """A fresh ddp-e2e-* namespace; on failure everything in it and the operator's log are printed."""
    name = harness.new_namespace(kubectl, request.node.name)
    yield name
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(harness.diagnostics(kubectl, name, operator))
    harness.delete_namespace(kubectl, name)
