"""The job's NetworkPolicy: who may reach its pods, when it exists, and how the operator is configured."""

import pytest

from ddp_operator import names
from ddp_operator.__main__ import network_policy_config, parse_args
from ddp_operator.netpol import NetworkPolicyConfig, parse_labels, render_network_policy, wanted
from ddp_operator.plan import CREATE, DELETE, plan
from ddp_operator.spec import SpecError

from ddp_builders import NOW, make_job, observed, rdzv, trainer

IN_CLUSTER = NetworkPolicyConfig(operator_namespace="ddp-system",
                                 operator_labels=parse_labels("app.kubernetes.io/name=ddp-operator,"
                                                              "app.kubernetes.io/instance=ddp-operator"))


def test_policy_admits_the_job_and_the_operator_on_the_progress_and_diagnostics_ports_only():
    job = make_job()
    np = render_network_policy(job, IN_CLUSTER)
    assert np["metadata"]["name"] == "mnist" and np["metadata"]["namespace"] == "ml"
    assert np["metadata"]["ownerReferences"][0]["uid"] == job.uid
    assert np["metadata"]["ownerReferences"][0]["controller"] is True
    # Every pod of the job (trainers and the rendezvous store) is selected ...
    for role in (names.ROLE_TRAINER, names.ROLE_RDZV):
        pod_labels = {names.LABEL_JOB_NAME: "mnist", names.LABEL_ROLE: role}
        assert np["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert np["spec"]["policyTypes"] == ["Ingress"]  # egress untouched
    own, operator = np["spec"]["ingress"]
    # ... the job's own pods reach every port (gloo/nccl use ephemeral ones) ...
    assert own == {"from": [{"podSelector": {"matchLabels": {names.LABEL_JOB_NAME: "mnist"}}}]}
    # ... and the operator's pods, in the operator's namespace only, the progress port and the diagnostics sidecar's
    # only.
    assert operator["ports"] == [{"protocol": "TCP", "port": names.PROGRESS_PORT},
                                 {"protocol": "TCP", "port": names.DIAGNOSTICS_PORT}]
    (peer,) = operator["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ddp-system"}}
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "ddp-operator"


def test_a_job_without_the_diagnostics_sidecar_opens_the_progress_port_alone():
    np = render_network_policy(make_job(diagnostics={"enabled": False}), IN_CLUSTER)
    assert np["spec"]["ingress"][1]["ports"] == [{"protocol": "TCP", "port": names.PROGRESS_PORT}]


def test_operator_outside_the_cluster_gets_no_rule():
    np = render_network_policy(make_job(), NetworkPolicyConfig())
    assert len(np["spec"]["ingress"]) == 1


def test_spec_overrides_the_operator_default():
    on, off = NetworkPolicyConfig(), NetworkPolicyConfig(enabled_by_default=False)
    assert wanted(make_job(), on) and not wanted(make_job(), off)
    assert wanted(make_job(networkPolicy={"enabled": True}), off)
    assert not wanted(make_job(networkPolicy={"enabled": False}), on)
    assert make_job(networkPolicy={}).spec.network_policy_enabled is None


def test_enabled_must_be_a_boolean():
    with pytest.raises(SpecError) as e:
        make_job(networkPolicy={"enabled": "yes"})
    assert e.value.field == "spec.networkPolicy.enabled"


def _kinds(p):
    return sorted((a.verb, a.kind, a.name) for a in p.actions)


def test_fresh_job_creates_the_policy_before_any_pod():
    p = plan(make_job(), {}, observed(service_exists=False, network_policy_exists=False), NOW, IN_CLUSTER)
    assert p.actions[0].kind == "NetworkPolicy" and p.actions[0].verb == CREATE
    assert p.actions[0].body == render_network_policy(make_job(), IN_CLUSTER)
    assert [a.kind for a in p.actions].count("NetworkPolicy") == 1


def test_existing_policy_is_left_alone_and_a_missing_one_recreated():
    job = make_job()
    pods = (rdzv(), trainer(0), trainer(1))
    first = plan(job, {}, observed(service_exists=False, network_policy_exists=False), NOW)
    running = plan(job, first.status, observed(*pods, network_policy_exists=True, network_policy_uid="np"), NOW)
    assert not [a for a in running.actions if a.kind == "NetworkPolicy"]
    gone = plan(job, running.status, observed(*pods, network_policy_exists=False), NOW)
    assert _kinds(gone) == [(CREATE, "NetworkPolicy", "mnist")]


def test_disabled_deletes_only_our_own_policy():
    job = make_job(networkPolicy={"enabled": False})
    p = plan(job, {}, observed(network_policy_exists=True, network_policy_uid="np-uid"), NOW)
    deletes = [a for a in p.actions if a.kind == "NetworkPolicy"]
    assert [(a.verb, a.uid) for a in deletes] == [(DELETE, "np-uid")]
    # Nothing of ours (no owned policy seen): nothing to create or delete.
    p = plan(job, {}, observed(network_policy_exists=False), NOW)
    assert not [a for a in p.actions if a.kind == "NetworkPolicy"]
    # The install-wide default off: a job that does not ask gets none.
    p = plan(make_job(), {}, observed(network_policy_exists=False), NOW, NetworkPolicyConfig(enabled_by_default=False))
    assert not [a for a in p.actions if a.kind == "NetworkPolicy"]


def test_command_line(monkeypatch):
    monkeypatch.delenv("DDP_OPERATOR_NETWORK_POLICY", raising=False)
    monkeypatch.delenv("DDP_OPERATOR_POD_LABELS", raising=False)
    monkeypatch.setenv("POD_NAMESPACE", "ddp-system")
    assert network_policy_config(parse_args([])) == NetworkPolicyConfig()
    monkeypatch.setenv("DDP_OPERATOR_NETWORK_POLICY", "false")
    monkeypatch.setenv("DDP_OPERATOR_POD_LABELS", "b=2, a=1")
    cfg = network_policy_config(parse_args([]))
    assert cfg == NetworkPolicyConfig(enabled_by_default=False, operator_namespace="ddp-system",
                                      operator_labels=(("a", "1"), ("b", "2")))
    assert network_policy_config(parse_args(["--network-policy=true"])).enabled_by_default is True
    with pytest.raises(SystemExit):
        network_policy_config(parse_args(["--operator-pod-labels=novalue"]))
