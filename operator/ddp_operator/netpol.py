"""The NetworkPolicy `<job>` that keeps everyone but the job itself away from its pods.

A job's pods trust each other completely: the rendezvous store (`TCPStore`, no authentication) lets any
client join the rendezvous, and the workers exchange pickled objects. So ingress to the job's pods (the
trainers and the `<job>-rdzv` store, all labelled `ddp.dev/job-name=<job>`) is allowed only
- from the job's own pods, on every port (gloo and nccl open ephemeral ports), and
- from the operator's pods, on the progress port and the diagnostics port only (the operator polls every pod's
  `GET /progress` and, with spec.diagnostics, its diagnostics sidecar's `GET /diagnosis`).
Egress is left alone, and so is traffic from the node itself: every common enforcer (kube-router, Calico,
Cilium) lets a node reach its own pods, which the kubelet's probes and the API server's pod proxy need.

Whether a job gets one: `spec.networkPolicy.enabled` when set, else the operator's default
(`--network-policy`, the chart's `networkPolicy.enabled`), for clusters whose CNI enforces nothing or that
manage policies themselves.

Level-based like every child: each pass compares the policy the watch shows with the one the job needs now
(`drifted`) and merge-patches the fields the operator owns (OWNED_SPEC_FIELDS) back when they differ: someone edited
the policy, or the operator's identity changed (a release renamed or moved: other pod labels or namespace allowed to
poll). Fields it does not own (egress rules someone added) are left alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

from ddp_operator import names
from ddp_operator.labels import child_metadata, job_labels
from ddp_operator.spec import Job


@dataclass(frozen=True)
class NetworkPolicyConfig:
    """What the operator knows about itself. `operator_labels` select its own pods in `operator_namespace`;
    empty (the operator runs outside the cluster, e.g. as a host process) means no rule for it: it then
    reaches the pods from a node, which the enforcer allows anyway."""

    enabled_by_default: bool = True
    operator_namespace: str = ""
    operator_labels: tuple[tuple[str, str], ...] = field(default=())


def parse_labels(text: str) -> tuple[tuple[str, str], ...]:
    """`a=b,c=d` (a label selector of equalities, as --operator-pod-labels takes it) -> sorted pairs."""
    pairs = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{item!r} is not of the form key=value")
        pairs.append((key.strip(), value.strip()))
    return tuple(sorted(pairs))


def wanted(job: Job, config: NetworkPolicyConfig) -> bool:
    if job.spec.network_policy_enabled is not None:
        return job.spec.network_policy_enabled
    return config.enabled_by_default


def _operator_ports(job: Job) -> list[int]:
    """What the operator polls: the progress port, and the diagnostics sidecar's (spec.diagnostics)."""
    return [names.PROGRESS_PORT] + ([names.DIAGNOSTICS_PORT] if job.spec.diagnostics.enabled else [])


def render_network_policy(job: Job, config: NetworkPolicyConfig) -> dict:
    ingress: list[dict] = [{"from": [{"podSelector": {"matchLabels": job_labels(job)}}]}]
    if config.operator_labels and config.operator_namespace:
        ingress.append({
            "from": [{
                # Both selectors in one peer: pods with these labels in the operator's namespace only.
                "namespaceSelector": {"matchLabels": {names.LABEL_NAMESPACE_NAME: config.operator_namespace}},
                "podSelector": {"matchLabels": dict(config.operator_labels)},
            }],
            "ports": [{"protocol": "TCP", "port": port} for port in _operator_ports(job)],
        })
    return {
        "apiVersion": names.NETWORK_POLICY_API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": child_metadata(job, job.name, job_labels(job)),
        "spec": {
            "podSelector": {"matchLabels": job_labels(job)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


# The spec fields the operator writes and puts back; a patch of these three replaces each one whole (merge patch).
OWNED_SPEC_FIELDS = ("podSelector", "policyTypes", "ingress")


def _normal(value: Any, key: str = "") -> Any:
    """A value as the API server keeps it, for comparison: null, {} and [] are absent; a rule's port is TCP unless it
    says otherwise."""
    if isinstance(value, Mapping):
        out = {k: _normal(v, k) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        if key == "ports":
            value = [{"protocol": "TCP", **p} if isinstance(p, Mapping) else p for p in value]
        return [_normal(v) for v in value]
    return value


def drifted(desired: Mapping[str, Any], observed: Any) -> bool:
    """Whether the observed policy's spec differs from the desired one in a field the operator owns (pure)."""
    if not isinstance(observed, Mapping):
        return True
    return any(_normal(desired.get(f)) != _normal(observed.get(f)) for f in OWNED_SPEC_FIELDS)


def restoring_patch(desired: Mapping[str, Any]) -> dict:
    """The merge patch that puts the owned fields of a policy's spec back to `desired` (a rendered policy)."""
    return {"spec": {f: copy.deepcopy(desired["spec"][f]) for f in OWNED_SPEC_FIELDS if f in desired["spec"]}}
