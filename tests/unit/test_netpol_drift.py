"""The job's NetworkPolicy is level-based: each pass compares the policy the watch shows with the one the job needs and
merge-patches the fields the operator owns back when they differ (an edit, or the operator's identity changed); a
policy as the API server stores the rendered one is never taken for drifted."""

from __future__ import annotations

import copy

import kopf

from ddp_operator import handlers
from ddp_operator.jobs import kept_child
from ddp_operator.netpol import NetworkPolicyConfig, drifted, parse_labels, render_network_policy, restoring_patch
from ddp_operator.plan import PATCH, plan

from ddp_builders import NOW, job_body, make_job, observed, rdzv, trainer
from fake_api import fake_reconciler

OLD = NetworkPolicyConfig(operator_namespace="ddp-system", operator_labels=parse_labels(
    "app.kubernetes.io/name=ddp-operator,app.kubernetes.io/instance=ddp-operator"))
# The same operator installed again as another release, in another namespace.
NEW = NetworkPolicyConfig(operator_namespace="ml-ops", operator_labels=parse_labels(
    "app.kubernetes.io/name=ddp-operator,app.kubernetes.io/instance=training"))


def _stored(spec: dict) -> dict:
    """A spec as the API server returns it: a port's default protocol left out by the writer is filled in, empty
    selectors kept as {} (here: the renderer's explicit TCP dropped, to show either way compares equal)."""
    out = copy.deepcopy(spec)
    for rule in out.get("ingress") or []:
        for port in rule.get("ports") or []:
            port.pop("protocol", None)
        rule.setdefault("from", [])
    return out


def test_the_stored_form_of_the_rendered_policy_is_not_drift():
    spec = render_network_policy(make_job(), OLD)["spec"]
    assert not drifted(spec, spec)
    assert not drifted(spec, _stored(spec))
    assert not drifted(spec, {**spec, "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}]})  # not ours


def test_an_edit_or_another_operator_identity_is_drift():
    job = make_job()
    spec = render_network_policy(job, OLD)["spec"]
    opened = copy.deepcopy(spec)
    opened["ingress"].append({"from": [{"namespaceSelector": {}}]})
    assert drifted(spec, opened)
    assert drifted(spec, {**spec, "podSelector": {}})  # selects every pod of the namespace
    assert drifted(spec, {**spec, "policyTypes": ["Egress"]})
    assert drifted(spec, {k: v for k, v in spec.items() if k != "ingress"})  # deny-all... or allow-all; not ours
    assert drifted(render_network_policy(job, NEW)["spec"], spec)  # the operator moved: its pods are others
    assert drifted(render_network_policy(make_job(diagnostics={"enabled": False}), OLD)["spec"], spec)
    assert drifted(spec, None) and drifted(spec, "x")


def test_the_patch_puts_back_only_the_owned_fields():
    desired = render_network_policy(make_job(), NEW)
    assert restoring_patch(desired) == {"spec": {k: desired["spec"][k] for k in ("podSelector", "policyTypes",
                                                                                 "ingress")}}


def test_a_pass_patches_a_drifted_policy_and_leaves_a_current_one_alone():
    job = make_job()
    pods = (rdzv(), trainer(0), trainer(1))
    stale = render_network_policy(job, OLD)["spec"]
    p = plan(job, {}, observed(*pods, network_policy_exists=True, network_policy_uid="np", network_policy_spec=stale),
             NOW, NEW)
    (patch,) = [a for a in p.actions if a.kind == "NetworkPolicy"]
    assert (patch.verb, patch.name, patch.uid) == (PATCH, "mnist", "np")
    assert patch.body == restoring_patch(render_network_policy(job, NEW))
    current = _stored(render_network_policy(job, NEW)["spec"])
    again = plan(job, p.status, observed(*pods, network_policy_exists=True, network_policy_uid="np",
                                         network_policy_spec=current), NOW, NEW)
    assert not [a for a in again.actions if a.kind == "NetworkPolicy"]
    # Just created, the watch has not shown it yet: its spec is unknown, nothing is patched.
    fresh = plan(job, p.status, observed(*pods, network_policy_exists=True, network_policy_uid="np"), NOW, NEW)
    assert not [a for a in fresh.actions if a.kind == "NetworkPolicy"]


def test_the_watch_keeps_the_spec_and_the_shell_patches_the_policy_once():
    """kopf's slimmed event (jobs.kept_child) still carries the spec the index hands to the pass; an edited policy is
    patched back by UID, and the next pass (the watch showing the patched policy) writes nothing."""
    policy = render_network_policy(make_job(), NetworkPolicyConfig())
    policy["metadata"].update(uid="np-uid", managedFields=[{"manager": "x"}])
    kept = kept_child(policy)
    assert kept["spec"] == policy["spec"]
    kw = dict(namespace="ml", name="mnist", labels=policy["metadata"]["labels"])
    assert handlers.network_policies_by_job(body=kopf.Body(kept), **kw) == {
        ("ml", "mnist"): ("np-uid", (policy["metadata"]["ownerReferences"][0]["uid"],), policy["spec"])}

    r = fake_reconciler(job_body(), policies=True)
    r.reconcile("ml", "mnist")
    ((uid, owners, spec),) = r.indexes["network_policies_by_job"][("ml", "mnist")]
    edited = copy.deepcopy(spec)
    edited["ingress"] = [{}]  # "allow from everywhere"
    r.indexes["network_policies_by_job"][("ml", "mnist")] = [(uid, owners, edited)]
    r.reconcile("ml", "mnist")
    assert [(n, u) for n, u, _ in r.api.policy_patches] == [("mnist", uid)]
    assert r.indexes["network_policies_by_job"][("ml", "mnist")][0][2] == spec
    r.reconcile("ml", "mnist")
    assert len(r.api.policy_patches) == 1
