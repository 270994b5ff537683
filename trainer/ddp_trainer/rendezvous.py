"""The ``ddpjob-c10d`` rendezvous backend: torch's c10d rendezvous, made safe for hot spares.

A hot spare is a torchrun agent that waits in the rendezvous while the group is full (``--nnodes=N:N``
and N agents training), so that a lost node's place is taken without scheduling, pulling, starting a
container or importing torch. torch's dynamic rendezvous nearly supports it: an agent that arrives when
the round is complete with ``max_nodes`` participants goes into the *redundancy list*, keeps its heartbeat,
and once a participant drops out (its heartbeat expired) moves to the wait list and is admitted by the
next round.

It livelocks, though (torch 2.13, measured: tests/trainer/test_spares.py). An agent that is in the *wait
list* when a round completes with ``max_nodes`` participants without it stays in the wait list: the join
operation moves only agents that are in no list to the redundancy list. Every agent polls
``num_nodes_waiting()`` and restarts its workers for the next round while it is above 0, so the
participants restart again and again, and each new round again leaves one agent behind in the wait list.
That happens at every start with N+1 agents and at every recovery where the survivors rejoin at slightly
different times (the first to rejoin finds the old round complete with fewer than ``max_nodes`` and
enters the wait list).

This backend is the c10d handler with three rules added. The state write that completes a round with
``max_nodes`` participants also moves every agent left in the wait list to the redundancy list (atomically:
the participants never see them waiting). An agent that finds itself outside a complete round that has
``max_nodes`` participants, in the wait list or in no list, enters the redundancy list whatever its join
deadline (redundant agents wait without one, as in torch). And a newcomer (an agent that has been neither a
participant nor redundant in this rendezvous: the pod recreated for a lost one) waiting for a round that the
agents already waiting can fill leaves the places to them: otherwise whichever agent polls first wins, and a
quick replacement would train while the spare kept waiting (measured on a cluster) -- as fast, but the spare
would never be used. Everything else (heartbeats, admitting a redundant
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
import sys
from typing import Any, Callable

BACKEND = "ddpjob-c10d"
# The last line a released spare's torchrun writes (after torch's traceback): the operator finds it in the
# termination message (FallbackToLogsOnError) and neither counts nor replaces-as-failed that exit.
SPARE_RELEASED = "ddpjob-c10d: spare released"


class _Membership:
    """What one agent remembers of the rendezvous: whether it has been in it (a participant or a spare)."""

    veteran = False


def _spare_aware(join_op: Callable[[Any, float], Any], me: _Membership) -> Callable[[Any, float], Any]:
    """Wrap torch's join operation with the rules the module doc describes."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action, _should_keep_alive

    def join(ctx: Any, deadline: float) -> Any:
        state = ctx.state
        if state.closed and ctx.node in state.redundancy_list:
            _say_released(ctx.settings.run_id)  # torch raises RendezvousGracefulExitError next
        if state.closed:
            return join_op(ctx, deadline)
        if ctx.node in state.participants or ctx.node in state.redundancy_list:
            me.veteran = True
        full = state.complete and len(state.participants) >= ctx.settings.max_nodes
        if full and ctx.node not in state.participants:
            if ctx.node in state.wait_list:
                return _Action.REMOVE_FROM_WAIT_LIST  # then, on the next turn, the redundancy list
            if ctx.node not in state.redundancy_list:
                return _Action.ADD_TO_REDUNDANCY_LIST
        others = len(state.participants) + len(state.wait_list - {ctx.node})
        if (not state.complete and not me.veteran and ctx.node in state.wait_list
                and others >= ctx.settings.max_nodes):
            # A newcomer (the pod recreated for a lost one) lets the agents already waiting take the places
            # first: the spare trains, the newcomer becomes the spare (parked once the round is full).
            return _Action.KEEP_ALIVE if _should_keep_alive(ctx) else _Action.SYNC
        return join_op(ctx, deadline)

    return join


def _say_released(run_id: str) -> None:
    """Write SPARE_RELEASED at exit: after the traceback torch's launcher prints, so it is the log's last line."""
    def say() -> None:
        print(f"{SPARE_RELEASED}: rendezvous {run_id} was closed while this agent waited as a hot spare "
              f"(a participant ended); exit 1 is torch's", file=sys.stderr, flush=True)

    atexit.register(say)


def _park_waiting(state: Any, settings: Any) -> None:
    """In the same state write that completes a full round: the agents left in the wait list become redundant.

    Moving them in their own join loop (`_spare_aware`) alone is too late: it runs up to a second after the
    round completed (torch polls the state once a second), and the participants' agents, which poll
    ``num_nodes_waiting()`` every monitor interval, would see them waiting and restart first."""
    if state.complete and len(state.participants) >= settings.max_nodes and state.wait_list:
        state.redundancy_list.update(state.wait_list)
        state.wait_list.clear()


def create_handler(params: Any) -> Any:
    """torchrun's handler creator for ``--rdzv-backend=ddpjob-c10d`` (same parameters as c10d)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    needed = ("_DistributedRendezvousOpExecutor", "_RendezvousJoinOp", "_Action", "_should_keep_alive")
    missing = [n for n in needed if not hasattr(dr, n)]
    if missing:
        raise RuntimeError(f"rendezvous backend {BACKEND}: this torch lacks {', '.join(missing)}; "
                           f"use --rdzv-backend=c10d (without spares)")

    class _Executor(dr._DistributedRendezvousOpExecutor):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.membership = _Membership()  # lives as long as the agent's handler: across its rounds

        def run(self, state_handler: Any, deadline: float, update_deadline: Any = None) -> None:
            if isinstance(state_handler, dr._RendezvousJoinOp):
                state_handler = _spare_aware(state_handler, self.membership)
            super().run(state_handler, deadline, update_deadline)

        def _add_to_participants(self) -> None:
            super()._add_to_participants()
            _park_waiting(self._state, self._settings)

        def _mark_rendezvous_complete(self) -> None:
            super()._mark_rendezvous_complete()
            _park_waiting(self._state, self._settings)

    backend, store = create_backend(params)
    handler = dr.create_handler(store, backend, params)
    for attr in ("_op_executor", "_this_node", "_state_holder", "_settings", "_backend_name"):
        if not hasattr(handler, attr):
            raise RuntimeError(f"rendezvous backend {BACKEND}: this torch's handler lacks {attr}; "
                               f"use --rdzv-backend=c10d (without spares)")
    handler._op_executor = _Executor(handler._this_node, handler._state_holder, handler._settings)
    handler._backend_name = BACKEND  # torchrun checks that the handler is of the backend it asked for
    return handler


def get_handler() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: torch calls it and registers what it returns under the entry
    point's name."""
    return create_handler
