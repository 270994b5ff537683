"""The command line: which kopf settings follow from --namespace."""

from ddp_operator.__main__ import exact_namespaces, parse_args, settings_for


def test_exact_namespaces_disable_cluster_wide_scanning():
    assert settings_for(["team-a"]).scanning.disabled is True
    assert settings_for(["team-a", "team-b"]).scanning.disabled is True
    # Patterns need the namespace scan to find what matches; all namespaces is cluster-wide anyway.
    for patterns in (["ddp-it-*"], ["team-?"], ["!kube-*"], ["a,b"], ["team-a", "x-*"], []):
        assert exact_namespaces(patterns) is False, patterns
        assert settings_for(patterns).scanning.disabled is False


def test_namespaces_from_the_environment(monkeypatch):
    monkeypatch.setenv("DDP_OPERATOR_NAMESPACES", "team-a, team-b")
    assert parse_args([]).namespace == ["team-a", "team-b"]
    assert parse_args(["--namespace", "x"]).namespace == ["x"]
