"""What `kubectl ddp` shows (kubectl_ddp.view, describe, top): the progress line with its ETA, rows of jobs and pods,
the attempts timeline and the recovery sentence; a status with missing or mistyped fields shows "-", never raises."""

from datetime import datetime, timedelta, timezone

from kubectl_ddp import describe, top, view

NOW = datetime(2026, 12, 5, 12, 0, 0, tzinfo=timezone.utc)


def _job(status=None, **meta):
    return {"metadata": {"name": "digits", "namespace": "ml", "creationTimestamp": "2026-12-05T11:58:00Z", **meta},
            "spec": {"nodes": 2, "template": {"spec": {"containers": [{"name": "trainer", "image": "img:1",
                                                                        "command": ["torchrun", "t.py"]}]}}},
            "status": status or {}}


RUNNING = {"phase": "Running", "nodesReady": "2/2", "restarts": 1,
           "progress": {"step": 120, "epoch": 3, "loss": 0.0812345, "samplesPerSecond": 2210.5, "time": 1000.0,
                        "totalSteps": 200},
           "lastRecovery": {"fault": "NodeFailed", "resumedFrom": "peer", "restoredFromPod": "digits-0",
                            "stepsLost": 0, "seconds": 5.51},
           "attempts": [{"pod": "digits-1", "index": 1, "node": "vm", "reason": "Deleted", "counted": True,
                         "time": "2026-12-05T11:59:00Z", "exitCode": 137, "message": "a\nKilled by the test"}]}


def test_the_progress_line_and_its_eta():
    job = _job(RUNNING)
    # 120 steps in the 60 s since step 0 at t=940: 80 steps left take 40 s.
    eta = view.eta_seconds(view.progress(job), (940.0, 0.0))
    assert eta == 40.0
    assert view.progress_line(job, eta) == ("Running · nodes 2/2 · step 120/200 · epoch 3 · loss 0.08123 · "
                                            "2,210 samples/s · ETA 40s · restarts 1")
    # an 80-column terminal: samples/s goes first, so the live line keeps the ETA on one row; then the epoch, the nodes
    assert view.progress_line(job, eta, 82) == \
        "Running · nodes 2/2 · step 120/200 · epoch 3 · loss 0.08123 · ETA 40s · restarts 1"
    assert view.progress_line(job, eta, 80) == "Running · nodes 2/2 · step 120/200 · loss 0.08123 · ETA 40s · restarts 1"
    assert view.progress_line(job, eta, 60) == "Running · step 120/200 · loss 0.08123 · ETA 40s · restarts 1"
    assert len(view.progress_line(job, eta, 20)) > 20  # what is left is kept whole: the console's ellipsis cuts it
    assert view.eta_seconds(view.progress(job), None) is None
    assert view.eta_seconds(view.progress(job), (1000.0, 120.0)) is None  # the step has not moved yet
    no_total = _job({"phase": "Running", "progress": {"step": 5, "time": 1.0}})
    assert view.eta_seconds(view.progress(no_total), (0.0, 0.0)) is None


def test_a_hostile_or_empty_status_shows_dashes():
    junk = _job({"phase": 7, "nodesReady": ["x"], "restarts": "many", "progress": {"step": "x", "loss": float("nan"),
                 "totalSteps": -3}, "lastRecovery": "no", "attempts": ["bad", {"index": None}],
                 "conditions": [None, {"type": "Running"}]})
    assert view.progress_line(junk) == "Pending"
    assert view.job_row(junk, NOW) == ["ml", "digits", "Pending", "-", "-", "-", "-", "-", "0", "2m0s"]
    assert view.recovery_line(junk["status"]["lastRecovery"]) is None
    assert len(view.attempt_lines(junk, NOW)) == 2
    assert view.condition_rows(junk, NOW)[1][:2] == ["Running", "-"]
    describe.render(junk, [{"metadata": {}}], [{"message": None}], NOW)  # renders, does not raise


def test_rows_attempts_and_recovery():
    job = _job(RUNNING)
    assert view.job_row(job, NOW) == ["ml", "digits", "Running", "2/2", "120", "0.08123", "2,210", "-", "1", "2m0s"]
    assert view.attempt_lines(job, NOW) == ["  1m0s ago  rank 1  digits-1 on vm: Deleted, exit 137 [counted]",
                                            "            Killed by the test"]
    assert view.recovery_line(job["status"]["lastRecovery"]) == (
        "recovered from NodeFailed, resumed from peer (digits-0), 0 steps lost, 5.5 s")
    guessed = {"fault": "NodeLost", "resumedFrom": "start", "stepsLost": 294, "seconds": 55.6,
               "estimated": ["seconds", "stepsLost"]}
    assert view.recovery_line(guessed) == (
        "recovered from NodeLost, resumed from start, ≥ 294 steps lost (estimated), 55.6 s (estimated)")
    pod = {"metadata": {"name": "digits-1", "labels": {"ddp.dev/node-index": "1"},
                        "creationTimestamp": "2026-12-05T11:59:30Z"},
           "spec": {"nodeName": "vm"},
           "status": {"phase": "Running", "containerStatuses": [
               {"name": "trainer", "restartCount": 2, "ready": True, "state": {"running": {}}}]}}
    assert view.pod_row(pod, NOW) == ["digits-1", "1", "vm", "Running", "2", "30s"]
    waiting = {**pod, "status": {"containerStatuses": [
        {"name": "trainer", "restartCount": 0, "state": {"waiting": {"reason": "ImagePullBackOff"}}}]}}
    assert view.pod_row(waiting, NOW)[3] == "ImagePullBackOff"


def test_durations_read_like_kubectls():
    assert [view.duration(s) for s in (5, 200, 900, 7500, 200000, -1, None)] == [
        "5s", "3m20s", "15m", "2h5m", "2d7h", "-", "-"]


def test_describe_folds_repeated_events_and_top_renders_both_screens():
    event = {"involvedObject": {"kind": "DDPJob", "name": "digits"}, "type": "Normal", "reason": "TrainingSucceeded",
             "message": "done", "lastTimestamp": (NOW - timedelta(seconds=5)).isoformat()}
    lines = describe.event_lines([event, dict(event), dict(event)], NOW)
    assert len(lines) == 1 and lines[0].endswith("DDPJob/digits: done (x3)")
    from rich.console import Console
    console = Console(width=200, record=True)
    console.print(top.jobs_table([_job(RUNNING)], NOW, all_namespaces=False))
    console.print(top.job_screen(_job(RUNNING), [], NOW))
    text = console.export_text()
    assert "NAME    PHASE    NODES" in text and "digits  Running  2/2" in text
    assert "Last recovery: recovered from NodeFailed" in text
