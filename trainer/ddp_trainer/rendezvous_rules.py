"""The rules of the ``ddpjob-c10d`` rendezvous backend (numbered in ``ddp_trainer.rendezvous``'s docstring) as
decisions and writes on torch's shared rendezvous state: who may join and where it waits (rules 1 and 2), the group
size that follows the job (rule 3), the round-start records (rule 5), how often a waiting agent reads the state
(rule 6), heartbeats in keys of their own (rule 7), re-forms in few writes (rule 8) and the back-off of a write that
lost the race (rule 9); rule 4, the take-over of a recreated pod's predecessor, is ``rendezvous_take_over``.
``ddp_trainer.rendezvous`` wires them into torch's operation executor and handler; torch's own classes are imported
only where a rule needs them (torch is imported lazily)."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import random
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

BACKEND = "ddpjob-c10d"
# The last line a released spare's torchrun writes (after torch's traceback): the operator finds it in the
# termination message (FallbackToLogsOnError) and neither counts nor replaces-as-failed that exit.
SPARE_RELEASED = f"{BACKEND}: spare released"

# the backend's logger: its lines keep the name ddp_trainer.rendezvous
log = logging.getLogger(f"{__package__}.rendezvous")

_LAST = "ddpjob_last"    # state attribute: the participants of the last complete round
_ORDER = "ddpjob_order"  # state attribute: node -> when (a counter) it first was a participant or redundant
_POD = "ddpjob_pod"      # state attribute: node -> the pod (DDPJOB_POD_INDEX) its agent runs in (rule 4)
_GONE = "ddpjob_gone"    # state attribute: the nodes a newer agent of their pod took out (rule 4), newest last
GONE_KEPT = 64           # how many of those the state remembers
_COMPLETED = "ddpjob_completed"  # state attribute: (round, time.time()) of the write that completed the round (rule 5)
_READ = "ddpjob_read"            # state attribute: the participants that sent a heartbeat in that round (rule 5)
_BEATS = "ddpjob_beats"          # state attribute: the agents whose heartbeats are in keys of their own (rule 7)


def _priority(state: Any, node: Any) -> tuple[bool, float]:
    """Higher is first: the last round's participants, then by how long an agent has been in the rendezvous."""
    return node in getattr(state, _LAST, ()), -getattr(state, _ORDER, {}).get(node, math.inf)


def _remember(state: Any, nodes: Any) -> None:
    """Number the agents not numbered yet after every one that is, in the given order: one look at the order (the
    write that completes a round of N remembers N; a look per agent made it N²/2)."""
    order = dict(getattr(state, _ORDER, {}))
    last = max(order.values(), default=0)
    for node in nodes:
        if node not in order:
            last += 1
            order[node] = last
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


def sized(spec_min: int, spec_max: int, wanted: int) -> tuple[int, int]:
    """Rule 3: a round's (min_nodes, max_nodes) for the wanted size W, from the range torchrun started with (its
    ``--nnodes``, the job's spec). A fixed range (a job with spares: nodes:nodes) becomes W:W. An elastic range
    becomes min(spec min, W):W: torch completes a round the moment W agents joined (its join marks it complete when
    the participants reach max_nodes), and waits the last call only while fewer are there (a pod starting or lost),
    after which it still continues with as few as the spec allows."""
    if spec_min == spec_max:
        return wanted, wanted
    return min(spec_min, wanted), wanted


class _Size:
    """Rule 3: the handler's and its executor's settings follow the wanted size."""

    def __init__(self, handler: Any, path: str | None) -> None:
        self._handler, self._path = handler, path
        spec = handler._settings  # torchrun's --nnodes: the job's own range
        self.spec_range = (spec.min_nodes, spec.max_nodes)

    def follow(self) -> Any | None:
        """The new settings when the wanted size asks for other ones than those in force, else None (also without
        a wanted size: the settings in force stay, at first the spec's own range)."""
        wanted = wanted_nodes(self._path)
        current = self._handler._settings
        if wanted is None:
            return None
        min_nodes, max_nodes = sized(*self.spec_range, wanted)
        if (min_nodes, max_nodes) == (current.min_nodes, current.max_nodes):
            return None
        settings = dataclasses.replace(current, min_nodes=min_nodes, max_nodes=max_nodes)
        self._handler._settings = settings
        self._handler._op_executor._settings = settings
        log.warning("%s: the group size is now %d training nodes (round %d:%d, was %d:%d, from %s)", BACKEND, wanted,
                    min_nodes, max_nodes, current.min_nodes, current.max_nodes, self._path)
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


# How often a waiting agent reads the rendezvous state (rule 6): the base (DDPJOB_RDZV_POLL_SECONDS, ddp_trainer.launch's
# join-loop delay) up to POLL_NODES_PER_BASE nodes, growing in proportion past it, at most POLL_MAX_S; jitter takes up to
# POLL_JITTER of it off, never adds (a small job's interval stays within the join loop's turn, so every turn reads).
POLL_BASE_S = 0.1
POLL_NODES_PER_BASE = 8
POLL_MAX_S = 2.0
POLL_JITTER = 0.2


def poll_interval(nodes: int, base: float = POLL_BASE_S, jitter: float = 0.0) -> float:
    """Rule 6: seconds between a waiting agent's reads of the state, ``min(base * max(1, nodes / 8), 2 s)`` less a
    ``jitter`` share (a number in [0, 1) the caller draws once per agent) of up to a fifth. Each read is the whole
    state, O(N) bytes, so N agents reading every ``base`` cost O(N^2) bytes a second; this way the reads of all agents
    stay at most 80 a second from 8 to 160 nodes (N/2 past it), and jobs of up to 8 nodes see a round's completion
    within ``base``. A ``base`` above the cap is kept."""
    interval = min(base * max(1.0, nodes / POLL_NODES_PER_BASE), max(POLL_MAX_S, base))
    return interval * (1.0 - POLL_JITTER * jitter)


class Beats:
    """Rule 7: an agent's heartbeats in a store key of its own (``<state key>/beat/<agent>``: the time, a few bytes), not
    in the shared state. torch keeps them in the state, so every heartbeat was a compare-and-set of the whole state,
    O(N) bytes, once per keep-alive interval per agent (O(N²) bytes a second, and the writes of N agents racing each
    other); the state is now written only when the membership changes, and once per round by rule 5. Whoever reads
    the state lays the keys of the agents it lists over its heartbeat times (``overlay``: two store calls, O(N) bytes
    like the state itself) before torch's sanitizer judges them, so a silent agent expires exactly as before."""

    def __init__(self, store: Any, key: str) -> None:
        self._store, self._prefix = store, f"{key}/beat/"
        self.created = False  # this agent's key exists (made before the agent first enters the state)
        self.sent = -math.inf  # when (time.monotonic()) it last sent a heartbeat

    @classmethod
    def of(cls, holder: Any) -> "Beats | None":
        """The beats of torch's c10d state holder (its backend's store and key, its keep-alive settings); None for any
        other."""
        backend = getattr(holder, "_backend", None)
        store, key = getattr(backend, "_store", None), getattr(backend, "_key", None)
        if store is None or not isinstance(key, str) or not hasattr(holder, "_settings"):
            return None
        return cls(store, key)

    def key(self, node: Any) -> str:
        return self._prefix + str(node)  # torch's <address>_<pid>_<n>

    def send(self, node: Any) -> None:
        self._call("set", self.key(node), repr(time.time()))
        self.created, self.sent = True, time.monotonic()

    def enter(self, state: Any, me: Any) -> None:
        """In a state write of ``me`` (it enters a list or sends a heartbeat there): its key exists (made now, the
        first time), so readers may read it; agents no longer listed are forgotten. An agent that writes no key (not
        under this executor) is never in the set, and its heartbeats in the state stand as torch's."""
        if not self.created:
            self.send(me)
        keyed = getattr(state, _BEATS, set())
        if me not in keyed or not keyed <= state.last_heartbeats.keys():
            setattr(state, _BEATS, {n for n in keyed if n in state.last_heartbeats} | {me})

    def overlay(self, state: Any, expired: datetime) -> None:
        """Every listed agent whose heartbeat in the state is older than ``expired`` (torch's sanitizer would drop it)
        gets the later of that and its key's: while a round forms, the state's own are fresh and nothing is read."""
        keyed = getattr(state, _BEATS, set())  # their keys exist: an agent makes its key before it enters the state
        nodes = [n for n, beat in state.last_heartbeats.items() if beat < expired and n in keyed]
        keys = [self.key(n) for n in nodes]
        if not keys:
            return
        for node, raw in zip(nodes, self._call("multi_get", keys)):
            try:
                beat = datetime.fromtimestamp(float(raw), timezone.utc)
            except (ValueError, OverflowError, OSError, TypeError):
                continue  # not a time: the state's own heartbeat stands
            if beat > state.last_heartbeats[node]:
                state.last_heartbeats[node] = beat

    def _call(self, op: str, *args: Any) -> Any:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:  # as torch's c10d backend reports a store failure
            raise RendezvousConnectionError(f"{BACKEND}: the heartbeat keys' store call {op} failed") from exc


def _unheard(state: Any, me: Any) -> bool:
    """Rule 5 still wants ``me``'s next heartbeat written into the state: it has not heard of its new round yet."""
    return _completed_at(state) is not None and me in state.participants and me not in getattr(state, _READ, set())


def _beating(op: Callable[[Any, float], Any], beats: Beats, joining: bool,
             heard: Callable[[Any], bool] | None = None) -> Callable[[Any, float], Any]:
    """Rule 7 on an operation: a heartbeat it decides on goes to the agent's key, not into the state (unless rule 5
    wants it there and rule 10's ``heard`` does not record it by key); the local copy of the state records it, so the
    agent does not send it again at the next turn."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action

    def beat(ctx: Any, deadline: float) -> Any:
        action = op(ctx, deadline)
        if action != _Action.KEEP_ALIVE or (_unheard(ctx.state, ctx.node) and not (heard and heard(ctx))):
            return action
        if time.monotonic() - beats.sent >= ctx.settings.keep_alive_interval.total_seconds() / 2:
            beats.send(ctx.node)  # else sent just now (rendezvous_version.beat_first)
        ctx.state.last_heartbeats[ctx.node] = datetime.now(timezone.utc)  # local only: no state write
        return _Action.SYNC if joining else _Action.FINISH

    return beat


# Rule 8 applies to rounds of more than this many nodes: a small job's writes are a few KB, and its rendezvous stays
# torch's, step for step.
BATCH_ABOVE_NODES = 8


def expiry(settings: Any) -> timedelta:
    """How long a silent agent stays in the rendezvous: torch's keep-alive interval times its attempts."""
    return settings.keep_alive_interval * settings.keep_alive_max_attempt


def is_refresher(state: Any, me: Any) -> bool:
    """Whether ``me`` is the state's refresher (rule 10): the agent of its first heartbeat entry, the oldest (every
    agent sees the same order, and looking is O(1))."""
    return next(iter(state.last_heartbeats), None) == me


def batched(settings: Any) -> bool:
    """Whether rule 8 applies to a round of these settings."""
    return settings.max_nodes > BATCH_ABOVE_NODES


def admit_waiting(state: Any, settings: Any, complete: Callable[[], None]) -> list[Any]:
    """Rule 8, in the write of an agent that entered a round not complete yet: every agent waiting for the round (the
    wait list, and the redundancy list: a spare moves to the wait list only at its next poll) enters it too, by rule
    2's priority, up to max_nodes, with torch's own bookkeeping (the last call's deadline at min_nodes, ``complete``
    at max_nodes). They are alive (the sanitizer just judged their heartbeats) and asked for the round; each finds
    itself a participant at its next read instead of writing the state itself: the N writes of O(N) bytes that a
    re-form took one after another become one. Returns the agents admitted."""
    if state.complete or state.closed or not batched(settings):
        return []
    waiting = sorted(state.wait_list | state.redundancy_list, key=lambda n: (_priority(state, n), repr(n)),
                     reverse=True)
    admitted = []
    for node in waiting:
        if len(state.participants) >= settings.max_nodes or state.complete:
            break
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
        state.participants[node] = 0
        admitted.append(node)
        if len(state.participants) == settings.min_nodes:
            state.deadline = datetime.now(timezone.utc) + settings.timeout.last_call
        if len(state.participants) == settings.max_nodes:
            complete()
    return admitted


# Rule 9: a write that lost the compare-and-set waits uniform(0, BASE * 2^k) after its k-th loss in a row, at most a
# waiting agent's poll interval for the round's size (rule 6: 0.1 s up to 8 nodes, 2 s from 160).
BACKOFF_BASE_S = 0.01
BACKOFF_MAX_S = POLL_MAX_S


def backing_off(holder: Any) -> bool:
    """Rule 9 on a state holder: after a write that lost the race (``sync()`` False: another agent wrote first, and
    the holder now has that state) it waits a random while that doubles with each loss in a row, before the agent
    decides again. torch retries at once, so N agents writing together (every survivor leaving its round) retried in
    lockstep, N²/2 attempts of O(N) bytes; spread, most find the key free. The wait is at most the round's poll
    interval (rule 6), so a small job's agents wait no longer than they poll; then it reads the state afresh (the one
    the lost write brought back is older than the wait). A write that took starts over; reads
    (None) leave it. False where the holder has no ``sync``."""
    sync = getattr(holder, "sync", None)
    if sync is None:
        return False
    losses = 0

    def backed_off() -> Any:
        nonlocal losses
        has_set = sync()
        if has_set is False:
            losses += 1
            settings = getattr(holder, "_settings", None)
            cap = poll_interval(settings.max_nodes) if settings is not None else BACKOFF_MAX_S
            _sleep_beating(holder, random.uniform(0, min(cap, BACKOFF_BASE_S * 2 ** min(losses, 16))))
            # the state the lost write brought back is stale after the wait: read it again, so that the next
            # decision (and write) is on the state as it is now
            if hasattr(holder, "_last_sync_time"):
                holder._last_sync_time = -1
                sync()
        elif has_set:
            losses = 0
        return has_set

    holder.sync = backed_off
    return True


def _sleep_beating(holder: Any, seconds: float) -> None:
    """Sleep; where the holder has rule 11's ``ddpjob_beat`` (send this agent's heartbeat key if one is due), call it
    every half second meanwhile: an agent waits up to 2 s after lost writes at 512 nodes, and one that lost a few in a
    row outlived the keep-alive expiry (1 s x 3) without a heartbeat and was dropped (seen at 512 agents)."""
    beat = getattr(holder, "ddpjob_beat", None)
    if beat is None:
        time.sleep(seconds)
        return
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        beat()
        time.sleep(min(left, 0.5))
    beat()
