"""The pure half of `kubectl ddp logs` (logs.py does the API calls and the threads): the kubelet's timestamps, the
`[rank pod]` prefixes, the time-ordered merge of several pods' lines, and what changed between two listings of a job's
pods. No I/O here, so every rule is tested with plain values."""

from __future__ import annotations

import calendar
import heapq
import itertools
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from ddp_operator import names

# RFC3339Nano as the kubelet writes it: trailing zeros of the fraction dropped, so 0 to 9 digits.
_TIMESTAMP = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$")
FINISHED_PHASES = ("Succeeded", "Failed")
# A stream ends when its container exits, but the pod's status says so a moment later: listings that still show the
# container running after its stream ended, past which the stream is read again.
STALE_LISTINGS = 3
# The kubelet prints the same palette for no one; these just tell ranks apart on a terminal.
_COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta", "bright_green")


def parse_timestamp(text: str) -> int | None:
    """Nanoseconds since the epoch, or None when `text` is not RFC3339."""
    m = _TIMESTAMP.match(text)
    if not m:
        return None
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    seconds = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    zone = m.group(8)
    if zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        seconds -= sign * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
    return seconds * 1_000_000_000 + int((m.group(7) or "").ljust(9, "0"))


def split_timestamp(line: str) -> tuple[int | None, str]:
    """(time, text) of a line the kubelet served with timestamps=true; (None, line) when it carries none."""
    stamp, sep, text = line.partition(" ")
    ts = parse_timestamp(stamp)
    if ts is None:
        return None, line
    return ts, text if sep else ""


def iter_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Lines from the chunks of a streamed response, which split lines (and UTF-8 characters) anywhere. A last line
    without its newline is still a line: a container that dies mid-write leaves one."""
    buffer = b""
    for chunk in chunks:
        if isinstance(chunk, str):
            chunk = chunk.encode()
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            yield raw.decode("utf-8", errors="replace").removesuffix("\r")
    if buffer:
        yield buffer.decode("utf-8", errors="replace").removesuffix("\r")


def merge(streams: list[list[tuple[int | None, str]]]) -> list[tuple[int, str]]:
    """(stream index, text) of every line of every stream in time order. Equal times keep the streams' order, and a
    stream's own order always holds (a line without a time, or one stamped earlier than its predecessor, stays put)."""

    def monotonic(index: int, lines: list[tuple[int | None, str]]) -> Iterator[tuple[int, int, str]]:
        latest = 0
        for ts, text in lines:
            latest = max(latest, ts or 0)
            yield latest, index, text

    merged = heapq.merge(*(monotonic(i, s) for i, s in enumerate(streams)), key=lambda item: item[:2])
    return [(index, text) for _, index, text in merged]


def rank_key(rank: str) -> tuple[int, int | str]:
    """Numeric ranks in order; a pod without the node-index label after them."""
    return (0, int(rank)) if rank.isdigit() else (1, rank)


class Prefixes:
    """The `[rank pod] ` in front of each line, padded so that every pod's text starts in the same column; colored
    per rank on a terminal. The width grows when a pod with a longer name appears."""

    def __init__(self, color: bool = False) -> None:
        self.color = color
        self.rank_width = 1
        self.label_width = 0

    def add(self, rank: str, pod: str) -> None:
        self.rank_width = max(self.rank_width, len(rank))
        self.label_width = max(self.label_width, len(self._label(rank, pod)))

    def _label(self, rank: str, pod: str) -> str:
        return f"[{rank:>{self.rank_width}} {pod}]"

    def _paint(self, rank: str, text: str) -> str:
        if not self.color:
            return text
        from rich.color import ColorSystem
        from rich.style import Style
        color = _COLORS[rank_key(rank)[1] % len(_COLORS)] if rank.isdigit() else "white"
        return Style(color=color, bold=True).render(text, color_system=ColorSystem.STANDARD)

    def line(self, rank: str, pod: str, text: str) -> str:
        label = self._label(rank, pod)
        return self._paint(rank, label) + " " * (self.label_width - len(label) + 1) + text

    def note(self, rank: str, pod: str, text: str) -> str:
        return self._paint(rank, f"--- {self._label(rank, pod)}") + f" {text}"


class Dedup:
    """Drops the lines a resumed stream repeats. A dropped connection is resumed by reading the same container's log
    again from its start; the kubelet stamps every line, so in the replay what is not newer than the last line
    printed was printed. Outside a replay every line passes: stdout and stderr may be stamped slightly out of order.
    `latest` is the pod's time for ordering: it never goes back."""

    def __init__(self) -> None:
        self.latest: int | None = None
        self._at_latest = 0  # lines printed with exactly that time
        self._replaying = False
        self._replayed = 0

    def resume(self) -> None:
        self._replaying, self._replayed = self.latest is not None, 0

    def admit(self, ts: int | None) -> bool:
        if self._replaying:
            if ts is None or ts < self.latest:
                return False
            if ts == self.latest:
                self._replayed += 1
                if self._replayed <= self._at_latest:
                    return False
            self._replaying = False
        if ts is not None:
            if self.latest is None or ts > self.latest:
                self.latest, self._at_latest = ts, 1
            elif ts == self.latest:
                self._at_latest += 1
        return True


class ReorderBuffer:
    """Holds followed lines for `window` seconds and lets them out in time order: streams of several pods arrive
    with a lag of their own, and a little patience puts their lines back in the order they were written. Items carry
    a per-pod time that never goes back (`Dedup` ensures it), so a pod's own order is never disturbed."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._heap: list[tuple[int, int, float, object]] = []
        self._seq = itertools.count()

    def push(self, ts: int, arrived: float, item: object) -> None:
        heapq.heappush(self._heap, (ts, next(self._seq), arrived, item))

    def pop_ready(self, now: float) -> list:
        ready = []
        while self._heap and self._heap[0][2] <= now - self.window:
            ready.append(heapq.heappop(self._heap)[3])
        return ready

    def pop_all(self) -> list:
        return [heapq.heappop(self._heap)[3] for _ in range(len(self._heap))]

    def __len__(self) -> int:
        return len(self._heap)


@dataclass(frozen=True)
class PodView:
    """What `kubectl ddp logs` needs of one training pod: which container's log the kubelet would serve now."""

    uid: str
    name: str
    rank: str
    phase: str
    restarts: int
    state: str  # of the current trainer container: "running", "terminated", "waiting" or "" (no status yet)
    has_log: bool  # the trainer container ran (now or earlier), so the kubelet has a log for it
    waiting: str  # the reason the trainer container waits ("ContainerCreating"), when it does
    started_at: int | None  # nanoseconds; the start of the current trainer container

    @property
    def started(self) -> bool:
        """The current container has started: the log the kubelet serves now is its own."""
        return self.state in ("running", "terminated")


def pod_view(pod) -> PodView:
    """The view of a kubernetes V1Pod."""
    meta, status = pod.metadata, pod.status
    labels = meta.labels or {}
    trainer = next((c for c in (status and status.container_statuses) or [] if c.name == names.TRAINER_CONTAINER),
                   None)
    state = trainer.state if trainer else None
    current = state and (state.running or state.terminated)
    last = trainer.last_state.terminated if trainer and trainer.last_state else None
    started = getattr(current, "started_at", None)
    kind = next((k for k in ("running", "terminated", "waiting") if state and getattr(state, k)), "")
    return PodView(
        uid=meta.uid or meta.name, name=meta.name, rank=labels.get(names.LABEL_NODE_INDEX, "?"),
        phase=(status and status.phase) or "Pending", restarts=trainer.restart_count if trainer else 0,
        state=kind, has_log=bool(current or last),
        waiting=(state.waiting.reason or "waiting") if state and state.waiting else "",
        started_at=int(started.timestamp()) * 1_000_000_000 if started else None)


@dataclass(frozen=True)
class Change:
    kind: str  # "appeared", "restarted" or "deleted"
    pod: PodView
    replaces: str | None = None  # appeared: the name of the pod that had its rank before


def changes(before: Mapping[str, PodView], after: Mapping[str, PodView],
            last_names: Mapping[str, str]) -> list[Change]:
    """What happened between two listings (views by uid). `last_names` is the last pod seen at each rank over the
    whole run: a replacement may appear a listing or more after its predecessor went away, and it keeps its
    predecessor's rank (and may even keep its name, so pods are told apart by uid)."""
    out = [Change("deleted", v) for uid, v in before.items() if uid not in after]
    for uid, v in after.items():
        old = before.get(uid)
        if old is None:
            predecessor = next((o.name for o in before.values() if o.rank == v.rank and o.uid != uid), None)
            out.append(Change("appeared", v, predecessor or last_names.get(v.rank)))
        elif v.restarts > old.restarts:
            out.append(Change("restarted", v))
    return out


def after_stream(view: PodView | None, streamed_restarts: int, *, dropped: bool, listings: int) -> str:
    """What a pod's follower does once its log stream ended, given the pod's newest listing (None: the pod is gone),
    whether the stream broke (`dropped`, rather than ended by the server because the container exited) and how many
    listings came since: "done", "restarted" (a new container started in the same pod: its log is what the kubelet
    serves now), "resume" (read the same container's log again; `Dedup` skips what was printed) or "wait"."""
    if view is None:
        return "done"
    if view.restarts > streamed_restarts and view.started:
        return "restarted"
    if view.restarts == streamed_restarts and dropped:
        return "resume"  # the rest of that container's log, whether it still runs or not
    if view.phase in FINISHED_PHASES:
        return "done"
    if view.restarts == streamed_restarts and view.state == "running" and listings >= STALE_LISTINGS:
        return "resume"  # the server ended a stream of a container that runs on: do not wait forever
    return "wait"


def all_finished(views: Iterable[PodView]) -> bool:
    views = list(views)
    return bool(views) and all(v.phase in FINISHED_PHASES for v in views)
