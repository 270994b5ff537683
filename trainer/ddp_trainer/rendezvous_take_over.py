"""Rule 4 of the ``ddpjob-c10d`` rendezvous backend (numbered in ``ddp_trainer.rendezvous``'s docstring): a replacement
takes its predecessor's place at once. Every agent records its pod (``DDPJOB_POD_INDEX``) in the shared state, and the
write that records it takes any other agent recorded for that pod out of every list, as torch's heartbeat expiry
would; the agent taken out is remembered, and its next join fails (``TakenOver``) rather than take the place back.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .rendezvous_rules import _GONE, _POD, BACKEND, GONE_KEPT

log = logging.getLogger(f"{__package__}.rendezvous")


class PodRecords:
    """Rule 4's records of a state (agent -> pod), indexed by pod: a write that places many agents (rule 10's fold)
    builds it once, where a lookup per agent scanned every record (O(N) per agent, O(N^2) per fold)."""

    def __init__(self, state: Any) -> None:
        self.pods: dict[Any, str] = dict(getattr(state, _POD, {}))
        self.by_pod: dict[str, dict[Any, None]] = {}
        for node, pod in self.pods.items():
            self.by_pod.setdefault(pod, {})[node] = None
        setattr(state, _POD, self.pods)

    def record(self, node: Any, pod: str) -> None:
        old = self.pods.get(node)
        if old is not None:
            self.by_pod.get(old, {}).pop(node, None)
        self.pods[node] = pod
        self.by_pod.setdefault(pod, {})[node] = None

    def forget(self, node: Any) -> None:
        self.by_pod.get(self.pods.pop(node, ""), {}).pop(node, None)


def take_over(state: Any, me: Any, pod: str, settings: Any, records: PodRecords | None = None) -> list[Any]:
    """Rule 4, in the state write of an agent that enters the rendezvous or sends a heartbeat: record that ``me`` runs
    in ``pod`` and take every other agent recorded for that pod out of the rendezvous (as torch's heartbeat expiry
    takes out a dead one: the lists, the heartbeats, and a complete round left without participants is over),
    whether or not its heartbeats expired already. ``records``: the state's, built once for many calls in one write.
    Returns the agents taken out."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    # An agent stays recorded after its heartbeats expired: a frozen node's agent (a paused VM, a node cut off
    # longer than the keep-alive expiry) is forgotten by torch, and woken after its pod was recreated elsewhere it
    # would join as a newcomer and take its replacement's place. Recorded here, it is taken out like a dead one.
    # One record per pod, so the map stays as small as the job.
    records = records or PodRecords(state)
    gone = [n for n in records.by_pod.get(pod, {}) if n != me]
    left_participants = False
    for node in gone:
        records.forget(node)
        state.last_heartbeats.pop(node, None)
        if node in state.participants:
            del state.participants[node]
            left_participants = True
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
    records.record(me, pod)
    if gone:
        setattr(state, _GONE, [*getattr(state, _GONE, []), *gone][-GONE_KEPT:])
        log.warning("%s: the agent of pod %s took its predecessor's place: %s", BACKEND, pod,
                    ", ".join(str(n) for n in gone))
    if left_participants:
        dr._remove_participant_epilogue(state, settings)
    return gone


class TakenOver(RuntimeError):
    """This agent was taken out of the rendezvous by a newer agent of its pod (rule 4)."""

    def __init__(self, node: Any, pod: str) -> None:
        super().__init__(f"{BACKEND}: agent {node} was replaced by a newer agent of pod {pod} (its pod was recreated "
                         f"or its container restarted); this one stops")


def taken_over(state: Any, node: Any) -> bool:
    """Rule 4: whether a newer agent of ``node``'s pod took it out of the rendezvous."""
    return node in getattr(state, _GONE, ())


def _not_taken_over(op: Callable[[Any, float], Any], joining: bool, pod: str) -> Callable[[Any, float], Any]:
    """Rule 4 for the agent taken out: its join fails (it must not take the place back); its other operations
    (heartbeats, leaving) have nothing left to do."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action

    def checked(ctx: Any, deadline: float) -> Any:
        if not taken_over(ctx.state, ctx.node):
            return op(ctx, deadline)
        if joining:
            raise TakenOver(ctx.node, pod)
        return _Action.FINISH

    return checked
