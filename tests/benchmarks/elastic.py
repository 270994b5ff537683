#!/usr/bin/env python3
"""Elastic resize and recovery on a real cluster (`make bench-elastic`).

    tests/benchmarks/elastic.py [--cycles 2] [--quick] [--step-delay 0.1] [--record]

An elastic digits DDPJob (minNodes 1, maxNodes 3, nodes 2) goes through --cycles cycles of: a training pod other
than rank 0's killed at its desired size 2, then `kubectl scale` 2 -> 1 (down), 1 -> 2 (up), 2 -> 3 (up), 3 -> 2
(down). The same cycles run on a second elastic job with `spec.torchrun.rdzvBackend: c10d` (torch's own rendezvous,
which waits `lastCallTimeoutSeconds` once minNodes joined: the baseline, same run), and the same kill --cycles times
on a fixed-size job (nodes 2 = minNodes = maxNodes) as the bound for the elastic kill. One job at a time.

Measured (tests/benchmarks/rounds.py defines each measure, the e2e test uses the same):
- resize: the scale call -> rank 0's 5th training step in a group formed after it at the new size, the size the
  trainers' own `event=session` lines report (`resize_s_p50`: {"down", "up"});
- kill recovery: the kill -> the first training step after the resume (harness.recovery_after), elastic and fixed;
- re-forms and world-size changes per kill: rank 0's `event=session` lines from the kill until 5 steps at the desired
  size again; steps lost: ddp_trainer.testing.steps_lost (harness.recovery_after), on kills and resizes;
- failures counted by a resize: status.restarts and the counted status.attempts, before and after (a resize is no
  failure).

Goals (judged by goals_missed, results.emit_judged; exit 1 when one is missed): every resize reached its new size and
counted no failure, resize p50 <= 5 s each way, the elastic kill's recovery p50 within 1 s of the fixed job's, 1
re-form and 0 world-size changes per kill, steps lost <= 1. The baseline's figures are reported, not judged.
The last line is one JSON object: resize_s_p50, elastic_kill_recovery_s_p50, fixed_kill_recovery_s_p50,
reforms_per_kill, world_size_changes_per_kill, steps_lost_max, resize_failures_counted, baseline {the same for
rdzvBackend c10d}, detail, goals_missed. --record also writes docs/bench/elastic.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks import results, rounds  # noqa: E402
from tests.e2e import harness as h  # noqa: E402

STEPS_AT_SIZE = 5  # a resize or a kill is done at the 5th step of rank 0 at the size wanted
CYCLE = [("kill", 2), ("scale", 1), ("scale", 2), ("scale", 3), ("scale", 2)]  # from nodes 2
MIN_NODES, MAX_NODES, NODES = 1, 3, 2
GOAL_RESIZE_S, GOAL_KILL_VS_FIXED_S = 5.0, 1.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cycles", type=int, default=2, help="cycles of a kill and four resizes per elastic job")
    p.add_argument("--quick", action="store_true", help="one cycle (smoke test)")
    p.add_argument("--step-delay", type=float, default=0.1, help="seconds of sleep per training step")
    p.add_argument("--gap-steps", type=int, default=5, help="training steps after one measure before the next act")
    p.add_argument("--timeout", type=float, default=120, help="seconds allowed for one resize or recovery")
    p.add_argument("--baseline-backend", default="c10d", help="spec.torchrun.rdzvBackend of the baseline job")
    results.add_record_arg(p)
    a = p.parse_args()
    if a.quick:
        a.cycles = 1
    return a


class Bench:
    def __init__(self, a: argparse.Namespace, k: h.Kubectl, ns: str):
        self.a, self.k, self.ns = a, k, ns
        self.restored_at: dict[str, float] = {}  # job -> its last restore (the `since` of its next recovery)

    def apply(self, name: str, *, fixed: bool, backend: str | None) -> None:
        torchrun = {"rdzvBackend": backend} if backend else {}
        lo, hi = (NODES, NODES) if fixed else (MIN_NODES, MAX_NODES)
        job = h.digits_job(name, nodes=NODES, min_nodes=lo, max_nodes=hi, step_delay=self.a.step_delay, epochs=200,
                           env={"DIGITS_PATIENCE": "0"},  # never stop early: the acts need steps; deleted after
                           spec={"failurePolicy": {"backoffLimit": 4 * self.a.cycles + 4},
                                 **({"torchrun": torchrun} if torchrun else {})})
        h.apply(self.k, self.ns, job)
        h.log(f"{self.ns}/{name} applied ({'fixed' if fixed else 'elastic'}, rdzvBackend {backend or 'default'})")

    def _events(self, job: str) -> list[h.Event]:
        return h.job_events(self.k, self.ns, job)

    def _at_size(self, job: str, after: float, size: int) -> float:
        def check():
            st = h.status(self.k, self.ns, job)
            if st.get("phase") in ("Failed", "Succeeded"):
                raise h.PhaseError(f"{self.ns}/{job} ended {st.get('phase')}: {st.get('message')}")
            return rounds.nth_step_at_size(self._events(job), after, size, STEPS_AT_SIZE)
        return h.wait_for_or_raise(check, self.a.timeout, f"{job}: {STEPS_AT_SIZE} steps at world size {size}",
                                   h.PhaseError, interval=0.5)

    def _next(self, job: str) -> tuple[str, dict]:
        """Wait --gap-steps past rank 0's current step (a fresh snapshot at this size), then return rank 0."""
        _, prog = h.wait_rank0_step(self.k, self.ns, job, 1, self.a.timeout)
        return h.wait_rank0_step(self.k, self.ns, job, prog["step"] + self.a.gap_steps, self.a.timeout)

    def act(self, job: str, what: str, to: int, size: int) -> dict:
        """One kill (at `size`, back to `to` == size) or one `kubectl scale` from `size` to `to`."""
        rank0, prog = self._next(job)
        failures = rounds.counted_failures(h.status(self.k, self.ns, job))
        rec: dict = {"job": job, "act": what, "from": size, "to": to, "step": prog["step"]}
        if what == "kill":
            victim = next(p["metadata"]["name"] for p in h.trainer_pods(self.k, self.ns, job)
                          if h.running(p) and p["metadata"]["name"] != rank0)
            t = h.kill_pod(self.k, self.ns, victim)
            rec["pod"] = victim
        else:
            t = time.time()
            self.k("scale", f"ddpj/{job}", "-n", self.ns, f"--replicas={to}")
            rec["direction"] = "down" if to < size else "up"
        try:
            r = h.recovery_after(self.k, self.ns, job, t, timeout=self.a.timeout,
                                 since=self.restored_at.get(job, float("-inf")))
            self.restored_at[job] = r.restored_at
            done = self._at_size(job, t, to)
            reforms = rounds.Reforms.of(self._events(job), t, size)
            rec.update(recovery_s=r.seconds, steps_lost=r.steps_lost, source=r.source,
                       at_size_s=round(done - t, 2), reforms=reforms.count,
                       world_size_changes=reforms.world_size_changes, sizes=list(reforms.sizes),
                       failures_counted=rounds.counted_failures(h.status(self.k, self.ns, job)) - failures)
        except AssertionError as e:
            rec.update(recovery_s=None, at_size_s=None, error=str(e)[:300])
        h.log(f"  {job}: {what} {size} -> {to}: " + ", ".join(f"{k} {rec.get(k)}" for k in
              ("recovery_s", "at_size_s", "reforms", "sizes", "steps_lost", "failures_counted")))
        return rec

    def run_job(self, name: str, *, fixed: bool, backend: str | None) -> list[dict]:
        self.apply(name, fixed=fixed, backend=backend)
        h.wait_rank0_step(self.k, self.ns, name, 1, 300)
        out = []
        try:
            for _ in range(self.a.cycles):
                size = NODES
                for what, to in ([("kill", NODES)] if fixed else CYCLE):
                    rec = self.act(name, what, to, size)
                    out.append({**rec, "variant": "fixed" if fixed else (backend or "default")})
                    if rec.get("at_size_s") is None:
                        return out  # a job that did not reach its size measures nothing more
                    size = to
        finally:
            self.k("delete", "ddpj", name, "-n", self.ns, "--wait=false", check=False)
        return out


def _p50(recs: list[dict], key: str) -> float | None:
    return h.p50(results.measured([r.get(key) for r in recs]))


def _per(recs: list[dict], key: str) -> float | None:
    """The mean of `key` over `recs` (per kill); None when one was not measured."""
    values = [r.get(key) for r in recs]
    return None if not values or None in values else round(sum(values) / len(values), 2)


def figures(detail: list[dict], variant: str, fixed: list[dict]) -> dict:
    """The judged figures of one elastic job's acts (`variant`), against the fixed job's kills."""
    mine = [r for r in detail if r["variant"] == variant]
    kills = [r for r in mine if r["act"] == "kill"]
    resizes = [r for r in mine if r["act"] == "scale"]
    lost = results.measured([r.get("steps_lost") for r in mine])
    counted = results.measured([r.get("failures_counted") for r in resizes])
    return {
        "resize_s_p50": {d: _p50([r for r in resizes if r["direction"] == d], "at_size_s") for d in ("down", "up")},
        "elastic_kill_recovery_s_p50": _p50(kills, "recovery_s"),
        "fixed_kill_recovery_s_p50": _p50(fixed, "recovery_s"),
        "reforms_per_kill": _per(kills, "reforms"),
        "world_size_changes_per_kill": _per(kills, "world_size_changes"),
        "steps_lost_max": max(lost) if lost else None,
        "resizes": len(resizes),
        "resizes_done": sum(1 for r in resizes if r.get("at_size_s") is not None),
        "kills": len(kills),
        "resize_failures_counted": sum(counted) if len(counted) == len(resizes) else None,
    }


def result(detail: list[dict], baseline_backend: str, step_delay: float, loadavg: list[float] | None = None) -> dict:
    fixed = [r for r in detail if r["variant"] == "fixed"]
    return {
        **figures(detail, "default", fixed),
        "baseline": {"rdzvBackend": baseline_backend, **figures(detail, baseline_backend, fixed)},
        "goal": {"resize_s_p50": GOAL_RESIZE_S, "elastic_kill_vs_fixed_s": GOAL_KILL_VS_FIXED_S,
                 "reforms_per_kill": 1, "world_size_changes_per_kill": 0, "steps_lost_max": 1,
                 "resize_failures_counted": 0},
        "step_delay_s": step_delay,
        **({"loadavg_1m": loadavg} if loadavg else {}),  # the machine's load at the start and the end
        "detail": detail,
    }


def goals_missed(r: dict) -> list[str]:
    """The default (auto) job's goals ([]: all held); the baseline is reported, never judged."""
    out = results.goal(r["resizes"] > 0 and r["resizes_done"] == r["resizes"], "resizes_done",
                       f"{r['resizes_done']}/{r['resizes']}", "every resize trains at its new size")
    for d in ("down", "up"):
        v = r["resize_s_p50"].get(d)
        out += results.goal(v is not None and v <= GOAL_RESIZE_S, f"resize_s_p50.{d}", v, f"<= {GOAL_RESIZE_S:g} s")
    out += results.goal(r["resize_failures_counted"] == 0, "resize_failures_counted", r["resize_failures_counted"],
                        "0 (a resize is no failure)")
    e, f = r["elastic_kill_recovery_s_p50"], r["fixed_kill_recovery_s_p50"]
    out += results.goal(e is not None and f is not None and e <= f + GOAL_KILL_VS_FIXED_S,
                        "elastic_kill_recovery_s_p50", e, f"<= fixed_kill_recovery_s_p50 ({f}) + "
                                                          f"{GOAL_KILL_VS_FIXED_S:g} s")
    out += results.goal(r["kills"] > 0 and r["reforms_per_kill"] == 1, "reforms_per_kill", r["reforms_per_kill"], "1")
    out += results.goal(r["world_size_changes_per_kill"] == 0, "world_size_changes_per_kill",
                        r["world_size_changes_per_kill"], "0")
    out += results.goal(r["steps_lost_max"] is not None and r["steps_lost_max"] <= 1, "steps_lost_max",
                        r["steps_lost_max"], "<= 1")
    return out


def main() -> int:
    a = parse_args()
    load = [round(os.getloadavg()[0], 2)]
    detail: list[dict] = []
    with h.bench_namespace("bench-elastic") as (k, _, ns):
        bench = Bench(a, k, ns)
        detail += bench.run_job("fixed", fixed=True, backend=None)
        detail += bench.run_job("elastic", fixed=False, backend=None)
        detail += bench.run_job(f"elastic-{a.baseline_backend}", fixed=False, backend=a.baseline_backend)
    r = result(detail, a.baseline_backend, a.step_delay, load + [round(os.getloadavg()[0], 2)])
    r["baseline"]["goals_missed"] = goals_missed(r["baseline"])  # what the baseline would miss: shown, not judged
    return results.emit_judged("elastic", r, goals_missed(r), mode="quick" if a.quick else "full", record=a.record)


if __name__ == "__main__":
    sys.exit(main())
