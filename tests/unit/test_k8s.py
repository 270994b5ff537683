"""k8s.Api.node_ready: how a node's state is read, and what a 403 (namespace-scoped RBAC) means."""

import logging
from types import SimpleNamespace

import pytest
from kubernetes.client.exceptions import ApiException

from ddp_operator.k8s import Api


class _Core:
    def __init__(self, result):
        self.result, self.calls = result, 0

    def read_node(self, name):
        self.calls += 1
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def _api(result):
    api = Api.__new__(Api)  # no kubeconfig needed: only .core is used
    api.core, api._nodes_forbidden = _Core(result), False
    return api


def _node(ready):
    return SimpleNamespace(status=SimpleNamespace(conditions=[SimpleNamespace(type="Ready", status=ready)]))


def test_ready_not_ready_and_missing():
    assert _api(_node("True")).node_ready("n") is True
    assert _api(_node("Unknown")).node_ready("n") is False
    assert _api(ApiException(status=404, reason="Not Found")).node_ready("n") is False


def test_forbidden_is_unknown_logged_once_and_not_asked_again(caplog):
    api = _api(ApiException(status=403, reason="Forbidden"))
    with caplog.at_level(logging.DEBUG, logger="ddp_operator.k8s"):
        assert api.node_ready("n") is None
        assert api.node_ready("m") is None
    assert api.core.calls == 1
    assert len([r for r in caplog.records if "permission to read Nodes" in r.message]) == 1


def test_other_errors_are_raised():
    with pytest.raises(ApiException):
        _api(ApiException(status=500, reason="boom")).node_ready("n")
