"""`kubectl ddp logs`: the trainer logs of every pod of a DDPJob merged in time order, each line prefixed with its
`[rank pod]`; with --follow it keeps up with the job as pods are replaced (a new pod at the same node-index) or their
trainer restarts in place, until every pod finished. The API calls and the threads live here; the rules they follow
(timestamps, prefixes, merging, what changed between two listings) are logmerge.py's pure functions."""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TextIO

from kubernetes.client.exceptions import ApiException

from ddp_operator import names
from kubectl_ddp.logmerge import (
    FINISHED_PHASES, Dedup, PodView, Prefixes, ReorderBuffer, after_stream, all_finished, changes, iter_lines, merge,
    pod_view, rank_key, split_timestamp,
)

POLL_SECONDS = 1.0
# Streams of different pods reach us with lags of their own; lines wait this long to be put back in time order.
REORDER_SECONDS = 0.5
# With --follow, a job whose pods are all gone this long was deleted (or scaled to nothing): stop rather than hang.
GONE_SECONDS = 60.0
LIST_TIMEOUT_SECONDS = 30
# Reading many pods one after another would make a large job's logs slow to appear.
READ_CONCURRENCY = 8


def show_logs(core, namespace: str, job: str, *, follow: bool, rank: int | None, previous: bool, out: TextIO,
              tail: int | None = None, clock=time.monotonic, stop: threading.Event | None = None,
              poll: float = POLL_SECONDS) -> int:
    """Print the job's trainer logs to `out`: 0 when done, 1 when the job has no (such) pods, 130 on Ctrl-C.
    A previous container's log is complete, so `previous` reads it once even with `follow`."""
    views = list_pods(core, namespace, job, rank)
    if not views:
        which = f" with rank {rank}" if rank is not None else ""
        print(f"kubectl ddp logs: no pods of DDPJob {job}{which} in namespace {namespace}", file=sys.stderr)
        return 1
    prefixes = Prefixes(color=bool(getattr(out, "isatty", lambda: False)()))
    for v in views:
        prefixes.add(v.rank, v.name)
    if not follow or previous:
        return _show_once(core, namespace, views, prefixes, out, previous=previous, tail=tail)
    return _Follow(core, namespace, job, rank, out, prefixes, clock, stop or threading.Event(), poll).run(views, tail)


def list_pods(core, namespace: str, job: str, rank: int | None) -> list[PodView]:
    selector = f"{names.LABEL_JOB_NAME}={job},{names.LABEL_ROLE}={names.ROLE_TRAINER}"
    if rank is not None:
        selector += f",{names.LABEL_NODE_INDEX}={rank}"
    pods = core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=LIST_TIMEOUT_SECONDS).items
    return sorted((pod_view(p) for p in pods), key=lambda v: (rank_key(v.rank), v.name))


def api_message(e: ApiException) -> str:
    """The API server's own sentence (its Status body), not the client's multi-line dump."""
    try:
        return json.loads(e.body)["message"]
    except (TypeError, ValueError, KeyError):
        return f"{e.status} {e.reason}"


def _why_not_read(e: ApiException, previous: bool) -> str:
    message = api_message(e)
    if previous and e.status == 400 and "previous terminated container" in message:
        return "no previous container"
    return f"error: {message}"


def _read(core, namespace: str, view: PodView, previous: bool, tail: int | None) -> tuple[list, str | None]:
    """(timed lines, None), or ([], the note that says why the pod has none to show)."""
    if previous and view.restarts == 0:
        return [], "no previous container"
    if not previous and not view.has_log:
        if view.phase in FINISHED_PHASES:
            return [], f"trainer never started (pod {view.phase})"
        return [], f"trainer not started yet ({view.waiting or view.phase})"
    try:
        text = core.read_namespaced_pod_log(view.name, namespace, container=names.TRAINER_CONTAINER,
                                            timestamps=True, previous=previous, tail_lines=tail)
    except ApiException as e:
        return [], _why_not_read(e, previous)
    return [split_timestamp(line) for line in iter_lines([text])], None


def _show_once(core, namespace: str, views: list[PodView], prefixes: Prefixes, out: TextIO, *, previous: bool,
               tail: int | None) -> int:
    with ThreadPoolExecutor(max_workers=READ_CONCURRENCY) as pool:
        results = list(pool.map(lambda v: _read(core, namespace, v, previous, tail), views))
    for view, (_, note) in zip(views, results):
        if note:
            out.write(prefixes.note(view.rank, view.name, note) + "\n")
    for index, text in merge([lines for lines, _ in results]):
        out.write(prefixes.line(views[index].rank, views[index].name, text) + "\n")
    out.flush()
    return 0


@dataclass(frozen=True)
class _Item:
    """A line or a note of one pod, on its way from the pod's follower thread to the printing thread."""

    rank: str
    pod: str
    text: str
    note: bool
    at: int | None  # the pod's time (ns), never going back; None before the pod has one


class _Follow:
    """--follow: one thread per started pod (`_Tracker`) streams its log into a queue; this (the calling) thread
    lists the job's pods every `poll` seconds, tells the trackers what changed, and prints what they send through a
    `ReorderBuffer`. Only this thread writes to `out`."""

    def __init__(self, core, namespace, job, rank, out, prefixes, clock, stop, poll) -> None:
        self.core, self.namespace, self.job, self.rank = core, namespace, job, rank
        self.out, self.prefixes, self.clock, self.stop, self.poll = out, prefixes, clock, stop, poll
        self.stopping = threading.Event()  # tells the trackers to quit, whatever ended the run
        self.items: queue.Queue[_Item] = queue.Queue()
        self.buffer = ReorderBuffer(REORDER_SECONDS)
        self.views: dict[str, PodView] = {}
        self.trackers: dict[str, _Tracker] = {}
        self.replaces: dict[str, str] = {}  # uid of a new pod -> the pod it replaces, noted when it starts
        self.last_names: dict[str, str] = {}
        self.latest = 0  # the newest time printed: where a note of no time of its own goes
        self.last_error = ""
        self.empty_since: float | None = None

    def run(self, views: list[PodView], tail: int | None) -> int:
        self._apply({v.uid: v for v in views}, tail=tail)
        next_poll = self.clock() + self.poll
        try:
            while not self.stop.is_set():
                self._drain(timeout=max(0.0, min(0.1, next_poll - self.clock())))
                self._write(self.buffer.pop_ready(self.clock()))
                if self.clock() >= next_poll:
                    if self._poll():
                        break
                    next_poll = self.clock() + self.poll
        except KeyboardInterrupt:
            self._shutdown()
            print(file=sys.stderr)  # past the ^C the terminal echoed
            return 130
        self._shutdown()
        return 0

    def _poll(self) -> bool:
        """List the pods and act on what changed; True when the run is over."""
        try:
            views = list_pods(self.core, self.namespace, self.job, self.rank)
        except Exception as e:  # noqa: BLE001 - a failed listing is retried at the next poll, whatever it was
            message = api_message(e) if isinstance(e, ApiException) else str(e)
            if message != self.last_error:
                self._write([f"--- listing the pods of {self.job} failed: {message} (retrying)"])
            self.last_error = message
            return False
        self.last_error = ""
        self._apply({v.uid: v for v in views}, tail=None)
        if not views:
            self.empty_since = self.empty_since if self.empty_since is not None else self.clock()
            if self.clock() - self.empty_since >= GONE_SECONDS:
                self._write([f"--- no pods of {self.job} for {GONE_SECONDS:.0f}s: stopping"])
                return True
            return False
        self.empty_since = None
        if all_finished(views) and not any(t.is_alive() for t in self.trackers.values()):
            self._drain(timeout=0)
            return True
        return False

    def _apply(self, after: dict[str, PodView], tail: int | None) -> None:
        for change in changes(self.views, after, self.last_names):
            if change.kind == "appeared" and change.replaces:
                self.replaces[change.pod.uid] = change.replaces
            elif change.kind == "deleted":
                self._deleted(change.pod)
        for uid, view in after.items():
            self.last_names[view.rank] = view.name
            self.prefixes.add(view.rank, view.name)
            if uid in self.trackers:
                self.trackers[uid].update(view)
            elif view.has_log:
                tracker = _Tracker(self, view, tail, self.replaces.pop(uid, None))
                self.trackers[uid] = tracker
                tracker.start()
        self.views = after

    def _deleted(self, view: PodView) -> None:
        tracker = self.trackers.get(view.uid)
        if tracker is None or not tracker.gone():
            at = tracker.at if tracker else None
            self.items.put(_Item(view.rank, view.name, "pod deleted", note=True, at=at))

    def _drain(self, timeout: float) -> None:
        try:
            item = self.items.get(timeout=timeout) if timeout > 0 else self.items.get_nowait()
            while True:
                self.latest = max(self.latest, item.at or 0)
                self.buffer.push(item.at if item.at is not None else self.latest, self.clock(), item)
                item = self.items.get_nowait()
        except queue.Empty:
            pass

    def _write(self, items: list[_Item | str]) -> None:
        """Formatted now, not when queued: a pod that appeared since may have widened the prefixes."""
        lines = []
        for item in items:
            if isinstance(item, _Item):
                self.prefixes.add(item.rank, item.pod)
                show = self.prefixes.note if item.note else self.prefixes.line
                item = show(item.rank, item.pod, item.text)
            lines.append(item + "\n")
        if lines:
            self.out.write("".join(lines))
            self.out.flush()

    def _shutdown(self) -> None:
        self.stopping.set()
        for tracker in self.trackers.values():
            tracker.close()
        self._drain(timeout=0)
        self._write(self.buffer.pop_all())


class _Tracker(threading.Thread):
    """Follows one pod's trainer log: through in-place restarts of the container, and across dropped connections,
    until the pod finished or is gone. Daemon: a stream blocked in a read never keeps the process alive."""

    def __init__(self, follow: _Follow, view: PodView, tail: int | None, replaces: str | None) -> None:
        super().__init__(daemon=True, name=f"logs-{view.name}")
        self.follow, self.view, self.tail, self.replaces = follow, view, tail, replaces
        self.rank, self.pod = view.rank, view.name
        self.dedup = Dedup()
        self.at: int | None = None
        self.changed = threading.Condition()
        self.version = 0
        self.finished = False  # decided under `changed`, so that a deletion is noted exactly once
        self.response = None
        self.last_error = ""

    def update(self, view: PodView | None) -> None:
        with self.changed:
            self.view = view
            self.version += 1
            self.changed.notify_all()

    def gone(self) -> bool:
        """Tell the tracker its pod is gone; False when it already ended (its deletion is then the caller's note)."""
        with self.changed:
            if self.finished:
                return False
            self.update(None)
            return True

    def close(self) -> None:
        with self.changed:
            self.changed.notify_all()
        response = self.response
        if response is not None:
            try:  # unblocks the read; the thread notices `stopping` and ends
                response.close()
            except Exception:  # noqa: BLE001 - closing a stream that is already broken
                pass

    def _emit(self, text: str, *, note: bool = False, at: int | None = None) -> None:
        for t in (at, self.dedup.latest):
            if t is not None:
                self.at = t if self.at is None else max(self.at, t)
        self.follow.items.put(_Item(self.rank, self.pod, text, note, self.at))

    def run(self) -> None:
        try:
            self._follow()
        except Exception as e:  # noqa: BLE001 - one pod's failure is a note, never the end of the others
            if not self.follow.stopping.is_set():
                self._emit(f"error: {e}", note=True)

    def _follow(self) -> None:
        if self.replaces:
            self._emit(f"replaces {self.replaces}", note=True, at=self.view.started_at)
        streamed, tail = self.view.restarts, self.tail
        while not self.follow.stopping.is_set():
            dropped = self._stream(tail)
            tail = None
            with self.changed:
                seen, listings, decision = self.version, 0, "wait"
                while decision == "wait" and not self.follow.stopping.is_set():
                    # Only a listing newer than the stream's end tells whether its container exited; a gone pod
                    # is never listed again.
                    while self.version == seen and self.view is not None and not self.follow.stopping.is_set():
                        self.changed.wait(0.5)
                    seen, view, listings = self.version, self.view, listings + 1
                    decision = after_stream(view, streamed, dropped=dropped, listings=listings)
                if decision == "done":
                    self.finished = True
            if decision == "done":
                if view is None:
                    self._emit("pod deleted", note=True)
                return
            if decision == "restarted":
                streamed = view.restarts
                self._emit(f"trainer restarted in place (restart {streamed})", note=True, at=view.started_at)
            # Either way the next stream starts at its container's first line: Dedup drops what was printed.
            self.dedup.resume()

    def _stream(self, tail: int | None) -> bool:
        """Print the pod's current container log from its start (or its last `tail` lines); True when the
        connection broke before the server ended it."""
        follow = self.follow
        try:
            self.response = follow.core.read_namespaced_pod_log(
                self.pod, follow.namespace, container=names.TRAINER_CONTAINER, follow=True, timestamps=True,
                tail_lines=tail, _preload_content=False)
        except Exception as e:  # noqa: BLE001 - the listings decide whether to try again
            # 404: the pod is gone, which its listing says; the same error at every retry is said once.
            message = api_message(e) if isinstance(e, ApiException) else str(e)
            if getattr(e, "status", None) != 404 and message != self.last_error and not follow.stopping.is_set():
                self._emit(f"error: {message}", note=True)
            self.last_error = message
            return False
        self.last_error = ""
        try:
            # amt=None: each chunk the API server flushes, as it comes, rather than waiting for a full buffer.
            for line in iter_lines(self.response.stream(amt=None, decode_content=True)):
                if follow.stopping.is_set():
                    return False
                ts, text = split_timestamp(line)
                if self.dedup.admit(ts):
                    self._emit(text)
        except Exception:  # noqa: BLE001 - a broken connection (urllib3's ProtocolError and kin)
            return True
        finally:
            try:
                self.response.release_conn()
            except Exception:  # noqa: BLE001 - releasing a broken connection
                pass
        return False
