"""`kubectl ddp logs` (cli/kubectl_ddp/logs.py, logmerge.py): the pure rules (timestamps, prefixes, the merge, what
changed between two listings, what a follower does after its stream ended) on plain values, then the command itself
against a fake CoreV1Api whose pods change between listings, asserting the exact lines printed."""

from __future__ import annotations

import io
import json
import threading
import time
from collections import Counter
from datetime import datetime, timezone

import pytest
import urllib3
from kubernetes.client import (
    V1ContainerState, V1ContainerStateRunning, V1ContainerStateTerminated, V1ContainerStateWaiting,
    V1ContainerStatus, V1ObjectMeta, V1Pod, V1PodList, V1PodStatus,
)
from kubernetes.client.exceptions import ApiException

from ddp_operator import names
from kubectl_ddp import logmerge
from kubectl_ddp.logmerge import (
    Dedup, PodView, Prefixes, ReorderBuffer, after_stream, changes, iter_lines, merge, parse_timestamp, pod_view,
    split_timestamp,
)
from kubectl_ddp.logs import show_logs

NS, JOB = "team-a", "digits"
BASE = parse_timestamp("2024-05-01T10:00:00Z")
SELECTOR = f"{names.LABEL_JOB_NAME}={JOB},{names.LABEL_ROLE}={names.ROLE_TRAINER}"


def at(seconds: float) -> int:
    return BASE + round(seconds * 1e9)


def stamp(seconds: float) -> str:
    """RFC3339Nano as the kubelet writes it: the fraction's trailing zeros dropped."""
    whole, frac = divmod(round(seconds * 1e9), 1_000_000_000)
    fraction = f".{frac:09d}".rstrip("0").rstrip(".")
    return f"2024-05-01T10:00:{whole:02d}{fraction}Z"


def log(*lines: tuple[float, str]) -> str:
    return "".join(f"{stamp(s)} {text}\n" for s, text in lines)


def pod(name, rank, *, uid=None, phase="Running", state="running", restarts=0, started=0, reason="ContainerCreating",
        last=False):
    started_at = datetime.fromtimestamp(at(started) / 1e9, timezone.utc)
    states = {"running": V1ContainerState(running=V1ContainerStateRunning(started_at=started_at)),
              "terminated": V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=0, started_at=started_at)),
              "waiting": V1ContainerState(waiting=V1ContainerStateWaiting(reason=reason))}
    last_state = V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=1)) if last else None
    statuses = None if state is None else [V1ContainerStatus(
        name=names.TRAINER_CONTAINER, image="trainer:1", image_id="", ready=state == "running", restart_count=restarts,
        state=states[state], last_state=last_state)]
    labels = {names.LABEL_JOB_NAME: JOB, names.LABEL_ROLE: names.ROLE_TRAINER, names.LABEL_NODE_INDEX: str(rank)}
    return V1Pod(metadata=V1ObjectMeta(name=name, namespace=NS, uid=uid or f"uid-{name}", labels=labels),
                 status=V1PodStatus(phase=phase, container_statuses=statuses))


# --- the pure rules -------------------------------------------------------------------------------------------------

def test_timestamps_as_the_kubelet_writes_them():
    assert parse_timestamp("2024-05-01T10:00:01.5Z") == at(1.5)
    assert parse_timestamp("2024-05-01T10:00:01.000000123Z") == BASE + 1_000_000_123
    assert parse_timestamp("2024-05-01T10:00:01Z") == at(1)
    assert parse_timestamp("2024-05-01T12:00:01+02:00") == at(1)
    assert parse_timestamp("loss=0.3") is None
    assert split_timestamp("2024-05-01T10:00:02.25Z epoch 1 loss 0.3") == (at(2.25), "epoch 1 loss 0.3")
    assert split_timestamp("2024-05-01T10:00:02Z") == (at(2), "")
    assert split_timestamp("no stamp here") == (None, "no stamp here")


def test_lines_split_across_chunks_are_joined_and_a_last_partial_line_is_kept():
    chunks = [b"ep", b"och 1\nepoch 2\r\nl", "é".encode()[:1], "é".encode()[1:] + b"\n\ncrash"]
    assert list(iter_lines(chunks)) == ["epoch 1", "epoch 2", "lé", "", "crash"]
    assert list(iter_lines(["a\nb\n"])) == ["a", "b"]


def test_merge_is_in_time_order_stable_and_keeps_each_streams_own_order():
    a = [(at(1), "a1"), (at(3), "a3"), (at(2), "a-late-stamped"), (None, "a-unstamped")]
    b = [(at(1), "b1"), (at(2), "b2"), (at(4), "b4")]
    assert merge([a, b]) == [(0, "a1"), (1, "b1"), (1, "b2"), (0, "a3"), (0, "a-late-stamped"), (0, "a-unstamped"),
                             (1, "b4")]


def test_prefixes_align_every_pods_text_and_color_only_on_a_terminal():
    p = Prefixes()
    for rank, name in (("0", "digits-0"), ("10", "digits-10"), ("2", "digits-2-x")):
        p.add(rank, name)
    assert p.line("0", "digits-0", "hi") == "[ 0 digits-0]   hi"
    assert p.line("10", "digits-10", "hi") == "[10 digits-10]  hi"
    assert p.line("2", "digits-2-x", "hi") == "[ 2 digits-2-x] hi"
    assert p.note("2", "digits-2-x", "pod deleted") == "--- [ 2 digits-2-x] pod deleted"
    colored = Prefixes(color=True)
    colored.add("1", "digits-1")
    line = colored.line("1", "digits-1", "hi")
    assert line != "[1 digits-1] hi" and line.startswith("\x1b[") and line.endswith("[1 digits-1]\x1b[0m hi")


def test_a_resumed_stream_prints_only_what_is_new():
    d = Dedup()
    first = [at(1), at(2), at(2), None]
    assert [d.admit(t) for t in first] == [True, True, True, True]
    assert d.admit(at(1.5)) is True  # outside a replay an earlier stamp (stderr vs stdout) is still printed
    d.resume()
    replay = [at(1), at(1.5), at(2), at(2), at(2), at(3), at(1)]
    assert [d.admit(t) for t in replay] == [False, False, False, False, True, True, True]
    assert d.latest == at(3)


def test_the_reorder_buffer_lets_lines_out_in_time_order_after_the_window():
    b = ReorderBuffer(0.5)
    b.push(at(2), 10.0, "b")
    b.push(at(1), 10.3, "a")
    b.push(at(2), 10.4, "b2")
    assert b.pop_ready(10.6) == []  # "a" arrived 0.3 s ago and is older than "b": both wait
    assert b.pop_ready(10.8) == ["a", "b"]
    b.push(at(5), 11.0, "c")
    assert b.pop_all() == ["b2", "c"] and len(b) == 0


def view(name, rank, *, uid=None, restarts=0, phase="Running", state="running"):
    return PodView(uid=uid or name, name=name, rank=rank, phase=phase, restarts=restarts, state=state,
                   has_log=state != "waiting", waiting="", started_at=None)


def test_what_changed_between_two_listings():
    before = {"u0": view("d-0", "0", uid="u0"), "u1": view("d-1", "1", uid="u1"), "u2": view("d-2", "2", uid="u2")}
    after = {"u0": view("d-0", "0", uid="u0", restarts=1),
             "u1": view("d-1", "1", uid="u1"),  # the old pod, still terminating
             "u1b": view("d-1b", "1", uid="u1b"),
             "u2b": view("d-2", "2", uid="u2b"),  # the operator's replacement keeps the name: a new uid
             "u3": view("d-3", "3", uid="u3")}
    got = [(c.kind, c.pod.uid, c.replaces) for c in changes(before, after, {"3": "d-3-old"})]
    assert got == [("deleted", "u2", None), ("restarted", "u0", None), ("appeared", "u1b", "d-1"),
                   ("appeared", "u2b", "d-2"), ("appeared", "u3", "d-3-old")]
    assert changes(after, after, {}) == []


def test_what_a_follower_does_when_its_stream_ended():
    running = view("d-0", "0")
    assert after_stream(None, 0, dropped=False, listings=1) == "done"
    assert after_stream(view("d-0", "0", restarts=1), 0, dropped=False, listings=1) == "restarted"
    # a container that waits to be restarted (CrashLoopBackOff) is not new yet: the kubelet serves the old log
    assert after_stream(view("d-0", "0", restarts=1, state="waiting"), 0, dropped=False, listings=5) == "wait"
    assert after_stream(view("d-0", "0", state="terminated"), 0, dropped=False, listings=5) == "wait"
    assert after_stream(running, 0, dropped=True, listings=1) == "resume"
    assert after_stream(view("d-0", "0", phase="Succeeded", state="terminated"), 0, dropped=True, listings=1) \
        == "resume"  # the rest of a finished container's log
    assert after_stream(view("d-0", "0", phase="Succeeded", state="terminated"), 0, dropped=False,
                        listings=1) == "done"
    # the status lags the stream's end for a listing or two; past that the stream is read again
    assert after_stream(running, 0, dropped=False, listings=logmerge.STALE_LISTINGS - 1) == "wait"
    assert after_stream(running, 0, dropped=False, listings=logmerge.STALE_LISTINGS) == "resume"


def test_the_view_of_a_kubernetes_pod():
    v = pod_view(pod("d-1", 1, restarts=2, started=5, last=True))
    assert (v.uid, v.name, v.rank, v.phase, v.restarts, v.state, v.has_log, v.started_at) == \
        ("uid-d-1", "d-1", "1", "Running", 2, "running", True, at(5))
    pending = pod_view(pod("d-2", 2, phase="Pending", state="waiting"))
    assert (pending.has_log, pending.started, pending.waiting) == (False, False, "ContainerCreating")
    crashlooping = pod_view(pod("d-3", 3, state="waiting", reason="CrashLoopBackOff", restarts=1, last=True))
    assert (crashlooping.has_log, crashlooping.started) == (True, False)
    assert pod_view(pod("d-4", 4, phase="Pending", state=None)).state == ""


# --- the command against a fake API ---------------------------------------------------------------------------------

class Stream:
    """A followed log: its text, then held open until the fake reaches step `until`; `drop`: then the connection
    breaks instead of ending."""

    def __init__(self, text: str, until: int = 0, drop: bool = False) -> None:
        self.text, self.until, self.drop = text, until, drop


class FakeResponse:
    def __init__(self, core, stream: Stream) -> None:
        self.core, self.script, self.closed = core, stream, False

    def stream(self, amt=None, decode_content=None):
        data = self.script.text.encode()
        for i in range(0, len(data), 7):  # chunks that cut lines anywhere
            yield data[i:i + 7]
        deadline = time.monotonic() + 10
        while self.core.step < self.script.until and not self.closed and time.monotonic() < deadline:
            time.sleep(0.002)
        if self.script.drop:
            raise urllib3.exceptions.ProtocolError("Connection broken")

    def release_conn(self):
        pass

    def close(self):
        self.closed = True


class FakeCore:
    """CoreV1Api as `show_logs` uses it. `steps`: the job's pods at each listing; a listing moves to the next step
    only once the log reads `gates[step]` ((pod, restart count) pairs, cumulative) were made, so the followers'
    reads and the pods' changes interleave as they would on a cluster. `logs[(pod, restart count)]`: a text (or an
    ApiException) for a plain read, a list of `Stream`s (one per read, the last repeating) for a followed one."""

    def __init__(self, steps, logs, gates=()) -> None:
        self.steps, self.logs, self.gates = steps, logs, list(gates)
        self.step, self.lock = 0, threading.Lock()
        self.selectors, self.calls, self.reads = [], [], Counter()

    def list_namespaced_pod(self, namespace, label_selector, **_):
        assert namespace == NS
        with self.lock:
            gate = self.gates[self.step] if self.step < len(self.gates) else []
            if self.step + 1 < len(self.steps) and not Counter(gate) - self.reads:
                self.step += 1
            self.selectors.append(label_selector)
            wanted = dict(kv.split("=") for kv in label_selector.split(","))
            items = [p for p in self.steps[self.step] if wanted.items() <= p.metadata.labels.items()]
        return V1PodList(items=items)

    def read_namespaced_pod_log(self, name, namespace, container=None, follow=False, timestamps=False,
                                previous=False, tail_lines=None, _preload_content=True):
        assert (namespace, container, timestamps) == (NS, names.TRAINER_CONTAINER, True)
        with self.lock:
            current = next((p for p in self.steps[self.step] if p.metadata.name == name), None)
            if current is None:
                raise ApiException(status=404, reason="Not Found")
            key = (name, current.status.container_statuses[0].restart_count - previous)
            self.calls.append((name, key[1], previous, tail_lines, follow))
            n = self.reads[key]
            self.reads[key] += 1
        entry = self.logs[key]
        if isinstance(entry, Exception):
            raise entry
        if not follow:
            return entry
        assert _preload_content is False
        return FakeResponse(self, entry[min(n, len(entry) - 1)])


def api_error(status: int, message: str) -> ApiException:
    return ApiException(status=status, reason="Bad Request", body=json.dumps({"kind": "Status", "message": message}))


def run(core, **kw) -> tuple[int, list[str]]:
    out = io.StringIO()
    kw = {"follow": False, "rank": None, "previous": False, **kw}
    code = show_logs(core, NS, JOB, out=out, **kw)
    return code, out.getvalue().splitlines()


def test_the_logs_of_every_pod_merged_in_time_order_with_their_prefixes():
    pods = [pod("digits-0", 0), pod("digits-1", 1), pod("digits-2", 2, phase="Pending", state="waiting")]
    logs = {("digits-0", 0): log((1, "0 epoch 1"), (3, "0 epoch 2"), (3, "0 same time")) + "0 cut off",
            ("digits-1", 0): log((2, "1 epoch 1"), (3, "1 same time"), (4.5, "1 epoch 2"))}
    code, lines = run(FakeCore([pods], logs), tail=100)
    assert code == 0
    assert lines == [
        "--- [2 digits-2] trainer not started yet (ContainerCreating)",
        "[0 digits-0] 0 epoch 1",
        "[1 digits-1] 1 epoch 1",
        "[0 digits-0] 0 epoch 2",
        "[0 digits-0] 0 same time",
        "[0 digits-0] 0 cut off",  # no stamp of its own: it keeps its place after its predecessor
        "[1 digits-1] 1 same time",
        "[1 digits-1] 1 epoch 2",
    ]


def test_the_rank_filter_asks_for_that_pods_only():
    pods = [pod("digits-0", 0), pod("digits-1", 1)]
    core = FakeCore([pods], {("digits-1", 0): log((1, "one")), ("digits-0", 0): log((1, "zero"))})
    assert run(core, rank=1) == (0, ["[1 digits-1] one"])
    assert core.selectors == [f"{SELECTOR},{names.LABEL_NODE_INDEX}=1"]


def test_previous_containers_and_one_pods_error_are_notes_not_failures():
    pods = [pod("digits-0", 0), pod("digits-1", 1, restarts=1, last=True), pod("digits-2", 2, restarts=2, last=True),
            pod("digits-3", 3, restarts=1, last=True)]
    logs = {("digits-1", 0): log((1, "before the crash")),
            ("digits-2", 1): api_error(400, 'previous terminated container "trainer" in pod "digits-2" not found'),
            ("digits-3", 0): api_error(500, "etcdserver: request timed out")}
    core = FakeCore([pods], logs)
    assert run(core, previous=True) == (0, [
        "--- [0 digits-0] no previous container",
        "--- [2 digits-2] no previous container",
        "--- [3 digits-3] error: etcdserver: request timed out",
        "[1 digits-1] before the crash",
    ])
    assert ("digits-0", -1, True, None, False) not in core.calls  # restart count 0: nothing to ask for


def test_a_job_without_pods_is_an_error(capsys):
    assert run(FakeCore([[]], {})) == (1, [])
    assert "no pods of DDPJob digits in namespace team-a" in capsys.readouterr().err
    assert run(FakeCore([[pod("digits-0", 0)]], {}), rank=3) == (1, [])
    assert "with rank 3" in capsys.readouterr().err


def test_follow_keeps_up_with_restarts_in_place_replacements_and_deletions():
    d0, d1, d2, d1b = "digits-0-aaaaa", "digits-1-bbbbb", "digits-2-ccccc", "digits-1-ddddd"
    steps = [
        # 0: two trainers run, the third waits for its image
        [pod(d0, 0), pod(d1, 1), pod(d2, 2, phase="Pending", state="waiting")],
        # 1: digits-1's trainer crashed and the kubelet restarted it; digits-2 started
        [pod(d0, 0), pod(d1, 1, restarts=1, started=5, last=True), pod(d2, 2, started=6)],
        # 2: digits-1 was deleted and replaced by a new pod at its node-index; digits-0 finished
        [pod(d0, 0, phase="Succeeded", state="terminated"), pod(d2, 2, started=6), pod(d1b, 1, started=8)],
        # 3: all finished
        [pod(d0, 0, phase="Succeeded", state="terminated"), pod(d2, 2, phase="Succeeded", state="terminated"),
         pod(d1b, 1, phase="Succeeded", state="terminated", started=8)],
    ]
    logs = {
        (d0, 0): [Stream(log((1, "0 epoch 1"), (4, "0 epoch 2")), until=2)],
        (d1, 0): [Stream(log((2, "1 epoch 1"), (3, "1 crashed")), until=1)],
        (d1, 1): [Stream(log((5.5, "1 resumed")), until=2)],
        # the first connection breaks: the second read starts over, and only "2 done" is new
        (d2, 0): [Stream(log((6, "2 late start")), drop=True),
                  Stream(log((6, "2 late start"), (7, "2 done")), until=3)],
        (d1b, 0): [Stream(log((8.5, "1b epoch 3")), until=3)],
    }
    gates = [[(d0, 0), (d1, 0)], [(d1, 1), (d2, 0)], [(d1b, 0), (d2, 0), (d2, 0)]]
    core = FakeCore(steps, logs, gates)
    code, lines = run(core, follow=True, tail=50, poll=0.01)
    assert code == 0
    assert lines == [
        f"[0 {d0}] 0 epoch 1",
        f"[1 {d1}] 1 epoch 1",
        f"[1 {d1}] 1 crashed",
        f"[0 {d0}] 0 epoch 2",
        f"--- [1 {d1}] trainer restarted in place (restart 1)",
        f"[1 {d1}] 1 resumed",
        f"--- [1 {d1}] pod deleted",
        f"[2 {d2}] 2 late start",
        f"[2 {d2}] 2 done",
        f"--- [1 {d1b}] replaces {d1}",
        f"[1 {d1b}] 1b epoch 3",
    ]
    # --tail is for the logs there were when the command began; a restarted or new container is shown whole
    tails = {(name, restarts): tail for name, restarts, _, tail, _ in core.calls}
    assert tails[(d0, 0)] == tails[(d1, 0)] == 50
    assert tails[(d1, 1)] is tails[(d2, 0)] is tails[(d1b, 0)] is None
    assert all(follow for *_, follow in core.calls)


def test_follow_ends_when_told_to_stop():
    core = FakeCore([[pod("digits-0", 0)]], {("digits-0", 0): [Stream(log((1, "forever")), until=99)]})
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    assert run(core, follow=True, stop=stop, poll=0.01) == (0, ["[0 digits-0] forever"])
    assert time.monotonic() - started < 5


def test_follow_returns_130_on_ctrl_c(capsys):
    class Interrupted(FakeCore):
        def list_namespaced_pod(self, *a, **kw):
            if len(self.selectors) >= 3:
                raise KeyboardInterrupt
            return super().list_namespaced_pod(*a, **kw)

    core = Interrupted([[pod("digits-0", 0)]], {("digits-0", 0): [Stream(log((1, "working")), until=99)]})
    assert run(core, follow=True, poll=0.01) == (130, ["[0 digits-0] working"])


@pytest.mark.parametrize("previous", [False, True])
def test_follow_with_previous_reads_the_finished_container_once(previous):
    pods = [pod("digits-0", 0, restarts=1, last=True)]
    logs = {("digits-0", 0): log((1, "old")), ("digits-0", 1): [Stream(log((2, "new")))]}
    core = FakeCore([pods], logs)
    if previous:
        assert run(core, follow=True, previous=True) == (0, ["[0 digits-0] old"])
        assert core.calls == [("digits-0", 0, True, None, False)]
    else:  # a Running pod whose stream ended: it is followed until stopped
        stop = threading.Event()
        threading.Timer(0.2, stop.set).start()
        assert run(core, follow=True, stop=stop, poll=0.01) == (0, ["[0 digits-0] new"])
