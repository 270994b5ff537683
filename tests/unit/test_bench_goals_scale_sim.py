"""tests/benchmarks/scale_sim.py's judging (`goals_missed`) on synthetic results (no cluster): every outcome goal holds
on a good result and fails, with one message naming its figure, on a forced bad value; its pure helpers (percentile,
slope, the poll histogram) and the audit log's counting of the operator's writes."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import api_writes, scale_sim, sim_support
from tests.unit.test_bench_goals import changed, one_miss


def full_result() -> dict:
    by_n = {n: {"pods_missing": [], "creates": int(n) + 3, "status_writes": 4} for n in ("10", "100", "1000")}
    return {"by_nodes": by_n, "duplicates": [], "deletions": {"deleted": 20, "replaced": 20},
            "node_storm": {"pods": 52, "replaced": 52},
            "many_jobs": [{"jobs": 100, "nodes": 32, "pods": 3300, "pods_found": 3300},
                          {"jobs": 1000, "nodes": 1, "pods": 2000, "pods_found": 2000}],
            "restart": {"recreated": []}, "non_loopback_ips": [], "operator_rss_mib_max": 180.5}


def quick_result() -> dict:
    r = full_result()
    r["by_nodes"] = {"100": r["by_nodes"]["100"]}
    r["deletions"] = {"deleted": 5, "replaced": 5}
    for key in ("node_storm", "many_jobs", "restart"):
        r[key] = None
    return r


def test_a_good_full_run_and_a_good_quick_run_miss_nothing():
    assert scale_sim.goals_missed(full_result()) == []
    assert scale_sim.goals_missed(quick_result()) == []


@pytest.mark.parametrize("path, bad, figure", [
    (("by_nodes", "1000", "pods_missing"), ["job-17"], "by_nodes[1000].pods_missing"),
    (("by_nodes", "1000", "creates"), 1004, "creates_per_job_by_nodes[1000]"),
    (("by_nodes", "10", "status_writes"), 7, "status_writes_per_job_by_nodes[10]"),
    (("duplicates",), ["ddp-sim-n100-abc/job-3"], "duplicates"),
    (("deletions", "replaced"), 19, "deletions.replaced"),
    (("node_storm", "replaced"), 51, "node_storm.replaced"),
    (("node_storm", "pods"), 0, "node_storm.replaced"),
    (("many_jobs", 0, "pods_found"), 3299, "many_jobs[100x32].pods_found"),
    (("restart", "recreated"), ["ddp-sim-many-1000x1-abc/j0001-0"], "restart.recreated"),
    (("non_loopback_ips",), ["ns/job-1=10.88.0.7"], "non_loopback_ips"),
    (("operator_rss_mib_max",), 401.0, "operator_rss_mib_max"),
    (("operator_rss_mib_max",), None, "operator_rss_mib_max"),
])
def test_each_outcome_goal_fails_on_a_bad_value(path, bad, figure):
    one_miss(scale_sim.goals_missed(changed(full_result(), path, bad)), figure)


def test_percentile_slope_and_the_slowest_poll():
    assert scale_sim.percentile([], 99) is None
    assert scale_sim.percentile([0.3, 0.1, 0.2], 50) == 0.2
    assert scale_sim.percentile([0.1] * 99 + [5.0], 99) == 0.1 and scale_sim.percentile([0.1] * 98 + [5.0] * 2, 99) == 5.0
    assert scale_sim.slope({"10": 13, "100": 103, "1000": 1003}) == 1.0
    assert scale_sim.slope({"10": 4, "1000": 4}) == 0.0
    assert scale_sim.slope({"100": 4}) is None
    text = "\n".join(f'ddpjob_progress_poll_seconds_bucket{{le="{le}"}} {n}' for le, n in
                     [("0.5", 10.0), ("1.0", 10.0), ("2.0", 12.0), ("3.0", 14.0), ("+Inf", 14.0)])
    after = scale_sim.poll_histogram(text)
    assert after[float("inf")] == 14.0
    # four polls since, none faster than 1 s, the slowest in the (2, 3] bucket
    assert scale_sim.slowest_poll({0.5: 10.0, 1.0: 10.0, 2.0: 10.0, 3.0: 10.0, float("inf"): 10.0}, after) == 3.0
    assert scale_sim.slowest_poll(after, after) is None


def test_the_operators_writes_are_counted_by_kind_in_the_jobs_namespace_only():
    def ev(verb, resource, ns="ddp-sim-a", sub=None, agent="kopf/1.37", user="kubernetes-admin"):
        ref = {"resource": resource, "namespace": ns, **({"subresource": sub} if sub else {})}
        return {"verb": verb, "objectRef": ref, "stage": "ResponseComplete", "userAgent": agent,
                "user": {"username": user}, "requestReceivedTimestamp": "2026-12-05T16:00:00.000000Z"}
    events = [ev("create", "pods"), ev("create", "pods"), ev("create", "services"), ev("create", "networkpolicies"),
              ev("patch", "ddpjobs", sub="status"), ev("patch", "ddpjobs", sub="status"),
              ev("create", "pods", ns="ddp-sim-b"),  # another job's namespace
              ev("patch", "pods", sub="status", agent="kwok/v0.8.0 (linux/amd64) kubernetes/$Format"),  # kwok
              ev("delete", "pods", agent="kubectl/v1.34.4"),  # the benchmark itself
              ev("create", "bindings", user="system:kube-scheduler"),  # the control plane
              ev("get", "pods")]
    writes = sim_support.operator_writes(events, "ddp-sim-a")
    assert writes == {"creates": 4, "status_writes": 2}


def test_the_audit_cursor_reads_on_across_a_rotation(tmp_path):
    log = tmp_path / "audit.log"
    log.write_text(json.dumps({"n": 0}) + "\n")
    cursor = api_writes.AuditCursor(log)
    with open(log, "a") as f:
        f.write(json.dumps({"n": 1}) + "\n")
    log.rename(tmp_path / "audit-2026-12-05T16-00-00.000.log")  # the API server rotates by renaming
    log.write_text(json.dumps({"n": 2}) + "\n")
    assert [e["n"] for e in cursor.events()] == [1, 2]


def _audit(verb, name, at, agent="OpenAPI-Generator/37.0.2/python", code=201, sub=""):
    return {"verb": verb, "userAgent": agent, "stageTimestamp": f"2026-12-06T10:06:{at}Z",
            "responseStatus": {"code": code},
            "objectRef": {"resource": "pods", "namespace": "ns", "name": name, "subresource": sub}}


def test_a_pod_kwok_deleted_though_nobody_asked_is_told_apart_from_a_duplicate():
    """kwok deletes by name: its delete of a force-deleted pod took the replacement made meanwhile (audit of a run)."""
    kwok = "kwok/v0.8.0 (linux/amd64)"
    events = [
        _audit("delete", "job-25", "09.192000", code=200),               # the operator's force delete
        _audit("create", "job-25", "09.617000"),                         # its replacement
        _audit("delete", "job-25", "11.930000", agent=kwok, code=200),   # kwok's late delete takes it
        _audit("create", "job-26", "09.617000"),
        _audit("delete", "job-26", "19.000000", code=200),               # a graceful delete by someone...
        _audit("delete", "job-26", "19.930000", agent=kwok, code=200),   # ...that kwok carries out: no race
        _audit("create", "job-27", "09.617000"),
        _audit("delete", "job-27", "09.900000", agent=kwok, code=404),   # kwok's delete that found nothing
        _audit("create", "job-28", "09.617000"),
        _audit("patch", "job-28", "09.700000", agent=kwok, code=200, sub="status"),
    ]
    assert sim_support.kwok_raced(events) == {"ns/job-25"}
