#!/usr/bin/env python3
"""Recovery of a running DDPJob from pod kills on a real cluster (`make bench-e2e-recovery`).

    tests/benchmarks/e2e_recovery.py [--kills 5] [--quick] [--step-delay 0.1]

Runs 2-node digits DDPJobs (slowed by the example's step delay) and force-deletes training pods while
they train: `--kills` times a pod that is not rank 0, then `--kills` times rank 0's pod (the pod that
serves the progress endpoint), then `--kills` times a training member of a job with `spec.spares: 1` (the
hot spare takes its place; rank 0 reports the members' pod indices). Several kills share one job, spaced by --gap-steps of training; a new job
starts when one finishes. For every kill:

- recovery: kill -> the first training step the re-formed group logs (timestamps of the trainer's
  `event=step` lines, which share the host's clock on the embedded cluster and on kind);
- steps lost: ddp_trainer.testing.steps_lost -- the highest step any surviving pod's trainer logged
  before the restore minus the step training resumed from (never clamped; None where no surviving pod
  logged a step, e.g. an image whose non-rank-0 pods log no step lines);
- survived: training resumed and the job ended Succeeded.

Exits 1 (after printing the JSON) when a kill was not survived: a failed recovery is never swallowed.
--record also writes docs/bench/e2e_recovery.json.

Goals: every kill survived, recovery p50 <= 5 s (non-rank-0 and rank 0), <= 3 s with a spare. Each kill is also split into the phases
of tests/benchmarks/recovery_phases.py (`phases`: the median seconds of each; `milestones_s`: of each milestone
after the kill). --compare / --compare-command run the same kills on jobs with other torchrun settings or another
trainer command, in the same run (`compare`).
The last line of output is one JSON object: kills, survived, recovery_s_p50, rank0_recovery_s_p50,
spare_recovery_s_p50 (spares_used: kills where the former spare became a member), phases, steps_lost_max, and
the details.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks import recovery_phases, results  # noqa: E402
from tests.e2e import harness as h  # noqa: E402

STEPS_PER_EPOCH = 20  # 2 nodes x batch 32 over the 1258 training samples


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=5, help="kills of each kind (non-rank-0, rank 0)")
    p.add_argument("--quick", action="store_true", help="one kill of each kind (smoke test)")
    p.add_argument("--step-delay", type=float, default=0.1, help="seconds of sleep per training step")
    p.add_argument("--first-kill-step", type=int, default=25, help="rank 0's step before the first kill")
    p.add_argument("--gap-steps", type=int, default=15, help="training steps after a recovery before the next kill")
    p.add_argument("--epochs", type=int, default=12, help="epochs per job (early stopping is off)")
    p.add_argument("--timeout", type=float, default=180, help="seconds allowed for one recovery")
    p.add_argument("--compare", metavar="FIELD=VALUE,...", default="",
                   help="also kill non-rank-0 pods of jobs with these spec.torchrun settings (e.g. the previous "
                        "defaults keepAliveIntervalSeconds=2,keepAliveMaxAttempts=3): a default measured against "
                        "the one it replaces in the same run")
    p.add_argument("--compare-command", metavar="COMMAND", default="",
                   help="the compared jobs' trainer command instead of the sample's (e.g. "
                        "'torchrun -m ddp_trainer.examples.digits': stock torchrun against ddp_trainer.launch; "
                        "'env DDPJOB_FORKSERVER=exec python -m ddp_trainer.launch -m ddp_trainer.examples.digits')")
    p.add_argument("--compare-target", choices=("worker", "spare"), default="worker",
                   help="what the compared jobs lose: a non-rank-0 pod, or a member of a job with spares: 1")
    results.add_record_arg(p)
    a = p.parse_args()
    if a.quick:
        a.kills, a.epochs = 1, 4
    return a


def compare_settings(text: str) -> dict[str, int]:
    """"keepAliveIntervalSeconds=2,keepAliveMaxAttempts=3" -> spec.torchrun fields."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value)
    return out


class Bench:
    def __init__(self, a: argparse.Namespace, k: h.Kubectl, op: h.Operator, ns: str):
        self.a, self.k, self.op, self.ns = a, k, op, ns
        self.jobs: list[str] = []
        self.records: list[dict] = []
        self.restored_at: dict[str, float] = {}  # job -> its last restore (the window of the next kill)

    def new_job(self, variant: str) -> str:
        name = f"rec-{len(self.jobs)}"
        spec: dict = {"failurePolicy": {"backoffLimit": 4 * self.a.kills + 4}}
        if variant == "compare" and self.a.compare:
            spec["torchrun"] = compare_settings(self.a.compare)
        if variant == "spares" or (variant == "compare" and self.a.compare_target == "spare"):
            spec["spares"] = 1
        # LOGLEVEL=INFO: torchrun's agent logs its rendezvous (recovery_phases.py reads those lines)
        job = h.digits_job(name, nodes=2, step_delay=self.a.step_delay, epochs=self.a.epochs,
                           env={"DIGITS_PATIENCE": "0", "LOGLEVEL": "INFO"},  # never stop early: kills need steps
                           spec=spec)
        if variant == "compare" and self.a.compare_command:
            trainer = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
            trainer["command"] = self.a.compare_command.split()
        h.apply(self.k, self.ns, job)
        self.jobs.append(name)
        h.log(f"{self.ns}/{name} applied ({variant})")
        return name

    def steps_left(self, step: int) -> int:
        return self.a.epochs * STEPS_PER_EPOCH - step

    def one_kill(self, job: str, target: str, variant: str, min_step: int) -> tuple[str, int]:
        """Kill one pod of `job` once rank 0 is at `min_step`; returns (job, step to wait for next)."""
        rank0, prog = h.wait_rank0_step(self.k, self.ns, job, min_step, 300)
        before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in h.trainer_pods(self.k, self.ns, job)
                  if h.running(p)}
        if target == "spare":
            # a training member other than rank 0's pod (rank 0 reports the members' pod indices): the spare
            # takes its place
            members = {f"{job}-{i}" for i in prog.get("members") or []}
            victim = next(p for p in sorted(before) if p in members and p != rank0)
        else:
            victim = rank0 if target == "rank0" else next(p for p in before if p != rank0)
        spare_before = sorted(set(before) - {f"{job}-{i}" for i in prog.get("members") or []}) \
            if prog.get("members") else []
        killed_at = h.kill_pod(self.k, self.ns, victim)
        h.log(f"killed {victim} ({target}) of {job} at step {prog['step']}")
        rec = {"job": job, "target": target, "variant": variant, "pod": victim, "step": prog["step"],
               "time": killed_at}
        try:
            r = h.recovery_after(self.k, self.ns, job, killed_at, prog["step"], self.a.timeout,
                                 since=self.restored_at.get(job, float("-inf")))
            self.restored_at[job] = r.restored_at
            if target == "spare":
                after = h.wait_rank0_step(self.k, self.ns, job, r.resumed_from + 1, 120)[1]
                members = {f"{job}-{i}" for i in after.get("members") or []}
                rec.update(spare=spare_before, members_after=sorted(members),
                           spare_used=bool(spare_before) and set(spare_before) <= members)
            rec.update(recovery_s=r.seconds, resumed_from=r.resumed_from, source=r.source, steps_lost=r.steps_lost)
            h.log(f"  resumed from step {r.resumed_from} ({r.source}) {r.seconds} s after the kill")
            rec["milestones"] = self.milestones(job, victim, before, killed_at, r, spare=target == "spare")
            rec["phases"] = recovery_phases.phases(rec["milestones"])
            h.log("  phases: " + ", ".join(f"{k} {v}" for k, v in rec["phases"].items() if v is not None))
            next_step = r.resumed_from + self.a.gap_steps
        except AssertionError as e:
            rec.update(recovery_s=None, error=str(e)[:300])
            h.log(f"  no recovery: {e}")
            next_step = 10**9
        self.records.append(rec)
        return job, next_step

    def milestones(self, job: str, victim: str, before: dict[str, str], killed_at: float,
                   r: h.Recovery, spare: bool = False) -> dict[str, float | None]:
        """The milestones of one recovery (tests/benchmarks/recovery_phases.py) as seconds after the kill."""
        pods = {p["metadata"]["name"]: p for p in h.trainer_pods(self.k, self.ns, job)}
        lines = {name: h.pod_log_lines(self.k, self.ns, name) for name in pods}
        survivors = {n: lines[n] for n, p in pods.items() if before.get(n) == p["metadata"]["uid"] and n != victim}
        new = pods.get(victim)
        replaced = new is not None and new["metadata"]["uid"] != before.get(victim) and not spare
        events = self.k.json("get", "events", "-n", self.ns, "--field-selector",
                             f"involvedObject.name={victim},reason=Scheduled")["items"]
        scheduled = [h.parse_rfc3339(e.get("eventTime") or e.get("firstTimestamp")) for e in events
                     if replaced and e["involvedObject"].get("uid") == new["metadata"]["uid"]]
        m = recovery_phases.milestones(
            kill=killed_at, restored=r.restored_at, first_step=killed_at + r.seconds, victim=victim,
            survivors=survivors, members=lines, replacement=lines.get(victim) if replaced else None,
            operator=self.op.log_lines(), scheduled=scheduled[0] if scheduled else None)
        return recovery_phases.since_kill(m)

    def run(self) -> None:
        current: dict[str, tuple[str, int]] = {}  # variant -> (its job, the step of its next kill)
        for target, variant in [("worker", "default"), ("rank0", "default"), ("spare", "spares")] + \
                ([(self.a.compare_target, "compare")] if self.a.compare or self.a.compare_command else []):
            for _ in range(self.a.kills):
                job, next_step = current.get(variant, (None, 10**9))
                if next_step >= 10**9 or self.steps_left(next_step) < self.a.gap_steps + 5:
                    job, next_step = self.new_job(variant), self.a.first_kill_step
                current[variant] = self.one_kill(job, target, variant, next_step)
        outcome = {}
        for name in self.jobs:
            try:
                st = h.wait_phase(self.k, self.ns, name, "Succeeded", 600)
                outcome[name] = ("Succeeded", st.get("restarts"), h.final_accuracy(self.k, self.ns, name))
            except AssertionError as e:
                outcome[name] = (h.status(self.k, self.ns, name).get("phase"), None, None)
                h.log(f"{name} did not succeed: {e}")
        for rec in self.records:
            rec["survived"] = rec.get("recovery_s") is not None and outcome[rec["job"]][0] == "Succeeded"
        self.outcome = outcome

    def result(self) -> dict:
        ours = [r for r in self.records if r["variant"] == "default"]
        worker = [r["recovery_s"] for r in ours if r["target"] == "worker" and r.get("recovery_s") is not None]
        rank0 = [r["recovery_s"] for r in ours if r["target"] == "rank0" and r.get("recovery_s") is not None]
        compared = [r for r in self.records if r["variant"] == "compare"]
        spared = [r for r in self.records if r["variant"] == "spares"]
        lost = [r["steps_lost"] for r in self.records if r.get("steps_lost") is not None]
        worker_lost = [r.get("steps_lost") for r in self.records if r["target"] == "worker"]
        return {
            "kills": len(self.records),
            "survived": sum(1 for r in self.records if r.get("survived")),
            "all_survived": all(r.get("survived") for r in self.records),
            "recovery_s_p50": h.p50(worker),
            "rank0_recovery_s_p50": h.p50(rank0),
            # a training member killed in a job with spec.spares: 1 (the spare takes its place)
            "spare_recovery_s_p50": h.p50([r["recovery_s"] for r in spared if r.get("recovery_s") is not None]),
            "spares_used": sum(1 for r in spared if r.get("spare_used")),
            "spare_phases": recovery_phases.medians(r["phases"] for r in spared if r.get("phases")),
            "steps_lost_max": max(lost) if lost else None,
            # rank 0 survives a worker kill, so these are always measured (None: a bug in the measuring)
            "worker_steps_lost_max": None if None in worker_lost or not worker_lost else max(worker_lost),
            "steps_lost_unmeasured": sum(1 for r in self.records if r.get("steps_lost") is None),
            "sources": sorted({r["source"] for r in self.records if r.get("source")}),
            # median seconds of each phase of a recovery, and of each milestone after the kill (recovery_phases.py)
            "phases": recovery_phases.medians(r["phases"] for r in ours if r.get("phases")),
            "milestones_s": recovery_phases.medians(r["milestones"] for r in ours if r.get("milestones")),
            **({"compare": {
                "torchrun": compare_settings(self.a.compare),
                "command": self.a.compare_command or None,
                "kills": len(compared),
                "survived": sum(1 for r in compared if r.get("survived")),
                "recovery_s_p50": h.p50([r["recovery_s"] for r in compared if r.get("recovery_s") is not None]),
                "phases": recovery_phases.medians(r["phases"] for r in compared if r.get("phases")),
            }} if compared else {}),
            "recovery_s_max": max(worker) if worker else None,
            "rank0_recovery_s_max": max(rank0) if rank0 else None,
            "goal": {"recovery_s_p50": 5, "rank0_recovery_s_p50": 5, "spare_recovery_s_p50": 3, "survived": "all"},
            "step_delay_s": self.a.step_delay,
            "jobs": {n: {"phase": p, "restarts": r, "testAccuracy": acc} for n, (p, r, acc) in self.outcome.items()},
            "detail": [{k: v for k, v in r.items() if k != "time"} for r in self.records],
        }


def main() -> int:
    a = parse_args()
    with h.bench_namespace("bench-recovery") as (k, op, ns):
        bench = Bench(a, k, op, ns)
        bench.run()
        result = bench.result()
    results.emit("e2e_recovery", result, mode="quick" if a.quick else "full", record=a.record)
    return 0 if result["all_survived"] else 1


if __name__ == "__main__":
    sys.exit(main())
