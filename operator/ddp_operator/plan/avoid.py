"""Nodes that keep failing a job: its replacement pods keep off them for a while (status.avoidedNodes).

A node on which the job failed twice (AVOID_AFTER incidents: failures at least INCIDENT_GAP_SECONDS apart, so the
pods one node loss takes at once count once) for reasons of the infrastructure that point at the node within
WINDOW_SECONDS is avoided until AVOID_SECONDS after the last of them: every trainer pod the operator creates from
then on carries a preferred node affinity (weight 100) for any node but these (`metadata.name NotIn [...]`). A
preference, not a requirement: the scheduler puts the replacement elsewhere when anything else fits and on the
avoided node when nothing does (a one-node cluster, a full cluster), so avoidance never leaves a job unschedulable.
Pods already running are left where they are. At most MAX_AVOIDED nodes, the most recent first.

Level-based: the list is derived on every pass from status.attempts (node, class, cause, time), so it is the same
after an operator restart and lifts itself once its time is up.
"""

from __future__ import annotations

import copy
from datetime import datetime, timedelta
from typing import Any, Mapping

from ddp_operator import failure_class
from ddp_operator.observed import format_time, parse_time

AVOID_AFTER = 2
INCIDENT_GAP_SECONDS = 60
WINDOW_SECONDS = 600
AVOID_SECONDS = 1800
MAX_AVOIDED = 8
# Infrastructure failures that say nothing about the node: the pod's own memory limit, someone deleting the pod,
# the scheduler's or an operator's decisions (preemption, a drain, which cordons the node anyway), a pod never seen.
NOT_THE_NODE = {failure_class.REASON_POD_DELETED, failure_class.REASON_OOM, "Preempting", "PreemptionByScheduler",
                "EvictionByEvictionAPI", "NodeMissing", "RendezvousStoreLost"}


def avoided_nodes(attempts: list[Mapping[str, Any]], now: datetime) -> list[dict]:
    """[{node, failures, until}] for the nodes to keep off at `now`, most recent first."""
    times: dict[str, list[datetime]] = {}
    for a in attempts:
        if not isinstance(a, Mapping) or a.get("class") != failure_class.INFRASTRUCTURE:
            continue
        node, when = a.get("node"), parse_time(a.get("time"))
        if isinstance(node, str) and node and when is not None and a.get("cause") not in NOT_THE_NODE:
            times.setdefault(node, []).append(when)
    out = []
    window = timedelta(seconds=WINDOW_SECONDS)
    for node, seen in times.items():
        seen.sort()
        last = seen[-1]
        incidents: list[datetime] = []
        for t in (t for t in seen if last - t <= window):
            if not incidents or (t - incidents[-1]).total_seconds() >= INCIDENT_GAP_SECONDS:
                incidents.append(t)
        until = last + timedelta(seconds=AVOID_SECONDS)
        if len(incidents) >= AVOID_AFTER and now < until:
            out.append({"node": node, "failures": len(incidents), "until": format_time(until)})
    out.sort(key=lambda a: a["until"], reverse=True)
    return out[:MAX_AVOIDED]


def kept_off(pod: dict, nodes: list[str]) -> dict:
    """The pod with a preferred node affinity (weight 100) for any node but `nodes`, beside the template's own."""
    if not nodes:
        return pod
    pod = copy.deepcopy(pod)
    spec = pod.setdefault("spec", {})
    # The template's own affinity (its pod affinities and node affinity terms) is kept; a null one is none.
    spec["affinity"] = affinity = dict(spec.get("affinity") or {})
    affinity["nodeAffinity"] = node_affinity = dict(affinity.get("nodeAffinity") or {})
    preferred = list(node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or [])
    preferred.append({"weight": 100, "preference": {"matchFields": [
        {"key": "metadata.name", "operator": "NotIn", "values": sorted(nodes)}]}})
    node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    return pod
