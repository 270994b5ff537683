"""The pod-template hash: a short, stable digest of what shapes a job's pods, on each pod as `ddp.dev/template-hash`.

It covers the pod as the operator renders it (pod.py, rdzv.py) from the job's spec with this operator's code: the
user's template, the containers, the environment contract, the volumes, the diagnostics sidecar, the default
spread over nodes. It leaves out what differs from pod to pod or from one creation to the next, so that every pod of
one shape carries the same value:
- the pod's name and hostname, its node index (the label and DDPJOB_POD_INDEX);
- its group (the label, and the rendezvous id PET_RDZV_ID that carries it); the owner reference (the job's UID);
- the desired-size annotation (ddp.dev/nodes), which the operator keeps current on live pods (plan/spares.py);
- where one creation is placed: Kueue's admission (kueue.place) and the nodes avoided after failures
  (plan/avoid.py) are applied after the hash is taken.
So when an operator upgrade renders pods differently, or spec.template changes, the pods created from then on carry a
new value, and `kubectl get pods -L ddp.dev/template-hash` shows which pods have which shape.

The operator never acts on it: a running pod is not replaced because its hash differs (only a failure, a scale or a
new group replaces pods, docs/operations.md). Nor is it in the job's status: the current value would cost a render
of a pod on every pass, and the newest pod's label says the same.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Mapping

from ddp_operator import names

LENGTH = 10  # hex digits: 40 bits, as short as Kubernetes' own pod-template-hash
_PER_POD_LABELS = (names.LABEL_NODE_INDEX, names.LABEL_GROUP, names.LABEL_TEMPLATE_HASH)
_PER_POD_ANNOTATIONS = (names.NODES_ANNOTATION,)
_PER_POD_ENV = (names.ENV_POD_INDEX, names.ENV_RDZV_ID)


def _shape(pod: Mapping[str, Any]) -> dict:
    """The pod without its per-pod parts (the module docstring lists them)."""
    meta = pod.get("metadata") or {}
    spec = copy.deepcopy(dict(pod.get("spec") or {}))
    spec.pop("hostname", None)
    for key in ("containers", "initContainers"):
        for c in spec.get(key) or []:
            if isinstance(c, dict) and isinstance(c.get("env"), list):
                c["env"] = [e for e in c["env"] if not (isinstance(e, Mapping) and e.get("name") in _PER_POD_ENV)]
    return {
        "labels": {k: v for k, v in (meta.get("labels") or {}).items() if k not in _PER_POD_LABELS},
        "annotations": {k: v for k, v in (meta.get("annotations") or {}).items() if k not in _PER_POD_ANNOTATIONS},
        "spec": spec,
    }


def template_hash(pod: Mapping[str, Any]) -> str:
    """The hash of a rendered pod (before Kueue's placement and node avoidance)."""
    text = json.dumps(_shape(pod), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:LENGTH]


def with_template_hash(pod: dict) -> dict:
    """The rendered pod, labelled with its hash (in place; returned for chaining)."""
    labels = pod.setdefault("metadata", {}).setdefault("labels", {})
    labels[names.LABEL_TEMPLATE_HASH] = template_hash(pod)
    return pod
