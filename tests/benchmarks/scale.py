#!/usr/bin/env python3
"""The operator under many jobs at once, control plane only (`make bench-scale`).

    tests/benchmarks/scale.py [--jobs 200] [--nodes 1] [--quick] [--record]

Applies --jobs DDPJobs in one `kubectl apply` and measures how long the operator takes to create every
child (per job: the headless Service, the rendezvous-store pod and --nodes training pods), and the
operator's resident memory (its Prometheus process metrics), sampled throughout and reported at its peak.
Pods never run: their nodeSelector matches no node, so they stay Pending and only the operator, the API
server and the scheduler work. Everything is deleted afterwards (the namespace).

Goals (issue 4): all_children_created_s <= 30 (a timing: reported, not judged), operator_rss_mib <= 200 (judged;
not measured is a miss). Also judged: every child of every job made exactly once -- the pods and Services found at
the end are exactly the wanted counts, the NetworkPolicies one per job (or none, where the operator makes none), no
name was seen with two UIDs (the pods and Services at every poll, everything at the end) and no job's
status.attempts has an entry. The last line is one JSON object: jobs, all_children_created_s, operator_rss_mib,
goals_missed, and more; the exit status is 1 when a goal was missed.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks import results  # noqa: E402
from tests.e2e import harness as h  # noqa: E402

NOWHERE = {"ddp.dev/bench-node": "nowhere"}
RSS_GOAL_MIB = 200
CHILD_KINDS = ("pods", "services", "networkpolicies")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--nodes", type=int, default=1, help="training pods per job")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="20 jobs (smoke test)")
    results.add_record_arg(p)
    a = p.parse_args()
    if a.quick:
        a.jobs = 20
    return a


def job(i: int, nodes: int) -> dict:
    j = h.digits_job(f"s{i:04d}", nodes=nodes, progress_period=0)
    j["spec"]["template"]["spec"]["nodeSelector"] = dict(NOWHERE)
    return j


class RssSampler(threading.Thread):
    """The operator's RSS every `period` seconds, in the background."""

    def __init__(self, op: h.Operator, period: float = 2.0):
        super().__init__(daemon=True)
        self.op, self.period = op, period
        self.samples: list[float] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            rss = self.op.rss_mib()
            if rss is not None:
                self.samples.append(rss)
            self.stopped.wait(self.period)

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join(10)


class Census:
    """The UIDs seen under every child's name ("pods/<name>" -> UIDs), over every look."""

    def __init__(self, k: h.Kubectl, ns: str):
        self.k, self.ns = k, ns
        self.uids: dict[str, set[str]] = {}

    def look(self, resource: str) -> int:
        """How many `resource` (pods, services, networkpolicies) carry a job's label now; their UIDs recorded."""
        out = self.k("get", resource, "-n", self.ns, "-l", h.LABEL_JOB, "--no-headers",
                     "-o", "custom-columns=NAME:.metadata.name,UID:.metadata.uid", timeout=120).stdout
        found = [line.split()[:2] for line in out.splitlines() if line.strip()]
        for name, uid in found:
            self.uids.setdefault(f"{resource}/{name}", set()).add(uid)
        return len(found)

    def made_more_than_once(self) -> list[str]:
        return sorted(key for key, uids in self.uids.items() if len(uids) > 1)


def goals_missed(result: dict) -> list[str]:
    """Every child of every job made exactly once, and the operator's RSS within its goal ([]: all held)."""
    want, found, jobs = result["children"], result["children_found"], result["jobs"]
    out = []
    for kind in ("pods", "services"):
        out += results.goal(found[kind] == want[kind], f"children_found.{kind}", found[kind],
                            f"== {want[kind]} (every job's, once)")
    out += results.goal(found["networkpolicies"] in (0, jobs), "children_found.networkpolicies",
                        found["networkpolicies"], f"{jobs} (one per job), or 0 where the operator makes none")
    out += results.goal(not result["children_made_more_than_once"], "children_made_more_than_once",
                        result["children_made_more_than_once"], "[] (a name seen with one UID only)")
    out += results.goal(result["jobs_with_attempts"] == 0, "jobs_with_attempts", result["jobs_with_attempts"],
                        "0 (no pod ended)")
    rss = result["operator_rss_mib"]
    out += results.goal(rss is not None and rss <= RSS_GOAL_MIB, "operator_rss_mib", rss,
                        f"<= {RSS_GOAL_MIB} (None: not measured, a miss)")
    return out


def main() -> int:
    a = parse_args()
    _, k, op = h.start_operator()
    ns = h.new_namespace(k, "bench-scale")
    sampler = RssSampler(op)
    census = Census(k, ns)
    try:
        rss_before = op.rss_mib()
        sampler.start()
        want_pods, want_svcs = a.jobs * (a.nodes + 1), a.jobs
        manifests = [job(i, a.nodes) for i in range(a.jobs)]
        t0 = time.time()
        h.apply(k, ns, manifests)
        t_applied = time.time()
        h.log(f"{a.jobs} DDPJobs applied in {t_applied - t0:.1f} s; waiting for {want_pods} pods, {want_svcs} services")
        seen: tuple[int, int] = (0, 0)

        def done():
            nonlocal seen
            seen = (census.look("pods"), census.look("services"))
            return seen[0] >= want_pods and seen[1] >= want_svcs
        try:
            h.wait_for(done, a.timeout, "every child of every job", interval=0.5)
        except AssertionError:
            h.log(f"only {seen} of ({want_pods}, {want_svcs}) children after {a.timeout} s")
            raise
        t_children = time.time()

        jobs: list[dict] = []

        def all_pending():
            nonlocal jobs
            jobs = k.json("get", "ddpj", "-n", ns, timeout=120)["items"]
            return sum(1 for j in jobs if (j.get("status") or {}).get("phase")) == a.jobs
        h.wait_for(all_pending, 120, "a status on every job", interval=1.0)
        t_status = time.time()
        sampler.stop()
        rss_after = op.rss_mib()
        found = {kind: census.look(kind) for kind in CHILD_KINDS}
        samples = sampler.samples + ([rss_after] if rss_after else [])
        result = {
            "jobs": a.jobs,
            "all_children_created_s": round(t_children - t0, 1),
            "operator_rss_mib": round(max(samples), 1) if samples else None,
            "goal": {"all_children_created_s": 30, "operator_rss_mib": RSS_GOAL_MIB,
                     "children": "each made exactly once"},
            "apply_s": round(t_applied - t0, 1),
            "all_statuses_s": round(t_status - t0, 1),
            "children": {"pods": want_pods, "services": want_svcs},
            "children_found": found,
            "children_made_more_than_once": census.made_more_than_once()[:20],
            "jobs_with_attempts": sum(1 for j in jobs if (j.get("status") or {}).get("attempts")),
            "operator_rss_mib_before": round(rss_before, 1) if rss_before else None,
            "operator_rss_mib_after": round(rss_after, 1) if rss_after else None,
            "rss_samples": len(samples),
        }
    except BaseException:
        print(h.dump_namespace(k, ns)[-20000:], file=sys.stderr)
        print(op.logs(80), file=sys.stderr)
        raise
    finally:
        sampler.stop()
        # Jobs first, so the operator sees them go; then the namespace with whatever is left.
        k("delete", "ddpj", "--all", "-n", ns, "--wait=false", check=False, timeout=300)
        h.delete_namespace(k, ns, wait=True)
        op.stop()
    return results.emit_judged("scale", result, goals_missed(result), mode="quick" if a.quick else "full",
                               record=a.record)


if __name__ == "__main__":
    sys.exit(main())
