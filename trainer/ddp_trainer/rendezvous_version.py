"""Rule 11 of the ``ddpjob-c10d`` rendezvous (numbered in ``ddp_trainer.rendezvous``'s docstring): an agent reads the
shared state only when it changed, and one agent vouches for everyone's heartbeats, so that a look at the rendezvous
(a waiting agent's poll, a training agent's ``num_nodes_waiting()``) moves O(1) bytes whatever N.

torch's state holder fetches the whole pickled state, O(N) bytes, at every sync past its cache, changed or not, and
unpickles it (about 1 ms at 512 agents). A waiting agent syncs every poll interval (rule 6) and a training one about
once a second. At 512 agents on 2 cores each agent read the 27 KB state about 100 times while the group formed (1.45 GB
through the clients, no round within the run's time): the agents' CPU, not the store, was the limit (docs/scale.md).

- **A version key.** Every state write that took is followed by an ``add`` of 1 to ``<state key>/version``, by every
  agent of this executor and at every size. A reader first looks at the version (an ``add`` of 0, a few bytes): when it
  is the version of the state the agent holds, the agent keeps that state (no transfer, no unpickling) and judges its
  heartbeats again, as torch's sync does after a read; else it reads the state. Why that is exact: a reader looks at
  the version before it reads the state, every write's ``add`` follows its compare-and-set, and a writer takes the
  state it wrote as version v only when its ``add`` returned one more than a version it looked at before writing; so
  an agent whose version equals the key's holds the state the key holds, once every writer's ``add`` has landed (a
  write whose ``add`` is on its way is seen one look later, as torch's 1 s cache sees any write late). A writer that
  lost the race, or whose ``add`` returned more, reads at its next look. A state the agent changed locally (an
  operation that did not write it) or dropped someone from (torch's sanitizer, pending a write) is rebuilt from the
  copy of the state kept with the version: no transfer.
- **A vouch instead of a refresh.** Heartbeats are keys of their own (rule 7), so the state's copies age while nobody
  writes it, and rule 10's refresher wrote them into the state once a keep-alive interval: a new version a second, and
  every agent read the whole state again. Now the refresher reads every listed agent's key and, where the state it
  holds is the key's version with nobody dropped, sets ``<state key>/alive`` to that version, a time T and the agents
  it leaves out (those whose key is older than ``VOUCH_LAG`` keep-alive intervals: maybe dying): every other agent of
  that version with a heartbeat key sent a heartbeat at T or later. A reader of that version that finds a heartbeat
  older than the expiry lays T over the others' (one small read) before rule 7 reads the keys of those still expired;
  T is no later than any vouched agent's last heartbeat, so nobody is kept alive longer than its key would keep it,
  and one left out is judged by its key. Where it cannot vouch (its state is not the version, or it dropped someone)
  the refresher writes the state as before; every writer lays the keys over the stale heartbeats it writes.

Rule 12, **a waiting agent looks only at what concerns it**. An agent that waits for something only another agent's
write brings does not read the state at each new version: a participant of a round not complete yet waits for the
round to complete, and an agent in the wait list of a complete round waits for the next round to open. A write that
took sets ``<state key>/round/<round>`` (the round exists) and, with the round complete,
``<state key>/complete/<round>``. The waiting agent looks at the one key it waits for (``check``, a few bytes) every ``QUIET_LOOK_S`` (its poll interval
where shorter) and reads the state once that key exists. Before, every waiting agent read the whole state at its next
look after each write: at 512 agents a re-form took 16 writes and six reads of the 50 KB state per agent. It reads as
before where it must decide on the state: the refresher (rule 10), a participant once the round's last call passed
(someone marks it complete), an agent whose state it changed, and any agent once a heartbeat in the state it holds is
older than the expiry: someone there may have died (a lost participant the round waits for, a lost refresher), which
torch's sanitizer judges on a read, as before. The state's heartbeats are never older than the state, so that also
bounds how long an agent goes without a read (it may have been dropped, taken over, or the rendezvous closed).

Rules 11 and 12 apply where rule 10 does (rounds of more than 8 nodes): there readers keep their state, the refresher
vouches and waiting agents look at their round's key. The version is bumped by every write of this executor whatever
the size, so that agents whose settings differ for a moment (rule 3 crossing 8 nodes) never keep a state another one
changed. Garbage in either key is ignored.

Costs found on the way at 512 agents are here too: torch's event naming on every heartbeat (``quiet_events``), an
agent that waits after lost writes (rule 9) without sending its heartbeat (``Versioned.beat``), and heartbeats sent only
after a look at the state (``beat_first``).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
import weakref
from datetime import datetime, timezone
from typing import Any

from .rendezvous_rules import BACKEND, _BEATS, _unheard, batched, expiry, is_refresher

# The refresher leaves out of its vouch the agents whose heartbeat key is older than this many keep-alive intervals
# (a heartbeat is due every interval; a late one may be a dying agent's), at most VOUCH_LEFT_OUT_MAX of them (the
# oldest): T is the oldest beat of the others, so a crowd of late ones makes T older, never unsound.
VOUCH_LAG = 1.5
VOUCH_LEFT_OUT_MAX = 64
# Rule 12: a waiting agent looks at its round's key this often (its poll interval where shorter).
QUIET_LOOK_S = 0.25


def quiet_events(obj: Any) -> bool:
    """torch's ``_record`` on a rendezvous handler or operation executor (``obj``), without its cost where nothing
    records rendezvous events (torch's default: a NullHandler). torch names each event with two ``inspect.stack()``
    calls, which read the source lines of every frame, before ``construct_and_record_rdzv_event`` looks whether
    anything records, at every heartbeat and every state write of every agent (an eighth of the agents' CPU at 512
    agents on 2 cores, in py-spy). Where a handler records them, the event is torch's, named after the caller as
    torch names it (its file part names this module). False where ``obj`` has no ``_record``."""
    if not callable(getattr(obj, "_record", None)):
        return False
    from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event, handlers

    def _record(message: str, node_state: Any = NodeState.RUNNING, **extra: Any) -> None:
        if isinstance(handlers.get_logging_handler("dynamic_rendezvous"), logging.NullHandler):
            return
        node = getattr(obj, "_node", None) or obj._this_node
        construct_and_record_rdzv_event(
            name=f"{type(obj).__name__}.{sys._getframe(1).f_code.co_name}", run_id=obj._settings.run_id,
            message=message, node_state=node_state, hostname=node.addr, pid=node.pid, local_id=node.local_id, **extra)

    obj._record = _record
    return True


class _Beater:
    """One thread per process sends the heartbeat keys of this process's agents that wait in ``next_rendezvous``
    (``beat_first``), every ``BEAT_TICK_S``: a pod runs one agent, a benchmark hundreds, and a thread each made hundreds
    of wake-ups a second compete for one interpreter."""

    def __init__(self) -> None:
        self._lock, self._sends, self._thread = threading.Lock(), {}, None

    def add(self, key: int, send: Any) -> None:
        with self._lock:
            self._sends[key] = send
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{BACKEND}-beats", daemon=True)
                self._thread.start()

    def remove(self, key: int) -> None:
        with self._lock:
            self._sends.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(BEAT_TICK_S)
            with self._lock:
                sends = list(self._sends.values())
            for send in sends:
                send()


# How often the beater looks whether a waiting agent's heartbeat key is due (a keep-alive interval is 1 s or more).
BEAT_TICK_S = 0.25
_WAITING_BEATS = _Beater()


def beat_first(handler: Any) -> bool:
    """An agent's heartbeat key (rule 7) goes out once a keep-alive interval whatever its looks at the state cost:

    - while it trains, torch's keep-alive (its timer) sends the key before anything else, outside the handler's
      heartbeat lock. torch's keep-alive looks at the state first (a sync: the version, the vouch, the keys of stale
      heartbeats, the whole state when it changed; behind the lock, which a training agent's ``num_nodes_waiting()``
      holds for its own look) and sent the heartbeat after it;
    - while it waits in ``next_rendezvous`` (torch stops its timer there and the join loop sends the heartbeats), the
      process's beater thread (``_Beater``) sends the key when none went out for a keep-alive interval: one turn of
      the join loop can take seconds (a read of the whole state and its unpickling, lost writes, the fold of a writer).

    On a loaded machine those looks were slow and the key as late: at 512 agents on 2 cores heartbeats went out more
    than the 3 s expiry apart, the others dropped live agents and the re-form churned (docs/scale.md). The key says
    only that this agent's process runs, which needs no look; what a look decides still follows it (the refresher's
    vouch, rule 5's record), and ``_beating`` does not send the key again within half an interval. An agent's first
    heartbeat in a new round is left to its look (rule 5 records it; a fresh key laid over its stale heartbeat would
    let the look decide there is nothing to send). Any handler: the executor's ``beats`` are read at each call (none:
    torch's keep-alive, unchanged). False where the handler's class has no ``_keep_alive`` or ``next_rendezvous``."""
    if getattr(handler, "_ddpjob_beat_first", False):
        return True  # once (ddp_trainer.launch enables rule 4 on the handler create_handler made)
    cls = type(handler)
    keep_alive, next_rendezvous = getattr(cls, "_keep_alive", None), getattr(cls, "next_rendezvous", None)
    if not callable(keep_alive) or not callable(next_rendezvous) or \
            {"_keep_alive", "next_rendezvous"} & vars(handler).keys():  # wrapped by someone else: left alone
        return False
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    # the wrappers hold the handler weakly, as torch's timer does: a handler dropped is collected and its timer stops
    this = weakref.ref(handler)

    def send(due: float = 0.0) -> None:
        h = this()
        beats = getattr(getattr(h, "_op_executor", None), "beats", None)
        if beats is None or not beats.created or time.monotonic() - beats.sent < due or \
                _unheard(h._state_holder.state, h._this_node):
            return
        try:
            beats.send(h._this_node)
        except RendezvousError:
            pass  # the store is what the agent's own next call meets and reports

    def _keep_alive() -> None:
        send()
        if (h := this()) is not None:
            keep_alive(h)

    def _next_rendezvous() -> Any:
        h = this()
        interval = h._settings.keep_alive_interval.total_seconds()
        send(interval)
        _WAITING_BEATS.add(id(h), lambda: send(interval))
        try:
            return next_rendezvous(h)
        finally:
            _WAITING_BEATS.remove(id(h))

    handler._keep_alive, handler.next_rendezvous = _keep_alive, _next_rendezvous
    handler._ddpjob_beat_first = True
    return True


def vouch_line(version: int, t: float, left_out: list[str]) -> str:
    """The vouch key's value: the version, the time (seconds since the epoch), the names left out; space-separated."""
    return " ".join([str(int(version)), f"{t:.3f}", *left_out])


def parse_vouch(raw: Any) -> tuple[int, float, set[str]] | None:
    """(version, time, names left out) from the vouch key's value, or None for anything else."""
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).decode("utf-8", errors="replace")
    if not isinstance(raw, str):
        return None
    fields = raw.split(" ")
    try:
        version, t = int(fields[0]), float(fields[1])
    except (ValueError, IndexError):
        return None
    if version < 0 or not math.isfinite(t):
        return None
    return version, t, set(fields[2:])


class Versioned:
    """Rule 11 on one agent's state holder (torch's ``_BackendRendezvousStateHolder``), its backend and its executor's
    heartbeat keys: the version looked at before a read, bumped after a write, the state kept while it is the version's,
    and the vouch (made by rule 10's refresher, laid over the heartbeats by readers)."""

    def __init__(self, holder: Any, executor: Any, store: Any, key: str) -> None:
        self._holder, self._executor, self._store = holder, executor, store
        self._version_key, self._alive_key = f"{key}/version", f"{key}/alive"
        self._round_key, self._complete_key = f"{key}/round", f"{key}/complete"  # rule 12
        backend = holder._backend
        self._get, self._set = backend.get_state, backend.set_state
        backend.get_state, backend.set_state = self._get_state, self._set_state
        self._sync, self._mark = holder.sync, holder.mark_dirty
        holder.sync, holder.mark_dirty = self._synced, self._marked
        beats = executor.beats
        self._overlay = beats.overlay
        beats.overlay = self._vouched_overlay
        self.known: tuple[int, bytes, Any] | None = None  # (version, state bits, token) of the last read or write
        self._looked: int | None = None  # the version just looked at, for the read that follows
        self._from_known = False  # the bits the backend last handed torch are ``known``'s
        self._served: Any = None  # the holder's state object while it is ``known``'s bits (judged, raised heartbeats)
        self._touched = False  # an operation changed the holder's state since (mark_dirty)
        self.full_reads = 0  # reads of the whole state (for tests and logs)
        self.quiet_looks = 0  # rule 12's looks at a round's key instead of a read (for tests and logs)
        self._quiet_for: Any = None  # the state whose heartbeats ``_quiet_until`` was computed from
        self._quiet_until: datetime | None = None  # until then nobody in that state can have expired

    @classmethod
    def of(cls, holder: Any, executor: Any) -> "Versioned | None":
        """Rule 11 on torch's c10d state holder, for an executor with rule 10 (``executor.helping``, whose refresher
        then vouches); None for any other."""
        helping, beats = getattr(executor, "helping", None), getattr(executor, "beats", None)
        backend = getattr(holder, "_backend", None)
        store, key = getattr(backend, "_store", None), getattr(backend, "_key", None)
        needed = ("sync", "mark_dirty", "_state", "_dirty", "_cache_duration", "_last_sync_time", "_dead_nodes",
                  "_sanitize")
        if helping is None or beats is None or store is None or not isinstance(key, str) or \
                not all(hasattr(backend, a) for a in ("get_state", "set_state")) or \
                not all(hasattr(holder, a) for a in needed):
            return None
        versioned = cls(holder, executor, store, key)
        helping.vouch = versioned.vouch
        holder.ddpjob_beat = versioned.beat  # rule 9's waits send the heartbeats that fall due
        return versioned

    def beat(self) -> None:
        """Send this agent's heartbeat key if one is due (a keep-alive interval since the last): its join loop does not
        turn while it waits after a lost write (rule 9)."""
        beats, settings = self._executor.beats, self._executor._settings
        if beats.created and time.monotonic() - beats.sent >= settings.keep_alive_interval.total_seconds():
            beats.send(self._executor._node)

    def on(self) -> bool:
        return batched(self._executor._settings)

    # --- the backend: the version looked at before a read, bumped after a write ------------------------------------

    def _get_state(self) -> Any:
        looked, self._looked = self._looked, None
        if not self.on():
            self.known, self._from_known = None, False
            self.full_reads += 1
            return self._get()
        version = looked if looked is not None else self._version()
        if self.known is not None and self.known[0] == version:
            self._from_known = True
            return self.known[1], self.known[2]
        self.full_reads += 1
        got = self._get()
        self.known = None if got is None else (version, got[0], got[1])
        self._from_known = got is not None
        return got

    def _set_state(self, state: bytes, token: Any = None) -> Any:
        before = self.known[0] if self.known is not None else None
        self.known, self._from_known = None, False
        out = self._set(state, token)
        if out is not None and out[2]:
            written = self._holder._state  # the state torch pickled for this write
            if self.on() and isinstance(getattr(written, "round", None), int):  # rule 12, before the version moves
                self._call("set", f"{self._round_key}/{written.round}", "1")
                if getattr(written, "complete", False):
                    self._call("set", f"{self._complete_key}/{written.round}", "1")
            version = self._version(1)
            if before is not None and version == before + 1:  # no other write since the version looked at before
                self.known, self._from_known = (version, out[0], out[1]), True
        return out

    def _version(self, add: int = 0) -> int:
        return int(self._call("add", self._version_key, add))

    # --- the holder: a look that keeps the state -------------------------------------------------------------------

    def _marked(self) -> None:
        self._touched = True
        self._mark()

    def _synced(self) -> Any:
        holder = self._holder
        if not holder._dirty and self.on():
            cache = holder._cache_duration
            if cache > 0 and holder._last_sync_time >= max(time.monotonic() - cache, 0):
                return None  # torch's cache, as its sync
            if self._quiet():
                # rule 12: nothing that concerns this agent yet; the next look after QUIET_LOOK_S (torch's cache)
                holder._last_sync_time = time.monotonic() - cache + min(QUIET_LOOK_S, cache)
                return None
            version = self._version()
            if self._served is not None and self._served is holder._state and not self._touched and \
                    self.known is not None and self.known[0] == version:
                # what torch's sync does after a read, on the state it holds (it is the store's)
                holder._last_sync_time = time.monotonic()
                self._from_known = True
                holder._sanitize()
                if holder._dead_nodes:  # dropped locally: the next look rebuilds it from the copy kept
                    self._served = None
                return None
            self._looked = version
        before, touched, self._touched = holder._state, self._touched, False
        try:
            has_set = self._sync()
        finally:
            self._looked = None
        if holder._state is before:  # torch's cache served it: nothing read
            self._served = None if touched or self._served is not before else before
        else:
            self._served = holder._state if self._from_known and not holder._dead_nodes else None
        return has_set

    def _quiet(self) -> bool:
        """Rule 12 (see the module doc): whether this look may leave the state unread, because the agent waits for the
        round it is a participant of to complete, or in the wait list for the next round to open, that round's key
        does not exist yet, and nobody in the state it holds can have expired yet. Local checks first; one ``check``."""
        holder, me, settings = self._holder, self._executor._node, self._executor._settings
        state = holder._state
        if self._touched or self.known is None or self._served is not state or state.closed:
            return False
        if me in state.participants and not state.complete:
            if state.deadline is not None and state.deadline < datetime.now(state.deadline.tzinfo):
                return False  # the last call passed: someone marks the round complete
            waited_for = f"{self._complete_key}/{state.round}"
        elif me in state.wait_list and state.complete:
            waited_for = f"{self._round_key}/{state.round + 1}"
        else:
            return False
        if is_refresher(state, me):
            return False  # the refresher (rule 10) reads and vouches as before
        if self._quiet_for is not state:  # once per state held: it does not change while the agent is quiet
            oldest = min(state.last_heartbeats.values(), default=None)
            self._quiet_for, self._quiet_until = state, None if oldest is None else oldest + expiry(settings)
        if self._quiet_until is None or datetime.now(self._quiet_until.tzinfo) >= self._quiet_until:
            return False  # someone may have expired (a lost participant, the refresher): judged on a read, as before
        self.quiet_looks += 1
        return not self._call("check", [waited_for])

    # --- the vouch ---------------------------------------------------------------------------------------------------

    def _vouched_overlay(self, state: Any, expired: datetime) -> None:
        """Rule 7's overlay (the keys of heartbeats older than ``expired``), after laying the vouch of this state's
        version over the heartbeats it vouches for, where one is older than ``expired``."""
        keyed = getattr(state, _BEATS, set())
        if self.on() and self._from_known and self.known is not None and \
                any(b < expired and n in keyed for n, b in state.last_heartbeats.items()):
            got = parse_vouch(self._call("compare_set", self._alive_key, "", ""))  # never a wait
            if got is not None and got[0] == self.known[0]:
                _, t, left_out = got
                beat = datetime.fromtimestamp(min(t, time.time()), timezone.utc)
                for node, last in state.last_heartbeats.items():
                    if last < beat and node in keyed and str(node) not in left_out:
                        state.last_heartbeats[node] = beat
        self._overlay(state, expired)

    def vouch(self, state: Any, me: Any) -> bool:
        """Rule 10's refresher, once a keep-alive interval: vouch for the heartbeats of the state's version (see the
        module doc) instead of writing the state. False where it cannot; the refresher then writes the state."""
        holder = self._holder
        if not self.on() or self._touched or state is not holder._state:
            return False
        if self.known is None or self._served is not state or self._version() != self.known[0]:
            holder._last_sync_time = -1  # vouch for the version readers hold now: read it first
            holder.sync()
            state = holder._state
            if self.known is None or self._served is not state:
                return False
        settings, beats = self._executor._settings, self._executor.beats
        keyed = getattr(state, _BEATS, set())
        nodes = [n for n in state.last_heartbeats if n in keyed]
        if not nodes or any(" " in str(n) or "\n" in str(n) for n in nodes):
            return False
        now = time.time()
        lagging = now - VOUCH_LAG * settings.keep_alive_interval.total_seconds()
        beats_read = []
        for node, raw in zip(nodes, self._call("multi_get", [beats.key(n) for n in nodes])):
            try:
                t = float(raw)
            except (ValueError, TypeError):
                t = -math.inf
            beats_read.append((t if math.isfinite(t) else -math.inf, node))
            if math.isfinite(t) and datetime.fromtimestamp(min(t, now), timezone.utc) > state.last_heartbeats[node]:
                state.last_heartbeats[node] = datetime.fromtimestamp(min(t, now), timezone.utc)  # as readers will judge
        # left out: the laggards, at most VOUCH_LEFT_OUT_MAX (the oldest); T is the oldest beat of the others
        beats_read.sort(key=lambda tn: tn[0])
        cut = min(sum(1 for t, _ in beats_read if t < lagging), VOUCH_LEFT_OUT_MAX)
        left_out = [str(n) for _, n in beats_read[:cut]]
        oldest = beats_read[cut][0] if cut < len(beats_read) else now
        if not math.isfinite(oldest):
            return False
        self._call("set", self._alive_key, vouch_line(self.known[0], oldest, left_out))
        return True

    def _call(self, op: str, *args: Any) -> Any:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:  # as torch's c10d backend reports a store failure
            raise RendezvousConnectionError(f"{BACKEND}: the rendezvous store call {op} failed") from exc
