"""Rule 10 of the ``ddpjob-c10d`` rendezvous (numbered in ``ddp_trainer.rendezvous``'s docstring): joins, re-forms and
rule 5's round-start records batched by helping, so that a round of N costs each agent O(1) store operations.

torch keeps the whole membership in one store key and every change is a compare-and-set of the whole pickled state,
O(N) bytes. When N agents change it at once (every survivor leaving its round at a re-form, every agent joining at a
start) their writes go one after another and the losers retry: O(N) retries of O(N) bytes per agent, and on a loaded
machine the window between an agent's read and its write is so long that almost every write lost (256 agents, 2
cores: 40 lost compare-and-sets per agent, no re-form within two minutes; docs/scale.md). Now:

- An agent that asks for a round (``next_rendezvous``: its exit operation, first) **announces** itself with one small
  store operation: it appends a line to ``<state key>/joining`` (``announcement``: its node, its pod for rule 4, the
  round it leaves if it is a participant of the complete round, the time), after its heartbeat key (rule 7) exists.
- **Whoever writes the state folds in every announced agent** not yet placed (``fold``): a participant leaving the
  complete round it named leaves it for the wait list (rule 8's exit); an agent in no list enters where its own join
  would put it (the redundancy list when the complete round is full, rule 1; else the wait list, from which rule 8's
  ``admit_waiting`` admits by rule 2's priority, up to max_nodes, with torch's last-call deadline and completion);
  rule 4's take-over runs for its pod. Its heartbeat in the state is the announcement's time, so an agent that
  announced and died expires as if it had written that heartbeat itself; an announcement older than the keep-alive
  expiry is ignored. After a write that took, the writer cuts what it read off the key (later lines stay).
- An agent's first write after announcing waits a random while (up to ``HOLD_MAX_S`` or its poll interval) and then
  decides again on the state as it is by then: agents that announce together are placed by the first of them to
  write. An agent that finds itself placed writes nothing: it waits for the round, reading at its poll interval (rule
  6). One whose announcement nobody folded (a race with a round change) writes itself, as before; one that finds
  itself in no list again (its heartbeats expired while it was starved) announces again.
- **One refresher** (the agent of the state's first heartbeat entry) writes every listed agent's heartbeat key into
  the state once a keep-alive interval. Heartbeats are keys of their own (rule 7), so the state's copies went stale
  while nobody wrote, and every reader then fetched all N keys on every read to judge them.
- Rule 5's record that a participant heard of its new round goes to ``<state key>/heard/<round>`` (an append), not
  into the state: that was one more compare-and-set of O(N) bytes per agent per round. Readers merge the key into the
  state's record before rule 5 judges (only while the round is in its grace and someone has not been heard of).

Garbage in either key is ignored line by line, never raised. Rule 10 applies where rules 7 and 8 do (heartbeat keys,
rounds of more than 8 nodes); a small job's rendezvous stays torch's step for step.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable
from urllib.parse import quote, unquote

from .rendezvous_rules import (
    BACKEND, _BEATS, _READ, _completed_at, _remember, admit_waiting, batched, expiry, is_refresher, poll_interval,
)
from .rendezvous_take_over import PodRecords, take_over, taken_over

log = logging.getLogger(f"{__package__}.rendezvous")

# The first write after an announcement waits up to this long (or the round's poll interval, rule 6, if shorter) for
# another agent's write to place the agent: agents that announce within that while are placed by the first of them to
# write, and the others write nothing.
HOLD_MAX_S = 0.5
_NO_POD = "!"  # quote(..., safe="") never writes it: a pod named "!" stays distinct from none
_MAX_INT = 2 ** 63


@dataclass(frozen=True)
class Announcement:
    """One agent asking for a round: its node (torch's ``_NodeDesc`` fields), pod (rule 4), the round it leaves when
    it is a participant of that complete round (else -1), and when (its clock, seconds since the epoch)."""

    addr: str
    pid: int
    local_id: int
    pod: str | None
    leaves: int
    t: float

    @property
    def ident(self) -> tuple[str, int, int]:
        return self.addr, self.pid, self.local_id


def announcement(node: Any, pod: str | None, leaves: int, t: float) -> str:
    """The line an agent appends to the joining key (percent-encoded strings, space-separated fields)."""
    pod_field = _NO_POD if pod is None else quote(pod, safe="")
    return f"{quote(node.addr, safe='')} {int(node.pid)} {int(node.local_id)} {pod_field} {int(leaves)} {t:.3f}\n"


def parse(raw: Any, limit: int = 4096, newer_than: float = -math.inf) -> list[Announcement]:
    """The announcements in the key's value, in the order they were appended; a line that is not one is skipped, and
    so is one made before ``newer_than`` (cheaply: its time is looked at first). At most the last ``limit`` lines are
    looked at: a flooded key costs a writer no more than that."""
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).decode("utf-8", errors="replace")
    if not isinstance(raw, str) or not raw:
        return []
    out = []
    for line in raw.split("\n")[-limit - 1:]:
        fields = line.split(" ")
        if len(fields) != 6:
            continue
        try:
            t = float(fields[5])
            if not t >= newer_than:
                continue
            addr, pod = _unquoted(fields[0]), None if fields[3] == _NO_POD else _unquoted(fields[3])
            pid, local_id, leaves = int(fields[1]), int(fields[2]), int(fields[4])
        except (ValueError, UnicodeDecodeError):
            continue
        if not addr or not 0 <= pid < _MAX_INT or not 0 <= local_id < _MAX_INT or not -1 <= leaves < _MAX_INT \
                or not math.isfinite(t) or pod == "":
            continue
        out.append(Announcement(addr, pid, local_id, pod, leaves, t))
    return out


def _unquoted(field: str) -> str:
    """A field as ``announcement`` encodes it, decoded; ValueError for any other spelling."""
    value = unquote(field, errors="strict")
    if quote(value, safe="") != field:
        raise ValueError(field)
    return value


def _latest(announced: Iterable[Announcement]) -> list[Announcement]:
    """One announcement per agent, its latest, in append order (a pod's dead agent before its replacement)."""
    latest: dict[tuple[str, int, int], Announcement] = {}
    for a in announced:
        latest.pop(a.ident, None)
        latest[a.ident] = a
    return list(latest.values())


def _wants(state: Any, node: Any, a: Announcement, now: float, expiry_s: float) -> bool:
    """Whether the state lacks what ``a`` asks for: a fresh announcement of an agent not taken out (rule 4) that is in
    no list, or is a participant of the complete round it leaves."""
    if not now - expiry_s <= a.t <= now + expiry_s or taken_over(state, node):
        return False
    if node in state.participants:
        return state.complete and a.leaves == state.round
    return node not in state.wait_list and node not in state.redundancy_list


def _nodes(state: Any, announced: list[Announcement]) -> list[tuple[Any, Announcement]]:
    """Each announcement with its node: the state's own object where the state lists it (pickle writes a node once
    however many lists hold it), else a new one."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    known = {n: n for n in itertools.chain(state.participants, state.wait_list, state.redundancy_list,
                                           state.last_heartbeats)}
    out = []
    for a in announced:
        node = _NodeDesc(a.addr, a.pid, a.local_id)
        out.append((known.get(node, node), a))
    return out


def wanted(state: Any, announced: list[Announcement], now: float, expiry_s: float) -> list[tuple[Any, Announcement]]:
    """The announced agents a write would place now (pure): see ``fold``."""
    if state.closed:
        return []
    return [(n, a) for n, a in _nodes(state, _latest(announced)) if _wants(state, n, a, now, expiry_s)]


def fold(state: Any, settings: Any, announced: list[Announcement], now: float, *, spares: bool,
         complete: Callable[[], None]) -> list[Any]:
    """Rule 10, in a write of the state: place every announced agent the state lacks, as its own writes would have
    (see the module doc), and admit the waiting ones to a round not complete yet (rule 8). ``complete`` marks the round
    complete (the writer's executor: ranks, rules 1, 2 and 5). Returns the agents placed; nothing on a closed
    rendezvous, and nothing for stale announcements (older than the keep-alive expiry) or agents taken out."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _remove_participant_epilogue

    expiry_s = expiry(settings).total_seconds()
    placed = []
    keyed = set(getattr(state, _BEATS, set()))
    records = PodRecords(state)  # rule 4's, indexed once for every take-over of this write
    for node, a in wanted(state, announced, now, expiry_s):
        if not _wants(state, node, a, now, expiry_s):  # an earlier one's take-over or round change decided it
            continue
        if node in state.participants:  # it leaves the complete round it named (torch's exit, rule 8)
            del state.participants[node]
            state.last_heartbeats.pop(node, None)
            _remove_participant_epilogue(state, settings)
        if state.complete and len(state.participants) >= settings.max_nodes:
            state.redundancy_list.add(node)  # rule 1: a full round's newcomer waits as redundant
            if spares:
                _remember(state, [node])
        else:
            state.wait_list.add(node)  # the next round's; admitted below while it forms
        state.last_heartbeats[node] = datetime.fromtimestamp(min(a.t, now), timezone.utc)
        keyed.add(node)  # its heartbeat key exists: it made it before announcing (rule 7)
        if a.pod is not None:
            take_over(state, node, a.pod, settings, records)  # rule 4, as in its own write
        placed.append(node)
    if placed:
        setattr(state, _BEATS, {n for n in keyed if n in state.last_heartbeats})
        admit_waiting(state, settings, complete)
    return placed


def heard_in(raw: Any, participants: Iterable[Any]) -> set[Any]:
    """The participants named in a heard key's value (one ``<address>_<pid>_<n>`` a line; anything else ignored)."""
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).decode("utf-8", errors="replace")
    if not isinstance(raw, str):
        return set()
    names = set(raw.split("\n"))
    return {n for n in participants if str(n) in names}


class Helping:
    """Rule 10 on one agent's executor and torch's state holder: its announcement, the folding of every write, the
    trimming of the joining key, and rule 5's heard records by key."""

    def __init__(self, holder: Any, executor: Any, store: Any, key: str, grace_s: float) -> None:
        self._holder, self._executor, self._store, self._key = holder, executor, store, key
        self._joining = f"{key}/joining"
        self._grace_s = grace_s
        self._heard_round = -1  # the round whose heard key this agent wrote into
        self._all_heard = -1  # the round whose participants all were heard of (a complete round only loses them)
        self._hold = False  # the next write waits for help first (the first since this agent announced, soon after)
        self._announced = -math.inf  # when (time.monotonic()) this agent last announced itself
        self._refreshed = -math.inf  # when (time.monotonic()) it last looked whether it is the refresher
        self._sync, self._sanitize = holder.sync, holder._sanitize
        self.vouch: Callable[[Any, Any], bool] | None = None  # rule 11's, set by rendezvous_version
        holder.sync = self._helped_sync
        holder._sanitize = self._sanitize_with_heard

    @classmethod
    def of(cls, holder: Any, executor: Any, grace_s: float) -> "Helping | None":
        """Rule 10 on torch's c10d state holder, for an executor with rule 7's heartbeat keys (``executor.beats``);
        None for any other."""
        backend = getattr(holder, "_backend", None)
        store, key = getattr(backend, "_store", None), getattr(backend, "_key", None)
        if getattr(executor, "beats", None) is None or store is None or not isinstance(key, str) or \
                not all(hasattr(holder, a) for a in ("sync", "_sanitize", "_state", "_dirty")):
            return None
        return cls(holder, executor, store, key, grace_s)

    def on(self) -> bool:
        return batched(self._executor._settings)

    def wrap(self, op: Callable[[Any, float], Any], joining: bool, keeping: bool) -> Callable[[Any, float], Any]:
        """Rule 10 on one of torch's operations (``joining``: a join, ``keeping``: a heartbeat): the exit announces the
        agent (``announcing``), a join announces it again where it would write itself in (``rejoining``), and a
        join's wait or a heartbeat refreshes the state's heartbeats where this agent is the refresher (``refresh``)."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action, _RendezvousExitOp

        if isinstance(op, _RendezvousExitOp):
            return self.announcing(op)
        if not joining and not keeping:
            return op
        inner, idle = self.rejoining(op) if joining else op, _Action.SYNC if joining else _Action.FINISH

        def refreshing(ctx: Any, deadline: float) -> Any:
            action = inner(ctx, deadline)
            if action == idle and self.on() and self._refresh_due(ctx.state, ctx.node):
                self.refresh(ctx.state, ctx.node)
            return action

        return refreshing

    # --- the announcement --------------------------------------------------------------------------------------

    def announcing(self, exit_op: Callable[[Any, float], Any]) -> Callable[[Any, float], Any]:
        """torch's exit operation (the first of ``next_rendezvous``) that announces the agent before it first decides
        (after its first read of the state, so it knows whether it leaves a complete round, and which), and leaves only
        that round: a write that took its announcement may have placed it in the next one already, which torch's exit
        would leave again."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action

        announced: list[int | None] = []

        def announce(ctx: Any, deadline: float) -> Any:
            if not announced:
                announced.append(self.announce(ctx.state, ctx.node))
            leaves = announced[0]
            if leaves is not None and ctx.node in ctx.state.participants and ctx.state.round != leaves:
                return _Action.FINISH  # placed in a newer round by another agent's write
            return exit_op(ctx, deadline)

        return announce

    def rejoining(self, join_op: Callable[[Any, float], Any]) -> Callable[[Any, float], Any]:
        """A join operation that announces the agent again when it is about to write itself into a list it is in none
        of (its heartbeats expired while it waited: a starved process; or its announcement was not folded) and it has
        not announced within a keep-alive interval: agents dropped together re-enter in a few writes too. Until its
        state lists it, an agent that announced sends its heartbeat (its key) once a keep-alive interval: a write may
        have placed it, with its announcement's time as its heartbeat, a poll interval before it reads that (2 s at
        160 nodes and more), and judged by the state alone it expired before it knew it was in (seen at 512 agents)."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action

        entering = (_Action.ADD_TO_PARTICIPANTS, _Action.ADD_TO_WAIT_LIST, _Action.ADD_TO_REDUNDANCY_LIST)

        def join(ctx: Any, deadline: float) -> Any:
            action = join_op(ctx, deadline)
            state, me, settings = ctx.state, ctx.node, ctx.settings
            if me in state.participants or me in state.wait_list or me in state.redundancy_list:
                return action
            interval, now = settings.keep_alive_interval.total_seconds(), time.monotonic()
            if action in entering and now - self._announced > interval:
                self.announce(state, me)
            elif self.on() and now - self._announced < interval * settings.keep_alive_max_attempt and \
                    now - self._executor.beats.sent > interval:
                self._executor.beats.send(me)
            return action

        return join

    def announce(self, state: Any, me: Any) -> int | None:
        """Append this agent's announcement (after its heartbeat key: a writer that folds it may read that key).
        Returns the round it leaves (-1: none), or None where it announced nothing (rule 10 off, closed, taken out)."""
        if not self.on() or state.closed or taken_over(state, me):
            return None
        self._executor.beats.send(me)
        leaves = state.round if state.complete and me in state.participants else -1
        self._call("append", self._joining, announcement(me, self._executor.pod, leaves, time.time()))
        self._hold, self._announced = True, time.monotonic()
        return leaves

    # --- folding, in every write ---------------------------------------------------------------------------------

    def _helped_sync(self) -> Any:
        holder, settings = self._holder, self._executor._settings
        if not holder._dirty or not self.on() or holder._state.closed:
            return self._sync()
        if self._hold and time.monotonic() - self._announced < settings.keep_alive_interval.total_seconds():
            # the first write soon after announcing waits a random while for another agent's write to place it, then
            # the agent decides again on the state as it is by then (its own change dropped, as a lost write's is)
            self._hold = False
            time.sleep(random.uniform(0, min(poll_interval(settings.max_nodes), HOLD_MAX_S)))
            holder._dirty = False
            holder._last_sync_time = -1
            return self._sync()
        raw = self._call("compare_set", self._joining, "", "")  # the value, never a wait (the key may not exist)
        expiry_s = expiry(settings).total_seconds()
        folded = self._fold(parse(raw, 4 * settings.max_nodes + 64, time.time() - expiry_s)) if raw else []
        self._keys_over(holder._state, None)  # rule 11: a new version's readers judge by its heartbeats, not the keys
        has_set = self._sync()
        if has_set and raw:
            # what it read is in the state now (or stale): cut it off the key, keeping what others appended since
            current = self._call("compare_set", self._joining, raw, "")
            if current and bytes(current).startswith(bytes(raw)):
                self._call("compare_set", self._joining, current, bytes(current)[len(raw):])
        if has_set and folded:
            log.debug("%s: this write placed %d announced agents", BACKEND, len(folded))
        return has_set

    def _fold(self, announced: list[Announcement]) -> list[Any]:
        state, settings, now = self._holder._state, self._executor._settings, time.time()
        expiry_s = expiry(settings).total_seconds()
        todo = wanted(state, announced, now, expiry_s)
        if not todo:
            return []
        beats = self._executor.beats
        if not self._call("check", [beats.key(n) for n, _ in todo]):
            # a well-formed line with no heartbeat key (rule 7 would wait on it): written by no agent of this
            # executor; they write themselves
            log.warning("%s: announced agents without heartbeat keys; not placed by this write", BACKEND)
            return []
        executor = self._executor

        def complete() -> None:
            executor._state = state
            executor._mark_rendezvous_complete()

        return fold(state, settings, announced, now, spares=getattr(executor, "spares", False), complete=complete)

    # --- the refresher ------------------------------------------------------------------------------------------

    def _refresh_due(self, state: Any, me: Any) -> bool:
        """Once a keep-alive interval: whether this agent refreshes the state's heartbeats: the first of the state's
        heartbeats (the oldest entry: every agent sees the same order, and looking is O(1)). A dead refresher hands the
        task on when its heartbeats expire and the sanitizer takes it out; until then readers judge by the keys."""
        now = time.monotonic()
        if now - self._refreshed < self._executor._settings.keep_alive_interval.total_seconds() or state.closed:
            return False
        self._refreshed = now
        return is_refresher(state, me)

    def refresh(self, state: Any, me: Any) -> bool:
        """Write the state with every listed agent's heartbeat from its key (rule 7) where that is newer. Heartbeats are
        keys of their own, so the state's go stale while nobody writes, and every reader then read N keys to judge
        them (O(N) per read, O(N²) per poll interval across the group: what a slow start at 512 agents spent its CPU
        on). One agent doing it once a keep-alive interval keeps them fresh for all. False if the write lost."""
        if self.vouch is not None and self.vouch(state, me):  # rule 11: no state write while it can vouch instead
            return True
        self._keys_over(state, me)
        state.last_heartbeats[me] = datetime.now(timezone.utc)
        self._holder.mark_dirty()
        return bool(self._holder.sync())

    def _keys_over(self, state: Any, me: Any) -> None:
        """Lay the heartbeat keys (rule 7) over the state's heartbeats older than a keep-alive interval (but ``me``'s)."""
        settings, beats = self._executor._settings, self._executor.beats
        now = datetime.now(timezone.utc)
        keyed = getattr(state, _BEATS, set())
        nodes = [n for n, beat in state.last_heartbeats.items()
                 if n in keyed and n != me and beat < now - settings.keep_alive_interval]
        for node, raw in zip(nodes, self._call("multi_get", [beats.key(n) for n in nodes]) if nodes else ()):
            try:
                beat = datetime.fromtimestamp(float(raw), timezone.utc)
            except (ValueError, OverflowError, OSError, TypeError):
                continue
            if beat > state.last_heartbeats[node]:
                state.last_heartbeats[node] = beat

    # --- rule 5's heard records ----------------------------------------------------------------------------------

    def heard(self, ctx: Any) -> bool:
        """Rule 5's record that ``ctx.node`` heard of its new round, in the round's heard key instead of the state
        (once per round); the local copy records it too. False where rule 10 is off (the state records it)."""
        if not self.on():
            return False
        state = ctx.state
        if self._heard_round != state.round:
            self._call("append", f"{self._key}/heard/{state.round}", f"{ctx.node}\n")
            if state.participants.get(ctx.node) == 0 and state.round > 0:
                self._call("delete_key", f"{self._key}/heard/{state.round - 1}")  # rank 0 forgets the last round's
            self._heard_round = state.round
        setattr(state, _READ, getattr(state, _READ, set()) | {ctx.node})
        return True

    def _sanitize_with_heard(self) -> None:
        """Rule 5 judges with the heard key merged into the state's record (while it matters: the round in its grace
        and someone not heard of yet), then torch's sanitizer (under rules 5 and 7) runs."""
        state = self._holder._state
        completed = _completed_at(state)
        if completed is not None and self.on() and time.time() - completed < self._grace_s:
            read = getattr(state, _READ, set())
            members = set(state.participants)
            if not members <= read:
                if self._all_heard != state.round:
                    raw = self._call("compare_set", f"{self._key}/heard/{state.round}", "", "")
                    read = read | heard_in(raw, members)
                    if members <= read:
                        self._all_heard = state.round
                else:
                    read = read | members
                setattr(state, _READ, read)
        self._sanitize()

    def _call(self, op: str, *args: Any) -> Any:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:  # as torch's c10d backend reports a store failure
            raise RendezvousConnectionError(f"{BACKEND}: the rendezvous store call {op} failed") from exc

