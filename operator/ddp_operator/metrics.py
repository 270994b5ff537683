"""Prometheus metrics of the operator, served on --metrics-port (default 8080) at /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from ddp_operator import names

JOBS = Gauge("ddpjob_jobs", "DDPJobs known to this operator, by phase.", ["phase"])
RESTARTS = Counter("ddpjob_restarts_total", "Training pod failures counted against backoffLimit.")
DISRUPTIONS = Counter("ddpjob_disruptions_total", "Pod losses from evictions, preemption and node loss.")
RECOVERY = Histogram("ddpjob_recovery_seconds",
                     "From a pod loss to all training pods Running again (operator's view).",
                     buckets=(1, 2, 5, 10, 15, 20, 30, 45, 60, 120, 300, 600))
RECONCILES = Counter("ddpjob_reconcile_total", "Reconcile passes, by result.", ["result"])
RECONCILE_SECONDS = Histogram("ddpjob_reconcile_seconds", "Duration of a reconcile pass.",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
RECONCILE_STAGE_SECONDS = Histogram("ddpjob_reconcile_stage_seconds",
                                    "Duration of one stage of a reconcile pass (pass_clock.STAGES).", ["stage"],
                                    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
API_WRITES = Counter("ddpjob_api_writes_total", "Kubernetes API writes by the operator.", ["verb", "kind"])
PROGRESS_POLL_SECONDS = Histogram("ddpjob_progress_poll_seconds",
                                  "Duration of one job's progress poll (every trainer pod and sidecar asked).",
                                  buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120))
PROGRESS_WRITES = Counter("ddpjob_progress_writes_total", "Status writes that only carry trainer progress.")
NODES_WATCHED = Gauge("ddpjob_nodes_watched", "Nodes the operator's node watch holds (0: not listed yet, or no "
                      "permission to list Nodes: each node a pass needs is read).")
NODE_READS = Counter("ddpjob_node_reads_total", "Nodes read one by one: those the node watch could not vouch for.")
MEMORY_ENTRIES = Gauge("ddpjob_operator_state_entries",
                       "Per-job state the operator holds in memory (job records, job objects, polls in flight), "
                       "by structure; back to its level once deleted jobs are swept.", ["structure"])


def set_phases(phases: dict[str, str]) -> None:
    counts = {p: 0 for p in names.PHASES}
    for phase in phases.values():
        counts[phase] = counts.get(phase, 0) + 1
    for phase, count in counts.items():
        JOBS.labels(phase).set(count)


def serve(port: int) -> None:
    if port:
        start_http_server(port)


def set_state_entries(sizes: dict[str, int]) -> None:
    for structure, size in sizes.items():
        MEMORY_ENTRIES.labels(structure).set(size)
