"""The poller and the diagnostics sidecars (docs/diagnostics.md), with stand-in sidecars on loopback: a process group
that never formed is handed to a pass at its deadline (after the pods logged their stacks), a silent hang and a
progress hang carry the pods' diagnoses, a Stalled job that formed is cleared, a malformed answer is one Event, and
the polls keep the stall clocks' pace whatever progressPeriodSeconds says."""

import dataclasses
import time

import pytest

from ddp_operator import names, progress
from ddp_trainer.testing import free_port

from fake_api import fake_reconciler, running_job
from ddp_builders import ProgressServer, Silent, job_body

INIT = "_new_process_group_helper (torch/distributed/distributed_c10d.py:2011)"
ALLREDUCE = "allreduce (torch/distributed/distributed_c10d.py:2501)"


def _worker(pid, rank, env_rank, phase, frame=INIT, user="main (train.py:42)", digest="d", cpu=1.0):
    return {"pid": pid, "rank": rank, "envRank": env_rank, "localRank": 0, "worldSize": 2, "cpuSeconds": cpu,
            "phase": phase, "frame": frame, "userFrame": user, "digest": digest}


def _answer(*workers):
    return {"version": 1, "time": 1733400000.5, "stacks": "ok", "workers": list(workers)}


# A pod's diagnostics sidecar on one loopback address: answers `answer` (changeable), records every path asked.
Sidecar = ProgressServer


@pytest.fixture
def ports(monkeypatch):
    """Free ports for the progress endpoint (nobody listens unless a test says so) and the sidecars."""
    progress, diagnostics = free_port(), free_port()
    monkeypatch.setattr(names, "PROGRESS_PORT", progress)
    monkeypatch.setattr(names, "DIAGNOSTICS_PORT", diagnostics)
    return progress, diagnostics


@pytest.fixture
def servers():
    started = []
    yield started
    for s in started:
        s.close()


def _running_job(name, **spec):
    """A reconciler with one Running job whose trainer pod i runs on 127.0.0.<i + 2>; its passes' stall and
    diagnoses arguments are recorded in `r.found`."""
    r = fake_reconciler()
    key, _, obj = running_job(r, name, **spec)
    r.found = []
    real = r.poller.reconcile

    def recording(*args, **kwargs):
        r.found.append(kwargs)
        return real(*args, **kwargs)
    r.poller.reconcile = recording
    return r, key, obj


def _condition(obj, kind):
    return next((c for c in obj.written.get("conditions") or [] if c["type"] == kind), None)


def _poll_now(r, key, obj):
    """A poll that asks the progress endpoints and (when a stall clock needs them) the sidecars, whatever the pace."""
    obj.progress_at = obj.diagnosed_at = 0.0
    r.poller.poll(key)


def test_a_due_startup_deadline_hands_a_pass_the_never_formed_finding_after_the_stacks_are_logged(ports, servers):
    r, key, obj = _running_job("twice", failurePolicy={"processGroupTimeoutSeconds": 10})
    # the local rank taken for the global one: both pods' workers claim rank 0, rank 1 never joins
    servers += [Sidecar("127.0.0.2", ports[1], _answer(_worker(41, 0, 0, "init"))),
                Sidecar("127.0.0.3", ports[1], _answer(_worker(41, 0, 1, "init")))]
    _poll_now(r, key, obj)
    w = obj.stall_watch
    assert w is not None and not w.formed and r.found == []  # not due yet: nothing handed in, nothing logged
    assert all(s.paths == [names.DIAGNOSTICS_PATH] for s in servers)
    obj.stall_watch = dataclasses.replace(w, init_since=time.monotonic() - 11)
    obj.progress_at = obj.diagnosed_at = time.monotonic()  # polled a moment ago: the deadline alone makes it due
    assert r.poller.due(key) is not None
    r.poller.poll(key)
    (found,) = [f["stall"] for f in r.found if "stall" in f]
    assert found.reason == names.REASON_PG_NEVER_FORMED
    assert "global rank 1 of 2 never joined" in found.message and "rank 0 claimed twice" in found.message
    # the full stacks went to the sidecars' logs before the pass was handed the finding
    assert all(s.paths[-1] == f"{names.DIAGNOSTICS_PATH}?log={names.REASON_PG_NEVER_FORMED}" for s in servers)
    # what the user sees: Stalled, a Warning Event with the same line, every pod restarted
    stalled = _condition(obj, names.COND_STALLED)
    assert stalled["status"] == "True" and stalled["reason"] == names.REASON_PG_NEVER_FORMED
    assert any(e[1:3] == ("Warning", names.REASON_PG_NEVER_FORMED) and "never joined" in e[3] for e in r.api.events)
    assert sorted(r.api.deleted) == ["twice-0", "twice-1"]
    assert obj.written["diagnosis"]["ranks"][0]["frame"] == INIT


def test_an_invalid_diagnosis_is_one_event_and_its_valid_parts_are_kept(ports, servers):
    r, key, obj = _running_job("odd")
    bad = {"stacks": 5, "workers": [{**_worker(41, 0, 0, "init"), "rank": "zero", "cpuSeconds": -1}]}
    servers += [Sidecar("127.0.0.2", ports[1], bad), Sidecar("127.0.0.3", ports[1], _answer())]
    for _ in range(3):
        _poll_now(r, key, obj)  # never raises
    events = [e for e in r.api.events if e[2] == names.REASON_INVALID_REPORT]
    assert len(events) == 1 and events[0][1] == "Warning"
    assert "odd-0" in events[0][3] and "diagnostics sidecar" in events[0][3]
    assert all(f in events[0][3] for f in ("stacks", "workers[0].rank", "workers[0].cpuSeconds"))
    # the rest of the answer counts: its worker is in init, so the group has not formed
    assert obj.stall_watch is not None and not obj.stall_watch.formed


def _asked_at(r, key, obj, seconds_ago):
    """Whether a poll is due when the pods were last polled and their sidecars asked `seconds_ago`."""
    obj.progress_at = obj.diagnosed_at = time.monotonic() - seconds_ago
    return r.poller.due(key) is not None


def test_the_polls_keep_the_stall_pace_whatever_progress_period_seconds_says(ports, servers):
    r, key, obj = _running_job("slow", progressPeriodSeconds=600,
                               failurePolicy={"hangTimeoutSeconds": 0, "processGroupTimeoutSeconds": 300})
    pod0 = Sidecar("127.0.0.2", ports[1], _answer(_worker(41, 0, 0, "init")))
    pod1 = Sidecar("127.0.0.3", ports[1], _answer(_worker(42, 1, 1, "init")))
    servers += [pod0, pod1]
    _poll_now(r, key, obj)
    assert not _asked_at(r, key, obj, 0)
    assert _asked_at(r, key, obj, 5.1)  # not formed: every 5 s (300/10, at most 5), not every 600 s
    # the start-up deadline makes a poll due the moment it is up, whatever the pace
    obj.stall_watch = dataclasses.replace(obj.stall_watch, init_since=time.monotonic() - 300)
    assert _asked_at(r, key, obj, 0)
    # once formed (and a formed group's hang rule off) the job is polled at progressPeriodSeconds again
    pod0.answer = _answer(_worker(41, 0, 0, "running", frame="forward (model.py:3)"))
    pod1.answer = _answer(_worker(42, 1, 1, "collective", frame=ALLREDUCE))
    _poll_now(r, key, obj)
    assert obj.stall_watch.formed and r.found == []
    assert not _asked_at(r, key, obj, 5.1)
    assert pod0.paths == [names.DIAGNOSTICS_PATH] * 2


def test_a_formed_script_that_reports_nothing_is_asked_at_a_tenth_of_the_hang_timeout(ports, servers):
    r, key, obj = _running_job("plain", failurePolicy={"hangTimeoutSeconds": 1800})
    servers += [Sidecar("127.0.0.2", ports[1], _answer(_worker(41, 0, 0, "running", frame="step (train.py:9)"))),
                Sidecar("127.0.0.3", ports[1], _answer(_worker(42, 1, 1, "collective", frame=ALLREDUCE)))]
    _poll_now(r, key, obj)
    assert obj.stall_watch.formed and not obj.stall_watch.reporting
    # its progress endpoint is polled every 5 s (hang detection); its sidecars at most every 30 s (1800/10, capped)
    obj.progress_at, obj.diagnosed_at = time.monotonic() - 5.1, time.monotonic() - 5.1
    r.poller.poll(key)
    assert len(servers[0].paths) == 1
    obj.progress_at, obj.diagnosed_at = time.monotonic() - 5.1, time.monotonic() - 30.1
    r.poller.poll(key)
    assert len(servers[0].paths) == 2


def test_a_stalled_job_seen_formed_is_cleared(ports, servers):
    r, key, obj = _running_job("again")
    obj.written["conditions"].append({"type": names.COND_STALLED, "status": "True",
                                      "reason": names.REASON_PG_NEVER_FORMED, "message": "rank 1 never joined",
                                      "lastTransitionTime": "2026-12-01T00:00:00Z"})
    servers += [Sidecar("127.0.0.2", ports[1], _answer(_worker(41, 0, 0, "running", frame="step (train.py:9)"))),
                Sidecar("127.0.0.3", ports[1], _answer(_worker(42, 1, 1, "collective", frame=ALLREDUCE)))]
    _poll_now(r, key, obj)
    assert [f["stall"].reason for f in r.found] == [names.REASON_PG_FORMED]
    stalled = _condition(obj, names.COND_STALLED)
    assert stalled["status"] == "False" and stalled["reason"] == names.REASON_PG_FORMED
    assert r.api.deleted == []


def test_a_silent_hang_replaces_the_pod_outside_the_collective(ports, servers):
    r, key, obj = _running_job("blocks", failurePolicy={"hangTimeoutSeconds": 20})
    servers += [Sidecar("127.0.0.2", ports[1], _answer(_worker(41, 0, 0, "collective", frame=ALLREDUCE))),
                Sidecar("127.0.0.3", ports[1], _answer(_worker(42, 1, 1, "running", frame="sleep (time.py:1)",
                                                               user="stuck_on_io (train.py:30)")))]
    _poll_now(r, key, obj)
    w = obj.stall_watch
    assert w.formed and not w.reporting and r.found == []  # formed; the clock runs from now
    obj.stall_watch = dataclasses.replace(w, since=time.monotonic() - 21)
    _poll_now(r, key, obj)  # the same stacks, the same CPU time: still
    (found,) = [f["stall"] for f in r.found]
    assert found.reason == names.REASON_HANG and "stuck_on_io (train.py:30)" in found.message
    assert servers[1].paths[-1] == f"{names.DIAGNOSTICS_PATH}?log={names.REASON_HANG}"
    assert r.api.deleted == ["blocks-1"]
    assert _condition(obj, names.COND_STALLED)["reason"] == names.REASON_HANG


def test_a_progress_hang_check_hands_in_the_pods_diagnoses(ports, servers):
    r, key, obj = _running_job("hung", failurePolicy={"hangTimeoutSeconds": 20})
    servers += [ProgressServer("127.0.0.2", ports[0], {"rank": 0, "step": 40}),
                ProgressServer("127.0.0.3", ports[0], {"rank": 1, "step": 40}),
                Sidecar("127.0.0.2", ports[1], _answer(_worker(41, 0, 0, "collective", frame=ALLREDUCE))),
                Sidecar("127.0.0.3", ports[1], _answer(_worker(42, 1, 1, "running", frame="read (socket.py:7)",
                                                               user="stuck_on_io (train.py:30)")))]
    _poll_now(r, key, obj)
    assert obj.stall_watch.reporting and r.found == []  # a reporting job: the progress rule decides
    obj.hang_watch = dataclasses.replace(obj.hang_watch, since=time.monotonic() - 21)
    _poll_now(r, key, obj)
    (found,) = r.found
    assert set(found) == {"hang_reports", "diagnoses"}
    assert [(d.name, d.diagnosis.workers[0].user_frame) for d in found["diagnoses"]] == \
        [("hung-0", "main (train.py:42)"), ("hung-1", "stuck_on_io (train.py:30)")]
    assert servers[3].paths[-1] == f"{names.DIAGNOSTICS_PATH}?log={names.REASON_HANG}"
    assert r.api.deleted == ["hung-1"]  # a tie on step 40: the highest index
    assert obj.written["diagnosis"]["reason"] == names.REASON_HANG


def test_a_pod_frozen_whole_is_acted_on_without_waiting_for_its_sidecar(ports, servers, monkeypatch):
    """Pod 1 frozen with its sidecar (one cgroup): neither answers. The hang is acted on within the hang's short
    diagnosis deadline, not the 15 s a logged diagnosis may take otherwise."""
    monkeypatch.setattr(progress, "DIAGNOSIS_DEADLINE_SECONDS", 2.0)  # the first poll's wait for the frozen one
    monkeypatch.setattr(progress, "HANG_DIAGNOSIS_DEADLINE_SECONDS", 1.0)
    r, key, obj = _running_job("frozen", failurePolicy={"hangTimeoutSeconds": 20})
    servers += [ProgressServer("127.0.0.2", ports[0], {"rank": 0, "step": 40}),
                Sidecar("127.0.0.2", ports[1], _answer(_worker(41, 0, 0, "collective", frame=ALLREDUCE))),
                Silent("127.0.0.3", ports[0]), Silent("127.0.0.3", ports[1])]
    _poll_now(r, key, obj)
    obj.hang_watch = dataclasses.replace(obj.hang_watch, since=time.monotonic() - 21)
    started = time.monotonic()
    _poll_now(r, key, obj)
    took = time.monotonic() - started
    assert r.api.deleted == ["frozen-1"], r.api.deleted  # the pod that did not answer
    assert took < progress.DIAGNOSIS_LOG_DEADLINE_SECONDS, f"the hang waited {took:.1f} s for a frozen sidecar"
    (found,) = [f for f in r.found if "hang_reports" in f]
    assert [d.diagnosis is None for d in found["diagnoses"]] == [False, True]


def test_a_sidecar_that_does_not_answer_never_delays_a_hang_check(ports, servers, monkeypatch):
    """The sidecars are asked in the same poll as a due hang check (the first poll of a restarted operator, which
    knows nothing of the group yet) and pod 1's never answers: the hang is handed to a pass as soon as the progress
    probes are in, not after the sidecars' deadline."""
    monkeypatch.setattr(progress, "DIAGNOSIS_DEADLINE_SECONDS", 3.0)
    monkeypatch.setattr(progress, "HANG_DIAGNOSIS_DEADLINE_SECONDS", 0.5)
    r, key, obj = _running_job("slow", failurePolicy={"hangTimeoutSeconds": 20})
    servers += [ProgressServer("127.0.0.2", ports[0], {"rank": 0, "step": 40}),
                ProgressServer("127.0.0.3", ports[0], {"rank": 1, "step": 40}),
                Sidecar("127.0.0.2", ports[1], _answer(_worker(41, 0, 0, "running", frame="step (train.py:9)"))),
                Silent("127.0.0.3", ports[1])]
    _poll_now(r, key, obj)
    obj.hang_watch = dataclasses.replace(obj.hang_watch, since=time.monotonic() - 21)
    obj.stall_watch = None  # as after an operator restart: the group is not known to have formed
    acted = []
    real = r.poller.reconcile
    r.poller.reconcile = lambda *a, **kw: (acted.append(time.monotonic()), real(*a, **kw))[1]
    started = time.monotonic()
    _poll_now(r, key, obj)
    assert r.api.deleted == ["slow-1"] and len(acted) == 1, (r.api.deleted, acted)
    assert acted[0] - started < 2.5, \
        f"the hang waited {acted[0] - started:.1f} s for the sidecars' regular diagnosis"


def test_without_the_sidecar_nobody_is_asked(ports, servers):
    r, key, obj = _running_job("plain", diagnostics={"enabled": False}, failurePolicy={"hangTimeoutSeconds": 20})
    servers += [Sidecar("127.0.0.2", ports[1], _answer(_worker(41, 0, 0, "init")))]
    _poll_now(r, key, obj)
    obj.hang_watch = None
    assert servers[0].paths == [] and obj.stall_watch is None


def test_the_index_of_a_pod_is_its_labels_or_unknown():
    from ddp_operator.poller import _index
    assert _index({"metadata": {"labels": {names.LABEL_NODE_INDEX: "3"}}}) == 3
    assert _index({"metadata": {"labels": {names.LABEL_NODE_INDEX: "x"}}}) == -1
    assert _index({"metadata": {}}) == -1



def test_a_sidecars_answer_is_bounded_and_the_reason_quoted(ports, servers):
    from ddp_operator import progress

    big = Sidecar("127.0.0.2", ports[1], _answer(*[_worker(i + 1, i, i, "init", user="x" * 400) for i in range(700)]))
    small = Sidecar("127.0.0.3", ports[1], _answer(_worker(41, 0, 0, "init")))
    servers += [big, small]
    assert progress.fetch_diagnosis("127.0.0.2") is None  # past MAX_DIAGNOSIS_BYTES: no answer, no memory held
    assert progress.fetch_diagnosis("127.0.0.3", log="a b/c")["workers"][0]["pid"] == 41
    assert small.paths == [f"{names.DIAGNOSTICS_PATH}?log=a%20b%2Fc"]
