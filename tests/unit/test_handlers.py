"""reconciler.Reconciler with a fake API and in-memory indexes: one job's pods cannot stall the others, per-job
memory goes with the job, progress never goes back, a foreign child is reported."""

import copy
import socket
import threading
import time

import pytest

from ddp_operator import backoff, names
from ddp_trainer.testing import free_port as _free_port

from fake_api import FakeApi, fake_reconciler
from ddp_builders import ProgressServer as _Serve
from ddp_builders import job_body


def _reconciler():
    return fake_reconciler()


def _add_job(r, name, namespace="ml", **spec):
    body = job_body(name=name, namespace=namespace, **spec)
    body["metadata"]["uid"] = f"uid-{namespace}-{name}"
    r.indexes["ddpjobs_by_key"][(namespace, name)] = [body]
    return (namespace, name), body


def _run_pods(r, key, ip="127.0.0.9"):
    for p in r.indexes["pods_by_job"].get(key, []):
        p["status"] = {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True"}]}


def _sizes(r):
    """Every per-job record and job object of the Reconciler (private on purpose: this is what must not leak)."""
    return {"records": len(r.jobs._records), "objects": sum(len(x.objects) for x in r.jobs._records.values())}


def _obj(r, key, body):
    """What the Reconciler keeps of the job object `body`."""
    return r.jobs.get(key).objects[body["metadata"]["uid"]]


# --- one job cannot stall the others ------------------------------------------------------------------------------
def test_one_jobs_failing_probe_never_drops_another_jobs_wake_up(monkeypatch, caplog):
    r = _reconciler()
    a, _ = _add_job(r, "a", progressPeriodSeconds=1)
    b, _ = _add_job(r, "b")
    for key in (a, a, b):
        r.reconcile(*key)
        _run_pods(r, key)
    passes, probed = [], threading.Event()
    real = r.reconcile
    monkeypatch.setattr(r, "reconcile", lambda ns, name, body=None: (passes.append((ns, name)), real(ns, name))[1])

    def boom(key):
        if key == a:
            probed.set()
            raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
    monkeypatch.setattr(r.poller, "poll", boom)
    r.jobs.wake(b, 0)
    r.tick()  # must not raise
    assert b in passes
    assert probed.wait(5)
    deadline = time.monotonic() + 5
    while r.jobs.tracked()["probing"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not r.jobs.tracked()["probing"]  # the failed poll is done with; the next period polls again
    assert "progress poll failed" in caplog.text
    r.stop()


def test_one_jobs_failing_pass_re_arms_it_and_still_runs_the_others(monkeypatch):
    r = _reconciler()
    a, _ = _add_job(r, "a")
    b, _ = _add_job(r, "b", failurePolicy={"startupTimeoutSeconds": 0})  # no wake-up for its pending pods
    passes = []
    real = r._reconcile

    def flaky(key, body):
        passes.append(key)
        if key == a:
            raise OverflowError("date value out of range")
        return real(key, body)
    monkeypatch.setattr(r, "_reconcile", flaky)
    r.jobs.wake(a, 0)
    r.jobs.wake(b, 0)
    r.tick()
    assert a in passes and b in passes
    assert r.jobs.get(a).wakeup is not None and r.jobs.get(b).wakeup is None  # a is retried, b is done


def _trickler():
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    def trickle(conn):
        try:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.0 200 OK\r\n")
            while not stop.wait(0.05):
                conn.sendall(b"X")
        except OSError:
            pass
        finally:
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
    return sock.getsockname()[1], lambda: (stop.set(), sock.close())


def test_a_trickling_pod_never_holds_the_ticker(monkeypatch):
    port, close = _trickler()
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    r = _reconciler()
    slow, slow_body = _add_job(r, "slow", progressPeriodSeconds=1)
    other, _ = _add_job(r, "other")
    r.reconcile(*slow)
    _run_pods(r, slow, ip="127.0.0.1")
    r.reconcile(*slow)
    assert _obj(r, slow, slow_body).written["phase"] == names.PHASE_RUNNING
    try:
        r.jobs.wake(other, 0)
        done = threading.Event()
        t = threading.Thread(target=lambda: (r.tick(), done.set()), daemon=True)
        started = time.monotonic()
        t.start()
        assert done.wait(3), "the ticker is stuck on a pod that trickles bytes"
        assert time.monotonic() - started < 1.0
        assert r.jobs.get(("ml", "other")).last_pass  # its wake-up ran
        # The probe itself gives up at its deadline.
        deadline = time.monotonic() + 3 + 2
        while r.jobs.tracked()["probing"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not r.jobs.tracked()["probing"]
    finally:
        close()
        r.stop()


# --- progress -----------------------------------------------------------------------------------------------------
def _running_job(r, name="job"):
    key, body = _add_job(r, name, progressPeriodSeconds=1)
    r.reconcile(*key)
    _run_pods(r, key, ip="127.0.0.2")
    r.reconcile(*key)
    assert _obj(r, key, body).written["phase"] == names.PHASE_RUNNING
    return key, body


def test_only_pods_owned_by_the_job_are_probed(monkeypatch):
    port = _free_port()
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    r = _reconciler()
    key, body = _running_job(r)
    # A pod anyone could create in the namespace, with the job's labels but no owner reference, answers...
    impostor = copy.deepcopy(r.indexes["pods_by_job"][key][1])
    impostor["metadata"].update(name="impostor", uid="impostor-uid", ownerReferences=[])
    impostor["status"]["podIP"] = "127.0.0.1"
    r.indexes["pods_by_job"][key].append(impostor)
    servers = [_Serve("127.0.0.1", port, {"step": 999}), _Serve("127.0.0.2", port, {"step": 7})]
    try:
        r.poller.poll(key)
    finally:
        for server in servers:
            server.close()
    # ...and is never asked; the job's own pods (on 127.0.0.2) are, and their step is written.
    assert [s["progress"]["step"] for _, s in r.api.patches if "progress" in s] == [7]


def test_progress_polling_never_writes_an_older_step(monkeypatch):
    port = _free_port()
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    r = _reconciler()
    key, body = _running_job(r)
    for step, written in ((61, 61), (54, 61), (62, 62)):
        server = _Serve("127.0.0.2", port, {"step": step})
        try:
            _obj(r, key, body).progress_at = 0.0
            r.poller.poll(key)
        finally:
            server.close()
        assert _obj(r, key, body).written["progress"]["step"] == written
        assert body["status"]["progress"]["step"] == written
    assert [s["progress"]["step"] for _, s in r.api.patches if "progress" in s] == [61, 62]


# --- memory -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["deleted-event", "namespace-gone"])
def test_a_hundred_jobs_created_and_deleted_leave_nothing_behind(how):
    r = _reconciler()
    before = _sizes(r)
    for i in range(100):
        key, body = _add_job(r, f"j{i}", namespace=f"ns{i % 7}")
        r.reconcile(*key)
        _run_pods(r, key)
        r.reconcile(*key)
        r.jobs.wake(key, 60)
        pods = r.indexes["pods_by_job"].get(key, [])
        # A pod deleted while the job lives: a tombstone.
        r.jobs.tombstone(key, pods[0])
        # The job goes away: its DELETED event (or, with its namespace, nothing at all)...
        del r.indexes["ddpjobs_by_key"][key]
        if how == "deleted-event":
            r.jobs.forget(key, body["metadata"]["uid"])
        # ...and then the garbage collector deletes its pods, each DELETED event triggering a pass.
        for p in r.indexes["pods_by_job"].pop(key, []):
            r.jobs.tombstone(key, p)
            r.reconcile(*key)
    r._swept_at = 0.0
    r.tick()
    assert _sizes(r) == before == {k: 0 for k in before}
    assert all(v == 0 for v in r.jobs.tracked().values())


def test_a_job_forgotten_during_its_pass_keeps_its_lock_until_the_sweep():
    r = _reconciler()
    key, body = _add_job(r, "a")
    r.reconcile(*key)
    lock = r.jobs.record(key).lock
    with lock:  # a pass is running
        del r.indexes["ddpjobs_by_key"][key]
        r.jobs.forget(key, body["metadata"]["uid"])
        assert r.jobs.record(key).lock is lock  # a pass starting now waits for it
        assert not r.jobs.record(key).objects
    r._swept_at = 0.0
    r.tick()
    assert _sizes(r) == {"records": 0, "objects": 0}


# --- foreign children ---------------------------------------------------------------------------------------------
def test_a_foreign_pod_holding_a_childs_name_is_a_condition_and_an_event(monkeypatch):
    r = _reconciler()
    key, body = _add_job(r, "mnist")
    r.api.conflicts.add("mnist-0")
    r.reconcile(*key)
    assert r.jobs.get(key).wakeup is not None  # the conflict is reported without waiting for a resync
    r.jobs.get(key).wakeup = 0
    r.tick()
    status = _obj(r, key, body).written
    cond = [c for c in status["conditions"] if c["type"] == names.COND_REPLICA_FAILURE][0]
    assert cond["status"] == "True" and cond["reason"] == names.REASON_CHILD_CONFLICT
    assert "pod ml/mnist-0 already exists and is not owned by this DDPJob" in cond["message"]
    assert "delete or rename it" in status["message"]
    assert [e for e in r.api.events if e[2] == names.REASON_CHILD_CONFLICT and e[1] == "Warning"]
    # The object is removed: the next retry (its wake-up is armed) creates the job's own pod and clears the
    # condition.
    assert r.jobs.get(key).wakeup is not None
    r.api.conflicts.clear()
    monkeypatch.setattr(backoff, "CONFLICT_RETRY_SECONDS", 0.0)
    r.jobs.get(key).wakeup = 0
    r.tick()
    r.tick()
    status = _obj(r, key, body).written
    cond = [c for c in status["conditions"] if c["type"] == names.COND_REPLICA_FAILURE][0]
    assert cond["status"] == "False"
    assert any(p["metadata"]["name"] == "mnist-0" for p in r.indexes["pods_by_job"][key])


# --- hang detection and lastRecovery ------------------------------------------------------------------------------
def _hung_job(r, monkeypatch, **spec):
    port = _free_port()
    monkeypatch.setattr(names, "PROGRESS_PORT", port)
    key, body = _add_job(r, "hung", failurePolicy={"hangTimeoutSeconds": 20}, **spec)
    r.reconcile(*key)
    trainers = sorted((p for p in r.indexes["pods_by_job"][key]
                       if p["metadata"]["labels"][names.LABEL_ROLE] == names.ROLE_TRAINER),
                      key=lambda p: p["metadata"]["name"])
    _run_pods(r, key)
    for i, p in enumerate(trainers):  # hung-0 on 127.0.0.2 (global rank 0), hung-1 on 127.0.0.3
        p["status"]["podIP"] = f"127.0.0.{i + 2}"
    r.reconcile(*key)
    assert _obj(r, key, body).written["phase"] == names.PHASE_RUNNING
    return key, body, port


def test_a_hung_job_loses_its_silent_pod_within_the_timeout(monkeypatch):
    from ddp_operator import hang

    r = _reconciler()
    key, body, port = _hung_job(r, monkeypatch)
    rank0 = _Serve("127.0.0.2", port, {"rank": 0, "step": 40, "workerRestarts": 0})  # hung-1 answers nothing
    try:
        r.poller.poll(key)
        w = _obj(r, key, body).hang_watch
        assert w.key == (40, 0) and not r.poller.hang_check_due(key, body, time.monotonic())
        assert r.api.deleted == []
        # the step has not changed for the timeout: the next tick's poll asks every pod, the silent one goes
        _obj(r, key, body).hang_watch = hang.Watch(w.incarnation, w.key, time.monotonic() - 21)
        assert r.poller.hang_check_due(key, body, time.monotonic())  # its own wake-up, whatever the poll interval
        assert r.poller.due(key) is not None
        r.poller.poll(key)
    finally:
        rank0.close()
    assert r.api.deleted == ["hung-1"]
    status = _obj(r, key, body).written
    assert status["phase"] == names.PHASE_RESTARTING and status["reason"] == names.REASON_HANG
    assert status["attempts"][-1]["reason"] == names.REASON_HANG and status["attempts"][-1]["pod"] == "hung-1"
    assert status["lastIncident"]["reason"] == names.REASON_HANG
    assert [e for e in r.api.events if e[1] == "Warning" and e[2] == names.REASON_HANG]


def test_a_step_that_moves_is_no_hang_and_detection_needs_a_report(monkeypatch):
    from ddp_operator import hang

    r = _reconciler()
    key, body, port = _hung_job(r, monkeypatch)
    # nothing ever answered (a plain script): never hung
    r.poller.poll(key)
    assert _obj(r, key, body).hang_watch is None and not r.poller.hang_check_due(key, body, time.monotonic() + 10_000)
    rank0 = _Serve("127.0.0.2", port, {"rank": 0, "step": 40})
    try:
        _obj(r, key, body).progress_at = 0.0
        r.poller.poll(key)
    finally:
        rank0.close()
    w = _obj(r, key, body).hang_watch
    _obj(r, key, body).hang_watch = hang.Watch(w.incarnation, w.key, time.monotonic() - 21)
    rank0 = _Serve("127.0.0.2", port, {"rank": 0, "step": 41})  # it moved after all
    try:
        _obj(r, key, body).progress_at = 0.0
        r.poller.poll(key)
    finally:
        rank0.close()
    assert r.api.deleted == [] and not r.poller.hang_check_due(key, body, time.monotonic())


def test_last_recovery_is_written_from_rank0s_report(monkeypatch):
    r = _reconciler()
    key, body, port = _hung_job(r, monkeypatch)
    report = {"rank": 0, "step": 60, "workerRestarts": 1,
              "recovery": {"resumedFrom": "peer", "step": 50, "highestStep": 51, "stepsLost": 1,
                           "restoredFromPod": "hung-0", "seconds": 8.5, "at": 1735732900.0}}
    # pod 1 answers too, for itself: the status is global rank 0's
    servers = [_Serve("127.0.0.3", port, {"rank": 1, "step": 60, "recovery": {**report["recovery"], "stepsLost": 7}}),
               _Serve("127.0.0.2", port, report)]
    try:
        r.poller.poll(key)
    finally:
        for s in servers:
            s.close()
    status = _obj(r, key, body).written
    assert status["progress"]["step"] == 60 and status["progress"]["workerRestarts"] == 1
    assert status["lastRecovery"] == {"fault": names.FAULT_WORKER_RESTART, "startedAt": "2025-01-01T12:01:31Z",
                                      "seconds": 8.5, "stepsLost": 1, "resumedFrom": "peer",
                                      "restoredFromPod": "hung-0"}
    # the next ordinary pass keeps it (level-based)
    r.reconcile(*key)
    assert _obj(r, key, body).written["lastRecovery"]["stepsLost"] == 1


def test_a_start_over_is_estimated_from_the_progress_written_before_the_fault(monkeypatch):
    """Every pod lost, no checkpoint volume: rank 0's record has neither seconds nor stepsLost. The poller writes
    the operator's estimate from the status before its write (progress at step 300 from before the fault), in the
    same write as the goodput that counts it; later polls leave both as they are."""
    r = _reconciler()
    key, body, port = _hung_job(r, monkeypatch)
    obj = _obj(r, key, body)
    obj.written.update(progress={"step": 300, "time": 1735732890.0, "summary": "step 300"},  # 12:01:30Z
                       lastIncident={"reason": names.REASON_NODE_FAILED, "time": "2025-01-01T12:01:35Z"},
                       goodput={"since": "2025-01-01T12:00:00Z", "stepSeconds": 0.5})
    report = {"rank": 0, "step": 2, "time": 1735732951.0, "workerRestarts": 0,
              "recovery": {"resumedFrom": "start", "step": 0, "at": 1735732950.0}}
    for step in (2, 20):
        rank0 = _Serve("127.0.0.2", port, {**report, "step": step})
        try:
            obj.progress_at = 0.0
            r.poller.poll(key)
        finally:
            rank0.close()
        status = obj.written
        assert status["progress"]["step"] == 300  # never back
        assert status["lastRecovery"] == {"fault": names.REASON_NODE_FAILED, "startedAt": "2025-01-01T12:01:35Z",
                                          "seconds": 55.0, "stepsLost": 300, "resumedFrom": "start",
                                          "estimated": ["seconds", "stepsLost"]}
        g = status["goodput"]
        assert (g["recoveries"], g["stepsLost"], g["seconds"]["recovering"], g["seconds"]["redone"]) == (1, 300, 55.0,
                                                                                                         150.0)
    r.reconcile(*key)
    assert obj.written["lastRecovery"]["stepsLost"] == 300 and obj.written["goodput"]["recoveries"] == 1


# --- kopf's memo and the parsed spec ------------------------------------------------------------------------------
def test_the_memo_carries_the_configuration_to_the_reconciler_and_every_handler(monkeypatch):
    import kopf

    from ddp_operator import handlers, k8s
    from ddp_operator.netpol import NetworkPolicyConfig
    from ddp_operator.reconciler import Config

    index = {"ddpjobs_by_key": {}, "pods_by_job": {}, "services_by_job": {}}
    monkeypatch.setattr(k8s, "Api", lambda fence=None: FakeApi(index))
    config = Config(network_policy=NetworkPolicyConfig(enabled_by_default=False), kueue=True)
    memo, settings = handlers.memo(config), kopf.OperatorSettings()
    handlers.configure(settings=settings, memo=memo)
    try:
        r = memo.reconciler
        assert r.config is config
        assert settings.watching.label_selectors[names.KUEUE_API_VERSION, names.WORKLOAD_PLURAL] == names.LABEL_JOB_NAME
        assert settings.watching.chunk_size == handlers.LIST_CHUNK  # listings paged: never all pods at once
        key, body = ("ml", "mnist"), job_body()
        index["ddpjobs_by_key"][key] = [body]
        # Each resource handler gets a shallow copy of the operator's memo: the same Reconciler.
        handlers.on_job(namespace="ml", name="mnist", body=body, memo=copy.copy(memo), **index)
        assert r.indexes["pods_by_job"] is index["pods_by_job"]  # bound for the ticker
        assert sorted(p["metadata"]["name"] for p in index["pods_by_job"][key]) == ["mnist-0", "mnist-1", "mnist-rdzv"]
        assert len(index["services_by_job"][key]) == 1  # the Service, no NetworkPolicy: the memo's network_policy
    finally:
        handlers.cleanup(memo=memo)
    assert r._stop.is_set()


def test_the_poller_reads_the_parsed_spec_of_the_pass_without_parsing_again(monkeypatch):
    from ddp_operator import jobs

    r = _reconciler()
    key, body = _running_job(r)
    parses = []
    real = jobs.parse_job
    monkeypatch.setattr(jobs, "parse_job", lambda b: (parses.append(b), real(b))[1])
    assert r.poller.due(key) is not None  # progressPeriodSeconds 1, never polled yet
    assert parses == []
    body["spec"]["progressPeriodSeconds"] = 0  # a changed spec is parsed again: polling is off
    assert r.poller.due(key) is None and len(parses) == 1
