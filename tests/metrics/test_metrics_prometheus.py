"""The per-job metrics through a real Prometheus, without a cluster: the operator's collector (job_metrics.py) served
on a loopback port over job bodies the test changes, the pinned Prometheus (hack/build-binaries.sh prometheus)
scraping it every second, and PromQL through its HTTP API: a running job's step increases, a recovery shows up as
one recovery of its fault and one observation of the histogram, a deleted job's series go, and every query of the
chart's Grafana dashboard returns the job's series (tests/e2e/test_e2e_prometheus.py does the same against the
chart's operator and a real training job)."""

from __future__ import annotations

import copy

from prometheus_client import CollectorRegistry, start_http_server

from ddp_operator import job_metrics
from ddp_trainer.testing import free_port
from tests.support import prometheus as prom
from tests.support.waiting import wait_for

NS, JOB, GONE = "ml", "digits", "gone"
SEL = f'namespace="{NS}", name="{JOB}"'
SCRAPE_WAIT_S = 20  # a few 1-second scrapes, with room for a busy machine


def job_body(name: str, step: int) -> dict:
    return {"apiVersion": "ddp.dev/v1alpha1", "kind": "DDPJob",
            "metadata": {"namespace": NS, "name": name, "uid": f"uid-{name}"},
            "status": {"phase": "Running",
                       "progress": {"step": step, "loss": 2.0 / (1 + step), "samplesPerSecond": 480.0},
                       "goodput": {"ratio": 0.9, "wallSeconds": 50.0, "recoveries": 0, "stepsLost": 0,
                                   "seconds": {"productive": 45.0, "starting": 5.0, "queued": 0.0,
                                               "recovering": 0.0, "redone": 0.0},
                                   "byFault": {}}}}


def recovered(body: dict, step: int) -> dict:
    """The body after a NodeFailed recovery of 7.5 s that lost 2 steps, training again at `step`."""
    body = copy.deepcopy(body)
    s = body["status"]
    s["progress"].update(step=step, loss=2.0 / (1 + step))
    s["lastRecovery"] = {"fault": "NodeFailed", "startedAt": "2026-01-01T00:00:00Z", "seconds": 7.5,
                         "stepsLost": 2, "resumedFrom": "peer"}
    s["goodput"].update(ratio=0.8, wallSeconds=60.0, recoveries=1, stepsLost=2,
                        byFault={"NodeFailed": {"recoveries": 1, "seconds": 7.5, "stepsLost": 2}})
    s["goodput"]["seconds"].update(productive=48.0, recovering=5.5, redone=1.5)
    return body


def test_prometheus_sees_a_jobs_step_its_recovery_and_every_dashboard_query(tmp_path):
    bodies = {JOB: job_body(JOB, 10), GONE: job_body(GONE, 5)}
    registry = CollectorRegistry()
    collector = job_metrics.register(lambda: list(bodies.values()), registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        with prom.Prometheus([f"127.0.0.1:{port}"], tmp_path / "prometheus") as p:
            wait_for(lambda: p.value(f"ddpjob_job_step{{{SEL}}}") == 10, SCRAPE_WAIT_S, "step 10 scraped")
            assert p.value(f'ddpjob_job_step{{namespace="{NS}", name="{GONE}"}}') == 5
            for step in (20, 30):
                bodies[JOB] = job_body(JOB, step)
                wait_for(lambda: p.value(f"ddpjob_job_step{{{SEL}}}") == step, SCRAPE_WAIT_S, f"step {step}")
            rise = f"max_over_time(ddpjob_job_step{{{SEL}}}[5m]) - min_over_time(ddpjob_job_step{{{SEL}}}[5m])"
            assert p.value(rise) == 20, "the step did not increase"

            # A pod lost: the job recovers from NodeFailed (the event handler shows the operator the new status);
            # the other job is deleted.
            bodies[JOB] = recovered(bodies[JOB], 40)
            collector.see(bodies[JOB])
            del bodies[GONE]
            wait_for(lambda: p.value(f'ddpjob_job_recoveries_total{{{SEL}, fault="NodeFailed"}}') == 1,
                     SCRAPE_WAIT_S, "one NodeFailed recovery")
            # The histogram is observed by collector.see(), a moment after the body changed: a scrape in between shows
            # the recovery counted (from the body) and not yet observed, so it is waited for, not read once.
            wait_for(lambda: p.value(f'ddpjob_job_recovery_seconds_count{{{SEL}, fault="NodeFailed"}}') == 1,
                     SCRAPE_WAIT_S, "the NodeFailed recovery observed once by the recovery-seconds histogram")
            assert p.value(f'ddpjob_job_steps_lost_total{{{SEL}, fault="NodeFailed"}}') == 2
            assert p.value(f"sum(ddpjob_job_recoveries_total{{{SEL}}})") == 1
            p50 = p.value(f"histogram_quantile(0.5, sum by (le) (ddpjob_job_recovery_seconds_bucket{{{SEL}}}))")
            assert p50 is not None and 5 < p50 <= 10, p50  # 7.5 s falls in the (5, 10] bucket
            wait_for(lambda: p.query(f'{{namespace="{NS}", name="{GONE}"}}') == [], SCRAPE_WAIT_S,
                     "the deleted job's series gone (stale)")
            wait_for(lambda: p.value(f"count_over_time(ddpjob_job_step{{{SEL}}}[1m])") >= 6, SCRAPE_WAIT_S,
                     "enough samples for the dashboard's windows")

            variables = {"namespace": NS, "job": JOB, "datasource": "prometheus", "__rate_interval": "1m",
                         "__interval": "1s", "__range": "5m"}
            board = prom.dashboard()
            queries = prom.panel_queries(board, variables)
            assert len(queries) >= 10, queries
            empty, foreign = [], []
            for title, expr in queries:
                rows = p.query(expr)
                if not rows:
                    empty.append((title, expr))
                foreign += [(title, r["metric"]) for r in rows if r["metric"].get("name", JOB) != JOB]
            assert not empty, f"dashboard queries without a series: {empty}"
            assert not foreign, f"dashboard queries with another job's series: {foreign}"
            for var, label, selector in prom.variable_queries(board, variables):
                values = p.label_values(label, selector)
                assert {"namespace": NS, "job": JOB}[var] in values, (var, selector, values)
            assert p.targets_up(), p.log_tail()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
