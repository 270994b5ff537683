"""RBAC is derived from the operator's calls (tests/rbac_needs.py) and the shipped manifests grant exactly that:
nothing missing, nothing unused. The Helm chart, both scopes, is compared in tests/chart/test_chart_render.py."""

import yaml

from tests import rbac_needs, tools

MANIFEST_RBAC = tools.REPO_ROOT / "manifests" / "base" / "rbac.yaml"


def _cluster_role() -> dict:
    (role,) = [d for d in yaml.safe_load_all(MANIFEST_RBAC.read_text()) if d and d["kind"] == "ClusterRole"
               and not any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in d["metadata"]["labels"])]
    return role


def test_derivation_sees_every_client_call():
    """Every client call in k8s.py is classified (an unknown API class or method fails the derivation)."""
    n = rbac_needs.needs()
    assert len(n.calls) >= 8, n.calls
    assert ("", "pods", "create") in n.namespaced and ("", "pods", "watch") in n.namespaced
    assert ("ddp.dev", "ddpjobs/status", "patch") in n.namespaced
    assert ("", "nodes", "get") in n.cluster
    assert {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")} == n.leader


def test_client_method_names_map_to_rbac():
    assert rbac_needs.plural("network_policy") == "networkpolicies"
    assert rbac_needs.plural("pod") == "pods"
    assert rbac_needs._METHOD.match("create_namespaced_network_policy").groups() == (
        "create", "namespaced_", "network_policy", None)
    assert rbac_needs._resource(["networking.k8s.io", "v1", "networkpolicies"]) == ("networking.k8s.io",
                                                                                   "networkpolicies")
    assert rbac_needs._resource(["v1", "pods"]) == ("", "pods")


def test_manifests_grant_exactly_what_the_code_needs():
    n = rbac_needs.needs()
    assert rbac_needs.granted(_cluster_role()["rules"]) == n.namespaced | n.cluster


def test_no_unused_verbs():
    """The verbs a review found unused: events are only created, and nothing is read with get except Nodes and the
    pod or Service that holds a child's name after a 409 (who owns it?) and the job's metric-history ConfigMap (read
    before each replace); everything else comes from watches."""
    g = rbac_needs.granted(_cluster_role()["rules"])
    assert ("", "events", "patch") not in g
    assert {(grp, res) for grp, res, verb in g if verb == "get"} == {("", "nodes"), ("", "pods"), ("", "services"),
                                                                          ("", "configmaps")}
