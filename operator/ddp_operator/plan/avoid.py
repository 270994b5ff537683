"""Nodes that keep failing a job: its replacement pods keep off them for a while (status.avoidedNodes).

A node on which the job's pods failed twice (AVOID_AFTER) for reasons of the infrastructure that point at the node
within WINDOW_SECONDS is avoided until AVOID_SECONDS after the last of them: every trainer pod the operator creates
from then on carries a required node affinity `metadata.name NotIn [...]`, added to each of the template's own node
selector terms (so the user's affinity still holds). Pods already running are left where they are. At most
MAX_AVOIDED nodes, the most recent first, so that a cluster-wide outage never leaves a job nowhere to run.

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
        recent = [t for t in seen if last - t <= window]
        until = last + timedelta(seconds=AVOID_SECONDS)
        if len(recent) >= AVOID_AFTER and now < until:
            out.append({"node": node, "failures": len(recent), "until": format_time(until)})
    out.sort(key=lambda a: a["until"], reverse=True)
    return out[:MAX_AVOIDED]


def kept_off(pod: dict, nodes: list[str]) -> dict:
    """The pod with a required node affinity that keeps it off `nodes` (ANDed into each of its own terms)."""
    if not nodes:
        return pod
    pod = copy.deepcopy(pod)
    spec = pod.setdefault("spec", {})
    node_affinity = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    rule = {"key": "metadata.name", "operator": "NotIn", "values": sorted(nodes)}
    required["nodeSelectorTerms"] = [{**t, "matchFields": [*(t.get("matchFields") or []), rule]} for t in terms]
    return pod
