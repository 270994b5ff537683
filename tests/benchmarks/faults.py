#!/usr/bin/env python3
"""Every fault a running DDPJob should survive, injected once each on the cluster (`make bench-faults`).

    tests/benchmarks/faults.py [--faults store_loss,agent_kill,...] [--quick] [--step-delay 0.15] [--record]

For each fault: a fresh 2-node digits DDPJob (slowed by the example's step delay, as the e2e tests do;
early stopping off) in a namespace of its own, so faults never interfere and the kubelet's per-container
crash back-off starts fresh. Once rank 0 reports --inject-step steps, the fault is injected:

- `store_loss`: `kubectl delete pod <job>-rdzv --force --grace-period=0` (the rendezvous store).
- `agent_kill`: SIGKILL, from the host, of the torchrun agent of pod 1 (the process whose environment
  holds the job's DDPJOB_NAME/DDPJOB_NAMESPACE, DDPJOB_POD_INDEX=1 and no LOCAL_RANK; containers of the
  embedded cluster are host processes).
- `worker_kill`: SIGKILL of one worker process of pod 1 (LOCAL_RANK in its environment).
- `hang`: SIGSTOP of one worker process of pod 1; the job sets `failurePolicy.hangTimeoutSeconds: 20`.
- `operator_kill`: force-delete pod 1, one second later the operator's pod (`DDPJOB_OPERATOR=subprocess`:
  SIGKILL the operator process and start a new one, as its Deployment would). Checked at every poll:
  at most one live pod per node index, and no failure counted twice (`status.restarts` <= 1, no pod UID
  twice in `status.attempts`); at the end, status.goodput took the one incident in once, not again after the
  operator's restart (`recoveries` 1: operator_kill_wrong). status.lastRecovery.fault must be NodeFailed, or
  NodeMissing where the killed operator had not recorded the pod's end in the second it had (its successor finds
  the pod gone unseen; `recorded_before_kill` in the detail).
- `apiserver_restart`: `hack/cluster.py restart apiserver`; the operator must carry on without being
  restarted (its pod's UID and restartCount unchanged; as a subprocess: still the same process).
- `node_notready`: `hack/cluster.py stop kubelet` until the operator has recorded the pods as lost (at most
  --notready-s, 90 s), `start kubelet`; the job sets
  `failurePolicy.nodeLostTimeoutSeconds: 20` (the node turns NotReady ~20-25 s after the kubelet stops: the
  embedded cluster's 20 s node Lease and node-monitor grace period, as on kind); the operator must record the pods as lost
  (an attempt with reason NodeLost), force-delete and recreate them. On a one-node
  cluster every pod of the job is on the lost node: nothing in memory survives, and without a checkpoint
  volume training starts over. The steps lost are recorded as they are and not held against survival.
- `evict_all`: every trainer pod evicted at once through the eviction API (a policy/v1 Eviction per pod, as
  `kubectl drain` does; the node is not cordoned) with the pods' grace period; the job has a checkpoint volume (a
  hostPath under harness.SHARED_HOST_DIR) whose periodic checkpoint never comes (every 1000 steps), so only the
  checkpoint rank 0 writes on SIGTERM can keep the loss to the step in flight. The evicted pods' logs are followed
  (`kubectl logs -f`) until their containers end. Checked: status.lastRecovery says `resumedFrom: disk` and
  `stepsLost` <= 1 (the trainer's figure), the evictions spent no backoffLimit (`status.restarts` 0) and each is a
  disruption (evict_all_wrong).

What is measured, from the trainer's own log lines (`<time>Z ddp_trainer rank=R event=...`; the embedded
cluster's containers share the host's clock). Logs are collected at every poll from every trainer pod and
from the previous container of a container restarted in place (`kubectl logs --previous`), so lines of
pods that are replaced later and of restarted containers are kept.

- A *restore*: an `event=resume` line (`source` peer|local|checkpoint) or `event=start` (a fresh start,
  restored step 0) logged after the injection; rank 0 logs one per re-formed group.
- `resumed_from`: the first restore's source: peer, local, disk (`checkpoint`), start (`fresh`); null when
  training was never restarted (the fault did not interrupt it).
- `steps_lost`: ddp_trainer.testing.steps_lost, the one definition -- the highest step any rank logged
  before the restore minus the step the restore restored (never clamped), summed over the restores after
  the injection (each counted from the previous one); 0 when training was never restarted and the job
  succeeded; null when it could not be measured.
- `recovery_s`: injection -> the first `event=step` line after the last restore with a step past the
  restored one (log timestamps; the injection's time is taken on the host just before the kill/delete/stop);
  null when training was never restarted or never resumed.
- `survived`: the job reached Succeeded, every check of the fault held (status.lastRecovery.fault names the fault:
  EXPECTED_FAULT) and steps_lost <= 1 (for
  node_notready on a one-node cluster: Succeeded alone).

Exits 1 (after printing the JSON) when a fault was not survived. The last line of output is one JSON
object: one entry per fault, `{"survived", "recovery_s", "steps_lost", "resumed_from", "goodput"}` (goodput: the job's
status.goodput.ratio at its end, the share of its run that made progress, docs/recovery.md), `all_survived`,
and `detail` (per fault: restores, checks, the operator's status.lastRecovery when it reports one, error).
--record also writes docs/bench/faults.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks import results  # noqa: E402
from tests.e2e import harness as h  # noqa: E402

FAULTS = ["store_loss", "agent_kill", "worker_kill", "hang", "operator_kill", "apiserver_restart", "node_notready",
          "evict_all"]
QUICK = ["store_loss", "agent_kill", "worker_kill"]
STEPS_PER_EPOCH = 20  # 2 nodes x batch 32 over the 1258 training samples
HANG_TIMEOUT_S = 20
NODE_LOST_TIMEOUT_S = 20  # node_notready's failurePolicy.nodeLostTimeoutSeconds
SOURCES = {"peer": "peer", "local": "local", "checkpoint": "disk", "fresh": "start"}
EVICT_CHECKPOINT_EVERY = 1000  # evict_all's periodic checkpoint: never reached, only the SIGTERM one counts
LABEL_INDEX = "ddp.dev/node-index"
POD_LOGS = Path("/var/log/pods")


# What status.lastRecovery.fault must name after each fault that interrupts training (the user's answer to "why did
# it restart"): the incident the operator recorded, or WorkerRestart when torchrun restarted its workers in place.
EXPECTED_FAULT = {
    "store_loss": "RendezvousStoreLost",
    "agent_kill": "TrainerRestarted",
    "worker_kill": "WorkerRestart",
    "hang": "Hang",
    "operator_kill": "NodeFailed",
    "evict_all": "NodeDisrupted",
}


def counted(status: dict) -> int:
    """Failures counted against either budget (backoffLimit: status.restarts; infraBackoffLimit: infraRestarts)."""
    return int(status.get("restarts") or 0) + int(status.get("infraRestarts") or 0)


def wrong_fault(fault: str, status: dict, *, unseen: bool = False) -> str | None:
    """What is wrong with the job's status.lastRecovery.fault after `fault`, or None. `unseen` (operator_kill): the
    killed operator had not recorded the deleted pod when it died, so its successor finds the pod gone unseen and
    NodeMissing (the CRD's reason for that) is right too."""
    want = EXPECTED_FAULT.get(fault)
    got = (status.get("lastRecovery") or {}).get("fault")
    if not want or got == want or (unseen and got == "NodeMissing"):
        return None
    return f"status.lastRecovery.fault is {got!r}, not {want!r}"


def host_dir(ns: str, job: str) -> str:
    """evict_all's checkpoint volume: a directory of every node (harness.SHARED_HOST_DIR), removed after the fault."""
    return f"{h.SHARED_HOST_DIR}/{ns}-{job}-checkpoints"


def evict_all_wrong(status: dict, evicted: int) -> list[str]:
    """What is wrong with the job's status after `evicted` pods were all evicted at once (evict_all; [] if nothing):
    it must have resumed from the checkpoint rank 0 wrote on SIGTERM, at most one step behind, and the evictions
    must be disruptions that spent no backoffLimit."""
    wrong = []
    last = status.get("lastRecovery") or {}
    if last.get("resumedFrom") != "disk":
        wrong.append(f"status.lastRecovery.resumedFrom is {last.get('resumedFrom')!r}, not 'disk' (the SIGTERM "
                     "checkpoint)")
    lost = last.get("stepsLost")
    if not isinstance(lost, int) or lost > 1:
        wrong.append(f"status.lastRecovery.stepsLost is {lost!r}, not at most 1")
    if "stepsLost" in (last.get("estimated") or []):
        wrong.append("status.lastRecovery.stepsLost is the operator's estimate: the trainer left no mark beside the "
                     "SIGTERM checkpoint")
    if counted(status):
        wrong.append(f"status.restarts + infraRestarts {counted(status)}: the evictions spent a failure budget")
    if (status.get("disruptions") or 0) < evicted:
        wrong.append(f"status.disruptions {status.get('disruptions') or 0} < {evicted} pods evicted")
    return wrong


def operator_kill_wrong(status: dict) -> list[str]:
    """What is wrong with the job's status.goodput after operator_kill ([] if nothing): the one pod deleted is one
    recovery, taken in once although a second operator derived goodput again (docs/recovery.md, "Goodput")."""
    g = status.get("goodput")
    if not isinstance(g, dict):
        return ["no status.goodput: the recovery's cost was never taken in"]
    if g.get("recoveries") != 1:
        return [f"status.goodput.recoveries {g.get('recoveries')!r}, not 1 (one pod was deleted; byFault "
                f"{g.get('byFault')!r})"]
    return []


def verdict(succeeded: bool, d: dict, steps_lost: int | None, *, judge_steps: bool = True) -> tuple[bool, list[str]]:
    """Whether a fault was survived, and why not: the job Succeeded, no error, no violation of the fault's checks and
    (`judge_steps`) at most one step lost."""
    steps_ok = not judge_steps or (steps_lost is not None and steps_lost <= 1)
    why = [x for x in (d.get("error"), *(d.get("violations") or []),
                       None if steps_ok or d.get("error") else f"steps lost {steps_lost} (at most 1 allowed)") if x]
    return succeeded and not why, why


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--quick", action="store_true", help=f"smoke test: {','.join(QUICK)} only, shorter jobs")
    p.add_argument("--step-delay", type=float, default=0.15, help="seconds of sleep per training step")
    p.add_argument("--inject-step", type=int, default=25, help="rank 0's step at the injection")
    p.add_argument("--epochs", type=int, default=6, help="epochs per job (node_notready: enough to outlast "
                   "the outage)")
    p.add_argument("--notready-s", type=float, default=90, help="how long node_notready keeps the kubelet stopped")
    p.add_argument("--timeout", type=float, default=420, help="seconds from the injection to Succeeded")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between polls (logs, invariants)")
    results.add_record_arg(p)
    a = p.parse_args()
    a.faults = QUICK if a.quick and a.faults == ",".join(FAULTS) else [f for f in a.faults.split(",") if f]
    unknown = set(a.faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown fault(s) {sorted(unknown)}: choose from {FAULTS}")
    if a.quick:
        a.epochs = min(a.epochs, 4)
    return a


def signal_process(namespace: str, job: str, index: int, kind: str, sig: int) -> tuple[int, float]:
    """Send `sig` to pod `index`'s agent (kind "agents") or its lowest-numbered worker; (pid, time)."""
    procs = h.wait_for(lambda: h.pod_processes(namespace, job, index)[kind], 30,
                       f"{kind[:-1]} process of {namespace}/{job}-{index} on this host")
    pid = procs[0]
    t = time.time()
    os.kill(pid, sig)
    return pid, t


# --------------------------------------------------------------------------------------------
# logs of every container a job ran, kept as they are collected

class LogBook:
    """Trainer logs of every pod (by UID) and container run (restartCount) seen at any poll."""

    def __init__(self, k: h.Kubectl, namespace: str, job: str, host: bool = False):
        self.k, self.ns, self.job = k, namespace, job
        self.texts: dict[tuple[str, str, int], str] = {}  # (pod name, uid, container restartCount) -> text
        # The embedded cluster's kubelet writes container logs to /var/log/pods on this host: readable while the
        # kubelet is stopped and for a while after a pod was deleted, when `kubectl logs` cannot reach them.
        self.host = host and POD_LOGS.is_dir()

    def collect_host(self) -> None:
        for d in POD_LOGS.glob(f"{self.ns}_{self.job}-*_*"):
            _, name, uid = d.name.split("_", 2)
            if name == f"{self.job}-rdzv":
                continue
            for f in (d / "trainer").glob("*.log"):
                try:
                    self._keep((name, uid, int(f.stem)), cri_text(f.read_text(errors="replace")))
                except (OSError, ValueError):
                    continue

    def _keep(self, key: tuple[str, str, int], text: str) -> None:
        if len(text) > len(self.texts.get(key, "")):
            self.texts[key] = text

    def collect(self, pods: list[dict] | None = None) -> None:
        if self.host:
            self.collect_host()
        try:
            pods = pods if pods is not None else h.trainer_pods(self.k, self.ns, self.job)
        except AssertionError:
            return
        for pod in pods:
            name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
            cs = next((c for c in pod.get("status", {}).get("containerStatuses") or [] if c["name"] == "trainer"), None)
            if cs is None:
                continue
            restarts = int(cs.get("restartCount") or 0)
            p = self.k("logs", "-n", self.ns, name, "-c", "trainer", check=False, timeout=30)
            if p.returncode == 0:
                self._keep((name, uid, restarts), p.stdout)
            if restarts > 0:
                p = self.k("logs", "-n", self.ns, name, "-c", "trainer", "--previous", check=False, timeout=30)
                if p.returncode == 0:
                    self._keep((name, uid, restarts - 1), p.stdout)

    def events(self) -> list[h.Event]:
        found: list[h.Event] = []
        for (name, _uid, run), text in self.texts.items():
            found += h.events(text, f"{name}#{run}")
        return sorted(found, key=lambda e: e.time)


def cri_text(text: str) -> str:
    """The container's own output from a CRI log file (`<time> stdout|stderr F|P <text>`; P: partial line)."""
    out, partial = [], ""
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 4:
            continue
        if parts[2] == "P":
            partial += parts[3]
        else:
            out.append(partial + parts[3])
            partial = ""
    return "\n".join(out) + ("\n" if out else "")


def measure(evs: list[h.Event], injected_at: float, succeeded: bool) -> dict:
    """recovery_s, steps_lost, resumed_from and the restores, as the module docstring defines them."""
    restores = [e for e in evs if e.event in ("resume", "start") and e.time >= injected_at]
    steps = [(e.time, e.int("step")) for e in evs if e.event == "step"]
    if not restores:
        return {"recovery_s": None, "steps_lost": 0 if succeeded else None, "resumed_from": None, "restores": []}
    rows, total, since = [], 0, float("-inf")
    for r in restores:
        restored = r.int("step", 0) if r.event == "resume" else 0
        first = next((t for t, step in steps if t >= r.time and step > restored), float("inf"))
        held = h.held_steps(evs, max(since, injected_at), first)
        lost = h.steps_lost(steps, restored, r.time, since=since, held=held)
        rows.append({"pod": r.pod, "at_s": round(r.time - injected_at, 2), "source": r.fields.get("source", "fresh"),
                     "step": restored, "steps_lost": lost})
        total = None if total is None or lost is None else total + lost
        since = r.time
    last = restores[-1]
    restored = rows[-1]["step"]
    first = next((e for e in evs if e.event == "step" and e.time >= last.time and e.int("step") > restored), None)
    return {"recovery_s": round(first.time - injected_at, 2) if first else None, "steps_lost": total,
            "resumed_from": SOURCES.get(rows[0]["source"], rows[0]["source"]), "restores": rows}


# --------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, a: argparse.Namespace, cluster: h.Cluster, k: h.Kubectl, op: h.Operator):
        self.a, self.cluster, self.k, self.op = a, cluster, k, op
        self.namespaces: list[str] = []
        self.results: dict[str, dict] = {}
        self.detail: dict[str, dict] = {}
        self.nodes = 0
        self.kubelet_stopped = False

    # -- injections -------------------------------------------------------------------------------
    def _need_host(self, fault: str) -> None:
        if not self.cluster.embedded:
            raise RuntimeError(f"{fault} needs the embedded cluster (host processes, hack/cluster.py)")

    def _operator_identity(self) -> dict:
        if self.op.mode == "subprocess":
            return {"pid": self.op.proc.pid if self.op.proc else None,
                    "alive": self.op.proc is not None and self.op.proc.poll() is None}
        pods = self.op.pods()
        return {"pods": sorted((p["metadata"]["name"], p["metadata"]["uid"],
                                sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or []))
                               for p in pods)}

    def inject(self, fault: str, ns: str, job: str, d: dict) -> float:
        if fault == "store_loss":
            t = time.time()
            self.k("delete", "pod", f"{job}-rdzv", "-n", ns, "--force", "--grace-period=0", "--wait=false")
            return t
        if fault == "agent_kill":
            self._need_host(fault)
            pid, t = signal_process(ns, job, 1, "agents", signal.SIGKILL)
            d["pid"] = pid
            return t
        if fault == "worker_kill":
            self._need_host(fault)
            pid, t = signal_process(ns, job, 1, "workers", signal.SIGKILL)
            d["pid"] = pid
            return t
        if fault == "hang":
            self._need_host(fault)
            pid, t = signal_process(ns, job, 1, "workers", signal.SIGSTOP)
            d["pid"] = self.stopped_pid = pid
            return t
        if fault == "operator_kill":
            uid = self.k.json("get", "pod", f"{job}-1", "-n", ns)["metadata"]["uid"]
            t = h.kill_pod(self.k, ns, f"{job}-1")
            time.sleep(1)
            # whether the operator about to be killed recorded the pod's end (wrong_fault's `unseen`)
            d["recorded_before_kill"] = uid in (h.status(self.k, ns, job).get("recordedPods") or [])
            if self.op.mode == "subprocess":
                self.op.proc.kill()
                self.op.proc.wait()
                self.op._start_subprocess()
                d["operator"] = "subprocess killed (SIGKILL) and started again"
            else:
                pod = self.op.pods()[0]["metadata"]
                self.k("delete", "pod", pod["name"], "-n", pod["namespace"], "--force", "--grace-period=0",
                       "--wait=false")
                d["operator"] = f"pod {pod['namespace']}/{pod['name']} force-deleted"
            return t
        if fault == "apiserver_restart":
            self._need_host(fault)
            d["operator_before"] = self._operator_identity()
            t = time.time()
            h.embedded.restart_component("kube-apiserver")
            d["apiserver_back_s"] = round(time.time() - t, 2)
            return t
        if fault == "node_notready":
            self._need_host(fault)
            t = time.time()
            h.embedded.stop_component("kubelet")
            self.kubelet_stopped = True
            try:
                deadline = t + self.a.notready_s
                while time.time() < deadline:
                    time.sleep(min(self.a.poll, max(0.0, deadline - time.time())))
                    self.book.collect()  # what the API server still tells (logs need the kubelet: best effort)
                    ready = self.k("get", "node", "-o", "jsonpath={.items[*].status.conditions[?(@.type=='Ready')]"
                                   ".status}", check=False, timeout=15).stdout.strip()
                    if ready and "True" not in ready and "notready_after_s" not in d:
                        d["notready_after_s"] = round(time.time() - t, 1)
                    # the kubelet stays down until the operator has treated the pods as lost (or --notready-s)
                    st = h.status(self.k, ns, job) if "notready_after_s" in d else {}
                    if any(a.get("reason") == "NodeLost" for a in st.get("attempts") or []):
                        d["node_lost_after_s"] = round(time.time() - t, 1)
                        break
            finally:
                h.embedded.start_component("kubelet")
                self.kubelet_stopped = False
            d["kubelet_stopped_s"] = round(time.time() - t, 1)
            return t
        if fault == "evict_all":
            pods = sorted(p["metadata"]["name"] for p in h.trainer_pods(self.k, ns, job))
            self.followers = h.follow_logs(self.k, ns, pods)  # their logs go with the pods
            d["evicted"] = pods
            return h.evict_pods(self.k, ns, pods)
        raise KeyError(fault)

    # -- one fault --------------------------------------------------------------------------------
    def job_spec(self, fault: str, name: str, ns: str) -> dict:
        epochs = self.a.epochs
        if fault == "node_notready":  # training must outlast the outage (the containers keep running)
            epochs = max(epochs, int(self.a.notready_s / max(self.a.step_delay, 0.05) / STEPS_PER_EPOCH) + 6)
        if fault in ("apiserver_restart", "operator_kill"):  # still training once the control plane is back
            epochs += 4
        policy: dict = {"backoffLimit": 6}
        if fault == "hang":
            policy["hangTimeoutSeconds"] = HANG_TIMEOUT_S
        if fault == "node_notready":
            # The node turns NotReady ~20-25 s after the kubelet stops; with the default 60 s the operator would
            # act after --notready-s, and the node-loss path would go untried.
            policy["nodeLostTimeoutSeconds"] = NODE_LOST_TIMEOUT_S
        job = h.digits_job(name, nodes=2, step_delay=self.a.step_delay, epochs=epochs,
                           env={"DIGITS_PATIENCE": "0"}, spec={"failurePolicy": policy})
        if fault == "evict_all":
            job = h.with_disk_checkpoint(job, host_dir(ns, name), every=EVICT_CHECKPOINT_EVERY)
        return job

    def check_invariants(self, fault: str, pods: list[dict], st: dict, d: dict) -> None:
        if fault != "operator_kill":
            return
        per_index: dict[str, list[str]] = {}
        for p in pods:
            if h.running(p) or p.get("status", {}).get("phase") == "Pending" and not p["metadata"].get("deletionTimestamp"):
                per_index.setdefault(p["metadata"].get("labels", {}).get(LABEL_INDEX, "?"), []).append(p["metadata"]["name"])
        dup = {i: names for i, names in per_index.items() if len(names) > 1}
        if dup:
            d.setdefault("violations", []).append(f"two live pods for one index: {dup}")
        restarts = counted(st)
        d["max_restarts_seen"] = max(d.get("max_restarts_seen", 0), restarts)
        if restarts > 1:
            d.setdefault("violations", []).append(f"status.restarts + infraRestarts {restarts} > 1 (one pod was "
                                                  f"deleted)")
        uids = [a.get("uid") for a in st.get("attempts") or [] if a.get("uid")]
        if len(uids) != len(set(uids)):
            d.setdefault("violations", []).append(f"a pod UID recorded twice in status.attempts: {uids}")

    def one(self, fault: str) -> None:
        ns = h.new_namespace(self.k, f"faults-{fault}")
        self.namespaces.append(ns)
        name = "f-" + fault.replace("_", "-")
        d: dict = {"namespace": ns, "job": name}
        self.detail[fault] = d
        self.book = LogBook(self.k, ns, name, host=self.cluster.embedded)
        self.stopped_pid = None
        self.followers: list = []
        injected_at = None
        phase = None
        try:
            h.apply(self.k, ns, self.job_spec(fault, name, ns))
            h.log(f"{fault}: {ns}/{name} applied")
            _, prog = h.wait_rank0_step(self.k, ns, name, self.a.inject_step, 300)
            d["step_at_injection"] = prog.get("step")
            self.book.collect()
            injected_at = self.inject(fault, ns, name, d)
            h.log(f"{fault}: injected at step {prog.get('step')}")
            deadline = injected_at + self.a.timeout
            while time.time() < deadline:
                try:
                    st = h.status(self.k, ns, name)
                    pods = h.trainer_pods(self.k, ns, name)
                except AssertionError:  # the API server is restarting
                    time.sleep(self.a.poll)
                    continue
                self.book.collect(pods)
                self.check_invariants(fault, pods, st, d)
                phase = st.get("phase")
                if phase in ("Succeeded", "Failed"):
                    break
                time.sleep(self.a.poll)
            st = h.status(self.k, ns, name)
            phase = st.get("phase")
            self.book.collect()
            for f in self.followers:  # the evicted pods' logs, to their end
                self.book.texts[(f.pod, "evicted", -1)] = f.text(timeout=10)
            d.update(phase=phase, restarts=st.get("restarts"), reason=st.get("reason"),
                     attempts=[{k: a.get(k) for k in ("pod", "reason", "exitCode", "counted")}
                               for a in st.get("attempts") or []])
            # did the operator act (an attempt recorded)? node_notready: NotReady ~20 s after the kubelet stopped
            d["operator_acted"] = bool(st.get("attempts"))
            if st.get("lastRecovery") is not None:
                d["lastRecovery"] = st["lastRecovery"]
            if isinstance(st.get("goodput"), dict):  # what the fault cost over the job's run (docs/recovery.md)
                d["goodput"] = st["goodput"]
            if wrong := wrong_fault(fault, st, unseen=d.get("recorded_before_kill") is False):
                d.setdefault("violations", []).append(wrong)
            if phase != "Succeeded":
                d["error"] = f"job {phase or 'still running'} {self.a.timeout:.0f} s after the injection" + \
                    (f": {st.get('reason')}: {st.get('message')}" if st.get("reason") else "")
            if fault == "apiserver_restart":
                d["operator_after"] = self._operator_identity()
                if d["operator_after"] != d["operator_before"]:
                    d.setdefault("violations", []).append("the operator was restarted (or replaced)")
            if fault == "node_notready" and not any(a.get("reason") == "NodeLost" for a in st.get("attempts") or []):
                d.setdefault("violations", []).append("the operator never treated the NotReady node's pods as lost")
            if fault == "operator_kill" and counted(st) > 1:
                d.setdefault("violations", []).append(f"status.restarts + infraRestarts {counted(st)} > 1 at the end")
            if fault == "operator_kill" and (wrong_goodput := operator_kill_wrong(st)):
                d.setdefault("violations", []).extend(wrong_goodput)
            if fault == "evict_all" and (wrong_status := evict_all_wrong(st, len(d.get("evicted") or []))):
                d.setdefault("violations", []).extend(wrong_status)
        except Exception as e:  # noqa: BLE001 - reported, never swallowed: survived is false
            d["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            h.log(f"{fault}: {d['error']}")
        finally:
            if getattr(self, "kubelet_stopped", False):
                h.embedded.start_component("kubelet")
                self.kubelet_stopped = False
            if self.stopped_pid:
                try:
                    os.kill(self.stopped_pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        succeeded = phase == "Succeeded"
        m = measure(self.book.events(), injected_at, succeeded) if injected_at else \
            {"recovery_s": None, "steps_lost": None, "resumed_from": None, "restores": []}
        d["restores"] = m["restores"]
        one_node = fault == "node_notready" and self.nodes == 1
        if fault == "node_notready":
            d["nodes"] = self.nodes
        survived, why = verdict(succeeded, d, m["steps_lost"], judge_steps=not one_node)
        self.results[fault] = {"survived": survived, "recovery_s": m["recovery_s"], "steps_lost": m["steps_lost"],
                               "resumed_from": m["resumed_from"], "goodput": (d.get("goodput") or {}).get("ratio")}
        if why:
            d["why_not_survived"] = why
        h.log(f"{fault}: {json.dumps(self.results[fault])}" + (f" -- {'; '.join(why)}" if why else ""))
        h.delete_namespace(self.k, ns)
        if fault == "evict_all":
            shutil.rmtree(host_dir(ns, name), ignore_errors=True)

    def run(self) -> None:
        self.nodes = len(self.k.json("get", "nodes")["items"])
        for fault in self.a.faults:
            self.one(fault)

    def result(self) -> dict:
        out: dict = dict(self.results)
        out["all_survived"] = all(r["survived"] for r in self.results.values())
        out["faults"] = list(self.results)
        out["step_delay_s"] = self.a.step_delay
        out["hang_timeout_s"] = HANG_TIMEOUT_S
        out["notready_s"] = self.a.notready_s
        out["node_lost_timeout_s"] = NODE_LOST_TIMEOUT_S
        out["operator"] = self.op.mode
        out["detail"] = self.detail
        return out


def main() -> int:
    a = parse_args()
    cluster, k, op = h.start_operator()
    bench = Bench(a, cluster, k, op)
    try:
        bench.run()
        result = bench.result()
    except BaseException:
        for ns in bench.namespaces:
            print(h.diagnostics(k, ns, op), file=sys.stderr)
        raise
    finally:
        for ns in bench.namespaces:
            h.delete_namespace(k, ns)
        op.stop()
    results.emit("faults", result, mode="quick" if a.quick else "full", record=a.record)
    return 0 if result["all_survived"] else 1


if __name__ == "__main__":
    sys.exit(main())
