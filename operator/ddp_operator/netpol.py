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
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
