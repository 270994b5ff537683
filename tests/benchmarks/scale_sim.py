#!/usr/bin/env python3
"""The control plane at 1,000 nodes, simulated with kwok (`make bench-scale-sim`; issue 28, section 1).

    tests/benchmarks/scale_sim.py [--nodes 10,100,1000] [--deletes 20] [--quick] [--record]

kwok (hack/kwok.py) keeps fake Nodes Ready and moves the pods bound to them to Running without a kubelet; the
operator runs as a host process of its own (`python -m ddp_operator --namespace 'ddp-sim-*'`), so its CPU seconds
and memory are read from /proc and its probes of the fake pods' loopback IPs stay on this machine. Every simulated
DDPJob tolerates kwok's taint and selects type=kwok. Scenarios, in this order, on the same fake nodes:

  a. one DDPJob of N nodes for each N: apply -> every pod created -> every pod Running; per N the seconds, pods/s,
     the operator's creates and status writes for the job (the audit log, the job's namespace) and its CPU seconds;
     before the operator starts, the largest job's objects created by a minimal client (sim_baseline): the control
     plane's own rate for them, the figure the operator's pods/s is read against;
  b. a pod of the largest job deleted, --deletes times one after the other -> its replacement created (p50/p99);
  e. hang detection switched on for the largest job (its fake pods answer no probe; 20 of them sit on loopback
     servers that accept and never answer, on the progress and diagnostics ports): the operator's poll duration
     (its ddpjob_progress_poll_seconds histogram) and how long another job's pod replacement takes meanwhile;
  c. 50 fake nodes lost at once under the running jobs: taken from kwok, and marked as the node controller marks a
     node that stopped heart-beating (Ready Unknown; its pods Ready False), all in one go -> every pod on them
     replaced after nodeLostTimeoutSeconds (seconds from NotReady);
  f. 100 jobs x 32 nodes at once, and 1,000 one-node jobs at once: every pod created, seconds;
  d. the operator killed (SIGKILL) with every pod of the above existing -> its first correct pass after the restart
     (a pod deleted right after the restart replaced), and nothing else recreated.
--quick (the smoke test): a at N=100 and b with 5 deletes only.

Goals judged (goals_missed, outcomes only): every pod created exactly once (no name with two UIDs outside the
deletions and losses the scenarios cause), creates <= N + 3 and status writes <= 6 per clean job, every deleted pod
and every pod of a lost node replaced, nothing recreated after the restart, every fake pod IP on loopback (checked
after each scenario: the run stops at the first one that is not), and the operator's peak RSS <= 400 MiB. Timings are
reported, never judged. Everything is removed afterwards (namespaces, fake nodes, kwok). The last line is one JSON
object; exit status 1 when a goal was missed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from kubernetes import client as kclient
from kubernetes import config as kconfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hack import kwok  # noqa: E402
from tests.benchmarks import results  # noqa: E402
from tests.benchmarks.api_writes import AuditCursor  # noqa: E402
from tests.benchmarks.sim_baseline import create_as_the_operator, job_objects  # noqa: E402
from tests.benchmarks.sim_support import (  # noqa: E402
    PodWatch, SilentServers, SimOperator, kwok_raced, operator_writes, timed_listing, wait_until,
)
from tests.e2e import harness as h  # noqa: E402
from tests.support.kube import Kubectl, create_test_namespace  # noqa: E402
from tests.support.suite import SIM_NS_PREFIX  # noqa: E402

RSS_GOAL_MIB = 400
STATUS_WRITES_GOAL = 6
NODE_LOST_TIMEOUT_S = 10
# Every other scenario's jobs wait out a NotReady node this long: on a busy 2-core machine kwok may renew a fake node's
# Lease late, and a node NotReady for a few seconds must not replace pods behind a scenario's back.
CALM_NODE_LOST_TIMEOUT_S = 3600
STORM_NODES = 50
MARK_WRITERS = 16  # the node storm's status writes (the nodes' Ready Unknown, their pods' Ready False) in flight at once
SILENT_PODS = 20
PROGRESS_PORT, DIAGNOSTICS_PORT = 29401, 29402
JOB = "job"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="10,100,1000", help="the sizes N of scenario a (comma-separated)")
    p.add_argument("--deletes", type=int, default=20, help="pods deleted one after the other (scenario b)")
    p.add_argument("--many", default="100x32,1000x1,100x36", help="scenario f's rounds: JOBSxNODES, comma-separated "
                   "(the last brings the cluster past 10,000 pods for the restart, scenario d)")
    p.add_argument("--quick", action="store_true", help="N=100, 5 deletes, nothing else (smoke test)")
    p.add_argument("--kubeconfig", default="", help="another cluster than the embedded one (its API server's audit "
                                                    "log in --audit-log)")
    p.add_argument("--audit-log", type=Path, default=None)
    p.add_argument("--fake-nodes", type=int, default=0, help="fake nodes (default: the largest N, + 50 for the node "
                                                              "storm); fewer pack several pods on each, as kwok's "
                                                              "Leases cost a busy machine one write per node per 10 s")
    results.add_record_arg(p)
    a = p.parse_args(argv)
    a.sizes = sorted({int(n) for n in a.nodes.split(",") if n.strip()})
    a.rounds = [tuple(int(x) for x in r.split("x")) for r in a.many.split(",") if r.strip()]
    a.full = not a.quick
    if a.quick:
        a.sizes, a.deletes, a.rounds = [100], 5, []
    return a


def sim_job(name: str, nodes: int, **spec: object) -> dict:
    """A DDPJob whose pods go to fake nodes only; no progress polling unless `spec` turns it on."""
    key, value = kwok.MANAGED_ANNOTATION
    job = {"apiVersion": "ddp.dev/v1alpha1", "kind": "DDPJob", "metadata": {"name": name},
           "spec": {"nodes": nodes, "progressPeriodSeconds": 0,
                    "failurePolicy": {"backoffLimit": 10000, "nodeLostTimeoutSeconds": CALM_NODE_LOST_TIMEOUT_S},
                    "template": {"spec": {
                        "nodeSelector": {kwok.NODE_LABEL[0]: kwok.NODE_LABEL[1]},
                        "tolerations": [{"key": key, "operator": "Exists", "effect": "NoSchedule"}],
                        "containers": [{"name": "trainer", "image": h.TRAINER_IMAGE, "imagePullPolicy": "IfNotPresent",
                                        "command": ["python", "-m", "ddp_trainer.launch", "-m", "train"],
                                        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]}}}}
    job["spec"].update(spec)
    return job


def pod_names(job: str, nodes: int) -> set[str]:
    return {f"{job}-{i}" for i in range(nodes)} | {f"{job}-rdzv"}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 100)) - 1))], 3)


def slope(by_n: dict[str, float | None]) -> float | None:
    """How a cost grows per node between the smallest and the largest N measured (None: fewer than two)."""
    points = sorted((int(n), v) for n, v in by_n.items() if v is not None)
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return None
    (n0, v0), (n1, v1) = points[0], points[-1]
    return round((v1 - v0) / (n1 - n0), 4)


def poll_histogram(text: str) -> dict[float, float]:
    """The operator's ddpjob_progress_poll_seconds histogram: cumulative counts by upper bound (+Inf as inf)."""
    out = {}
    for m in re.finditer(r'^ddpjob_progress_poll_seconds_bucket\{le="([^"]+)"\} ([0-9.e+]+)$', text, re.M):
        out[float("inf") if m.group(1) == "+Inf" else float(m.group(1))] = float(m.group(2))
    return out


def slowest_poll(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The upper bound of the slowest bucket any poll fell in between two readings of the histogram (None: no poll,
    or no histogram)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    return next(b for b, c in zip(bounds, counts) if c >= counts[-1])


class Sim:
    """The run's shared state: kubectl, the operator, the audit log, one watch per namespace, the result."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        if a.kubeconfig:
            self.kubeconfig, self.audit = a.kubeconfig, a.audit_log
        else:
            cluster = h.connect()
            if not cluster.embedded:
                raise SystemExit("the kwok simulation runs against the embedded cluster (hack/kwok.py), or --kubeconfig")
            self.kubeconfig, self.audit = str(cluster.kubeconfig), h.embedded.audit_log()
        self.k = Kubectl(self.kubeconfig)
        self.run_audit = AuditCursor(self.audit)
        self.core = kclient.CoreV1Api(kconfig.new_client_from_config(config_file=self.kubeconfig))
        self.op = SimOperator(self.kubeconfig)
        self.watches: dict[str, PodWatch] = {}
        self.replaced_ok: set[str] = set()  # uids the scenarios removed on purpose (their names may come back)

    def namespace(self, label: str) -> str:
        ns = create_test_namespace(self.k, f"{SIM_NS_PREFIX}{label}-{secrets.token_hex(3)}")
        w = PodWatch(self.kubeconfig, ns)
        w.start()
        self.watches[ns] = w
        return ns

    def drop(self, ns: str) -> None:
        """Namespace `ns` deleted and gone, and forgotten by the run."""
        self.watches.pop(ns).stop()
        self.k("delete", "namespace", ns, "--timeout=300s", timeout=320)

    def create(self, ns: str, jobs: list[dict]) -> None:
        for start in range(0, len(jobs), 200):
            text = json.dumps({"apiVersion": "v1", "kind": "List", "items": jobs[start:start + 200]})
            self.k("create", "-n", ns, "-f", "-", input=text, timeout=600)

    def phase(self, ns: str, job: str) -> str | None:
        return (self.k.json("get", "ddpj", job, "-n", ns).get("status") or {}).get("phase")

    def check_loopback(self) -> list[str]:
        """Every fake pod IP seen that is not a loopback address; the run stops at the first."""
        bad = sorted({f"{ns}/{w.names[u]}={ip}" for ns, w in self.watches.items() for u, ip in w.ips().items()
                      if not kwok.is_loopback(ip)})
        if bad:
            raise SystemExit(f"network rule broken: fake pod IPs outside 127.0.0.0/8: {bad[:5]}")
        return bad

    def duplicates(self) -> tuple[list[str], list[str]]:
        """(names seen with two UIDs where no scenario removed the first, those of them kwok deleted right after their
        create: sim_support.kwok_raced, not counted as duplicates)."""
        out, raced = [], kwok_raced(self.run_audit.events())
        for ns, w in self.watches.items():
            for name, uids in w.uids_by_name().items():
                if len([u for u in uids[:-1] if u not in self.replaced_ok]) > 0:
                    out.append(f"{ns}/{name}")
        return sorted(n for n in out if n not in raced), sorted(n for n in out if n in raced)


# --- scenarios ---------------------------------------------------------------------------------------------------

def one_job(sim: Sim, n: int) -> tuple[str, dict]:
    """Scenario a at size n: its namespace and figures."""
    ns = sim.namespace(f"n{n}")
    w = sim.watches[ns]
    cursor = AuditCursor(sim.audit)
    cpu0 = sim.op.cpu_seconds()
    t0 = time.time()
    sim.create(ns, [sim_job(JOB, n)])
    timeout = 120 + n * 0.5
    t_created = wait_until(lambda: w.count(JOB) >= n + 1, timeout, f"{n + 1} pods of {ns}/{JOB} created")
    t_running = wait_until(lambda: w.count(JOB, running=True) >= n + 1, timeout, f"{n + 1} pods Running")
    wait_until(lambda: sim.phase(ns, JOB) == "Running", 120, f"{ns}/{JOB} Running", interval=0.5)
    time.sleep(4)  # the last coalesced status write lands (reconciler.STATUS_COALESCE_SECONDS)
    writes = operator_writes(cursor.events(), ns)
    names = set(w.live(JOB).values())
    h.log(f"N={n}: created in {t_created - t0:.1f} s, Running in {t_running - t0:.1f} s, writes {dict(writes)}")
    return ns, {"created_s": round(t_created - t0, 2), "running_s": round(t_running - t0, 2),
                "pods_per_s": round((n + 1) / max(t_created - t0, 1e-3), 1),
                "creates": writes.get("creates", 0), "status_writes": writes.get("status_writes", 0),
                "writes": dict(sorted(writes.items())), "operator_cpu_s": round(sim.op.cpu_seconds() - cpu0, 2),
                "pods_missing": sorted(pod_names(JOB, n) - names)[:10]}


def control_plane(sim: Sim, n: int) -> dict:
    """Scenario a's baseline, before the operator starts: the same objects created by a minimal client
    (sim_baseline), "created" as in scenario a; the namespace is gone again before the next scenario."""
    ns = sim.namespace(f"base{n}")
    w = sim.watches[ns]
    children, pods = job_objects(sim_job(JOB, n), ns)
    t0 = time.time()
    requests_s = create_as_the_operator(sim.core.api_client, children, pods)
    t_created = wait_until(lambda: w.count(JOB) >= n + 1, 120 + n * 0.5, f"{n + 1} baseline pods of {ns} created")
    sim.drop(ns)
    h.log(f"baseline N={n}: the control plane created the job's objects in {t_created - t0:.1f} s without the operator")
    return {"nodes": n, "created_s": round(t_created - t0, 2), "requests_s": round(requests_s, 2),
            "pods_per_s": round((n + 1) / max(t_created - t0, 1e-3), 1)}


def replace_one(sim: Sim, ns: str, job: str, n: int, rng: random.Random) -> float | None:
    """Delete one trainer pod of `job` (kubectl, default grace): seconds until its replacement is created."""
    w = sim.watches[ns]
    live = {name: uid for uid, name in w.live(job).items()}
    name = f"{job}-{rng.randrange(n)}"
    uid = live.get(name)
    if uid is None:
        return None
    sim.replaced_ok.add(uid)
    t0 = w.delete(name)
    try:
        t1 = wait_until(lambda: any(u != uid and nm == name for u, nm in w.live(job).items()), 60,
                        f"a replacement of {ns}/{name}", interval=0.02)
    except AssertionError:
        return None
    wait_until(lambda: w.count(job, running=True) >= n + 1, 60, f"{ns}/{job} whole again", interval=0.1)
    return round(t1 - t0, 3)


def deletions(sim: Sim, ns: str, n: int, count: int) -> dict:
    """Scenario b."""
    rng = random.Random(28)
    times = [replace_one(sim, ns, JOB, n, rng) for _ in range(count)]
    done = [t for t in times if t is not None]
    h.log(f"replacements: {done}")
    return {"deleted": count, "replaced": len(done), "replacement_s": done,
            "replacement_p50_s": percentile(done, 50), "replacement_p99_s": percentile(done, 99)}


def hang_polls(sim: Sim, ns: str, n: int, other: tuple[str, int]) -> dict:
    """Scenario e: hang detection on for the largest job; the poll's duration, another job's replacement latency."""
    w = sim.watches[ns]
    trainers = sorted((name, uid) for uid, name in w.live(JOB).items() if name != f"{JOB}-rdzv")
    ips = [w.ip[uid] for _, uid in trainers[:SILENT_PODS] if uid in w.ip]
    rng = random.Random(5)
    before = [replace_one(sim, other[0], JOB, other[1], rng) for _ in range(3)]
    with SilentServers(ips, (PROGRESS_PORT, DIAGNOSTICS_PORT)) as silent:
        hist0 = poll_histogram(sim.op.metrics())
        patch = {"spec": {"progressPeriodSeconds": 5, "failurePolicy": {
            "hangTimeoutSeconds": 30, "processGroupTimeoutSeconds": 3600}}}
        sim.k("patch", "ddpj", JOB, "-n", ns, "--type=merge", "-p", json.dumps(patch))
        time.sleep(20)  # a few polls of the big job
        during = [replace_one(sim, other[0], JOB, other[1], rng) for _ in range(5)]
        time.sleep(5)
        hist1 = poll_histogram(sim.op.metrics())
        accepted = silent.accepted
    sim.k("patch", "ddpj", JOB, "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"progressPeriodSeconds": 0}}))
    polls = hist1.get(float("inf"), 0) - hist0.get(float("inf"), 0)
    done = [t for t in during if t is not None]
    base = [t for t in before if t is not None]
    h.log(f"hang polls: {polls:.0f}, slowest <= {slowest_poll(hist0, hist1)} s; other job {base} -> {done}")
    return {"hang_poll_s": slowest_poll(hist0, hist1), "polls": int(polls), "silent_pods": len(ips),
            "silent_connections": accepted, "other_job_replacement_s_before": base,
            "other_job_replacement_s_during": done,
            "other_job_delay_s": round(max(done) - max(base), 3) if done and base else None}


def node_storm(sim: Sim) -> dict:
    """Scenario c: STORM_NODES fake nodes taken from kwok at once under the running jobs."""
    pods_on: dict[str, tuple[str, str]] = {}  # uid -> (namespace, name)
    by_node: dict[str, int] = {}
    for ns, w in sim.watches.items():
        for uid, name in w.live().items():
            node = w.node.get(uid)
            if node:
                by_node[node] = by_node.get(node, 0) + 1
    nodes = sorted(by_node, key=lambda nd: (-by_node[nd], nd))[:STORM_NODES]
    for ns, w in sim.watches.items():
        for uid, name in w.live().items():
            if w.node.get(uid) in nodes:
                pods_on[uid] = (ns, name)
    sim.replaced_ok.update(pods_on)
    storm = {"spec": {"failurePolicy": {"nodeLostTimeoutSeconds": NODE_LOST_TIMEOUT_S}}}
    for ns, job in sorted({(ns, sim.watches[ns].jobs[uid]) for uid, (ns, _) in pods_on.items()}):
        sim.k("patch", "ddpj", job, "-n", ns, "--type=merge", "-p", json.dumps(storm))
    kwok.unmanage(nodes)  # kwok lets them be: no stage touches them or their pods any more
    # What the node controller writes once a node stops heart-beating, written at once: Ready Unknown on the nodes,
    # Ready False on their pods (its MarkPodsNotReady). The operator's node-loss clock starts here.
    t0 = time.time()
    stamp = datetime.fromtimestamp(t0, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    unknown = {"status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
         "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}]}}
    not_ready = {"status": {"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": stamp}]}}
    # Side by side, like the controller's own workers: one after the other, 260 writes took 8.7 s of the figure.
    with ThreadPoolExecutor(MARK_WRITERS) as pool:
        list(pool.map(lambda node: sim.core.patch_node_status(node, unknown), nodes))
        list(pool.map(lambda pod: sim.core.patch_namespaced_pod_status(pod[1], pod[0], not_ready), pods_on.values()))
    h.log(f"node storm: {len(nodes)} nodes NotReady, {len(pods_on)} pods on them not Ready "
          f"({time.time() - t0:.1f} s to write)")

    def all_replaced() -> bool:
        return all(any(u != uid and nm == name for u, nm in sim.watches[ns].live().items())
                   for uid, (ns, name) in pods_on.items())
    try:
        t1 = wait_until(all_replaced, NODE_LOST_TIMEOUT_S + 120, "every pod of the lost nodes replaced", 0.2)
    except AssertionError:
        t1 = None
    replaced = sum(1 for uid, (ns, name) in pods_on.items()
                   if any(u != uid and nm == name for u, nm in sim.watches[ns].live().items()))
    kwok.manage(nodes)
    calm = {"spec": {"failurePolicy": {"nodeLostTimeoutSeconds": CALM_NODE_LOST_TIMEOUT_S}}}
    for ns, job in sorted({(ns, sim.watches[ns].jobs[uid]) for uid, (ns, _) in pods_on.items()}):
        sim.k("patch", "ddpj", job, "-n", ns, "--type=merge", "-p", json.dumps(calm))
    h.log(f"node storm: {replaced}/{len(pods_on)} pods replaced, {None if t1 is None else round(t1 - t0, 1)} s "
          f"after their nodes turned NotReady")
    return {"nodes": len(nodes), "pods": len(pods_on), "replaced": replaced,
            "node_lost_timeout_s": NODE_LOST_TIMEOUT_S, "node_storm_s": None if t1 is None else round(t1 - t0, 1)}


def many_jobs(sim: Sim, jobs: int, nodes: int) -> dict:
    """Scenario f, one round: `jobs` DDPJobs of `nodes` nodes created at once."""
    ns = sim.namespace(f"many-{jobs}x{nodes}")
    w = sim.watches[ns]
    want = jobs * (nodes + 1)
    t0 = time.time()
    sim.create(ns, [sim_job(f"j{i:04d}", nodes) for i in range(jobs)])
    t_created = wait_until(lambda: w.count() >= want, 900, f"{want} pods in {ns}", interval=0.5)
    t_running = wait_until(lambda: w.count(running=True) >= want, 900, f"{want} pods Running in {ns}", 0.5)
    h.log(f"{jobs}x{nodes}: {want} pods created in {t_created - t0:.1f} s, Running in {t_running - t0:.1f} s, "
          f"operator RSS {sim.op.rss_mib()} MiB")
    return {"jobs": jobs, "nodes": nodes, "pods": want, "pods_found": w.count(), "created_s": round(t_created - t0, 1),
            "running_s": round(t_running - t0, 1), "operator_rss_mib": sim.op.rss_mib(),
            "operator_rss_mib_max": sim.op.peak_rss_mib()}  # the peak so far: where the memory went


def restart(sim: Sim, ns: str) -> dict:
    """Scenario d: SIGKILL, start again, delete one pod at once: the first correct pass is its replacement."""
    total = sum(w.count() for w in sim.watches.values())
    before = {ns_: {n: u[-1] for n, u in w.uids_by_name().items()} for ns_, w in sim.watches.items()}
    peak_before = sim.op.peak_rss_mib()
    listing = timed_listing(sim.core)  # the control plane's part of what follows
    h.log(f"listing every labelled pod before the kill: {listing}")
    sim.op.kill()
    w = sim.watches[ns]
    probe = f"{JOB}-1"
    uid = next((u for u, nm in w.live(JOB).items() if nm == probe), None)
    t0 = time.time()
    sim.op.start()
    w.delete(probe)
    sim.replaced_ok.add(uid or "")
    t1 = wait_until(lambda: any(u != uid and nm == probe for u, nm in w.live(JOB).items()), 180,
                    "the probe pod replaced after the restart", interval=0.05)
    time.sleep(15)  # room for a wrong recreation to show
    recreated = sorted(f"{ns_}/{n}" for ns_, ws in sim.watches.items() for n, u in ws.uids_by_name().items()
                       if n in before.get(ns_, {}) and u[-1] != before[ns_][n] and not (ns_ == ns and n == probe))
    restarted_peak = round(sim.op.stat()[2], 1)
    h.log(f"restart with {total} pods: first correct pass {t1 - t0:.1f} s after the start; recreated {recreated[:5]}; "
          f"peak RSS {peak_before} MiB before the kill, {restarted_peak} MiB after the restart")
    return {"pods": total, "first_pass_s": round(t1 - t0, 2), "recreated": recreated[:20], "listing_before": listing,
            "operator_rss_mib_max_before": peak_before, "restarted_rss_mib_max": restarted_peak}


# --- the judgement -----------------------------------------------------------------------------------------------

def goals_missed(result: dict) -> list[str]:
    """Every outcome goal missed, one message each ([]: every goal held); timings are never judged."""
    out = []
    for n, r in result["by_nodes"].items():
        n_ = int(n)
        out += results.goal(not r["pods_missing"], f"by_nodes[{n}].pods_missing", r["pods_missing"], "[]")
        out += results.goal(r["creates"] <= n_ + 3, f"creates_per_job_by_nodes[{n}]", r["creates"], f"<= {n_ + 3}")
        out += results.goal(r["status_writes"] <= STATUS_WRITES_GOAL, f"status_writes_per_job_by_nodes[{n}]",
                            r["status_writes"], f"<= {STATUS_WRITES_GOAL}")
    out += results.goal(not result["duplicates"], "duplicates", result["duplicates"], "[] (every pod created once)")
    d = result.get("deletions")
    if d is not None:
        out += results.goal(d["replaced"] == d["deleted"], "deletions.replaced", d["replaced"], f"== {d['deleted']}")
    s = result.get("node_storm")
    if s is not None:
        out += results.goal(s["pods"] > 0 and s["replaced"] == s["pods"], "node_storm.replaced", s["replaced"],
                            f"== {s['pods']} (> 0: every pod of a NotReady node)")
    for r in result.get("many_jobs") or []:
        out += results.goal(r["pods_found"] == r["pods"], f"many_jobs[{r['jobs']}x{r['nodes']}].pods_found",
                            r["pods_found"], f"== {r['pods']}")
    rs = result.get("restart")
    if rs is not None:
        out += results.goal(not rs["recreated"], "restart.recreated", rs["recreated"], "[] (nothing recreated)")
    out += results.goal(not result["non_loopback_ips"], "non_loopback_ips", result["non_loopback_ips"], "[]")
    rss = result["operator_rss_mib_max"]
    out += results.goal(rss is not None and rss <= RSS_GOAL_MIB, "operator_rss_mib_max", rss,
                        f"<= {RSS_GOAL_MIB} (None: not measured, a miss)")
    return out


def summary(a: argparse.Namespace, parts: dict, sim: Sim) -> dict:
    by_n = {str(n): r for n, r in parts["by_nodes"].items()}
    duplicates, raced = sim.duplicates()
    d, e, c, rs = parts.get("deletions"), parts.get("hang"), parts.get("node_storm"), parts.get("restart")
    costs = {key: {n: r[key] for n, r in by_n.items()} for key in ("created_s", "creates", "status_writes",
                                                                   "operator_cpu_s")}
    return {
        "nodes": a.sizes,
        "pods_per_s_by_nodes": {n: r["pods_per_s"] for n, r in by_n.items()},
        "created_s_by_nodes": costs["created_s"],
        "running_s_by_nodes": {n: r["running_s"] for n, r in by_n.items()},
        "creates_per_job_by_nodes": costs["creates"],
        "status_writes_per_job_by_nodes": costs["status_writes"],
        "operator_cpu_s_by_nodes": costs["operator_cpu_s"],
        "slope_per_node": {key: slope(v) for key, v in costs.items()},
        "control_plane_pods_per_s": (parts.get("baseline") or {}).get("pods_per_s"),
        "replacement_p50_s": d and d["replacement_p50_s"], "replacement_p99_s": d and d["replacement_p99_s"],
        "node_storm_s": c and c["node_storm_s"], "hang_poll_s": e and e["hang_poll_s"],
        "other_job_delay_s": e and e["other_job_delay_s"],
        "restart_first_pass_s": rs and rs["first_pass_s"],
        "operator_rss_mib_max": sim.op.peak_rss_mib() or None, "operator_cpu_s": sim.op.cpu_seconds(),
        "goal": {"created_s at 1000": 10, "creates": "<= N + 3", "status_writes": f"<= {STATUS_WRITES_GOAL}",
                 "replacement_p99_s": 1, "node_storm_s": f"<= {NODE_LOST_TIMEOUT_S + 10}",
                 "operator_rss_mib_max": RSS_GOAL_MIB, "hang_poll_s": 10, "other_job_delay_s": 1},
        "by_nodes": by_n, "baseline": parts.get("baseline"), "deletions": d, "hang": e, "node_storm": c, "many_jobs": parts.get("many_jobs"),
        "restart": rs, "duplicates": duplicates[:20], "kwok_raced": raced[:20], "kwok_raced_count": len(raced), "non_loopback_ips": sim.check_loopback(),
        "fake_nodes": parts["fake_nodes"],
    }


def scenarios(sim: Sim, a: argparse.Namespace, parts: dict) -> dict:
    if a.full:
        parts["baseline"] = control_plane(sim, max(a.sizes))
    sim.op.start()
    spaces = {}
    for n in a.sizes:
        spaces[n], parts["by_nodes"][n] = one_job(sim, n)
        sim.check_loopback()
    big = max(a.sizes)
    parts["deletions"] = deletions(sim, spaces[big], big, a.deletes)
    sim.check_loopback()
    if a.full:
        small = min(a.sizes)
        parts["hang"] = hang_polls(sim, spaces[big], big, (spaces[small], small))
        parts["node_storm"] = node_storm(sim)
        sim.check_loopback()
        parts["many_jobs"] = [many_jobs(sim, jobs, nodes) for jobs, nodes in a.rounds]
        sim.check_loopback()
        parts["restart"] = restart(sim, spaces[big])
    return summary(a, parts, sim)


def clean(sim: Sim) -> None:
    """The operator stopped, every namespace of the run deleted and gone (kwok still runs: it removes their pods)."""
    for w in sim.watches.values():
        w.stop()
    sim.op.stop()
    for ns in sim.watches:
        sim.k("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False, timeout=120)
    try:
        wait_until(lambda: not any(sim.k("get", "namespace", ns, check=False).returncode == 0 for ns in sim.watches),
                   300, "the run's namespaces gone", interval=2)
    except AssertionError as e:
        h.log(f"{e}: the pod GC finishes it once the fake nodes are gone")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sim = Sim(a)
    h.log(f"kwok simulation: sizes {a.sizes}, {a.deletes} deletes, rounds {a.rounds}")
    sim.k("apply", "--server-side", "--force-conflicts", "--field-manager=ddp-sim", "-f", str(h.CRD_FILE))
    sim.k("wait", "--for=condition=Established", "crd/ddpjobs.ddp.dev", "--timeout=60s")
    fake = a.fake_nodes or max(a.sizes) + (STORM_NODES if a.full else 0)
    parts: dict = {"by_nodes": {}, "fake_nodes": fake}
    try:
        with kwok.fake_nodes(fake, Path(sim.kubeconfig)):
            try:
                result = scenarios(sim, a, parts)
            finally:
                clean(sim)
    except BaseException:
        print(sim.op.log_tail(80), file=sys.stderr)
        raise
    return results.emit_judged("scale_sim", result, goals_missed(result), mode="quick" if a.quick else "full",
                               record=a.record)


if __name__ == "__main__":
    sys.exit(main())
