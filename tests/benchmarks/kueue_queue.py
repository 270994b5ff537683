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

Judged (goals_missed; the exit status is 1 when one is missed), every round: job B was seen waiting (its pods listed
while it read Queued and A had not finished, every 0.5 s until A succeeded: `waiting_looks`) and had no pod in any
of those looks (`waiting_pods_max`), then ran to its first step (`handoff_s`); A's Workload was marked Finished; A
and the baseline reached their first steps.
The last line is one JSON object: queued_first_step_s, baseline_first_step_s, admission_delay_s (paired),
queued_pods_s, baseline_pods_s, admission_pods_delay_s (paired), handoff_s, handoff_pods_s, rounds, goals_missed.
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


def first_step(k: h.Kubectl, ns: str, job: str, after: float) -> float | None:
    """h.first_step_after, or None (logged) where the job reached no first step within TIMEOUT."""
    try:
        return h.first_step_after(k, ns, job, after, TIMEOUT)
    except AssertionError as e:
        h.log(f"{ns}/{job}: no first step: {e}")
        return None


def while_waiting(k: h.Kubectl, ns: str) -> tuple[dict, dict]:
    """Job B's pods, looked at until job A (holding the quota) succeeded: (A's final status, {"looks": looks taken
    while B waited, "pods_max": the most pods of B in one of them}). A look counts only where, after its pod
    listing, A had still not finished and B still read Queued: B was waiting when its pods were listed."""
    seen = {"looks": 0, "pods_max": 0}

    def check():
        pods = len(k.json("get", "pods", "-n", ns, "-l", f"{h.LABEL_JOB}=b")["items"])
        a = h.status(k, ns, "a")
        if a.get("phase") == "Failed":
            raise h.PhaseError(f"{ns}/a failed: {a.get('message')}")
        if a.get("phase") == "Succeeded":
            return a
        if h.status(k, ns, "b").get("reason") == "Queued":
            seen["looks"] += 1
            seen["pods_max"] = max(seen["pods_max"], pods)
        return None
    done = h.wait_for_or_raise(check, TIMEOUT, f"{ns}/a to succeed while b waits", h.PhaseError, interval=0.5)
    return done, seen


def queued_round(k: h.Kubectl, i: int) -> dict:
    ns = h.new_namespace(k, f"bench-kueue-{i}")
    cq = h.kueue_queue(k, ns, FLAVOR)
    try:
        t0 = time.time()
        h.apply(k, ns, h.queued(job("a")))
        a_pods = pods_created(k, ns, "a")
        a_first = first_step(k, ns, "a", t0)
        r = {"queued_pods_s": round(a_pods - t0, 2), "queued_first_step_s": results.difference(a_first, t0),
             "waiting_looks": 0, "waiting_pods_max": 0, "workload_finished": False, "handoff_pods_s": None,
             "handoff_s": None}
        if a_first is None:
            return r
        h.apply(k, ns, h.queued(job("b")))
        # All or nothing: the waiting job has no pods while the first one holds the quota.
        done, waiting = while_waiting(k, ns)
        r.update(waiting_looks=waiting["looks"], waiting_pods_max=waiting["pods_max"])
        completed = h.parse_rfc3339(done.get("completionTime"))
        b_first = first_step(k, ns, "b", completed - 1)
        if b_first is not None:
            r.update(handoff_pods_s=round(created_at(k, ns, "b") - completed, 2),
                     handoff_s=round(b_first - completed, 2))
            h.wait_phase(k, ns, "b", "Succeeded", TIMEOUT)
        wl = h.workload(k, ns, "a")
        finished = next((c for c in (wl or {}).get("status", {}).get("conditions") or [] if c["type"] == "Finished"),
                        {})
        r["workload_finished"] = finished.get("status") == "True"
        if not r["workload_finished"]:
            h.log(f"job a's Workload is not Finished: {wl}")
        return r
    finally:
        h.delete_namespace(k, ns, wait=True)
        k("delete", "clusterqueue", cq, "--ignore-not-found", check=False)


def baseline_round(k: h.Kubectl, i: int) -> dict:
    ns = h.new_namespace(k, f"bench-kueue-base-{i}")
    try:
        t0 = time.time()
        h.apply(k, ns, job("a"))
        pods = pods_created(k, ns, "a")
        first = first_step(k, ns, "a", t0)
        if first is not None:
            h.wait_phase(k, ns, "a", "Succeeded", TIMEOUT)
        return {"baseline_pods_s": round(pods - t0, 2), "baseline_first_step_s": results.difference(first, t0)}
    finally:
        h.delete_namespace(k, ns, wait=True)


def goals_missed(result: dict) -> list[str]:
    """Every round: the queued job was seen waiting, with no pod, then ran to its first step; A's Workload Finished;
    A and the baseline reached their first steps ([]: all held)."""
    out = []
    for i, r in enumerate(result["rounds"]):
        at = f"round {i}: "
        out += results.goal(r["queued_first_step_s"] is not None, at + "queued_first_step_s",
                            r["queued_first_step_s"], "job A's first step")
        out += results.goal(r["baseline_first_step_s"] is not None, at + "baseline_first_step_s",
                            r["baseline_first_step_s"], "the baseline's first step")
        out += results.goal(r["waiting_looks"] >= 1, at + "waiting_looks", r["waiting_looks"],
                            ">= 1 (job B seen waiting while A held the quota)")
        out += results.goal(r["waiting_pods_max"] == 0, at + "waiting_pods_max", r["waiting_pods_max"],
                            "0 (no pod of B while it waited)")
        out += results.goal(r["handoff_s"] is not None, at + "handoff_s", r["handoff_s"],
                            "job B's first step once A succeeded")
        out += results.goal(r["workload_finished"] is True, at + "workload_finished", r["workload_finished"],
                            "True (A's Workload marked Finished)")
    return out


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

    def p50(key: str) -> float | None:  # over the rounds where it was measured
        return h.p50(results.measured([r[key] for r in rounds]))

    def paired_p50(key: str, base: str) -> float | None:
        return h.p50(results.measured([results.difference(r[key], r[base]) for r in rounds]))

    result = {
        "queued_first_step_s": p50("queued_first_step_s"),
        "baseline_first_step_s": p50("baseline_first_step_s"),
        "admission_delay_s": paired_p50("queued_first_step_s", "baseline_first_step_s"),
        "queued_pods_s": p50("queued_pods_s"),
        "baseline_pods_s": p50("baseline_pods_s"),
        "admission_pods_delay_s": paired_p50("queued_pods_s", "baseline_pods_s"),
        "handoff_s": p50("handoff_s"),
        "handoff_pods_s": p50("handoff_pods_s"),
        "kueue_version": kueue.version(),
        "rounds": rounds,
    }
    return results.emit_judged("kueue_queue", result, goals_missed(result), mode="quick" if a.quick else "full",
                               record=a.record)


if __name__ == "__main__":
    sys.exit(main())
