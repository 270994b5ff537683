"""Hot spares (spec.spares): how spare pods are counted, which pods train, and how a released spare is told apart
from a failure. Pure.

A job with spares runs spec.nodes + spec.spares identical trainer pods (`<job>-0` ...) with a rendezvous of
exactly spec.nodes (PET_NNODES=nodes:nodes, backend ddpjob-c10d, see ddp_trainer.rendezvous; after a scale, the
size in each pod's names.NODES_ANNOTATION, which the backend follows). The rendezvous,
not the pod index, decides which pods train: the first spec.nodes agents to join; the others wait in its
redundancy list. When a member is lost, a waiting agent takes its place in the next round and the pod recreated
for the lost one becomes the spare (replenished). The operator cannot see the rendezvous, so:

- Counting: of the running (ready) trainer pods, spec.nodes fill the training places and the rest are spares
  (a group that is full has no other place for them): `nodesReady` is `<min(ready, nodes)>/<nodes> +<rest>`.
- Membership: the trainer tells it. ddp_trainer's progress report carries `members`, the pod indices of the
  training world (docs/contract.md); the hang rule judges only members, and at success the pods that are not
  members are stopped at once.
- Release: when a participant closes the rendezvous at the end, a waiting spare's torchrun exits 1 (torch's
  launcher fails on the missing run result); ddpjob-c10d makes SPARE_RELEASED_MARKER the start of its last log
  line, which reaches the operator in the termination message. Such an exit is recorded (reason SpareReleased),
  never counted: the operator may see it before it sees the participants exit 0. The marker is believed only
  there (the last line) and only for a job with spares: anywhere else it is a log line like any other (a script
  printing it, a traceback quoting it), and the failure it ends counts.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ddp_operator import names
from ddp_operator.observed import PodState
from ddp_operator.status import pod_counts, valid_members


def released(message: str, *, spares: int) -> bool:
    """Whether a trainer's termination message says it ended as a spare released by a closed rendezvous: a job
    with spares (only their backend writes the marker), and the message's last line starts with the marker."""
    lines = (message or "").rstrip().splitlines()
    return bool(spares) and bool(lines) and lines[-1].startswith(names.SPARE_RELEASED_MARKER)


def members(reports: Iterable[Mapping[str, Any] | None]) -> frozenset[int] | None:
    """The training world's pod indices from the first report that names them (rank 0's first, when the
    caller orders them so); None when no report does (a plain script, an older trainer)."""
    for report in reports:
        found = valid_members((report or {}).get("members")) if isinstance(report, Mapping) else None
        if found is not None:
            return frozenset(found)
    return None


def counts(trainers: Iterable[PodState], nodes: int, spares: int) -> tuple[dict[str, int], dict[str, int] | None]:
    """(status.nodes, status.spares) of the current trainer pods: the first `nodes` running/ready pods are
    training nodes, the rest spares. status.spares is None for a job without spares."""
    every = pod_counts(trainers, nodes)
    if not spares:
        return every, None
    node_counts = {**every, **{k: min(every[k], nodes) for k in ("active", "running", "ready")}}
    return node_counts, {"desired": spares, "running": max(0, every["running"] - nodes),
                         "ready": max(0, every["ready"] - nodes)}


def ready_text(node_counts: Mapping[str, int], spare_counts: Mapping[str, int] | None) -> str:
    """The NODES column: `2/2`, or `2/2 +1` with one spare ready."""
    text = f"{node_counts['ready']}/{node_counts['desired']}"
    return text if spare_counts is None else f"{text} +{spare_counts['ready']}"
