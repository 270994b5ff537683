"""The ``ddpjob-c10d`` rendezvous backend: torch's c10d rendezvous, made safe for hot spares.

A hot spare is a torchrun agent that waits in the rendezvous while the group is full (``--nnodes=N:N``
and N agents training), so that a lost node's place is taken without scheduling, pulling, starting a
container or importing torch. torch's dynamic rendezvous nearly supports it: an agent that arrives when
the round is complete with ``max_nodes`` participants goes into the *redundancy list*, keeps its heartbeat,
and once a participant drops out (its heartbeat expired) moves to the wait list and is admitted by the
next round.

It livelocks, though (torch 2.13, measured: tests/trainer/test_trainer_spares.py). An agent that is in the *wait
list* when a round completes with ``max_nodes`` participants without it stays in the wait list: the join operation
moves only agents that are in no list to the redundancy list. Every agent polls ``num_nodes_waiting()`` and restarts
its workers for the next round while it is above 0, so the participants restart again and again, and each new round
again leaves one agent behind in the wait list. That happens at every start with N+1 agents and at every recovery
where the survivors rejoin at slightly different times (the first to rejoin finds the old round complete with fewer
than ``max_nodes`` and enters the wait list).

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
   in between, which let a newcomer take the place too). Without rule 2, a quick replacement took the place while the
   spare kept waiting (measured on a cluster), and with two spares a survivor could be left out, its snapshot with it. The
   priorities live in the shared state (pickled with it): the last round's participants and, per agent, when it first
   was a participant or redundant. A higher-priority agent that is not waiting yet (still stopping its workers) is not
   waited for; survivors rejoin within a second of a loss, well before the lost agent's heartbeat expires and the new
   round starts.

3. The group size follows the job (``kubectl scale``; jobs with spares and elastic jobs). The operator keeps the
   wanted number of training nodes W (spec.nodes) in an annotation of every pod, which the kubelet writes into a
   downward API file named by ``DDPJOB_NODES_FILE``. The backend reads it before every step of a join and whenever
   the agent asks ``num_nodes_waiting()`` (each monitor interval). W sets the round's settings (``sized``): with a
   fixed ``--nnodes`` range (a job with spares) min = max = W; with an elastic range (minNodes < maxNodes)
   max = W and min = min(spec min, W), so torch completes a round the moment W agents joined (its join marks it
   complete when the participants reach max_nodes) instead of waiting the last call for maxNodes, and waits the
   last call only while fewer than W are there (a pod starting or lost), after which it continues smaller. A
   training agent that sees new settings reports a waiting node, so every agent stops its workers and the group
   re-forms at the new size (the spares stay spares: places go by rule 2). Agents that read the file a little
   later take part in one more re-form; without the file the round keeps ``PET_NNODES``, the spec's range.

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
   in. That holds for an agent whose heartbeats expired too (a frozen node woken after its pod was recreated elsewhere):
   records are kept per pod, not per heartbeat. torch names an agent ``<address>_<pid>_<n>``; in a container the agent
   is PID 1, so a container restarted in place would repeat the name of the agent it replaces. With rule 4 on, ``<n>``
   is an incarnation number drawn when the agent starts (``fresh_identity``), so every agent process has a name of its
   own. Without ``DDPJOB_POD_INDEX`` (plain torchrun outside a DDPJob) nothing changes; ``DDPJOB_TAKE_OVER=0`` turns the
   rule off. It applies to plain ``c10d`` too when ``ddp_trainer.launch`` runs the agent (jobs without spares): the
   executor below, with rules 1-3 off.

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

6. A waiting agent reads the state every ``poll_interval(N)`` (``rendezvous_rules``): ``min(0.1 s * max(1, N / 8), 2 s)``
   for a round of N nodes (``DDPJOB_RDZV_POLL_SECONDS`` instead of 0.1 s where set), less a jitter of up to a fifth
   drawn per agent. torch's state holder serves a cached state for 1 s whatever the join loop's delay
   (``ddp_trainer.launch`` turns it every 0.1 s), so a waiting agent saw a round complete up to a second late (on
   loopback, 4 agents: 0.55-1.0 s), and every agent read the whole state, O(N) bytes, once a second whatever N: O(N^2)
   bytes a second. Now jobs of up to 8 nodes see a round's completion within a tenth of a second, and the reads of all
   agents stay at most 80 a second from 8 to 160 nodes (N/2 past it). A training agent's look
   (``num_nodes_waiting()``, every monitor interval: 0.1 s) keeps torch's 1 s cache, or the longer interval of a large
   job, so training costs no more reads than before. Rule 6 applies wherever this module's executor runs.

7. A heartbeat is a key of the agent's own, not a rewrite of the shared state (``rendezvous_rules.Beats``). torch
   keeps every agent's last heartbeat in the state, so each heartbeat was a compare-and-set of the whole state, O(N)
   bytes, per agent per keep-alive interval: O(N^2) bytes a second through the store, and N agents' writes racing
   each other (make bench-rdzv-scale, docs/scale.md). Now an agent's heartbeat sets ``<state key>/beat/<agent>`` to
   the time, and whoever reads the state lays those keys over its heartbeat times before torch's sanitizer judges
   them (two store calls per read), so a silent agent expires exactly as before. The state is written when the
   membership changes, and by an agent's first heartbeat in a new round (rule 5 records there that it heard of the
   round). Rule 7 applies wherever this module's executor runs; every agent of a job runs the same one, and an agent
   that writes no key (not under this executor) keeps its heartbeats in the state, as torch does.

8. A re-form takes about one write of the state per agent, not three. Every write is a compare-and-set of the whole
   state, O(N) bytes, on the one key all agents write, so writes go one after another and the losers retry: torch's
   re-form took, per survivor, one write to leave the round, one to enter the wait list and one to enter the new
   round. Now an agent that leaves a round still running (``next_rendezvous``' exit) enters the wait list in the same
   write, and the write of the first agent that enters a new round admits every agent waiting for it, by rule 2's
   priority, up to max_nodes (``rendezvous_rules.admit_waiting``): the others find themselves participants at their
   next read. Rule 8 applies wherever this module's executor runs, to rounds of more than ``BATCH_ABOVE_NODES`` (8)
   nodes: a small job's writes are a few KB, and its rendezvous stays torch's step for step.

9. A write that lost the race waits before the agent tries again (``rendezvous_rules.backing_off``): a random while
   up to 10 ms x 2^k after its k-th loss in a row, at most the round's poll interval (rule 6: 0.1 s up to 8 nodes,
   2 s from 160). torch tries again at once, so agents that write together (every survivor leaving its round at a
   re-form) retried in lockstep: N^2/2 attempts of O(N) bytes.

10. A start or a re-form takes a few writes of the state, not one per agent (``rendezvous_batch``, where rules 7 and 8
   apply): an agent asking for a round announces itself in one small store operation, and whoever writes the state
   places every announced agent as its own writes would (rules 1, 2, 4, 8); rule 5's record is a key of the round's.

11-12. The state is read only when its version moved and concerns the agent (``rendezvous_version``).

Everything else (heartbeats, admitting a redundant agent when a participant drops out, closing at the end) is
torch's. A redundant agent still ends when a participant closes the rendezvous at the end of the training: torch raises
RendezvousGracefulExitError there, its launcher then fails on the missing run result (``'NoneType' object has no
attribute 'is_failed'``) and the spare's torchrun exits 1; this backend makes SPARE_RELEASED its last log line, which
is how the operator tells that exit from a failure (docs/contract.md).

torchrun finds the backend through the ``torchrun.handlers`` entry point (trainer/pyproject.toml: ``pip install``
registers it); the operator selects it with ``PET_RDZV_BACKEND=ddpjob-c10d`` for jobs with ``spec.spares`` or an
elastic range (``spec.torchrun.rdzvBackend: auto``). It uses torch internals (underscored names), so it checks them
when it is created and fails with a clear message rather than misbehave on a torch it was not written for; before
that, a torch outside the tested range is refused outright (``torch_version``: one line, exit code 78).

The rules' decisions and state writes are in ``ddp_trainer.rendezvous_rules``; this module wires them into torch's
operation executor, state holder and handler (and keeps rule 5's judgment of heartbeats next to the sanitizer).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from . import env as envmod, rendezvous_batch, rendezvous_version, torch_version
# The rules' decisions and state writes; every name stays importable from here (torchrun's entry point, the
# operator's contract test and the unit tests use ddp_trainer.rendezvous).
from .rendezvous_rules import (  # noqa: F401
    BACKEND, GONE_KEPT, SPARE_RELEASED, _COMPLETED, _GONE, _LAST, _ORDER, _POD, _READ, _completed_at, _heard,
    _priority, _priority_key, _remember, _round_complete, _round_completed, _say_released, _Size, expiry,
    _spare_aware, POLL_BASE_S, poll_interval, wanted_nodes, Beats, _beating, admit_waiting, backing_off, batched,
)
from .rendezvous_take_over import TakenOver, _not_taken_over, take_over, taken_over  # noqa: F401 (rule 4)

log = logging.getLogger(__name__)

# Rule 5 keeps a new round's participants from heartbeat expiry until all heard of the round, at most this long: an
# agent's store waits at a round's start (MASTER_ADDR, the role information) time out after 60 s anyway.
ROUND_START_GRACE = 60.0


def kept_from_expiry(state: Any, me: Any, now: float) -> set[Any]:
    """Rule 5: the agents whose heartbeats are not judged in this sync: ``me`` always, and every participant of a
    round just completed until each sent a heartbeat in it or ROUND_START_GRACE passed."""
    kept = {me}
    completed = _completed_at(state)
    if completed is not None and now - completed < ROUND_START_GRACE and \
            not set(state.participants) <= getattr(state, _READ, set()):
        kept.update(state.participants)
    return kept


def _guard_expiry(holder: Any, me: Any, beats: Beats | None = None) -> bool:
    """Rule 5 on torch's state holder: its sanitizer, which drops the agents whose heartbeats expired after every
    sync, does not see the heartbeats of the agents ``kept_from_expiry``; and rule 7: it sees those in the agents'
    heartbeat keys (``beats``). False where the holder is not torch's."""
    sanitize = getattr(holder, "_sanitize", None)
    if sanitize is None or not hasattr(holder, "_state"):
        log.warning("%s: this torch's rendezvous state holder has no _sanitize; a slow agent may leave a round as "
                    "it starts", BACKEND)
        return False

    def guarded() -> None:
        settings = holder._settings
        expired = datetime.now(timezone.utc) - expiry(settings)
        if beats is not None:  # rule 7, before torch's sanitizer judges
            beats.overlay(holder._state, expired)
        beats_now = holder._state.last_heartbeats
        # judged by one clock reading: a stall (a starved process) before torch's sanitizer reads its own must not drop
        # agents alive as of this one (at 512 agents on 2 cores it dropped hundreds at once); none expired: no sanitizer
        if all(b >= expired for b in beats_now.values()):
            holder._dead_nodes = []
            return
        kept = kept_from_expiry(holder._state, me, time.time()) | {n for n, b in beats_now.items() if b >= expired}
        hidden = {n: beats_now.pop(n) for n in kept if n in beats_now}
        try:
            sanitize()
        finally:
            holder._state.last_heartbeats.update(hidden)

    holder._sanitize = guarded
    return True


# torch's state holder caches the state this long (its default); a training agent's look keeps it (rule 6).
TORCH_CACHE_S = 1.0


@contextlib.contextmanager
def _paced(holder: Any, seconds: float) -> Iterator[None]:
    """Rule 6 on torch's state holder: within the block (a join) it reads the store at most every ``seconds``;
    after it, at most every TORCH_CACHE_S or ``seconds``, the longer. Nothing where the holder is not torch's."""
    if not hasattr(holder, "_cache_duration"):
        yield
        return
    holder._cache_duration = seconds
    try:
        yield
    finally:
        holder._cache_duration = max(TORCH_CACHE_S, seconds)


@contextlib.contextmanager
def _fresh_for_beats(holder: Any, settings: Any, on: bool) -> Iterator[None]:
    """Rule 7 on a heartbeat: it reads the state when the holder's copy is a keep-alive interval old, as torch's
    heartbeat did (its compare-and-set returned the state), so an agent's view of who expired stays as fresh as
    before; it only no longer writes it. Nothing when ``on`` is False or the holder is not torch's."""
    cache = getattr(holder, "_cache_duration", None)
    if not on or cache is None:
        yield
        return
    holder._cache_duration = min(cache, settings.keep_alive_interval.total_seconds())
    try:
        yield
    finally:
        holder._cache_duration = cache


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
                backing_off(state_holder)  # rule 9
                self.beats = Beats.of(state_holder)  # rule 7
                if not _guard_expiry(state_holder, node, self.beats):  # rule 5 (and 7: judged with the keys)
                    self.beats = None
                self.helping = rendezvous_batch.Helping.of(state_holder, self, ROUND_START_GRACE)  # rule 10
                self.versioned = rendezvous_version.Versioned.of(state_holder, self)  # rule 11
                rendezvous_version.quiet_events(self)
                # rule 6: the base, and a jitter drawn once so that agents started together do not read in lockstep
                self.poll_base = envmod.get_float(envmod.RDZV_POLL, POLL_BASE_S, minimum=0.0)
                self.poll_jitter = random.random()

            def run(self, state_handler: Any, deadline: float, update_deadline: Any = None) -> None:
                joining = isinstance(state_handler, dr._RendezvousJoinOp)
                keeping = isinstance(state_handler, dr._RendezvousKeepAliveOp)
                if joining and self.spares:
                    state_handler = _spare_aware(state_handler, self.size)
                if self.beats is not None and (joining or keeping):
                    state_handler = _beating(state_handler, self.beats, joining, getattr(self.helping, "heard", None))
                if self.helping is not None:
                    state_handler = self.helping.wrap(state_handler, joining, keeping)  # rule 10
                if self.pod is not None:
                    state_handler = _not_taken_over(state_handler, joining, self.pod)
                if not joining:
                    with _fresh_for_beats(self._state_holder, self._settings, keeping and self.beats is not None):
                        super().run(state_handler, deadline, update_deadline)
                    return
                # rule 6, with the round size in force (rule 3 may change it between joins)
                with _paced(self._state_holder, poll_interval(self._settings.max_nodes, self.poll_base,
                                                              self.poll_jitter)):
                    super().run(state_handler, deadline, update_deadline)

            def _keep_alive(self) -> None:
                # every write that enters a list or sends a heartbeat ends here (torch's add operations call it)
                super()._keep_alive()
                if self.beats is not None:
                    self.beats.enter(self._state, self._node)  # rule 7: its key exists before it is read
                _heard(self._state, self._node)  # rule 5
                if self.pod is not None:
                    take_over(self._state, self._node, self.pod, self._settings)

            def _mark_rendezvous_complete(self) -> None:
                super()._mark_rendezvous_complete()
                _round_completed(self._state)  # rule 5

            def _add_to_participants(self) -> None:
                super()._add_to_participants()
                admit_waiting(self._state, self._settings, self._mark_rendezvous_complete)  # rule 8

            def _remove_from_participants(self) -> None:
                super()._remove_from_participants()
                # rule 8: an agent that leaves a round still running (next_rendezvous' exit) enters the wait list in
                # the same write, the step torch's join takes next in a write of its own
                if self._state.complete and not self._state.closed and batched(self._settings):
                    self._state.wait_list.add(self._node)
                    self._keep_alive()

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
    """torchrun's handler creator for ``--rdzv-backend=ddpjob-c10d`` (same parameters as c10d). Exits 78 with one
    line on a torch outside the tested range (``torch_version``), before it touches torch's internals."""
    torch_version.require(BACKEND)
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    needed = ("_DistributedRendezvousOpExecutor", "_RendezvousJoinOp", "_RendezvousKeepAliveOp", "_RendezvousContext",
              "_Action", "_should_keep_alive", "_NodeDesc")
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
    rendezvous_version.quiet_events(handler)  # any handler: its heartbeats' events cost nothing unrecorded
    rendezvous_version.beat_first(handler)  # any handler: its heartbeat key, where it has one, before its look
    if pod is None:
        return False
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    needed = ("_remove_participant_epilogue", "_DistributedRendezvousOpExecutor", "_RendezvousJoinOp",
              "_RendezvousKeepAliveOp", "_Action", "_NodeDesc")
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
