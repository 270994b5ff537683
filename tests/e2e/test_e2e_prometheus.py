"""The per-job metrics of the chart's operator through a real Prometheus (the pinned build, hack/build-binaries.sh
prometheus) on this machine, scraping the operator's metrics Service every second while a digits job trains and loses
a pod: PromQL says that the job's step increases, that the kill is one recovery of its fault (and one observation of
the recovery-seconds histogram), and that every query of the chart's Grafana dashboard returns the job's series.

Prometheus scrapes the endpoints of the operator's metrics Service, as the chart's ServiceMonitor has it done: the
embedded cluster's pod IPs are reachable from this machine (the bridge is the host's), another cluster's are not, so
this test needs the embedded cluster, or the operator as a subprocess (DDPJOB_OPERATOR=subprocess: loopback).
tests/metrics/test_metrics_prometheus.py runs the same queries without a cluster."""

from __future__ import annotations

import pytest

from tests.e2e import harness as h
from tests.support import prometheus as prom
from tests.support.waiting import WaitTimeout, wait_for

STEP_DELAY = 0.15  # s per step: seconds of training before and after the kill (as test_e2e_training.py)
KILL_AT_STEP = 20
PROM_WAIT_S = 30  # a status write, then a scrape every second


def metrics_targets(operator, cluster, kubectl) -> list[str]:
    """host:port of every endpoint of the operator's metrics Service, the targets the chart's ServiceMonitor has
    Prometheus scrape (each replica apart: only the leader has the jobs' series)."""
    if operator.mode == "subprocess":
        return [f"127.0.0.1:{operator.process.metrics_port}"]
    if not cluster.embedded:
        pytest.skip("needs the embedded cluster: Prometheus runs on this machine and scrapes the operator's pod IPs")
    dep = operator.deployment
    ns = dep["metadata"]["namespace"]
    selector = ",".join(f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())
    services = [s["metadata"]["name"] for s in kubectl.json("get", "services", "-n", ns, "-l", selector)["items"]
                if any(port.get("name") == "metrics" for port in s["spec"].get("ports") or [])]
    assert services, f"no metrics Service of the operator ({selector}): the chart's metrics.enabled is off?"
    slices = kubectl.json("get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={services[0]}")["items"]
    port = next(p["port"] for s in slices for p in s.get("ports") or [] if p.get("name") == "metrics")
    targets = [f"{address}:{port}" for s in slices for e in s.get("endpoints") or []
               if (e.get("conditions") or {}).get("ready", True) for address in e.get("addresses") or []]
    assert targets, f"the Service {ns}/{services[0]} has no ready endpoint: {slices}"
    return targets


def test_prometheus_sees_a_jobs_step_its_recovery_and_every_dashboard_query(kubectl, ns, operator, cluster,
                                                                              tmp_path):
    job = "pm"
    sel = f'namespace="{ns}", name="{job}"'
    with prom.Prometheus(metrics_targets(operator, cluster, kubectl), tmp_path / "prometheus") as p:
        h.apply(kubectl, ns, h.digits_job(job, nodes=2, step_delay=STEP_DELAY))
        rank0, prog = h.wait_rank0_step(kubectl, ns, job, KILL_AT_STEP, 240)
        # The step increases, as Prometheus saw it (status.progress, written every progressPeriodSeconds).
        wait_for(lambda: (p.value(f"max_over_time(ddpjob_job_step{{{sel}}}[5m]) - "
                                  f"min_over_time(ddpjob_job_step{{{sel}}}[5m])") or 0) > 0, 60,
                 f"ddpjob_job_step of {ns}/{job} increasing in Prometheus (log: {p.log_path})")

        pods = [x["metadata"]["name"] for x in h.trainer_pods(kubectl, ns, job)]
        killed_at = h.kill_pod(kubectl, ns, next(n for n in pods if n != rank0))
        h.recovery_after(kubectl, ns, job, killed_at, prog["step"], 180)
        last = wait_for(lambda: (h.status(kubectl, ns, job).get("lastRecovery") or {}).get("fault"), 60,
                        f"{ns}/{job} status.lastRecovery")
        fault = f'fault="{last}"'
        wait_for(lambda: p.value(f"ddpjob_job_recoveries_total{{{sel}, {fault}}}") == 1, PROM_WAIT_S,
                 f"one {last} recovery of {ns}/{job} in Prometheus")
        assert p.value(f"sum(ddpjob_job_recoveries_total{{{sel}}})") == 1, "more than the one recovery"
        wait_for(lambda: p.value(f"ddpjob_job_recovery_seconds_count{{{sel}, {fault}}}") == 1, PROM_WAIT_S,
                 f"the {last} recovery observed once by the recovery-seconds histogram")
        assert p.value(f"ddpjob_job_step{{{sel}}}") >= KILL_AT_STEP

        variables = {"namespace": ns, "job": job, "datasource": "prometheus", "__rate_interval": "1m",
                     "__interval": "1s", "__range": "5m"}
        board = prom.dashboard()

        unanswered: list[tuple[str, str]] = []

        def answered() -> bool:  # every series exists once the job trained, recovered and had its goodput written
            unanswered[:] = [(title, expr) for title, expr in prom.panel_queries(board, variables) if not p.query(expr)]
            return not unanswered
        try:
            wait_for(answered, PROM_WAIT_S, f"every dashboard query answered for {ns}/{job}")
        except WaitTimeout:
            raise AssertionError(f"dashboard queries without a series of {ns}/{job}: {unanswered}") from None
        for title, expr in prom.panel_queries(board, variables):
            names = {r["metric"].get("name", job) for r in p.query(expr)}
            assert names == {job}, f"{title}: {expr} returned other jobs' series: {names}"
        for var, label, selector in prom.variable_queries(board, variables):
            assert {"namespace": ns, "job": job}[var] in p.label_values(label, selector), (var, selector)
        print(f"{ns}/{job}: {last} recovery seen by Prometheus; {len(prom.panel_queries(board, variables))} "
              "dashboard queries answered")
