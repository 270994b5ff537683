"""The stall rules through the reconciler (fake_api): what a pass writes and posts for the poller's findings, and
status.diagnosis carried from pass to pass, so the same diagnosis after the restart is recognised."""

from ddp_operator import names, stall
from ddp_operator.stall import Diagnosis, PodDiagnosis, Worker

from ddp_builders import job_body
from fake_api import fake_reconciler

INIT = "_new_process_group_helper (torch/distributed/distributed_c10d.py:2011)"


def _run_pods(r, key):
    """Every pod of the job Running; its trainer pods, by index."""
    for p in r.indexes["pods_by_job"][key]:
        p["status"] = {"phase": "Running", "podIP": "127.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]}
    return sorted((p for p in r.indexes["pods_by_job"][key]
                   if p["metadata"]["labels"][names.LABEL_ROLE] == names.ROLE_TRAINER),
                  key=lambda p: p["metadata"]["name"])


def _twice(trainers):
    """Pod 1's worker (RANK=1) claims rank 0: rank 1 never joins."""
    workers = [Worker(41, 0, 0, 0, 2, 1.0, "init", INIT, "main (train.py:8)", "d"),
               Worker(41, 0, 1, 0, 2, 1.0, "init", INIT, "main (train.py:8)", "d")]
    diagnoses = [PodDiagnosis(p["metadata"]["uid"], p["metadata"]["name"], i, Diagnosis("ok", (w,)))
                 for i, (p, w) in enumerate(zip(trainers, workers))]
    return stall.startup_finding(diagnoses, 2)


def test_never_formed_twice_through_the_reconciler_restarts_once_then_fails():
    body = job_body(name="twice", failurePolicy={"processGroupTimeoutSeconds": 60})
    r = fake_reconciler(body)
    key = ("ml", "twice")
    r.reconcile(*key)
    trainers = _run_pods(r, key)
    r.reconcile(*key)
    assert body["status"]["phase"] == names.PHASE_RUNNING
    first = _twice(trainers)
    r.reconcile(*key, stall=first)
    assert sorted(r.api.deleted) == ["twice-0", "twice-1"]
    assert body["status"]["phase"] == names.PHASE_RESTARTING
    assert body["status"]["diagnosis"]["message"] == first.message
    stalled = [c for c in body["status"]["conditions"] if c["type"] == names.COND_STALLED]
    assert stalled[0]["status"] == "True" and stalled[0]["message"] == first.message
    warnings = [e for e in r.api.events if e[1:] == ("Warning", names.REASON_PG_NEVER_FORMED, first.message)]
    assert len(warnings) == 1
    # the pods go; their replacements are created and run
    r.indexes["pods_by_job"][key] = [p for p in r.indexes["pods_by_job"][key]
                                     if p["metadata"]["labels"][names.LABEL_ROLE] != names.ROLE_TRAINER]
    r.reconcile(*key)
    new = _run_pods(r, key)
    assert {p["metadata"]["uid"] for p in new}.isdisjoint(p["metadata"]["uid"] for p in trainers)
    r.reconcile(*key)
    assert body["status"]["phase"] == names.PHASE_RUNNING and body["status"].get("restarts", 0) == 0
    assert body["status"]["diagnosis"]["message"] == first.message  # kept
    # the same diagnosis in the new pods: the script's fault
    r.reconcile(*key, stall=_twice(new))
    assert body["status"]["phase"] == names.PHASE_FAILED
    assert body["status"]["reason"] == names.REASON_PG_NEVER_FORMED
    assert body["status"]["message"].endswith("; the same after a restart: fix the script")
    assert any(e[1:3] == ("Warning", names.REASON_PG_NEVER_FORMED) and "fix the script" in e[3]
               for e in r.api.events)
