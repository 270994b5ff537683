#!/usr/bin/env python3
"""`make bench-report`: the README's Measured table and docs/recovery.md's baseline, overhead and fault
tables, from the
results the benchmarks recorded in docs/bench/<name>.json (tests/benchmarks/results.py).

    .venv/bin/python tests/benchmarks/report.py [--write | --check]

Each table sits between two marker comments (`<!-- bench-report:<block>:begin -->` ... `:end -->`);
only what lies between them is rewritten. --check (the default) exits 1 and names the blocks that differ
from what the files say; tests/unit/test_bench_report.py runs the same check.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests.benchmarks import recovery_phases, results  # noqa: E402

README = ROOT / "README.md"
RECOVERY = ROOT / "docs" / "recovery.md"
Doc = dict[str, Any]


def _n(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        value = f"{value:g}"
    return f"{value}{unit}"


def recorded(doc: Doc) -> str:
    m = doc.get("machine") or {}
    commit = (doc.get("commit") or "?")[:7] + ("+" if doc.get("dirty") else "")
    load = (doc.get("result") or {}).get("loadavg_1m")
    return (f"{doc.get('mode')}, `{commit}`, {str(doc.get('date'))[:10]}, "
            f"{m.get('cores')} cores / {_n(m.get('memory_gib'))} GiB, torch {m.get('torch')}"
            + (f", load {_n(max(load) if isinstance(load, list) else load)}" if load else ""))


def _count(doc: Doc, target: str) -> int:
    return sum(1 for d in doc["result"].get("detail", []) if d.get("target") == target)


def _survived(doc: Doc, target: str) -> int:
    return sum(1 for d in doc["result"].get("detail", []) if d.get("target") == target and d.get("survived"))


def _lost(doc: Doc, target: str) -> str:
    lost = [d.get("steps_lost") for d in doc["result"].get("detail", []) if d.get("target") == target]
    measured = [x for x in lost if x is not None]
    if not measured:
        return "steps lost not measured"
    text = f"steps lost (max) {max(measured)}"
    return text + (f" ({len(lost) - len(measured)} unmeasured)" if len(measured) < len(lost) else "")


def e2e_worker(doc: Doc) -> str:
    r = doc["result"]
    return (f"p50 {_n(r.get('recovery_s_p50'), ' s')}, max {_n(r.get('recovery_s_max'), ' s')}, "
            f"{_survived(doc, 'worker')}/{_count(doc, 'worker')} survived, {_lost(doc, 'worker')}")


def e2e_rank0(doc: Doc) -> str:
    r = doc["result"]
    return (f"p50 {_n(r.get('rank0_recovery_s_p50'), ' s')}, max {_n(r.get('rank0_recovery_s_max'), ' s')}, "
            f"{_survived(doc, 'rank0')}/{_count(doc, 'rank0')} survived, {_lost(doc, 'rank0')}")


def e2e_spare(doc: Doc) -> str:
    r = doc["result"]
    if "spare_recovery_s_p50" not in r:
        return "not recorded yet (this result predates spare kills)"
    return (f"p50 {_n(r.get('spare_recovery_s_p50'), ' s')}, {_survived(doc, 'spare')}/{_count(doc, 'spare')} "
            f"survived, the spare took the place {r.get('spares_used')}×, {_lost(doc, 'spare')}")


def trainer_recovery(doc: Doc) -> str:
    r = doc["result"]
    return (f"p50 {_n(r.get('recovery_s_p50'), ' s')}, max {_n(r.get('recovery_s_max'), ' s')}, "
            f"kills: {r.get('kills')}, {'survived' if r.get('survived') else 'did not survive'}, "
            f"steps lost (max) {_n(r.get('steps_lost_max'))}, final weights "
            f"{'bitwise equal' if r.get('bitwise_equal') else 'NOT bitwise equal'}" + _compared(r.get("compare")))


def _compared(c: dict | None) -> str:
    if not c:
        return ""
    env = ", ".join(f"`{k}={v}`" for k, v in c["env"].items())
    return f"; same run with {env}: p50 {_n(c.get('recovery_s_p50'), ' s')}"


def trainer_baseline(doc: Doc) -> str:
    r = doc["result"]
    if not r.get("baseline_survived"):
        return f"did not survive (waited {_n(r.get('baseline_waited_s'), ' s')})"
    return f"survived, {_n(r.get('baseline_recovery_s_p50'), ' s')}, steps lost {_n(r.get('baseline_steps_lost'))}"


def baselines_summary(doc: Doc) -> str:
    parts = []
    for name, c in doc["result"]["configs"].items():
        parts.append(f"{name} {c['survived']}/{c['kills']}" + (f" ({_n(c['recovery_s_p50'], ' s')})"
                                                              if c.get("recovery_s_p50") is not None else ""))
    return "survived: " + ", ".join(parts) + " — table in [docs/recovery.md](docs/recovery.md)"


def startup(doc: Doc) -> str:
    r = doc["result"]
    return (f"{_n(r.get('apply_to_running_s'), ' s')} / {_n(r.get('apply_to_first_step_s'), ' s')} "
            f"(hand-written pods: {_n(r.get('baseline_first_step_s'), ' s')}; delta {_n(r.get('delta_s'), ' s')})")


def kueue_queue(doc: Doc) -> str:
    r = doc["result"]
    return (f"apply → pods {_n(r.get('queued_pods_s'), ' s')} (no Kueue: {_n(r.get('baseline_pods_s'), ' s')}), "
            f"→ first step {_n(r.get('queued_first_step_s'), ' s')} (no Kueue: "
            f"{_n(r.get('baseline_first_step_s'), ' s')}); the waiting job's pods {_n(r.get('handoff_pods_s'), ' s')} "
            f"and first step {_n(r.get('handoff_s'), ' s')} after the running one succeeded (Kueue "
            f"{r.get('kueue_version')})")


def node_loss(doc: Doc) -> str:
    r = doc["result"]
    cases = r.get("cases") or {}
    parts = [f"{how}: {_n(c.get('recovery_s'), ' s')} (NotReady after {_n(c.get('notready_s'), ' s')}, then "
             f"{_n(c.get('after_notready_s'), ' s')}), {c.get('steps_lost')} steps lost"
             for how, c in sorted(cases.items(), key=lambda kv: kv[0] != "stop")]
    return "; ".join(parts) + f" (nodeLostTimeoutSeconds {r.get('node_lost_timeout_s')})"


def api(period_key: str) -> Callable[[Doc], str]:
    def figure(doc: Doc) -> str:
        r = doc["result"]
        at = (r.get("at_progress_period") or {}).get(str(r.get(period_key)))
        if at is None:
            return "not measured"
        return (f"{at['creates']} creates, {at['status_writes']} status writes, "
                f"{_n(at['steady_state_writes_per_min'])} writes/min while healthy + "
                f"{_n(at['progress_writes_per_min'])} progress writes/min")
    return figure


def scale(doc: Doc) -> str:
    r = doc["result"]
    return f"{r.get('jobs')} jobs: all children in {_n(r.get('all_children_created_s'), ' s')}, " \
           f"operator RSS {_n(r.get('operator_rss_mib'), ' MiB')}"


def scale_sim(doc: Doc) -> str:
    r = doc["result"]
    n = str(max(r.get("nodes") or [0]))
    return (f"{n} nodes: every pod created in {_n((r.get('created_s_by_nodes') or {}).get(n), ' s')} "
            f"({_n((r.get('pods_per_s_by_nodes') or {}).get(n))} pods/s; the control plane alone "
            f"{_n(r.get('control_plane_pods_per_s'))} pods/s), "
            f"{_n((r.get('creates_per_job_by_nodes') or {}).get(n))} creates, "
            f"{_n((r.get('status_writes_per_job_by_nodes') or {}).get(n))} status writes; a deleted pod replaced in "
            f"{_n(r.get('replacement_p99_s'), ' s')} (p99); 50 nodes lost: pods replaced {_n(r.get('node_storm_s'), ' s')} "
            f"after NotReady; hang poll ≤ {_n(r.get('hang_poll_s'), ' s')}; operator peak RSS "
            f"{_n(r.get('operator_rss_mib_max'), ' MiB')}")


def overhead(doc: Doc) -> str:
    r = doc["result"]
    spread = (f" (per-round p25–p75 {_n(r.get('ratio_p25'))}–{_n(r.get('ratio_p75'))})"
              if r.get("ratio_p25") is not None else "")
    text = (f"ratio {_n(r.get('ratio'))}{spread}, snapshot overhead {_n(r.get('snapshot_overhead_pct'), ' %')} "
            f"(one snapshot write {_n(r.get('snapshot_write_us'), ' µs')}")
    if r.get("digits_snapshot_every") is not None:
        text += f", K = {r['digits_snapshot_every']}"
    return text + ")"


def overhead_by_size(doc: Doc) -> str:
    r = doc["result"]
    by = r.get("overhead_pct_by_params") or {}
    lost = r.get("steps_lost_bound_by_params") or {}
    k = r.get("snapshot_every_by_params") or lost
    return ", ".join(f"{_params(int(n))}: {_n(pct, ' %')} (steps lost ≤ {lost.get(n)}, copies every {k.get(n)})"
                     for n, pct in by.items()) or "not measured"


def resident_commit(doc: Doc) -> str:
    models = doc["result"].get("models") or {}
    return ", ".join(f"{name if name == 'digits' else _params(m['params'])}: {_n(m.get('commit_ms'), ' ms')}"
                     for name, m in models.items()) or "not measured"


def _params(n: int) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k"


def overhead_table(bench_dir: Path) -> str:
    doc = results.load("trainer_overhead", bench_dir)
    if doc is None or not doc["result"].get("sweep"):
        return "Not recorded yet: run `make bench-overhead`."
    r = doc["result"]
    lines = ["| parameters | step without snapshots | snapshot copy | snapshot bytes | copied every K | "
             "copied per step | resident (never copied) | steps lost ≤ | overhead (CPU time, rank 0) | "
             "overhead (wall) | half the snapshot to a buddy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for z in r["sweep"]:
        resident = z.get("resident_bytes") or 0
        lines.append(f"| {z['params']:,} | {_n(z['step_ms'], ' ms')} | {_n(z['copy_ms'], ' ms')} | "
                     f"{z['snapshot_bytes'] / 2**20:.1f} MiB | {z['k']} | {z['bytes_per_step'] / 2**20:.2f} MiB | "
                     f"{f'{resident / 2**20:.1f} MiB' if z.get('resident') else 'off'} | "
                     f"{z.get('steps_lost_bound', z['k'])} | "
                     f"{_n(z['overhead_pct'], ' %')} | {_n(z.get('wall_overhead_pct'), ' %')} | "
                     f"{_n(z.get('buddy_transfer_ms'), ' ms')} |")
    lines.append("")
    lines.append(f"Recorded by `make bench-overhead`: {recorded(doc)}; budget {_n(r.get('snapshot_budget_pct'))} %; "
                 f"medians of paired rounds (a segment of whole K-cycles without, then with snapshots); "
                 f"snapshot copy: its cost to training (save point + CPU time of the background copy, K's "
                 f"input); overhead in CPU time of rank 0, whose pod writes the snapshot (writer thread "
                 f"included), and in wall time, which other processes' load on this shared machine swings "
                 f"by tens of percent per round; the "
                 f"snapshot read back equalled the live state at every size: "
                 f"{'yes' if all((r.get('snapshot_exact_by_params') or {}).values()) else 'NO'}"
                 + (f", and so did the resident state where it was on: "
                    f"{'yes' if all(v for v in r['resident_exact_by_params'].values() if v is not None) else 'NO'}"
                    f" (off where the trial found its commits too dear for the step); the optimizer "
                    f"step on resident tensors vs process memory (median, p25–p75 of paired rounds): "
                    + ", ".join(f"{_params(z['params'])} {_n(z.get('resident_vs_anonymous_pct'), ' %')}"
                                + (f" ({z['resident_vs_anonymous_pct_iqr'][0]}–{z['resident_vs_anonymous_pct_iqr'][1]})"
                                   if z.get("resident_vs_anonymous_pct_iqr") else "")
                                for z in r["sweep"] if z.get("resident"))
                    if r.get("resident_exact_by_params") else "")
                 + f". Digits "
                 f"(full vs bare DDP loop): ratio {_n(r.get('ratio'))}, per-round p25–p75 "
                 f"{_n(r.get('ratio_p25'))}–{_n(r.get('ratio_p75'))}, K = {_n(r.get('digits_snapshot_every'))}.")
    return "\n".join(lines)


# The faults `make bench-faults` injects (tests/benchmarks/faults.py), in its order: how each is injected and
# what DDPJob is designed to do about it. Whether it did is in the measured columns next to it.
FAULT_ROWS: list[tuple[str, str, str]] = [
    ("store_loss", "`kubectl delete pod <job>-rdzv --force --grace-period=0`",
     "the operator recreates the store pod and keeps every trainer pod; the agents re-rendezvous against the "
     "new store and the workers restore from their own `/dev/shm` snapshots"),
    ("agent_kill", "SIGKILL of pod 1's torchrun agent (from the host)",
     "the container fails and is restarted in place (`restartPolicy: OnFailure`), keeping its `/dev/shm` "
     "snapshot; the group re-forms and restores from it or from the peer"),
    ("worker_kill", "SIGKILL of one worker process of pod 1",
     "torchrun's agent restarts its workers (`--max-restarts`); every rank restores from its own snapshot"),
    ("hang", "SIGSTOP of one worker process of pod 1, `failurePolicy.hangTimeoutSeconds: 20`",
     "rank 0's step unchanged for 20 s: the operator probes every pod, deletes the stuck one (attempt reason "
     "`Hang`) and the others restore from peer snapshots"),
    ("operator_kill", "force-delete pod 1, 1 s later the operator's pod",
     "the Deployment starts a new operator; reconciliation is level-based, so it replaces pod 1 once, counts "
     "the failure once and never runs two pods for one index; the survivor's snapshot is broadcast"),
    ("apiserver_restart", "`hack/cluster.py restart apiserver` mid-job",
     "training never talks to the API server and carries on; the operator's watches reconnect without the "
     "operator restarting"),
    ("node_notready", "`hack/cluster.py stop kubelet`, 90 s, `start kubelet`",
     "after `failurePolicy.nodeLostTimeoutSeconds` NotReady (default 60 s; the benchmark sets 20 s so that the "
     "operator acts while the kubelet is still down) the pods on the node are treated as lost "
     "and replaced. On a one-node cluster that is every pod of the job at once: no peer is left to hold a "
     "snapshot, so training resumes from a disk checkpoint (`spec.checkpoint`) or starts over"),
    ("evict_all", "every trainer pod evicted at once (the eviction API, as `kubectl drain` does; the pods' grace "
     "period), a checkpoint volume whose periodic checkpoint never comes",
     "SIGTERM in each pod: every rank finishes the step in progress and starts no other; global rank 0 (its agent, "
     "if its worker died first) writes a checkpoint of its last save point and the high-water mark beside it; the "
     "operator records the evictions as disruptions (no `backoffLimit`) and recreates the pods, which resume from "
     "that checkpoint (`status.lastRecovery`: `resumedFrom: disk`, `stepsLost` ≤ 1; docs/recovery.md, \"Checkpoint "
     "on eviction\")"),
]


def _fault_cell(r: dict | None) -> tuple[str, str, str, str, str]:
    if r is None:
        return "not run", "—", "—", "—", "—"
    # goodput: the ratio faults.py recorded (the job's status.goodput.ratio at its end); a dash where a result
    # predates it
    return ("yes" if r.get("survived") else "**no**", _n(r.get("recovery_s"), " s"), _n(r.get("steps_lost")),
            r.get("resumed_from") or "not restarted", _n(r.get("goodput")))


def faults_table(bench_dir: Path) -> str:
    doc = results.load("faults", bench_dir)
    if doc is None:
        return "Not recorded yet: run `make bench-faults`."
    r = doc["result"]
    lines = ["| fault | injected by | what DDPJob is designed to do (issue 8; the measured columns say whether it did) | survived | injection → first resumed step | steps lost "
             "| resumed from | goodput |", "|---|---|---|---|---|---|---|---|"]
    for fault, how, what in FAULT_ROWS:
        survived, rec, lost, source, goodput = _fault_cell(r.get(fault))
        lines.append(f"| `{fault}` | {how} | {what} | {survived} | {rec} | {lost} | {source} | {goodput} |")
    n = sum(1 for f, *_ in FAULT_ROWS if f in r)
    ok = sum(1 for f, *_ in FAULT_ROWS if (r.get(f) or {}).get("survived"))
    lines.append("")
    lines.append(f"Recorded by `make bench-faults`: {recorded(doc)}; {ok}/{n} faults survived; operator "
                 f"{r.get('operator')}; step delay {_n(r.get('step_delay_s'), ' s')}; one fresh 2-node digits job "
                 f"per fault on a {(r.get('detail') or {}).get('node_notready', {}).get('nodes', '?')}-node "
                 f"cluster. Survived: the job Succeeded, the fault's checks held and at most one step was lost "
                 f"(node_notready on one node: Succeeded alone). \"not restarted\": training was never "
                 f"interrupted, nothing was lost. Goodput: the job's `status.goodput.ratio` at its end, the share of "
                 f"its run that made new progress ([Goodput](#goodput-what-the-failures-cost)); — where not recorded.")
    nr = (r.get("detail") or {}).get("node_notready") or {}
    if "kubelet_stopped_s" in nr:
        lines[-1] += (f" node_notready: the node was marked NotReady {_n(nr.get('notready_after_s'), ' s')} after the "
                      f"kubelet stopped, the kubelet ran again after {_n(nr.get('kubelet_stopped_s'), ' s')}; the "
                      f"operator {'recorded' if nr.get('operator_acted') else 'recorded no'} failure "
                      f"(status.attempts) for the job.")
    return "\n".join(lines)


def elastic(doc: Doc) -> str:
    r = doc["result"]
    b = r.get("baseline") or {}

    def side(x: dict) -> str:
        resize = x.get("resize_s_p50") or {}
        return (f"resize down {_n(resize.get('down'), ' s')} / up {_n(resize.get('up'), ' s')}, kill "
                f"{_n(x.get('elastic_kill_recovery_s_p50'), ' s')} ({_n(x.get('reforms_per_kill'))} re-form, "
                f"{_n(x.get('world_size_changes_per_kill'))} size changes per kill)")
    return (f"{side(r)}; fixed-size kill {_n(r.get('fixed_kill_recovery_s_p50'), ' s')}; steps lost (max) "
            f"{_n(r.get('steps_lost_max'))}; `rdzvBackend: {b.get('rdzvBackend')}` same run: {side(b)}")


def rdzv_scale(doc: Doc) -> str:
    r = doc["result"]
    by_n = r.get("reform_s_by_agents") or {}
    ops = r.get("store_ops_per_agent_by_agents") or {}
    agents = sorted(int(n) for n in by_n)
    shown = [n for n in agents if any(v is not None for v in by_n[str(n)].values())]
    if not shown:
        return "no round re-formed"
    n = str(shown[-1])
    head = "" if shown[-1] == agents[-1] else f"{agents[-1]} agents: no round formed on this machine (see the page); "
    return (head + f"{n} agents: " + "; ".join(
        f"`{run}` " + (f"{_n(s, ' s')}, {_n(ops[n].get(run))} store ops per agent" if s is not None else "did not form")
        for run, s in by_n[n].items()) + " — [docs/scale.md](docs/scale.md#the-rendezvous-at-512-agents)")


def largest_job(doc: Doc) -> str:
    r = doc["result"]
    faults = r.get("faults") or {}

    def fault(name: str, what: str) -> str:
        f = faults.get(name) or {}
        if not f.get("recovered"):
            return f"{what}: not survived"
        return (f"{what}: resumed in {_n(f.get('recovery_s'), ' s')} from step {_n(f.get('resumed_from'))} "
                f"({f.get('source')}), {_n(f.get('steps_lost'))} lost")
    phases = r.get("phases") or {}
    return (f"{r.get('nodes')} pods: " + "; ".join((fault("two_pods", "two pods at once"), fault("store", "store pod")))
            + f"; {'Succeeded' if phases.get('big') == 'Succeeded' else phases.get('big')}, weights "
            + ("bitwise equal to the uninterrupted job's" if r.get("bitwise_equal") else "**not** bitwise equal"))


def faults_summary(doc: Doc) -> str:
    r = doc["result"]
    names = [f for f, *_ in FAULT_ROWS if f in r]
    failed = [f for f in names if not r[f].get("survived")]
    goodput = min(((r[f]["goodput"], f) for f in names if r[f].get("goodput") is not None), default=None)
    return (f"{len(names) - len(failed)}/{len(names)} survived" + (f" (not: {', '.join(failed)})" if failed else "")
            + (f", goodput ≥ {_n(goodput[0])} ({goodput[1]})" if goodput else "")
            + " — table in [docs/recovery.md](docs/recovery.md#every-fault-once)")


# (what, benchmark file, figure, goal, command)
ROWS: list[tuple[str, str, Callable[[Doc], str], str, str]] = [
    ("non-rank-0 pod killed → first resumed step (on the cluster)", "e2e_recovery", e2e_worker, "≤ 5 s",
     "make bench-e2e-recovery"),
    ("rank 0's pod killed → first resumed step", "e2e_recovery", e2e_rank0, "≤ 5 s", "make bench-e2e-recovery"),
    ("a training member killed in a job with `spec.spares: 1` → first resumed step", "e2e_recovery", e2e_spare,
     "≤ 3 s", "make bench-e2e-recovery"),
    ("same, agents on loopback (`ddp_trainer.launch`, store process), node killed, replacement at once",
     "trainer_recovery", trainer_recovery, "≤ 2 s",
     "make bench-trainer-recovery"),
    ("stock torchrun (default environment) + checkpoint-every-10 script, same kill", "trainer_recovery",
     trainer_baseline, "", "make bench-trainer-recovery"),
    ("stock torchrun set up as a skilled user would, same kill (5 configurations)", "baselines",
     baselines_summary, "", "make bench-baselines"),
    ("elastic job (1..3 nodes): `kubectl scale` → 5 steps at the new size (p50), a pod killed at the desired size "
     "→ first resumed step", "elastic", elastic, "resize ≤ 5 s, kill ≤ fixed + 1 s, 1 re-form and 0 size changes "
     "per kill, ≤ 1 step lost", "make bench-elastic"),
    ("`kubectl apply` → pods Running / → first step", "startup", startup, "delta ≤ 2 s", "make bench-startup"),
    ("behind a real Kueue, quota for one 2-node job: queued start, and the hand-off to the job waiting behind it",
     "kueue_queue", kueue_queue, "", "make bench-kueue"),
    ("API writes, one clean 2-node job, default `progressPeriodSeconds` (30 s)", "api_writes",
     api("default_progress_period_s"), "≤ N+3 creates (with the NetworkPolicy), ≤ 6 status writes + progress, 0/min", "make bench-api"),
    ("same, the sample's `progressPeriodSeconds: 5`", "api_writes", api("sample_progress_period_s"),
     "progress ≤ 12/min", "make bench-api"),
    ("every fault once: store, agent, worker, operator lost; hung worker; API server restart; NotReady node; "
     "every trainer pod evicted (`evict_all`)",
     "faults", faults_summary, "all survived, ≤ 1 step lost", "make bench-faults"),
    ("a kind worker stopped (`docker stop`) / frozen (`docker pause`) under a 2-node job → first resumed step, "
     "3-node kind", "node_loss", node_loss, "after NotReady ≤ nodeLostTimeoutSeconds + 15 s, ≤ 1 step lost",
     "make bench-node-loss"),
    ("the rendezvous re-formed after one agent lost without leaving (real handlers against one store, loopback): "
     "torch's `c10d` (the replacement waits for the expiry), `ddpjob-c10d` with rule 4's take-over and with a spare",
     "rdzv_scale", rdzv_scale, "≤ 5 s at 512 agents; store ops per agent per round O(1)", "make bench-rdzv-scale"),
    ("the same at a 4 s keep-alive, where 512 agents re-form on this machine's 2 cores (at 1 s their 1,024 threads "
     "cannot send every heartbeat within the 3 s expiry)",
     "rdzv_scale_keep_alive_4s", rdzv_scale, "≤ 5 s at 512 agents; store ops per agent per round O(1)",
     "rdzv_scale.py --agents 256,512 --keep-alive 4"),
    ("the same, each worker's garbage collector paced per agent (`--agent-gc`): a worker holds 256 agents in one heap, "
     "where a real agent has a process of its own",
     "rdzv_scale_keep_alive_4s_agent_gc", rdzv_scale, "≤ 5 s at 512 agents; store ops per agent per round O(1)",
     "rdzv_scale.py --agents 256,512 --keep-alive 4 --agent-gc"),
    ("the largest real job here (1 process per pod, digits): two trainer pods killed at once, then the store pod",
     "largest_job", largest_job, "survived, ≤ 1 step lost, bitwise", "make bench-largest-job"),
    ("DDPJobs at once, control plane only", "scale", scale, "200 in ≤ 30 s, ≤ 200 MiB", "make bench-scale"),
    ("one DDPJob on kwok fake nodes, control plane only (the operator as a host process)", "scale_sim", scale_sim,
     "≤ 10 s, ≤ N+3 creates, ≤ 6 status writes, p99 ≤ 1 s, ≤ nodeLostTimeoutSeconds + 10 s, ≤ 10 s, ≤ 400 MiB",
     "make bench-scale-sim"),
    ("digits training with snapshots (adaptive K) + checkpoints vs a bare DDP loop", "trainer_overhead", overhead,
     "≥ 0.97, ≤ 2 %", "make bench-overhead"),
    ("snapshot overhead by model size (MLP, CPU), steps a failure may lose", "trainer_overhead",
     overhead_by_size, "≤ 2 % at every size, steps lost ≤ 10 at ~100M", "make bench-overhead"),
    ("resident state: sealing every rank's state at a step, without a copy (1 process, Adam)", "resident_commit",
     resident_commit, "", "make bench-resident-commit"),
]


def measured_table(bench_dir: Path) -> str:
    lines = ["| what | figure | goal | command | recorded (mode, commit, date, machine) |", "|---|---|---|---|---|"]
    for what, name, figure, goal, command in ROWS:
        doc = results.load(name, bench_dir)
        if doc is None:
            lines.append(f"| {what} | not recorded yet | {goal} | `{command}` | — |")
        else:
            lines.append(f"| {what} | {figure(doc)} | {goal} | `{command}` | {recorded(doc)} |")
    return "\n".join(lines)


def baselines_table(bench_dir: Path) -> str:
    doc = results.load("baselines", bench_dir)
    if doc is None:
        return "Not recorded yet: run `make bench-baselines`."
    r = doc["result"]
    lines = ["| setting | survived | kill → first resumed step (p50) | steps lost (max) |", "|---|---|---|---|"]
    for c in r["configs"].values():
        p50 = _n(c.get("recovery_s_p50"), " s") if c["survived"] else f"none resumed within {_n(c['waited_s'], ' s')}"
        lines.append(f"| {c['setting']} | {c['survived']}/{c['kills']} | {p50} | {_n(c.get('steps_lost_max'))} |")
    ours = results.load("trainer_recovery", bench_dir)
    if ours is not None:
        o = ours["result"]
        lines.append(f"| DDPJob's trainer (peer snapshots) under `{o.get('launcher', 'torch.distributed.run')}` with "
                     f"DDPJob's environment, keep-alives and store process, a node killed "
                     f"(`make bench-trainer-recovery`, {ours.get('mode')}) | "
                     f"{o.get('kills') if o.get('survived') else 0}/{o.get('kills')} | "
                     f"{_n(o.get('recovery_s_p50'), ' s')} | {_n(o.get('steps_lost_max'))} |")
    lines.append("")
    lines.append(f"Recorded by `make bench-baselines`: {recorded(doc)}; {r.get('kills_per_config')} kill(s) per "
                 f"configuration, checkpoint every {r.get('checkpoint_every')} steps; a kill counts as survived "
                 f"when training resumed and the job then finished on every node.")
    return "\n".join(lines)


def phases_table(bench_dir: Path) -> str:
    doc = results.load("e2e_recovery", bench_dir)
    if doc is None or "phases" not in doc["result"]:
        return "Not recorded yet: run `make bench-e2e-recovery`."
    r = doc["result"]
    compare = r.get("compare") or {}
    against = " ".join(filter(None, [f"`{compare['command']}`" if compare.get("command") else "",
                                     ", ".join(f"`{k}: {v}`" for k, v in (compare.get("torchrun") or {}).items())]))
    head = "| phase | from → to | what happens | median (s) |" + (f" compared: {against} |" if compare else "")
    lines = [head, "|---|---|---|---|" + ("---|" if compare else "")]
    for name, start, end, what in recovery_phases.PHASES:
        row = f"| `{name}` | {start} → {end} | {what} | {_n(r['phases'].get(name))} |"
        lines.append(row + (f" {_n((compare.get('phases') or {}).get(name))} |" if compare else ""))
    total = f"| **kill → first resumed step** (p50) | | | **{_n(r.get('recovery_s_p50'))}** |"
    lines.append(total + (f" **{_n(compare.get('recovery_s_p50'))}** |" if compare else ""))
    lines.append("")
    lines.append(f"Recorded by `make bench-e2e-recovery`: {recorded(doc)}; {r.get('kills')} kills "
                 f"({r.get('survived')} survived), medians over the non-rank-0 and rank-0 kills of the default "
                 f"setup" + (f", {compare.get('kills')} kills compared" if compare else "") + ". Milestones after "
                 f"the kill (median s): " + ", ".join(f"{k} {_n(v)}" for k, v in (r.get("milestones_s") or {}).items()
                                                    if k != "kill") + ".")
    return "\n".join(lines)


def node_loss_table(bench_dir: Path) -> str:
    doc = results.load("node_loss", bench_dir)
    if doc is None:
        return "Not recorded yet: run `make bench-node-loss`."
    r = doc["result"]
    lines = ["| how | node lost → NotReady | NotReady → first resumed step | node lost → first resumed step | "
             "steps lost | resumed from |", "|---|---|---|---|---|---|"]
    for how, c in sorted((r.get("cases") or {}).items(), key=lambda kv: kv[0] != "stop"):
        lines.append(f"| `docker {how}` | {_n(c.get('notready_s'), ' s')} | {_n(c.get('after_notready_s'), ' s')} | "
                     f"{_n(c.get('recovery_s'), ' s')} | {c.get('steps_lost')} | {c.get('source')} |")
    lines.append("")
    lines.append(f"Recorded by `make bench-node-loss`: {recorded(doc)}; nodeLostTimeoutSeconds "
                 f"{r.get('node_lost_timeout_s')} s, target after NotReady ≤ {_n(r.get('target_after_notready_s'), ' s')}"
                 f" (the timeout + 15 s); one fresh 2-node digits job per case, step delay 0.15 s.")
    return "\n".join(lines)


def elastic_table(bench_dir: Path) -> str:
    doc = results.load("elastic", bench_dir)
    if doc is None:
        return "Not recorded yet: run `make bench-elastic`."
    r = doc["result"]
    b = r.get("baseline") or {}
    def resize(direction: str) -> Callable[[dict], str]:
        return lambda x: _n((x.get("resize_s_p50") or {}).get(direction), " s")
    rows = [
        ("`kubectl scale` down → 5 steps at the new size (p50)", resize("down"), "≤ 5 s"),
        ("`kubectl scale` up → 5 steps at the new size (p50)", resize("up"), "≤ 5 s"),
        ("a pod killed at the desired size → first resumed step (p50)",
         lambda x: _n(x.get("elastic_kill_recovery_s_p50"), " s"), "≤ the fixed job's + 1 s"),
        ("the same kill in a fixed-size job (2 = minNodes = maxNodes, `c10d`)",
         lambda x: _n(x.get("fixed_kill_recovery_s_p50"), " s"), ""),
        ("re-forms per kill", lambda x: _n(x.get("reforms_per_kill")), "1"),
        ("world-size changes per kill", lambda x: _n(x.get("world_size_changes_per_kill")), "0"),
        ("steps lost (max, kills and resizes)", lambda x: _n(x.get("steps_lost_max")), "≤ 1"),
        ("failures counted by the resizes", lambda x: _n(x.get("resize_failures_counted")), "0"),
    ]
    lines = [f"| | `rdzvBackend: {b.get('rdzvBackend')}` (before) | `auto` = `ddpjob-c10d` (after) | goal |",
             "|---|---|---|---|"]
    lines += [f"| {what} | {fig(b)} | {fig(r)} | {goal} |" for what, fig, goal in rows]
    lines.append("")
    lines.append(f"Recorded by `make bench-elastic`: {recorded(doc)}; a 1..3 digits job at `nodes: 2` per backend, "
                 f"{r.get('kills')} kill(s) and {r.get('resizes')} resizes each (2 → 1 → 2 → 3 → 2 per cycle), step "
                 f"delay {_n(r.get('step_delay_s'), ' s')}, last call 10 s; sizes are the trainers' own (rank "
                 f"0's `event=session` lines, tests/benchmarks/rounds.py). Goals missed: "
                 f"{', '.join(r.get('goals_missed') or []) or 'none'}; by the `c10d` job: "
                 f"{', '.join(b.get('goals_missed') or []) or 'none'}.")
    return "\n".join(lines)


BLOCKS: list[tuple[Path, str, Callable[[Path], str]]] = [
    (README, "measured", measured_table),
    (RECOVERY, "baselines", baselines_table),
    (RECOVERY, "overhead", overhead_table),
    (RECOVERY, "faults", faults_table),
    (RECOVERY, "phases", phases_table),
    (RECOVERY, "node-loss", node_loss_table),
    (RECOVERY, "elastic", elastic_table),
]


def markers(block: str) -> tuple[str, str]:
    return (f"<!-- bench-report:{block}:begin (generated by `make bench-report` from docs/bench/*.json) -->",
            f"<!-- bench-report:{block}:end -->")


def replace_block(text: str, block: str, content: str) -> str:
    begin, end = markers(block)
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"markers of block {block!r} not found")
    return text[: i + len(begin)] + "\n" + content + "\n" + text[j:]


def stale(bench_dir: Path = results.BENCH_DIR) -> list[str]:
    """Blocks whose text differs from what the recorded results say (empty: all agree)."""
    out = []
    for path, block, render in BLOCKS:
        text = path.read_text()
        if replace_block(text, block, render(bench_dir)) != text:
            out.append(f"{path.relative_to(ROOT)}:{block}")
    return out


def write(bench_dir: Path = results.BENCH_DIR) -> list[str]:
    changed = []
    for path, block, render in BLOCKS:
        text = path.read_text()
        new = replace_block(text, block, render(bench_dir))
        if new != text:
            path.write_text(new)
            changed.append(f"{path.relative_to(ROOT)}:{block}")
    return changed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the tables")
    g.add_argument("--check", action="store_true", help="exit 1 if a table differs from the files (default)")
    a = p.parse_args()
    if a.write:
        changed = write()
        print("rewrote " + ", ".join(changed) if changed else "tables already match docs/bench/*.json")
        return 0
    out = stale()
    if out:
        print("out of date with docs/bench/*.json (run `make bench-report`): " + ", ".join(out))
        return 1
    print("tables match docs/bench/*.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
