"""What a re-form of the training group is, read from the trainers' own log lines: defined once here, used by
`make bench-elastic` (tests/benchmarks/elastic.py) and the e2e test of resizes and kills
(tests/e2e/test_e2e_lifecycle.py).

- A round is global rank 0's `event=session` line. Every worker logs one once `init_process_group` returned
  (ddp_trainer.session.init_session), so rank 0's line marks one formation of the group, and its `world_size` is
  the size the trainers themselves trained at, not the size the operator or the rendezvous meant.
- Re-forms after a time t: the rounds logged at or after t.
- World-size changes: how often a round's size differs from the size before it, starting from the size at t.
- Steps at a size: rank 0's `event=step` lines logged while the newest round after t is of that size; a resize is
  done when the n-th of them is logged (`nth_step_at_size`).

Pure functions of tests/e2e/harness.Event lists (harness.job_events reads them from the pods): no cluster, no clock.
The lines of a pod that is gone (killed, scaled away) are gone with it, which never matters here: every round after
t is formed by the pods that train after t, and their logs are read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class _Event(Protocol):  # tests/e2e/harness.Event
    time: float
    pod: str
    event: str
    fields: dict[str, str]

    def int(self, key: str, default: int = -1) -> int: ...


@dataclass(frozen=True)
class Round:
    time: float  # rank 0's `event=session` line: the group's process group is up
    pod: str  # the pod rank 0 ran in
    world_size: int  # as the trainers saw it (-1: the line carried none)


def _rank0(e: _Event) -> bool:
    return e.fields.get("rank") == "0"


def rounds(events: Iterable[_Event], after: float = float("-inf")) -> list[Round]:
    """Every formation of the training group at or after `after`, in time order."""
    return [Round(e.time, e.pod, e.int("world_size")) for e in sorted(events, key=lambda e: e.time)
            if e.event == "session" and _rank0(e) and e.time >= after]


def world_size_changes(found: list[Round], before: int) -> int:
    """How many times the world size changed over `found`, starting from `before` (the size before them)."""
    changes, size = 0, before
    for r in found:
        if r.world_size != size:
            changes, size = changes + 1, r.world_size
    return changes


def nth_step_at_size(events: Iterable[_Event], after: float, world_size: int, n: int) -> float | None:
    """Time of rank 0's n-th training step logged at or after `after` while the newest round formed after `after`
    is of `world_size` (None: not yet). Steps of the group from before `after` count for nothing, whatever its
    size: the resize is done when a group formed after it trains at the new size."""
    current, count = None, 0
    for e in sorted(events, key=lambda e: e.time):
        if e.time < after or not _rank0(e):
            continue
        if e.event == "session":
            current = e.int("world_size")
        elif e.event == "step" and current == world_size:
            count += 1
            if count == n:
                return e.time
    return None


@dataclass(frozen=True)
class Reforms:
    """The rounds after one resize or kill, as the goals judge them."""
    count: int  # re-forms
    world_size_changes: int
    sizes: tuple[int, ...]  # each round's world size, in order

    @classmethod
    def of(cls, events: Iterable[_Event], after: float, before: int) -> "Reforms":
        found = rounds(events, after)
        return cls(len(found), world_size_changes(found, before), tuple(r.world_size for r in found))


def counted_failures(status: dict) -> int:
    """Failures the operator counted: status.restarts plus the attempts it marked counted (a resize adds neither)."""
    attempts = [a for a in status.get("attempts") or [] if isinstance(a, dict) and a.get("counted")]
    restarts = status.get("restarts")
    return (restarts if isinstance(restarts, int) else 0) + len(attempts)
