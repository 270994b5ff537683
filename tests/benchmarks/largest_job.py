#!/usr/bin/env python3
"""The largest real job this machine carries (`make bench-largest-job`): what the simulation measures, on real pods.

    tests/benchmarks/largest_job.py [--nodes 8] [--step-delay 0.2] [--quick] [--record]

Two digits DDPJobs of --nodes nodes x 1 process run side by side on the embedded cluster (real kubelet and containerd
pods, real torchrun, the operator the harness starts): `ref`, never interrupted, and `big`, which loses
  1. two trainer pods at once (neither rank 0's) once rank 0 is at --kill-step: the operator replaces both, the group
     re-forms at the same size and resumes from the survivors' snapshots;
  2. --gap-steps after that, its rendezvous store pod: the operator recreates it, every trainer restarts in place and
     resumes from its own snapshot.
For each fault: recovery (kill -> the re-formed group's first step), the step resumed from, where the state came from,
the steps lost (tests/e2e/harness.recovery_after: the trainers' own log lines). Both jobs must end Succeeded, and
`big`'s final weights must be bitwise equal to `ref`'s: the world size never changed (the digits example keeps one
gradient-bucket layout with more than two ranks, so a resumed step rounds as the uninterrupted one does).

Goals (outcomes only; goals_missed): both faults survived (training resumed, both jobs Succeeded), steps lost <= 1 for
each, the state restored from a snapshot (peer or local, never a fresh start), every rank's final weights one digest,
equal to the uninterrupted job's. Timings are reported, never judged. --quick: 3 nodes. The last line is one JSON
object; exit status 1 when a goal was missed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks import results  # noqa: E402
from tests.e2e import harness as h  # noqa: E402

TRAIN_SAMPLES = 1258  # the digits example's training split
BATCH = 32  # per rank
STEPS_LOST_GOAL = 1
SNAPSHOT_SOURCES = ("peer", "local")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=8, help="trainer pods per job (1 process each)")
    p.add_argument("--quick", action="store_true", help="3 nodes")
    p.add_argument("--step-delay", type=float, default=0.2, help="seconds of sleep per training step")
    p.add_argument("--kill-step", type=int, default=12, help="rank 0's step before the two pods are killed")
    p.add_argument("--gap-steps", type=int, default=10, help="steps after the resume before the store pod is killed")
    p.add_argument("--tail-steps", type=int, default=15, help="steps left after the store pod's kill, at least")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed for the start and for each recovery")
    results.add_record_arg(p)
    a = p.parse_args()
    if a.quick:
        a.nodes = 3
    return a


def epochs_for(a: argparse.Namespace) -> int:
    """Enough epochs for both faults and --tail-steps after them (an epoch is ceil(samples / (nodes x batch)))."""
    per_epoch = math.ceil(TRAIN_SAMPLES / (a.nodes * BATCH))
    return math.ceil((a.kill_step + a.gap_steps + a.tail_steps + 5) / per_epoch)


def recovery_record(rec: h.Recovery | None, error: str | None = None) -> dict:
    if rec is None:
        return {"recovered": False, "error": error}
    return {"recovered": True, "recovery_s": rec.seconds, "resumed_from": rec.resumed_from, "source": rec.source,
            "steps_lost": rec.steps_lost}


def goals_missed(r: dict) -> list[str]:
    """The outcomes a run must show, judged from its result alone."""
    missed: list[str] = []
    for fault in ("two_pods", "store"):
        f = r["faults"].get(fault) or {}
        missed += results.goal(bool(f.get("recovered")), f"faults.{fault}.recovered", f.get("recovered"), "True")
        if f.get("recovered"):
            lost = f.get("steps_lost")
            missed += results.goal(lost is not None and 0 <= lost <= STEPS_LOST_GOAL, f"faults.{fault}.steps_lost",
                                   lost, f"0..{STEPS_LOST_GOAL}")
            missed += results.goal(f.get("source") in SNAPSHOT_SOURCES and (f.get("resumed_from") or 0) > 0,
                                   f"faults.{fault}.source", f.get("source"), "peer or local, resumed past step 0")
    for job, phase in r["phases"].items():
        missed += results.goal(phase == "Succeeded", f"phases.{job}", phase, "Succeeded")
    for job, digests in r["digests"].items():
        missed += results.goal(len(digests) == 1, f"digests.{job}", digests, "one digest for every rank")
    missed += results.goal(r["bitwise_equal"] is True, "bitwise_equal", r["bitwise_equal"],
                           "True: the final weights equal the uninterrupted job's")
    return missed


class Bench:
    def __init__(self, a: argparse.Namespace, k: h.Kubectl, ns: str):
        self.a, self.k, self.ns = a, k, ns
        self.faults: dict[str, dict] = {}

    def job(self, name: str) -> dict:
        return h.digits_job(name, nodes=self.a.nodes, step_delay=self.a.step_delay, epochs=epochs_for(self.a),
                            env={"DIGITS_PATIENCE": "0"},  # never stop early: the faults need their steps
                            spec={"failurePolicy": {"backoffLimit": 6}})

    def run(self) -> dict:
        t0 = time.time()
        h.apply(self.k, self.ns, [self.job("ref"), self.job("big")])
        h.log(f"{self.ns}: ref and big applied, {self.a.nodes} nodes each, {epochs_for(self.a)} epochs")
        rank0, prog = h.wait_rank0_step(self.k, self.ns, "big", 1, self.a.timeout)
        first_step_s = round(time.time() - t0, 1)
        rank0, prog = h.wait_rank0_step(self.k, self.ns, "big", self.a.kill_step, self.a.timeout)
        victims = [p["metadata"]["name"] for p in h.trainer_pods(self.k, self.ns, "big")
                   if h.running(p) and p["metadata"]["name"] != rank0][-2:]
        killed_at = time.time()
        self.k("delete", "pod", *victims, "-n", self.ns, "--grace-period=0", "--force", "--wait=false")
        h.log(f"killed {victims} of big at step {prog['step']} (rank 0 is {rank0})")
        since = float("-inf")
        try:
            rec = h.recovery_after(self.k, self.ns, "big", killed_at, timeout=self.a.timeout)
            self.faults["two_pods"] = {"pods": victims, "step": prog["step"], **recovery_record(rec)}
            since = rec.restored_at
            h.log(f"  resumed from step {rec.resumed_from} ({rec.source}) {rec.seconds} s after the kill")
            _, prog = h.wait_rank0_step(self.k, self.ns, "big", rec.resumed_from + self.a.gap_steps, self.a.timeout)
            killed_at = h.kill_pod(self.k, self.ns, "big-rdzv")
            h.log(f"killed big-rdzv at step {prog['step']}")
            rec = h.recovery_after(self.k, self.ns, "big", killed_at, timeout=self.a.timeout, since=since,
                                   previous=True)  # the trainers restart in place: their earlier lines are there
            self.faults["store"] = {"pods": ["big-rdzv"], "step": prog["step"], **recovery_record(rec)}
            h.log(f"  resumed from step {rec.resumed_from} ({rec.source}) {rec.seconds} s after the kill")
        except AssertionError as e:
            for fault in ("two_pods", "store"):
                self.faults.setdefault(fault, recovery_record(None, str(e)[:300]))
            h.log(f"  no recovery: {e}")
        phases, digests, restarts = {}, {}, {}
        for name in ("ref", "big"):
            try:
                st = h.wait_phase(self.k, self.ns, name, "Succeeded", self.a.timeout)
            except AssertionError as e:
                h.log(f"{name} did not succeed: {e}")
                st = h.status(self.k, self.ns, name)
            phases[name], restarts[name] = st.get("phase"), st.get("restarts")
            digests[name] = sorted({e.fields.get("weights_sha256") for e in
                                    h.job_events(self.k, self.ns, name, previous=True) if e.event == "final"})
        ref, big = digests["ref"], digests["big"]
        return {
            "nodes": self.a.nodes, "nproc_per_node": 1, "epochs": epochs_for(self.a), "step_delay_s": self.a.step_delay,
            "first_step_s": first_step_s, "faults": self.faults, "phases": phases, "restarts": restarts,
            "digests": digests, "bitwise_equal": len(ref) == 1 and ref == big,
            "steps_lost_max": max((f["steps_lost"] for f in self.faults.values() if f.get("steps_lost") is not None),
                                  default=None),
            "recovery_s": {n: f.get("recovery_s") for n, f in self.faults.items()},
            "wall_s": round(time.time() - t0, 1),
        }


def main() -> int:
    a = parse_args()
    with h.bench_namespace("bench-largest-job") as (k, _, ns):
        result = Bench(a, k, ns).run()
    return results.emit_judged("largest_job", result, goals_missed(result), mode="quick" if a.quick else "full",
                               record=a.record)


if __name__ == "__main__":
    sys.exit(main())
