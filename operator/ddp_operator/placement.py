"""Where a job's trainer pods go by default: spread over nodes, unless the template says where they go itself.

Every trainer pod is a node of the training: two on one machine share its failure (one lost node takes both, and
the peer snapshot that would restore one of them) and its network. So each trainer pod gets a topology spread
constraint over `kubernetes.io/hostname` for the job's trainer pods: maxSkew 1, whenUnsatisfiable ScheduleAnyway (a
preference the scheduler weighs, never a reason to stay Pending: a job with more pods than nodes still runs),
nodeTaintsPolicy Honor (nodes the pods cannot use anyway, e.g. tainted for other workloads, are not counted).

The template wins. None is added when the pod template
- states a topology spread constraint on kubernetes.io/hostname itself, or
- states a pod affinity or anti-affinity term (required or preferred) on kubernetes.io/hostname (co-locating or
  spreading pods by host is then the user's decision), or
- carries the annotation `ddp.dev/spread-across-nodes: "false"` (spec.template.metadata.annotations): the switch that
  turns the default off for one job (docs/operations.md).
The template's other constraints (zones, racks) are kept and ours is appended; its affinity is never touched. The
preferred node affinity that keeps replacements off failing nodes (plan/avoid.py) is added later, beside this.

Pure: `spread_across_nodes(job, spec, annotations)` changes the rendered pod spec in place (pod.py's copy).
"""

from __future__ import annotations

from typing import Any, Mapping

from ddp_operator import names
from ddp_operator.labels import trainer_selector
from ddp_operator.spec import Job

HOSTNAME = "kubernetes.io/hostname"


def _terms(affinity: Any) -> list[Mapping[str, Any]]:
    """Every pod (anti-)affinity term of an affinity, required and preferred (a preferred term's podAffinityTerm)."""
    out: list[Mapping[str, Any]] = []
    if not isinstance(affinity, Mapping):
        return out
    for kind in ("podAffinity", "podAntiAffinity"):
        section = affinity.get(kind)
        if not isinstance(section, Mapping):
            continue
        for term in section.get("requiredDuringSchedulingIgnoredDuringExecution") or []:
            if isinstance(term, Mapping):
                out.append(term)
        for weighted in section.get("preferredDuringSchedulingIgnoredDuringExecution") or []:
            if isinstance(weighted, Mapping) and isinstance(weighted.get("podAffinityTerm"), Mapping):
                out.append(weighted["podAffinityTerm"])
    return out


def placed_by_template(spec: Mapping[str, Any], annotations: Mapping[str, Any]) -> bool:
    """Whether the pod template decides how its pods share hosts (or turned the default off)."""
    if str(annotations.get(names.SPREAD_ANNOTATION, "")).lower() == "false":
        return True
    constraints = spec.get("topologySpreadConstraints") or []
    if any(isinstance(c, Mapping) and c.get("topologyKey") == HOSTNAME for c in constraints):
        return True
    return any(t.get("topologyKey") == HOSTNAME for t in _terms(spec.get("affinity")))


def default_spread(job: Job) -> dict:
    """The constraint every trainer pod of `job` gets unless its template places them."""
    return {
        "maxSkew": 1,
        "topologyKey": HOSTNAME,
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": trainer_selector(job)},
        "nodeTaintsPolicy": "Honor",
    }


def spread_across_nodes(job: Job, spec: dict, annotations: Mapping[str, Any]) -> None:
    """Append the default spread to the pod spec unless the template places the pods (placed_by_template)."""
    if placed_by_template(spec, annotations):
        return
    spec["topologySpreadConstraints"] = [*(spec.get("topologySpreadConstraints") or []), default_spread(job)]
