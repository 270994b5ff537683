"""The ``ddpjob-c10d`` rendezvous backend: torch's c10d rendezvous, made safe for hot spares.

A hot spare is a torchrun agent that waits in the rendezvous while the group is full (``--nnodes=N:N``
and N agents training), so that a lost node's place is taken without scheduling, pulling, starting a
container or importing torch. torch's dynamic rendezvous nearly supports it: an agent that arrives when
the round is complete with ``max_nodes`` participants goes into the *redundancy list*, keeps its heartbeat,
and once a participant drops out (its heartbeat expired) moves to the wait list and is admitted by the
next round.

It livelocks, though (torch 2.13, measured: tests/trainer/test_trainer_spares.py). An agent that is in the *wait
list* when a round completes with ``max_nodes`` participants without it stays in the wait list: the join
operation moves only agents that are in no list to the redundancy list. Every agent polls
``num_nodes_waiting()`` and restarts its workers for the next round while it is above 0, so the
participants restart again and again, and each new round again leaves one agent behind in the wait list.
That happens at every start with N+1 agents and at every recovery where the survivors rejoin at slightly
different times (the first to rejoin finds the old round complete with fewer than ``max_nodes`` and
enters the wait list).

This backend is the c10d handler with these rules added:

1. The state write that completes a round with ``max_nodes`` participants also moves every agent left in the
   wait list to the redundancy list (atomically: the participants never see them waiting), and an agent that
   finds itself outside a complete round that has ``max_nodes`` participants, in the wait list or in no list,
   enters the redundancy list whatever its join deadline (redundant agents wait without one, as in torch).
2. Places in a new round go by priority, not to whichever agent polls first: the participants of the last
   complete round (the survivors: their /dev/shm holds the training state) first, then the agents that have
   been in the rendezvous longest (the spare before the pod recreated for the lost one, which usually arrives
   while the lost agent's heartbeat has not expired yet and so also waits as redundant). An agent waits while
   the participants plus the agents waiting with a higher priority fill the round; waiting counts the redundancy
   list too, because a redundant agent moves to the wait list only at its next poll (1 s apart under plain
   torchrun), by which time a newcomer that polled first had taken its place (seen in CI). For the same reason a
   move between the lists is one state write (torch's takes two, with the agent in no list and without a heartbeat
   in between, which let a newcomer take the place too). Without rule 2, a quick
   replacement took the place while the spare kept waiting (measured on a cluster), and with two spares a
   survivor could be left out, its snapshot with it. The priorities live in the shared state (pickled with it):
   the last round's participants and, per agent, when it first was a participant or redundant. A
   higher-priority agent that is not waiting yet (still stopping its workers) is not waited for; survivors
   rejoin within a second of a loss, well before the lost agent's heartbeat expires and the new round starts.

3. The group size follows the job (``kubectl scale`` of a job with spares). The operator keeps the wanted number
   of training nodes (spec.nodes) in an annotation of every pod, which the kubelet writes into a downward API
   file named by ``DDPJOB_NODES_FILE``. The backend reads it before every step of a join and whenever the agent
   asks ``num_nodes_waiting()`` (each monitor interval): a new size becomes the round's min and max nodes, and
   a training agent that sees it reports a waiting node, so every agent stops its workers and the group re-forms
   at the new size (the spares stay spares: places go by rule 2). Agents that read the file a little later take
   part in one more re-form; the size in the pod's ``PET_NNODES`` is only the starting value.

4. A replacement takes its predecessor's place at once. An agent killed without a chance to leave (SIGKILL: the OOM
   killer, a lost node, a container restarted in place) stays a participant until its heartbeats expire (keep-alive
   interval x attempts), and the others cannot form the next round before that: seconds on every such loss. The
   operator recreates a lost pod under the same name and ``DDPJOB_POD_INDEX``, and one pod runs one agent, so an agent
   that enters the rendezvous records its pod (``DDPJOB_POD_INDEX``) in the shared state, and the same state write
   takes any other agent recorded for that pod out of every list, as torch's heartbeat expiry would: the round no
   longer waits for a dead agent. The agent taken out is remembered; should it still run (a pod force-deleted on a
   node that lost its connection), its next join fails with a message saying a newer agent of its pod replaced it,
   rather than taking the place back, and so does its next look at the rendezvous while it trains
   (``num_nodes_waiting()``, each monitor interval): it stops its workers and exits then, whatever they are blocked
   in. That holds for an agent whose heartbeats expired too (a frozen node woken after its pod was recreated
   elsewhere): records are kept per pod, not per heartbeat. torch names an agent
   ``<address>_<pid>_<n>``; in a container the agent is PID 1, so a container restarted in place would repeat the
   name of the agent it replaces. With rule 4 on, ``<n>`` is an incarnation number drawn when the agent starts
   (``fresh_identity``), so every agent process has a name of its own.
   Without ``DDPJOB_POD_INDEX`` (plain torchrun outside a DDPJob) nothing changes;
   ``DDPJOB_TAKE_OVER=0`` turns the rule off. It applies to plain ``c10d`` too when ``ddp_trainer.launch`` runs the
   agent (jobs without spares): the executor below, with rules 1-3 off.

5. A new round's participants are not judged dead by their heartbeats until each has heard of the round. An agent
   sends its heartbeats through the same store client as everything else, and a TCPStore client serves one call at a
   time: while an agent is blocked in a store call (it waits for the round's ``MASTER_ADDR`` or the other agents'
   role information, or its whole process is held up: a cold page cache on a loaded node, a stopped container) its
   heartbeats do not go out. torch's state holder drops every agent whose heartbeat is older than the keep-alive
   expiry at every sync, its own agent included. So at a round's start, one slow agent (dropped by the others'
   sync, or by its own when it wakes with its heartbeat stale) left the round just completed and joined the next
   one alone, while the others waited in the completed round for it until their store wait timed out (60 s, then a
   restart; seen on kind, 3 of 11 cold starts). The state write that completes a round records when (state
   attribute ``ddpjob_completed``), each participant records that it heard of the round with its first heartbeat
   in it (``ddpjob_read``), and until all have, or ``ROUND_START_GRACE`` passed, no participant's heartbeat is
   judged; an agent never judges its own (it is running). After that, torch's expiry works as before: a node lost
   during training is dropped after the keep-alive expiry. Rule 4 still takes a replaced agent out at once. Rule 5
   applies wherever this module's executor runs: ``ddpjob-c10d``, and plain ``c10d`` in a DDPJob pod under
   ``ddp_trainer.launch``.

Everything else (heartbeats, admitting a redundant
agent when a participant drops out, closing at the end) is torch's. A redundant agent still ends when a
participant closes the rendezvous at the end of the training: torch raises RendezvousGracefulExitError there,
its launcher then fails on the missing run result (``'NoneType' object has no attribute 'is_failed'``) and the
spare's torchrun exits 1; this backend makes SPARE_RELEASED its last log line, which is how the operator tells
that exit from a failure (docs/contract.md).

torchrun finds the backend through the ``torchrun.handlers`` entry point (the ``ddp_trainer`` dist-info
next to the package); the operator selects it with ``PET_RDZV_BACKEND=ddpjob-c10d`` for jobs with
``spec.spares``. It uses torch internals (underscored names), so it checks them when it is created and
fails with a clear message rather than misbehave on a torch it was not written for.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import math
import os
import sys
import time
from typing import Any, Callable

from . import env as envmod

BACKEND = "ddpjob-c10d"
# The last line a released spare's torchrun writes (after torch's traceback): the operator finds it in the
# termination message (FallbackToLogsOnError) and neither counts nor replaces-as-failed that exit.
SPARE_RELEASED = f"{BACKEND}: spare released"


log = logging.getLogger(__name__)

_LAST = "ddpjob_last"    # state attribute: the participants of the last complete round
_ORDER = "ddpjob_order"  # state attribute: node -> when (a counter) it first was a participant or redundant
_POD = "ddpjob_pod"      # state attribute: node -> the pod (DDPJOB_POD_INDEX) its agent runs in (rule 4)
_GONE = "ddpjob_gone"    # state attribute: the nodes a newer agent of their pod took out (rule 4), newest last
GONE_KEPT = 64           # how many of those the state remembers
_COMPLETED = "ddpjob_completed"  # state attribute: (round, time.time()) of the write that completed the round (rule 5)
_READ = "ddpjob_read"            # state attribute: the participants that sent a heartbeat in that round (rule 5)
# Rule 5 keeps a new round's participants from heartbeat expiry until all heard of the round, at most this long: an
# agent's store waits at a round's start (MASTER_ADDR, the role information) time out after 60 s anyway.
ROUND_START_GRACE = 60.0


def _priority(state: Any, node: Any) -> tuple[bool, float]:
    """Higher is first: the last round's participants, then by how long an agent has been in the rendezvous."""
    return node in getattr(state, _LAST, ()), -getattr(state, _ORDER, {}).get(node, math.inf)


def _remember(state: Any, nodes: Any) -> None:
    order = dict(getattr(state, _ORDER, {}))
    for node in nodes:
        order.setdefault(node, max(order.values(), default=0) + 1)
    setattr(state, _ORDER, order)


def wanted_nodes(path: str | None) -> int | None:
    """The number of training nodes the operator wants (rule 3), or None when there is no such file or it holds no
    positive number (not written yet, or being rewritten)."""
    if not path:
        return None
    try:
        with open(path) as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return value if value > 0 else None


class _Size:
    """Rule 3: the handler's and its executor's settings follow the wanted size."""

    def __init__(self, handler: Any, path: str | None) -> None:
        self._handler, self._path = handler, path

    def follow(self) -> Any | None:
        """The new settings when the wanted size differs from the round size in force, else None."""
        wanted = wanted_nodes(self._path)
        current = self._handler._settings
        if wanted is None or wanted == current.min_nodes == current.max_nodes:
            return None
        settings = dataclasses.replace(current, min_nodes=wanted, max_nodes=wanted)
        self._handler._settings = settings
        self._handler._op_executor._settings = settings
        log.warning("%s: the group size is now %d training nodes (was %d:%d, from %s)", BACKEND, wanted,
                    current.min_nodes, current.max_nodes, self._path)
        return settings


def _spare_aware(join_op: Callable[[Any, float], Any], size: _Size | None = None) -> Callable[[Any, float], Any]:
    """Wrap torch's join operation with the rules the module doc describes."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action, _RendezvousContext, _should_keep_alive

    def join(ctx: Any, deadline: float) -> Any:
        if size is not None and (settings := size.follow()) is not None:  # rule 3
            ctx = _RendezvousContext(ctx.node, ctx.state, settings)
        state, me = ctx.state, ctx.node
        if state.closed and me in state.redundancy_list:
            _say_released(ctx.settings.run_id)  # torch raises RendezvousGracefulExitError next
        if state.closed or me in state.participants:
            return join_op(ctx, deadline)
        if state.complete and len(state.participants) >= ctx.settings.max_nodes:  # rule 1
            if me not in state.redundancy_list:
                return _Action.ADD_TO_REDUNDANCY_LIST  # out of the wait list in the same write
            return join_op(ctx, deadline)
        if not state.complete:  # rule 2
            mine = _priority(state, me)
            waiting = state.wait_list | state.redundancy_list
            ahead = sum(1 for n in waiting if n != me and _priority(state, n) > mine)
            if len(state.participants) + ahead >= ctx.settings.max_nodes:
                if me not in state.wait_list:
                    return _Action.ADD_TO_WAIT_LIST
                return _Action.KEEP_ALIVE if _should_keep_alive(ctx) else _Action.SYNC
        return join_op(ctx, deadline)

    return join


def _say_released(run_id: str) -> None:
    """Write SPARE_RELEASED at exit: after the traceback torch's launcher prints, so it is the log's last line."""
    def say() -> None:
        print(f"{SPARE_RELEASED}: rendezvous {run_id} was closed while this agent waited as a hot spare "
              f"(a participant ended); exit 1 is torch's", file=sys.stderr, flush=True)

    atexit.register(say)


def _round_complete(state: Any, settings: Any) -> None:
    """In the state write that completes a round: remember who trained (rule 2) and, when the round is full, park
    the agents left in the wait list as redundant (rule 1).

    Parking them in their own join loop alone is too late: it runs up to a second after the round completed
    (torch polls the state once a second), and the participants' agents, which poll ``num_nodes_waiting()``
    every monitor interval, would see them waiting and restart first."""
    if not state.complete:
        return
    if len(state.participants) >= settings.max_nodes and state.wait_list:
        state.redundancy_list.update(state.wait_list)
        state.wait_list.clear()
    setattr(state, _LAST, set(state.participants))
    _remember(state, sorted(state.participants, key=_priority_key(state)))
    _remember(state, state.redundancy_list)
    alive = set(state.last_heartbeats)
    setattr(state, _ORDER, {n: i for n, i in getattr(state, _ORDER, {}).items() if n in alive})  # forget the dead


def _priority_key(state: Any) -> Callable[[Any], tuple[float, str]]:
    order = getattr(state, _ORDER, {})
    return lambda node: (order.get(node, math.inf), repr(node))


def take_over(state: Any, me: Any, pod: str, settings: Any) -> list[Any]:
    """Rule 4, in the state write of an agent that enters the rendezvous or sends a heartbeat: record that ``me`` runs
    in ``pod`` and take every other agent recorded for that pod out of the rendezvous (as torch's heartbeat expiry
    takes out a dead one: the lists, the heartbeats, and a complete round left without participants is over),
    whether or not its heartbeats expired already. Returns the agents taken out."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    # An agent stays recorded after its heartbeats expired: a frozen node's agent (a paused VM, a node cut off
    # longer than the keep-alive expiry) is forgotten by torch, and woken after its pod was recreated elsewhere it
    # would join as a newcomer and take its replacement's place. Recorded here, it is taken out like a dead one.
    # One record per pod, so the map stays as small as the job.
    pods = dict(getattr(state, _POD, {}))
    gone = [n for n, p in pods.items() if p == pod and n != me]
    left_participants = False
    for node in gone:
        del pods[node]
        state.last_heartbeats.pop(node, None)
        if node in state.participants:
            del state.participants[node]
            left_participants = True
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
    pods[me] = pod
    setattr(state, _POD, pods)
    if gone:
        setattr(state, _GONE, [*getattr(state, _GONE, []), *gone][-GONE_KEPT:])
        log.warning("%s: the agent of pod %s took its predecessor's place: %s", BACKEND, pod,
                    ", ".join(str(n) for n in gone))
    if left_participants:
        dr._remove_participant_epilogue(state, settings)
    return gone


def _round_completed(state: Any) -> None:
    """Rule 5, in the state write that completes a round: when, and that no participant heard of it yet."""
    setattr(state, _COMPLETED, (state.round, time.time()))
    setattr(state, _READ, set())


def _completed_at(state: Any) -> float | None:
    """When the state's round completed (rule 5), or None while it is not complete or predates rule 5."""
    completed = getattr(state, _COMPLETED, None)
    if not state.complete or completed is None or completed[0] != state.round:
        return None
    return completed[1]


def _heard(state: Any, me: Any) -> None:
    """Rule 5, in a heartbeat's write: ``me``, a participant of the complete round, has heard of it."""
    if _completed_at(state) is not None and me in state.participants:
        read = getattr(state, _READ, set())
        if me not in read:
            setattr(state, _READ, read | {me})


def kept_from_expiry(state: Any, me: Any, now: float) -> set[Any]:
    """Rule 5: the agents whose heartbeats are not judged in this sync: ``me`` always, and every participant of a
    round just completed until each sent a heartbeat in it or ROUND_START_GRACE passed."""
    kept = {me}
    completed = _completed_at(state)
    if completed is not None and now - completed < ROUND_START_GRACE and \
            not set(state.participants) <= getattr(state, _READ, set()):
        kept.update(state.participants)
    return kept


def _guard_expiry(holder: Any, me: Any) -> bool:
    """Rule 5 on torch's state holder: its sanitizer, which drops the agents whose heartbeats expired after every
    sync, does not see the heartbeats of the agents ``kept_from_expiry``. False where the holder is not torch's."""
    sanitize = getattr(holder, "_sanitize", None)
    if sanitize is None or not hasattr(holder, "_state"):
        log.warning("%s: this torch's rendezvous state holder has no _sanitize; a slow agent may leave a round as "
                    "it starts", BACKEND)
        return False

    def guarded() -> None:
        beats = holder._state.last_heartbeats
        hidden = {n: beats.pop(n) for n in kept_from_expiry(holder._state, me, time.time()) if n in beats}
        try:
            sanitize()
        finally:
            holder._state.last_heartbeats.update(hidden)

    holder._sanitize = guarded
    return True


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


@functools.cache
def _executor_class(spares: bool = True) -> type:
    """torch's operation executor with this backend's rules: 1-3 (hot spares, ddpjob-c10d) when ``spares``, rule 4
    once ``pod`` is set, and rule 5 always (classes made on use: torch is imported lazily)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    if spares:
        base = _executor_class(False)
    else:
        class Executor(dr._DistributedRendezvousOpExecutor):
            spares = False  # rules 1-3
            size: _Size | None = None  # rule 3, set by create_handler
            pod: str | None = None  # rule 4: DDPJOB_POD_INDEX, set by enable_take_over

            def __init__(self, node: Any, state_holder: Any, settings: Any) -> None:
                super().__init__(node, state_holder, settings)
                _guard_expiry(state_holder, node)  # rule 5

            def run(self, state_handler: Any, deadline: float, update_deadline: Any = None) -> None:
                joining = isinstance(state_handler, dr._RendezvousJoinOp)
                if joining and self.spares:
                    state_handler = _spare_aware(state_handler, self.size)
                if self.pod is not None:
                    state_handler = _not_taken_over(state_handler, joining, self.pod)
                super().run(state_handler, deadline, update_deadline)

            def _keep_alive(self) -> None:
                # every write that enters a list or sends a heartbeat ends here (torch's add operations call it)
                super()._keep_alive()
                _heard(self._state, self._node)  # rule 5
                if self.pod is not None:
                    take_over(self._state, self._node, self.pod, self._settings)

            def _mark_rendezvous_complete(self) -> None:
                super()._mark_rendezvous_complete()
                _round_completed(self._state)  # rule 5

        return Executor

    class SpareExecutor(base):  # type: ignore[valid-type,misc]
        spares = True

        def _add_to_participants(self) -> None:
            super()._add_to_participants()
            _round_complete(self._state, self._settings)

        def _mark_rendezvous_complete(self) -> None:
            super()._mark_rendezvous_complete()
            _round_complete(self._state, self._settings)

        def _add_to_redundancy_list(self) -> None:
            super()._add_to_redundancy_list()
            self._state.wait_list.discard(self._node)  # one write moves it (rule 1)
            _remember(self._state, [self._node])

        def _remove_from_redundancy_list(self) -> None:
            # torch leaves the agent in no list and without a heartbeat until its next turn adds it to the wait
            # list: others deciding rule 2 in between would not count it, and a round completed in between would
            # forget its priority (seen in CI: the recreated pod took the spare's place). One write moves it.
            super()._remove_from_redundancy_list()
            self._state.wait_list.add(self._node)
            self._keep_alive()

    return SpareExecutor


def create_handler(params: Any) -> Any:
    """torchrun's handler creator for ``--rdzv-backend=ddpjob-c10d`` (same parameters as c10d)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    needed = ("_DistributedRendezvousOpExecutor", "_RendezvousJoinOp", "_RendezvousContext", "_Action",
              "_should_keep_alive", "_NodeDesc")
    missing = [n for n in needed if not hasattr(dr, n)]
    if missing:
        raise RuntimeError(f"rendezvous backend {BACKEND}: this torch lacks {', '.join(missing)}; "
                           f"use --rdzv-backend=c10d (without spares)")

    backend, store = create_backend(params)
    handler = dr.create_handler(store, backend, params)
    for attr in ("_op_executor", "_this_node", "_state_holder", "_settings", "_backend_name"):
        if not hasattr(handler, attr):
            raise RuntimeError(f"rendezvous backend {BACKEND}: this torch's handler lacks {attr}; "
                               f"use --rdzv-backend=c10d (without spares)")
    pod = this_pod()
    if pod is not None:
        fresh_identity(handler)
    executor = _executor_class()(handler._this_node, handler._state_holder, handler._settings)
    handler._op_executor = executor
    enable_take_over(handler, pod)
    handler._backend_name = BACKEND  # torchrun checks that the handler is of the backend it asked for
    size = executor.size = _Size(handler, os.environ.get(envmod.NODES_FILE))
    size.follow()
    waiting = handler.num_nodes_waiting

    def num_nodes_waiting() -> int:
        """torch's count; at least 1 when the wanted size changed, so that a training agent re-forms (rule 3)."""
        resized = size.follow() is not None
        count = waiting()
        return max(count, 1) if resized else count

    handler.num_nodes_waiting = num_nodes_waiting
    return handler


def this_pod() -> str | None:
    """The pod this agent runs in, for rule 4 (``DDPJOB_POD_INDEX``); None outside a DDPJob or with
    ``DDPJOB_TAKE_OVER=0``."""
    if envmod.get_int(envmod.TAKE_OVER, 1, minimum=0) == 0:
        return None
    return envmod.get_str(envmod.POD_INDEX, None)


def enable_take_over(handler: Any, pod: str | None) -> bool:
    """Rule 4 on a dynamic rendezvous handler, c10d's or this backend's. False, and the handler unchanged, without a
    pod or where the handler or this torch is not what it was written for."""
    if pod is None:
        return False
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    needed = ("_remove_participant_epilogue", "_DistributedRendezvousOpExecutor", "_RendezvousJoinOp", "_Action",
              "_NodeDesc")
    if not isinstance(handler, dr.DynamicRendezvousHandler) or not all(hasattr(dr, n) for n in needed) or \
            not all(hasattr(handler, a) for a in ("_op_executor", "_this_node", "_state_holder", "_settings")):
        log.warning("%s: a replacement cannot take its predecessor's place here (not torch's dynamic rendezvous); "
                    "it waits for the predecessor's heartbeats to expire", BACKEND)
        return False
    executor = handler._op_executor
    if not isinstance(executor, _executor_class(False)):
        if type(executor) is not dr._DistributedRendezvousOpExecutor:
            return False
        fresh_identity(handler)
        executor = _executor_class(False)(handler._this_node, handler._state_holder, handler._settings)
        handler._op_executor = executor
    executor.pod = pod
    waiting = handler.num_nodes_waiting

    def num_nodes_waiting() -> int:
        """torch's count, read by a training agent every monitor interval; TakenOver once a newer agent of this pod
        took this one out. An agent woken from a freeze (a paused VM) after its pod was recreated elsewhere then
        stops, with its workers, at its next look, instead of when they fail (a worker stopped inside a collective
        or a store wait could hold on until the process group's timeout)."""
        count = waiting()
        if taken_over(handler._state_holder.state, handler._this_node):
            raise TakenOver(handler._this_node, pod)
        return count

    handler.num_nodes_waiting = num_nodes_waiting
    return True


def fresh_identity(handler: Any) -> Any:
    """Give the handler's agent a name no earlier agent of its pod had (rule 4): torch's ``<address>_<pid>_<n>`` with
    ``<n>`` an incarnation number drawn now instead of a per-process counter, which repeats with the PID (1 in a
    container) when a container restarts in place. Call before the handler's first operation."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    node = handler._this_node
    handler._this_node = dr._NodeDesc(node.addr, node.pid, int.from_bytes(os.urandom(4), "big") >> 1)
    return handler._this_node


def get_handler() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: torch calls it and registers what it returns under the entry
    point's name."""
    return create_handler
