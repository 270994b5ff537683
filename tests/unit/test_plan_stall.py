"""The planner's stall rules (plan/stall.py; docs/diagnostics.md): a process group that never formed is restarted
once and fails the job when the same diagnosis comes back; a silent hang replaces the stuck pod; status.diagnosis."""

import dataclasses

from ddp_operator import names, stall
from ddp_operator.plan import DELETE, plan
from ddp_operator.stall import Diagnosis, PodDiagnosis, Worker

from ddp_builders import NOW, later, make_job, observed, rdzv, trainer

INIT = "_new_process_group_helper (torch/distributed/distributed_c10d.py:2011)"
ALLREDUCE = "allreduce (torch/distributed/distributed_c10d.py:2501)"


def with_stall(obs, finding):
    """Observed with the shell's stall finding."""
    return dataclasses.replace(obs, stall=finding)


def worker(rank, env_rank=None, phase="init", frame=INIT, user=None, pid=41):
    return Worker(pid, rank, rank if env_rank is None else env_rank, 0, 2, 1.0, phase, frame, user, "d")


def diag(index, *workers, uid=None):
    return PodDiagnosis(uid or f"uid-mnist-{index}-0", f"mnist-{index}", index, Diagnosis("ok", tuple(workers)))


def twice(uids=(None, None)):
    """Pod 1's worker (RANK=1) claims rank 0 (rank from LOCAL_RANK): rank 1 never joins."""
    return stall.startup_finding([diag(0, worker(0), uid=uids[0]), diag(1, worker(0, env_rank=1), uid=uids[1])], 2)


def waits(uids=(None, None)):
    return stall.startup_finding([diag(0, worker(0), uid=uids[0]),
                                  diag(1, worker(1, phase="running", frame="read (socket.py:7)",
                                                 user="wait_for_data (train.py:12)"), uid=uids[1])], 2)


def _running(**failure_policy):
    job = make_job(failurePolicy={"hangTimeoutSeconds": 20, **failure_policy})
    first = plan(job, {}, observed(service_exists=False), NOW)
    return job, plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status


def pods(*uids):
    return observed(rdzv(), *(trainer(i, uid=u) for i, u in enumerate(uids)))


def test_a_process_group_that_never_formed_restarts_every_pod_once_not_counted():
    job, status = _running()
    finding = twice()
    p = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), finding), later(300))
    line = "global rank 1 of 2 never joined (pod mnist-1: its worker with RANK=1 claims rank 0); " \
           "rank 0 claimed twice (pods mnist-0, mnist-1)"
    assert finding.message == line
    stalled = next(c for c in p.status["conditions"] if c["type"] == names.COND_STALLED)
    assert (stalled["status"], stalled["reason"], stalled["message"]) == ("True", names.REASON_PG_NEVER_FORMED, line)
    assert ("Warning", names.REASON_PG_NEVER_FORMED, line) in [(e.type, e.reason, e.message) for e in p.events]
    assert sorted((a.verb, a.name) for a in p.actions) == [(DELETE, "mnist-0"), (DELETE, "mnist-1")]
    assert {a.grace_seconds for a in p.actions} == {names.HANG_DELETE_GRACE_SECONDS}
    assert [(a["pod"], a["reason"], a["counted"]) for a in p.status["attempts"]] == [
        ("mnist-0", names.REASON_PG_NEVER_FORMED, False), ("mnist-1", names.REASON_PG_NEVER_FORMED, False)]
    assert p.status.get("restarts", 0) == 0
    assert p.status["phase"] == names.PHASE_RESTARTING and p.status["reason"] == names.REASON_PG_NEVER_FORMED
    d = p.status["diagnosis"]
    assert (d["time"], d["reason"], d["message"]) == ("2025-01-01T12:05:00Z", names.REASON_PG_NEVER_FORMED, line)
    assert d["ranks"] == [{"rank": 0, "pod": "mnist-0", "phase": "init", "frame": INIT},
                          {"rank": 0, "pod": "mnist-1", "phase": "init", "frame": INIT}]
    assert d["signature"] == finding.signature and d["incarnation"]
    # the deleted pods, seen going and gone, are not recorded again; the status keeps the diagnosis
    going = plan(job, p.status, observed(rdzv(), trainer(0, deleting_since=later(301)),
                                         trainer(1, deleting_since=later(301))), later(301))
    assert len(going.status["attempts"]) == 2 and going.status.get("restarts", 0) == 0
    assert going.status["diagnosis"] == d and going.status["phase"] == names.PHASE_RESTARTING


def test_the_same_diagnosis_after_the_restart_fails_the_job():
    job, status = _running()
    first = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), twice()), later(300))
    back = plan(job, first.status, pods("new-0", "new-1"), later(310))
    assert back.status["phase"] == names.PHASE_RUNNING
    again = plan(job, back.status, with_stall(pods("new-0", "new-1"), twice(("new-0", "new-1"))), later(620))
    assert again.status["phase"] == names.PHASE_FAILED and again.status["reason"] == names.REASON_PG_NEVER_FORMED
    assert again.status["message"] == (f"{twice().message}; the same after a restart: fix the script")
    failed = next(c for c in again.status["conditions"] if c["type"] == names.COND_FAILED)
    assert failed["reason"] == names.REASON_PG_NEVER_FORMED
    assert ("Warning", names.REASON_PG_NEVER_FORMED) in [(e.type, e.reason) for e in again.events]
    assert sorted(a.name for a in again.actions if a.verb == DELETE) == ["mnist-0", "mnist-1", "mnist-rdzv"]
    assert again.status["diagnosis"]["incarnation"] != first.status["diagnosis"]["incarnation"]


def test_a_pass_that_runs_twice_on_the_same_finding_does_not_fail_the_job():
    job, status = _running()
    obs = with_stall(observed(rdzv(), trainer(0), trainer(1)), twice())
    first = plan(job, status, obs, later(300))
    # the pods are not yet seen going: the same finding for the same pods again
    second = plan(job, first.status, with_stall(observed(rdzv(), trainer(0), trainer(1)), twice()), later(301))
    assert second.status["phase"] != names.PHASE_FAILED
    assert len(second.status["attempts"]) == 2 and second.status.get("restarts", 0) == 0
    assert not [e for e in second.events if e.reason == names.REASON_PG_NEVER_FORMED and e.type == "Warning"
                and e.message == twice().message]  # said once


def test_a_different_diagnosis_after_the_restart_restarts_again_counted_against_the_backoff_limit():
    job, status = _running()
    first = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), twice()), later(300))
    back = plan(job, first.status, pods("new-0", "new-1"), later(310))
    other = waits(("new-0", "new-1"))
    again = plan(job, back.status, with_stall(pods("new-0", "new-1"), other), later(620))
    assert again.status["phase"] == names.PHASE_RESTARTING
    assert other.message == "global rank 1 of 2 never joined (pod mnist-1: waits in wait_for_data (train.py:12))"
    assert ("Warning", names.REASON_PG_NEVER_FORMED, other.message) in [
        (e.type, e.reason, e.message) for e in again.events]
    assert again.status["diagnosis"]["message"] == other.message
    # only the first restart is free: a script that never forms its group differently each time still ends
    assert len(again.status["attempts"]) == 4 and again.status.get("restarts", 0) == 1
    assert [a.get("counted") for a in again.status["attempts"]] == [False, False, True, True]


def test_a_group_that_formed_clears_stalled_and_the_next_same_diagnosis_restarts_again():
    job, status = _running()
    first = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), twice()), later(300))
    back = plan(job, first.status, pods("new-0", "new-1"), later(310))
    formed = plan(job, back.status, with_stall(pods("new-0", "new-1"), stall.formed_finding()), later(320))
    stalled = next(c for c in formed.status["conditions"] if c["type"] == names.COND_STALLED)
    assert (stalled["status"], stalled["reason"]) == ("False", names.REASON_PG_FORMED)
    assert ("Normal", names.REASON_PG_FORMED) in [(e.type, e.reason) for e in formed.events]
    later_on = plan(job, formed.status, with_stall(pods("new-0", "new-1"), twice(("new-0", "new-1"))), later(900))
    assert later_on.status["phase"] == names.PHASE_RESTARTING


def test_formed_without_a_stall_adds_no_condition():
    job, status = _running()
    p = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), stall.formed_finding()), later(10))
    assert names.COND_STALLED not in [c["type"] for c in p.status["conditions"]] and p.actions == ()


def test_a_stale_finding_or_a_job_not_running_with_every_pod_changes_nothing():
    job, status = _running()
    finding = twice()
    for obs, st in [
        (pods("uid-mnist-0-0", "replacement"), status),  # pod 1 replaced since the probe
        (observed(rdzv(), trainer(0), trainer(1, phase="Pending")), status),
        (observed(rdzv(), trainer(0), trainer(1, deleting_since=later(299))), status),
        (observed(rdzv(), trainer(0), trainer(1)), {**status, "phase": names.PHASE_RESTARTING}),
    ]:
        p = plan(job, st, with_stall(obs, finding), later(300))
        assert not [a for a in p.actions if a.verb == DELETE and a.grace_seconds]
        assert names.COND_STALLED not in [c["type"] for c in p.status["conditions"]]
        assert "diagnosis" not in p.status


def test_a_slow_start_never_acts():
    # still in init_process_group before the deadline, or phases unknown: the shell hands in nothing
    job, status = _running()
    p = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), None), later(299))
    assert p.actions == () and p.status["phase"] == names.PHASE_RUNNING and "diagnosis" not in p.status
    unknown = [diag(0, worker(0, phase="unknown", frame=None)), diag(1, worker(1, phase="unknown", frame=None))]
    assert stall.startup_finding(unknown, 2) is None


def test_a_hostile_status_diagnosis_is_ignored():
    job, status = _running()
    for bad in ("junk", 7, ["a"], {"reason": names.REASON_PG_NEVER_FORMED, "signature": {"x": 1}}):
        st = {**status, "diagnosis": bad}
        p = plan(job, st, with_stall(observed(rdzv(), trainer(0), trainer(1)), twice()), later(300))
        assert p.status["phase"] == names.PHASE_RESTARTING
        assert p.status["diagnosis"]["message"] == twice().message


# --- a silent hang ---------------------------------------------------------------------------------------------------
def silent_hang():
    return stall.hang_finding([diag(0, worker(0, phase="collective", frame=ALLREDUCE)),
                               diag(1, worker(1, phase="running", frame="read (socket.py:7)",
                                              user="stuck_on_io (train.py:30)"))])


def test_a_silent_hang_replaces_the_stuck_pod_and_records_its_frame():
    job, status = _running()
    finding = silent_hang()
    p = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), finding), later(100))
    assert [(a.verb, a.name, a.grace_seconds) for a in p.actions] == [
        (DELETE, "mnist-1", names.HANG_DELETE_GRACE_SECONDS)]
    assert p.status["phase"] == names.PHASE_RESTARTING and p.status["reason"] == names.REASON_HANG
    assert p.status["restarts"] == 1
    last = p.status["attempts"][-1]
    assert (last["pod"], last["reason"], last["counted"]) == ("mnist-1", names.REASON_HANG, True)
    stalled = next(c for c in p.status["conditions"] if c["type"] == names.COND_STALLED)
    assert (stalled["status"], stalled["reason"]) == ("True", names.REASON_HANG)
    assert "stuck_on_io (train.py:30)" in stalled["message"]
    assert [e.message for e in p.events if e.type == "Warning" and e.reason == names.REASON_HANG
            and "stuck_on_io (train.py:30)" in e.message]
    d = p.status["diagnosis"]
    assert d["reason"] == names.REASON_HANG and "stuck_on_io (train.py:30)" in d["message"]
    assert {"rank": 1, "pod": "mnist-1", "phase": "running", "frame": "read (socket.py:7)",
            "userFrame": "stuck_on_io (train.py:30)"} in d["ranks"]
    # the same pass again: nothing counted twice
    again = plan(job, p.status, with_stall(observed(rdzv(), trainer(0), trainer(1)), finding), later(101))
    assert again.status["restarts"] == 1 and len(again.status["attempts"]) == 1


def test_a_silent_hang_over_the_budget_fails_the_job():
    job, status = _running(backoffLimit=0)
    p = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), silent_hang()), later(100))
    assert p.status["phase"] == names.PHASE_FAILED and p.status["reason"] == names.REASON_BACKOFF_LIMIT
    assert "stuck_on_io (train.py:30)" in p.status["message"]


def test_no_silent_hang_action_with_hang_detection_off():
    job, status = _running(hangTimeoutSeconds=0)
    p = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), silent_hang()), later(100))
    assert p.actions == () and "diagnosis" not in p.status


# --- a hang found by progress, with the sidecars' diagnoses (plan/hang.py) -------------------------------------------
def with_diagnoses(obs, diagnoses):
    return dataclasses.replace(obs, hang_diagnoses=diagnoses)


def test_a_hang_found_by_progress_records_the_diagnosis_and_names_the_stuck_frame():
    job, status = _running()
    reports = {"uid-mnist-0-0": {"rank": 0, "step": 41}, "uid-mnist-1-0": {"rank": 1, "step": 40}}
    diagnoses = (diag(0, worker(0, phase="collective", frame=ALLREDUCE)),
                 diag(1, worker(1, phase="running", frame="read (socket.py:7)", user="stuck_on_io (train.py:30)")))
    obs = with_diagnoses(observed(rdzv(), trainer(0), trainer(1), hang_reports=reports), diagnoses)
    p = plan(job, status, obs, later(30))
    assert [(a.verb, a.name) for a in p.actions] == [(DELETE, "mnist-1")]
    restarting = [e for e in p.events if e.type == "Warning" and e.reason == names.REASON_HANG]
    assert restarting and all("stands in stuck_on_io (train.py:30)" in e.message for e in restarting)
    d = p.status["diagnosis"]
    assert d["reason"] == names.REASON_HANG and "stuck_on_io (train.py:30)" in d["message"]
    assert d["ranks"] == [{"rank": 0, "pod": "mnist-0", "phase": "collective", "frame": ALLREDUCE},
                          {"rank": 1, "pod": "mnist-1", "phase": "running", "frame": "read (socket.py:7)",
                           "userFrame": "stuck_on_io (train.py:30)"}]
    # without diagnoses (sidecars off) the rule is today's: no diagnosis
    plain = plan(job, status, observed(rdzv(), trainer(0), trainer(1), hang_reports=reports), later(30))
    assert "diagnosis" not in plain.status and [(a.verb, a.name) for a in plain.actions] == [(DELETE, "mnist-1")]


def test_a_finding_for_a_job_whose_rule_was_turned_off_since_changes_nothing():
    for spec in ({"failurePolicy": {"hangTimeoutSeconds": 20, "processGroupTimeoutSeconds": 0}},
                 {"failurePolicy": {"hangTimeoutSeconds": 20}, "diagnostics": {"enabled": False}}):
        job = make_job(**spec)
        first = plan(job, {}, observed(service_exists=False), NOW)
        status = plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status
        p = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), twice()), later(300))
        assert p.actions == () and p.status["phase"] == names.PHASE_RUNNING and "diagnosis" not in p.status
    job = make_job(failurePolicy={"hangTimeoutSeconds": 20}, diagnostics={"enabled": False})
    first = plan(job, {}, observed(service_exists=False), NOW)
    status = plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status
    p = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), silent_hang()), later(300))
    assert p.actions == () and "diagnosis" not in p.status


def test_diagnoses_that_keep_changing_end_at_the_backoff_limit():
    job, status = _running(backoffLimit=0)
    first = plan(job, status, with_stall(observed(rdzv(), trainer(0), trainer(1)), twice()), later(300))
    assert first.status["phase"] == names.PHASE_RESTARTING  # the first restart is free, whatever the limit
    back = plan(job, first.status, pods("new-0", "new-1"), later(310))
    again = plan(job, back.status, with_stall(pods("new-0", "new-1"), waits(("new-0", "new-1"))), later(620))
    assert (again.status["phase"], again.status["reason"]) == (names.PHASE_FAILED, names.REASON_BACKOFF_LIMIT)
    assert "never joined" in again.status["message"], again.status["message"]
