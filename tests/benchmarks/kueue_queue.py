#!/usr/bin/env python3
"""What queueing behind a real Kueue costs a DDPJob (`make bench-kueue`).

    tests/benchmarks/kueue_queue.py [--rounds 3] [--quick] [--record]

Kueue (hack/kueue.py, installed when missing and removed afterwards) and the operator with its Kueue
integration on (the chart's kueue.enabled). Each round, in a fresh namespace with a ClusterQueue whose quota fits
one 2-node digits job:
- queued start: `kubectl apply` of job A into the empty queue -> its first training step (Kueue admits the
  Workload, then the operator creates the pods);
- hand-off: job B is applied while A trains and waits (Suspended, reason Queued, no pods); A's success frees the
  quota (its Workload is marked Finished) -> B's first training step. Measured from A's status.completionTime
  (the pass that marks the Workload Finished; one-second resolution);
- baseline, in its own namespace: the same job without the queue label, apply -> first step (no Kueue).
Each start is also timed to the moment its trainer pods exist (`*_pods_s`): the control plane's part (Kueue's
admission, the operator's pass) without the pods' own start-up, whose noise on a shared machine is seconds.
The first step is the trainer's own `event=step` log line (h.job_events). Medians over the rounds; the
difference queued - baseline is paired by round (both share the machine's load).
The last line is one JSON object: queued_first_step_s, baseline_first_step_s, admission_delay_s (paired),
queued_pods_s, baseline_pods_s, admission_pods_delay_s (paired), handoff_s, handoff_pods_s, rounds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks import results  # noqa: E402
from tests.e2e import harness as h  # noqa: E402

FLAVOR = "ddp-bench-flavor"
TIMEOUT = 420.0


def pods_created(k: h.Kubectl, ns: str, job: str, n: int = 2) -> float:
    """Wall-clock time (polled every 0.1 s) at which the job's n trainer pods exist: the control plane's part of a
    start (Kueue's admission and the operator's pass), without the pods' own start-up."""
    def check():
        return time.time() if len(h.trainer_pods(k, ns, job)) >= n else None
    return h.wait_for(check, TIMEOUT, f"{ns}/{job}'s pods", interval=0.1)


def created_at(k: h.Kubectl, ns: str, job: str) -> float:
    """When the last of the job's trainer pods was created (the API server's timestamp, one-second resolution)."""
    return max(h.parse_rfc3339(p["metadata"]["creationTimestamp"]) for p in h.trainer_pods(k, ns, job))


def job(name: str) -> dict:
    return h.digits_job(name, nodes=2, epochs=1)


def queued_round(k: h.Kubectl, i: int) -> dict:
    ns = h.new_namespace(k, f"bench-kueue-{i}")
    cq = h.kueue_queue(k, ns, FLAVOR)
    try:
        t0 = time.time()
        h.apply(k, ns, h.queued(job("a")))
        a_pods = pods_created(k, ns, "a")
        a_first = h.first_step_after(k, ns, "a", t0, TIMEOUT)
        h.apply(k, ns, h.queued(job("b")))
        st = h.wait_for(lambda: (lambda s: s if s.get("reason") == "Queued" else None)(h.status(k, ns, "b")), 120,
                        "job b to wait in the queue")
        # All or nothing: the waiting job has no pods while the first one holds the quota.
        if h.trainer_pods(k, ns, "b"):
            raise AssertionError(f"job b has pods while waiting in the queue: {st}")
        done = h.wait_phase(k, ns, "a", "Succeeded", TIMEOUT)
        completed = h.parse_rfc3339(done.get("completionTime"))
        b_first = h.first_step_after(k, ns, "b", completed - 1, TIMEOUT)
        b_pods = created_at(k, ns, "b")
        h.wait_phase(k, ns, "b", "Succeeded", TIMEOUT)
        wl = h.workload(k, ns, "a")
        finished = next((c for c in (wl or {}).get("status", {}).get("conditions") or [] if c["type"] == "Finished"),
                        {})
        if finished.get("status") != "True":
            raise AssertionError(f"job a's Workload is not Finished: {wl}")
        return {"queued_pods_s": round(a_pods - t0, 2), "queued_first_step_s": round(a_first - t0, 2),
                "handoff_pods_s": round(b_pods - completed, 2), "handoff_s": round(b_first - completed, 2)}
    finally:
        h.delete_namespace(k, ns, wait=True)
        k("delete", "clusterqueue", cq, "--ignore-not-found", check=False)


def baseline_round(k: h.Kubectl, i: int) -> dict:
    ns = h.new_namespace(k, f"bench-kueue-base-{i}")
    try:
        t0 = time.time()
        h.apply(k, ns, job("a"))
        pods = pods_created(k, ns, "a")
        first = h.first_step_after(k, ns, "a", t0, TIMEOUT)
        h.wait_phase(k, ns, "a", "Succeeded", TIMEOUT)
        return {"baseline_pods_s": round(pods - t0, 2), "baseline_first_step_s": round(first - t0, 2)}
    finally:
        h.delete_namespace(k, ns, wait=True)


def main() -> int:
    a = results.rounds_args(__doc__.split("\n")[0], 3)
    cluster = h.connect()
    k = h.Kubectl(cluster.kubeconfig)
    h.ensure_images(cluster)
    kueue = h.kueue_module()
    was_there = kueue.release(cluster.kubeconfig) is not None
    kueue.up(cluster.kubeconfig)
    flavor = {"apiVersion": h.KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}, "spec": {}}
    h.apply(k, "default", flavor)
    op = h.Operator(cluster, k, kueue=True).start()
    rounds: list[dict] = []
    try:
        for i in range(a.rounds):
            r = queued_round(k, i)
            r.update(baseline_round(k, i))
            h.log(f"round {i}: {r}")
            rounds.append(r)
    finally:
        op.stop()
        k("delete", "resourceflavor", FLAVOR, "--ignore-not-found", check=False)
        if not was_there:
            kueue.down(cluster.kubeconfig)
    result = {
        "queued_first_step_s": h.p50([r["queued_first_step_s"] for r in rounds]),
        "baseline_first_step_s": h.p50([r["baseline_first_step_s"] for r in rounds]),
        "admission_delay_s": h.p50([r["queued_first_step_s"] - r["baseline_first_step_s"] for r in rounds]),
        "queued_pods_s": h.p50([r["queued_pods_s"] for r in rounds]),
        "baseline_pods_s": h.p50([r["baseline_pods_s"] for r in rounds]),
        "admission_pods_delay_s": h.p50([r["queued_pods_s"] - r["baseline_pods_s"] for r in rounds]),
        "handoff_s": h.p50([r["handoff_s"] for r in rounds]),
        "handoff_pods_s": h.p50([r["handoff_pods_s"] for r in rounds]),
        "kueue_version": kueue.version(),
        "rounds": rounds,
    }
    results.emit("kueue_queue", result, mode="quick" if a.quick else "full", record=a.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
