"""job_metrics.JobMetrics: the per-job series from DDPJob bodies (present, absent, hostile), gone with their body, the
recovery histogram observed once per recovery, the series per job counted, and its wiring into the operator."""

from __future__ import annotations

import math

import kopf
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ddp_operator import __main__ as operator_main
from ddp_operator import handlers, job_metrics, names
from fake_api import fake_reconciler


def body(name="a", namespace="ml", uid=None, **status) -> dict:
    return {"apiVersion": "ddp.dev/v1alpha1", "kind": "DDPJob",
            "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{namespace}-{name}"},
            "spec": {}, **({"status": status} if status else {})}


def goodput(**faults) -> dict:
    return {"ratio": 0.8, "wallSeconds": 100.0,
            "seconds": {"productive": 80.0, "starting": 10.0, "queued": 2.0, "recovering": 6.0, "redone": 2.0},
            "recoveries": sum(f["recoveries"] for f in faults.values()),
            "stepsLost": sum(f["stepsLost"] for f in faults.values()), "byFault": faults}


def full(name="a", namespace="ml", uid=None, *, step=40, recovery=None) -> dict:
    status = {"phase": "Running", "progress": {"step": step, "loss": 0.25, "samplesPerSecond": 512.0, "epoch": 1},
              "goodput": goodput(NodeFailed={"recoveries": 1, "seconds": 6.0, "stepsLost": 2})}
    if recovery is not None:
        status["lastRecovery"] = recovery
    return body(name, namespace, uid, **status)


def recovery(started="2026-01-01T00:00:00Z", seconds=7.5, fault="NodeFailed") -> dict:
    return {"fault": fault, "startedAt": started, "seconds": seconds, "stepsLost": 1, "resumedFrom": "peer"}


class Jobs:
    """The bodies a collector reads, changed by the test; the collector in a registry of its own."""

    def __init__(self, *bodies: dict) -> None:
        self.bodies = list(bodies)
        self.registry = CollectorRegistry()
        self.collector = job_metrics.register(lambda: self.bodies, self.registry)

    def samples(self) -> dict[tuple, float]:
        """(sample name, sorted labels) -> value of one scrape, parsed from the exposition text."""
        text = generate_latest(self.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def of(self, name="a", namespace="ml") -> dict[tuple, float]:
        return {k: v for k, v in self.samples().items()
                if dict(k[1]).get("name") == name and dict(k[1]).get("namespace") == namespace}


def labels(**kv) -> tuple:
    return tuple(sorted({"namespace": "ml", "name": "a", **kv}.items()))


def test_every_series_of_a_job_comes_from_its_status():
    s = Jobs(full()).of()
    assert s[("ddpjob_job_step", labels())] == 40
    assert s[("ddpjob_job_loss", labels())] == 0.25
    assert s[("ddpjob_job_samples_per_second", labels())] == 512
    assert s[("ddpjob_job_goodput_ratio", labels())] == 0.8
    assert s[("ddpjob_job_wall_seconds_total", labels())] == 100
    assert s[("ddpjob_job_productive_seconds_total", labels())] == 80
    assert {c: s[("ddpjob_job_lost_seconds_total", labels(cause=c))] for c in job_metrics.CAUSES} == {
        "starting": 10, "queued": 2, "recovering": 6, "redone": 2}
    assert s[("ddpjob_job_recoveries_total", labels(fault="NodeFailed"))] == 1
    assert s[("ddpjob_job_steps_lost_total", labels(fault="NodeFailed"))] == 2
    assert s[("ddpjob_job_fault_seconds_total", labels(fault="NodeFailed"))] == 6
    assert {p: s[("ddpjob_job_phase", labels(phase=p))] for p in names.PHASES} == {
        p: (1.0 if p == "Running" else 0.0) for p in names.PHASES}


def test_absent_fields_give_no_series_not_zeros():
    jobs = Jobs(body("new"), body("old", phase="Running", progress={"step": 3}))
    assert jobs.of("new") == {}  # a job without status yet
    assert {k[0] for k in jobs.of("old")} == {"ddpjob_job_step", "ddpjob_job_phase"}  # no goodput on an old job


def test_hostile_status_values_are_left_out_and_the_scrape_still_answers():
    nan, inf = float("nan"), float("inf")
    weird = {f"F{i:02d}": {"recoveries": 1, "seconds": 1.0, "stepsLost": 1} for i in range(30)}
    weird.update({'x"} 1\nevil': {"recoveries": 5}, "": {"recoveries": 7}, "NodeLost": "not a record",
                  "Hang": {"recoveries": True, "seconds": -1, "stepsLost": "3"}})
    hostile = body("h", phase="Exploded", progress={"step": nan, "loss": inf, "samplesPerSecond": -5},
                   goodput={"ratio": 1.5, "wallSeconds": "100", "seconds": [1, 2], "byFault": weird},
                   lastRecovery={"fault": "x" * 1000, "seconds": nan})
    jobs = Jobs(hostile, full(), body("x", phase="Running", progress="garbage", goodput=None), "not a body",
                {"metadata": None}, {"metadata": {"name": "u", "namespace": "ml", "uid": 7}})
    s = jobs.of("h")
    faults = {dict(k[1])["fault"]: v for k, v in s.items() if k[0] == "ddpjob_job_recoveries_total"}
    assert len(faults) == job_metrics.MAX_FAULTS  # 15 names and Other, whatever status holds
    assert faults["Other"] == 15 + 5 + 7  # F15..F29, the unprintable name and the empty one, added up
    assert set(faults) - {"Other"} == {f"F{i:02d}" for i in range(15)}
    assert {k[0] for k in s} == {"ddpjob_job_recoveries_total", "ddpjob_job_steps_lost_total",
                                 "ddpjob_job_fault_seconds_total"}  # no phase, progress, ratio or seconds
    assert all(math.isfinite(v) and v >= 0 for v in s.values())
    assert jobs.of("a")[("ddpjob_job_step", labels())] == 40  # the other jobs lose nothing
    assert jobs.of("x") == {("ddpjob_job_phase", labels(name="x", phase=p)): float(p == "Running")
                            for p in names.PHASES}


class Exploding(dict):
    def get(self, key, default=None):
        if key == "status":
            raise RuntimeError("boom")
        return super().get(key, default)


def test_a_body_or_a_listing_that_raises_costs_its_own_series_only():
    jobs = Jobs(Exploding(body("boom", phase="Running")), full())
    s = jobs.samples()
    assert ("ddpjob_job_step", labels()) in s and not any(dict(k[1]).get("name") == "boom" for k in s)

    def broken():
        raise RuntimeError("dictionary changed size during iteration")
    registry = CollectorRegistry()
    job_metrics.register(broken, registry)
    text = generate_latest(registry).decode()  # answers, with every family and no job's series
    assert "# TYPE ddpjob_job_step gauge" in text and "ddpjob_job_step{" not in text


def test_a_deleted_jobs_series_disappear_with_its_body():
    jobs = Jobs(full("a"), full("b"))
    jobs.collector.see(full("b"))
    jobs.collector.see(full("b", recovery=recovery()))
    assert ("ddpjob_job_recovery_seconds_count", labels(name="b", fault="NodeFailed")) in jobs.samples()
    jobs.bodies = [full("a")]
    assert jobs.of("b") == {} and jobs.of("a")
    # and a job created again under the same name starts afresh (another UID)
    jobs.bodies.append(full("b", uid="uid-2", recovery=recovery()))
    assert ("ddpjob_job_recovery_seconds_count", labels(name="b", fault="NodeFailed")) not in jobs.samples()


def hist(jobs: Jobs, fault="NodeFailed", name="a") -> tuple[float, float] | None:
    s = jobs.samples()
    count = s.get(("ddpjob_job_recovery_seconds_count", labels(name=name, fault=fault)))
    return None if count is None else (count, s[("ddpjob_job_recovery_seconds_sum", labels(name=name, fault=fault))])


def test_the_histogram_observes_each_recovery_once():
    jobs = Jobs(full())
    jobs.samples()  # first seen without a recovery
    first = full(recovery=recovery())
    jobs.bodies = [first]
    for _ in range(3):  # scrapes and watch events of the same record
        jobs.collector.see(first)
        assert hist(jobs) == (1, 7.5)
    s = jobs.samples()
    assert s[("ddpjob_job_recovery_seconds_bucket", labels(fault="NodeFailed", le="5.0"))] == 0
    assert s[("ddpjob_job_recovery_seconds_bucket", labels(fault="NodeFailed", le="10.0"))] == 1
    assert s[("ddpjob_job_recovery_seconds_bucket", labels(fault="NodeFailed", le="+Inf"))] == 1
    jobs.bodies = [full(recovery=recovery("2026-01-01T00:10:00Z", 400.0))]
    assert hist(jobs) == (2, 407.5)
    jobs.bodies = [full(recovery=recovery("2026-01-01T00:20:00Z", 3.0, fault="Hang"))]
    assert hist(jobs) == (2, 407.5) and hist(jobs, "Hang") == (1, 3.0)


def test_the_recovery_a_job_had_before_this_process_is_not_observed_again():
    """After an operator restart the histogram starts empty: the record the previous process observed is its
    baseline; only the recoveries after it count."""
    jobs = Jobs(full(recovery=recovery()))
    assert hist(jobs) is None
    jobs.bodies = [full(recovery=recovery("2026-01-01T00:10:00Z", 12.0))]
    assert hist(jobs) == (1, 12.0)


def test_a_record_without_seconds_or_with_a_hostile_fault_is_handled():
    jobs = Jobs(full())
    jobs.samples()
    jobs.bodies = [full(recovery={"fault": "NodeFailed", "startedAt": "2026-01-01T00:00:00Z"})]
    assert hist(jobs) is None  # nothing to observe
    for i in range(20):  # more distinct faults than a job may have label values
        jobs.bodies = [full(recovery=recovery(f"2026-01-01T01:{i:02d}:00Z", 1.0, fault=f"Fault{i}"))]
        jobs.samples()
    jobs.bodies = [full(recovery=recovery("2026-01-01T02:00:00Z", 1.0, fault='bad"fault'))]
    faults = {dict(k[1])["fault"] for k in jobs.samples() if k[0] == "ddpjob_job_recovery_seconds_count"}
    assert len(faults) == job_metrics.MAX_FAULTS and "Other" in faults and 'bad"fault' not in faults
    assert hist(jobs, "Other") == (6, 6.0)  # Fault15..Fault19 and the bad name


def test_series_per_job():
    """docs/metrics.md: 16 series per job with goodput, 3 per fault, 12 per fault of the recovery histogram."""
    jobs = Jobs(full())
    jobs.samples()
    jobs.bodies = [full(recovery=recovery())]
    per_family: dict[str, int] = {}
    for (name, _), _ in jobs.of().items():
        per_family[name] = per_family.get(name, 0) + 1
    fixed = len(names.PHASES) + 6 + len(job_metrics.CAUSES)
    per_fault = 3 + len(job_metrics.RECOVERY_BUCKETS) + 3  # buckets with +Inf, _sum, _count
    assert fixed == 16 and per_fault == 15
    assert sum(per_family.values()) == fixed + per_fault
    assert jobs.collector.recoveries.series() == len(job_metrics.RECOVERY_BUCKETS) + 3
    # the most a job can have: MAX_FAULTS fault label values in every fault family
    assert fixed + job_metrics.MAX_FAULTS * per_fault == 256


def test_the_operator_serves_the_jobs_in_its_index():
    """__main__.job_bodies reads the Reconciler kopf's startup handler puts in the memo; the job event handler
    observes a recovery as it comes and forgets the job's histogram when it is deleted."""
    memo = kopf.Memo()
    assert operator_main.job_bodies(memo) == []  # before startup, and on a standby replica
    r = fake_reconciler(full("a"))
    memo.reconciler = r
    memo.job_metrics = collector = job_metrics.JobMetrics(lambda: operator_main.job_bodies(memo))
    assert [b["metadata"]["name"] for b in operator_main.job_bodies(memo)] == ["a"]
    uid = "uid-ml-a"
    for obj in (full("a"), full("a", recovery=recovery())):
        handlers.on_job_event({"type": "MODIFIED", "object": obj}, namespace="ml", name="a", uid=uid, memo=memo)
    assert collector.recoveries.series() == len(job_metrics.RECOVERY_BUCKETS) + 3
    handlers.on_job_event({"type": "DELETED", "object": full("a")}, namespace="ml", name="a", uid=uid, memo=memo)
    assert collector.recoveries.series() == 0


def test_a_listing_that_meets_a_change_of_the_index_is_taken_again():
    class Jobs:
        calls = 0

        def keys(self):
            Jobs.calls += 1
            if Jobs.calls == 1:
                raise RuntimeError("dictionary changed size during iteration")
            return [("ml", "a")]

        def body(self, key):
            return full("a")
    memo = kopf.Memo()
    memo.reconciler = type("R", (), {"jobs": Jobs()})()
    assert [b["metadata"]["name"] for b in operator_main.job_bodies(memo)] == ["a"] and Jobs.calls == 2
