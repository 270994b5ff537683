"""Every field the operator reads from a pod is untrusted: hostile values in the termination message (through
observe_pod -> plan -> status) and in the progress endpoint's report (through the poller's parser) are dropped one
by one, the rest kept, a Warning Event says which, and nothing raises: the job still finishes."""

import json
import math

import pytest

from ddp_operator import names, progress
from ddp_operator.observed import observe_pod
from ddp_operator.plan import plan
from ddp_operator.report import valid_report
from ddp_operator.status import last_recovery, progress_status

from ddp_builders import NOW, later, make_job, observed, rdzv, trainer

NAN, INF = float("nan"), float("inf")
JUNK = ["x" * 100_000, [1], {"a": {"b": [1, {"c": None}]}}, [[[[[]]]]]]
COUNT_BAD = [*JUNK, "7", True, NAN, INF, -INF, 1e300, -1, 2.5, 10 ** 30, 10 ** 4000]
REAL_BAD = [*JUNK, "0.5", True, NAN, INF, -INF, 10 ** 4000]
FLAG_BAD = [*JUNK, 1, "true", NAN]

RECOVERY = {"resumedFrom": "peer", "step": 50, "highestStep": 51, "stepsLost": 1, "restoredFromPod": "mnist-0",
            "seconds": 10.0, "at": 1735732900.0}
GOOD = {"rank": 0, "step": 90, "epoch": 3, "loss": 0.25, "samplesPerSecond": 100.0, "lastCheckpointStep": 80,
        "worldSize": 2, "metrics": {"acc": 0.9}, "time": 1735732950.0, "final": True, "workerRestarts": 1,
        "snapshotEvery": 1, "lastSnapshotStep": 89, "snapshotResident": True, "members": [0, 1],
        "recovery": RECOVERY}
# field -> hostile values; `recovery.x` is a field of the recovery record, `metrics.x` one metric
TABLE = {
    **{f: COUNT_BAD for f in ("step", "epoch", "lastCheckpointStep", "worldSize", "workerRestarts", "snapshotEvery",
                              "lastSnapshotStep")},
    "loss": REAL_BAD, "samplesPerSecond": [*REAL_BAD, -1.0], "time": [*REAL_BAD, 1e300, -1.0],
    "snapshotResident": FLAG_BAD,
    "metrics": [*JUNK[:2], "acc", 3, NAN],
    "metrics.acc": [JUNK[0], *JUNK[2:], ["a"], list(range(100)), {"d": "x"}, "0.9", NAN, INF, 10 ** 4000, True],
    "members": [JUNK[0], *JUNK[2:], [-1], [names.MAX_NODES], [True], list(range(2000)), NAN],
    "recovery": [*JUNK[:2], "peer", 7, NAN],
    "recovery.at": [*REAL_BAD, 1e300, -1e300, -1.0],
    "recovery.seconds": [*REAL_BAD, 1e300, -1.0],
    "recovery.stepsLost": [*JUNK, "1", True, NAN, INF, 1e300, 10 ** 30, 10 ** 4000],
    "recovery.resumedFrom": [*JUNK, "elsewhere", 1, NAN],
    "recovery.restoredFromPod": [*JUNK[1:], "x" * 300, 7, NAN],
}
CASES = [(f, v) for f, values in TABLE.items() for v in values]
IDS = [f"{f}={str(v)[:12]}" for f, v in CASES]


def _with(field, value):
    report = json.loads(json.dumps(GOOD))
    where, _, sub = field.partition(".")
    if sub:
        report[where][sub] = value
    else:
        report[where] = value
    return report


def _json(report):
    """The message a hostile trainer writes (Python's json writes NaN/Infinity; the operator's json reads them)."""
    return json.dumps(report)


def _strict(status):
    """The status must be what the API server accepts: strict JSON, integers within int64."""
    text = json.dumps(status, allow_nan=False)

    def walk(v):
        if isinstance(v, bool):
            return
        if isinstance(v, int):
            assert -2 ** 63 <= v < 2 ** 63, v
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
    walk(status)
    return text


def _running():
    job = make_job()
    first = plan(job, {}, observed(service_exists=False), NOW)
    status = plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), NOW).status
    return job, {**status, "lastIncident": {"reason": names.REASON_NODE_FAILED, "time": "2025-01-01T12:01:35Z"}}


def _kept(field, status):
    """The valid fields of GOOD other than `field` are all still shown."""
    top = field.partition(".")[0]
    progress_ = status["progress"]
    for key in ("step", "epoch", "worldSize", "workerRestarts", "lastSnapshotStep", "loss"):
        if key != top:
            assert progress_[key] == GOOD[key], (field, key)
    if top != "metrics":
        assert progress_["metrics"] == {"acc": 0.9}
    if top != "recovery":
        assert status["lastRecovery"]["stepsLost"] == 1 and status["lastRecovery"]["resumedFrom"] == "peer"


@pytest.mark.parametrize("field, value", CASES, ids=IDS)
def test_a_hostile_termination_message_field_is_dropped_and_the_job_still_finishes(field, value):
    job, status = _running()
    message = _json(_with(field, value))
    done = observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0, message=message),
                    trainer(1, phase="Succeeded", exit_code=0))
    p = plan(job, status, done, later(200))
    assert p.status["phase"] == names.PHASE_SUCCEEDED
    _strict(p.status)
    _kept(field, p.status)
    warnings = [e for e in p.events if e.reason == names.REASON_INVALID_REPORT]
    assert len(warnings) == 1 and warnings[0].type == "Warning"
    assert "mnist-0" in warnings[0].message and field in warnings[0].message
    assert len(warnings[0].message) < 1024
    # once: the next pass (the job finished) says nothing more
    again = plan(job, p.status, done, later(201))
    assert not [e for e in again.events if e.reason == names.REASON_INVALID_REPORT]
    _strict(again.status)


@pytest.mark.parametrize("field, value", CASES, ids=IDS)
def test_a_hostile_progress_report_field_is_dropped_by_the_pollers_parser(field, value):
    body = json.dumps(_with(field, value)).encode()
    raw = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body
    report = progress._report(raw)
    clean, invalid = valid_report(report)
    if isinstance(value, float) and not math.isfinite(value):
        assert clean is not None and field not in invalid  # the endpoint's NaN/Infinity read as null: not measured
    else:
        assert clean is not None and field in invalid
    shown = progress_status(clean)
    recovery = last_recovery(None, {"reason": names.REASON_NODE_FAILED, "time": "2025-01-01T12:01:35Z"}, clean)
    status = {"progress": shown, **({"lastRecovery": recovery} if recovery else {})}
    _strict(status)
    _kept(field, status)


@pytest.mark.parametrize("message", [
    "[" * 4000, '{"final": true, "x": ' + "[" * 4000 + "]" * 4000 + "}", '{"final": true, "step": 1' + "0" * 4000 + "}",
    '{"final": true, "step": 1e999}', '{"final": [1], "step": 3}', "null", "[1, 2]", '"final"',
])
def test_a_termination_message_that_is_not_a_report_never_raises(message):
    job, status = _running()
    state = observe_pod(trainer(0, phase="Succeeded", exit_code=0, message=message))
    assert state.final_report is None or json.dumps(state.final_report, allow_nan=False)
    p = plan(job, status, observed(rdzv(), trainer(0, phase="Succeeded", exit_code=0, message=message),
                                   trainer(1, phase="Succeeded", exit_code=0)), later(200))
    assert p.status["phase"] == names.PHASE_SUCCEEDED
    _strict(p.status)


def test_a_failure_whose_exit_summary_is_hostile_is_counted_without_raising():
    job, status = _running()
    message = "exitcode  : " + "9" * 4000 + " (pid: 1)\n" + "exitcode : 3 (pid: 2)"
    p = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1, message=message,
                                                                 restart_policy="Never")), later(5))
    assert p.status["restarts"] == 1
    _strict(p.status)


def test_a_report_with_a_rank_that_is_not_a_rank_is_nobodys():
    for rank in ("0", [0], True, -1, NAN, 1e300):
        clean, invalid = valid_report({**GOOD, "rank": rank})
        assert clean is None and invalid == ("rank",)
    assert math.isclose(valid_report(GOOD)[0]["loss"], 0.25) and valid_report(GOOD)[1] == ()
    # null is "not measured" (a diverging loss, no checkpoint yet): left out, not invalid
    clean, invalid = valid_report({**GOOD, "loss": None, "lastCheckpointStep": None})
    assert invalid == () and "loss" not in clean


@pytest.mark.parametrize("value", ["yesterday", "2026-13-45T99:00:00Z", 17, ["2026-01-01T00:00:00Z"], {"t": 1}])
def test_a_malformed_time_on_a_pod_is_unknown_never_an_exception(value):
    """deletionTimestamp and a container's finishedAt are read from the pod: a malformed one reads as unknown."""
    failed = trainer(1, phase="Failed", exit_code=1, restart_policy="Never")
    failed["metadata"]["deletionTimestamp"] = value
    failed["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = value
    state = observe_pod(failed)
    assert state.deleting and state.deletion_time is None and state.finished_at is None
    job, status = _running()
    p = plan(job, status, observed(rdzv(), trainer(0), failed), later(5))
    assert p.status["restarts"] == 1
    _strict(p.status)
