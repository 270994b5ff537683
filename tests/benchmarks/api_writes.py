#!/usr/bin/env python3
"""How much the operator writes to the API server for one clean job (`make bench-api`).

    tests/benchmarks/api_writes.py [--nodes 2] [--window 120] [--quick] [--audit-log PATH] [--record]

Runs one N-node digits DDPJob from apply to Succeeded with nothing going wrong, and counts the operator's
writes (create, update, patch, delete) in the API server's audit log: the embedded cluster records the
metadata of every write in .cluster/logs/audit.log (hack/cluster.py's audit policy); another cluster needs
an audit log of its own (--audit-log). The operator's writes are those of its ServiceAccount (the chart's
operator) or, for DDPJOB_OPERATOR=subprocess, the non-kubectl writes of the kubeconfig's user; only
writes in the job's namespace count (never the control plane's own `system:` users).

Steady state: once the job is Running with every node ready, --window seconds of healthy training (the step delay
keeps it training past the window). One job runs at the CRD's default progressPeriodSeconds (30) and one at the
sample's (manifests/samples/digits.yaml: 5 s), side by side, each in its own namespace (only its namespace's
writes count for it): rank 0's progress copied into the status is a feature with its own rate (at most one status
write per period), reported as `progress_writes_per_min` (status writes inside the window), and so is the metric
history those copies feed (docs/cli.md: the `<job>-history` ConfigMap, written at most every 30 s), reported as
`history_writes_per_min`; every other write inside the window counts in `steady_state_writes_per_min`.
--progress-period N measures one period only (0: progress off).

Goals, judged at every period measured (goals_missed): creates <= N + 3 (NetworkPolicy, Service, rendezvous-store
pod, N training pods), 0 writes per minute while healthy besides progress (steady_state_writes_per_min == 0), and
at most one progress write per period (inside the window: floor(window_s / period) + 1 status writes; none with
progress off; and at most one history write per 30 s). Status writes <= 6 besides the progress copies is a goal
too, but not judged here: the copies made outside the window cannot be told from the others in the audit log. The
last line is one JSON object: the default period's nodes, creates, status_writes, steady_state_writes_per_min,
progress_writes_per_min, under `at_progress_period` the same for every period measured, and `goals_missed` (one
message per goal missed); the exit status is 1 when a goal was missed. --record also writes
docs/bench/api_writes.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

for _p in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parents[2] / "operator"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from ddp_operator import history  # noqa: E402
from ddp_operator.crd import DEFAULTS  # noqa: E402
from tests.benchmarks import results  # noqa: E402
from tests.e2e import harness as h  # noqa: E402

WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
TRAIN_SAMPLES = 1258
BATCH = 32
JOB = "api"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--window", type=float, default=120, help="seconds of healthy training observed")
    p.add_argument("--progress-period", type=int, default=None,
                   help="measure one spec.progressPeriodSeconds only (default: the CRD's default and the sample's)")
    p.add_argument("--audit-log", type=Path, default=None, help="the API server's audit log (default: embedded)")
    p.add_argument("--quick", action="store_true", help="a 20 s window (smoke test)")
    results.add_record_arg(p)
    a = p.parse_args()
    # seconds of training left after the window, so that the job is still training when the window closes
    a.margin = 45
    if a.quick:
        a.window, a.margin = 20, 15
    return a


def ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


class AuditCursor:
    """The API server's audit log from a point on, rotation included (the rotated file keeps the inode it had)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        st = self.path.stat()
        self.inode, self.offset = st.st_ino, st.st_size

    def events(self) -> list[dict]:
        files = []
        if self.path.stat().st_ino != self.inode:
            rotated = [p for p in self.path.parent.glob("audit*.log") if p.stat().st_ino == self.inode]
            files += [(p, self.offset) for p in rotated] + [(self.path, 0)]
        else:
            files.append((self.path, self.offset))
        out = []
        for path, offset in files:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            for line in data.splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out


def classify(ev: dict) -> str:
    ref = ev.get("objectRef") or {}
    resource, sub, verb = ref.get("resource"), ref.get("subresource"), ev["verb"]
    if resource == "ddpjobs":
        return "status_writes" if sub == "status" else "job_object_writes"
    if resource == "events":
        return "events"
    if resource == "configmaps":
        return "history_writes"  # the job's metric history (docs/cli.md), written at most every FLUSH_SECONDS
    if verb == "create" and resource in ("pods", "services", "networkpolicies"):
        return "creates"
    if verb in ("delete", "deletecollection"):
        return "deletes"
    return f"other:{verb}:{resource}" + (f"/{sub}" if sub else "")


DEFAULT_PERIOD = DEFAULTS["progressPeriodSeconds"]
SAMPLE_PERIOD = 5  # manifests/samples/digits.yaml


def measure(a: argparse.Namespace, k: h.Kubectl, op: h.Operator, audit: Path, user: str, period: int | None) -> dict:
    """One clean job at `period` (None: the CRD's default, the field left out of the manifest)."""
    ns = h.new_namespace(k, "bench-api")
    try:
        steps = a.nodes and 4 * math.ceil(math.ceil(TRAIN_SAMPLES / a.nodes) / BATCH)  # 4 epochs
        delay = round((a.window + a.margin) / steps, 3)  # trains past the window
        manifest = h.digits_job(JOB, nodes=a.nodes, step_delay=delay, epochs=4, env={"DIGITS_PATIENCE": "0"})
        if period is None:
            del manifest["spec"]["progressPeriodSeconds"]  # the API server fills in the CRD's default
        else:
            manifest["spec"]["progressPeriodSeconds"] = period
        cursor = AuditCursor(Path(audit))
        t_apply = time.time()
        h.apply(k, ns, manifest)
        applied = h.job(k, ns, JOB)["spec"].get("progressPeriodSeconds")

        def healthy():
            st = h.status(k, ns, JOB)
            if st.get("phase") in ("Failed", "Succeeded"):
                raise h.PhaseError(f"{JOB} ended {st.get('phase')} before the window: {st}")
            nodes = st.get("nodes") or {}
            return st if st.get("phase") == "Running" and nodes.get("ready") == a.nodes else None
        h.wait_for_or_raise(healthy, 300, f"{JOB} Running with {a.nodes} ready nodes", h.PhaseError)
        h.wait_rank0_step(k, ns, JOB, 1, 120)  # training, not just started containers
        time.sleep(3)  # let the transition's own writes land before the window opens
        w0 = time.time()
        h.log(f"steady-state window at progressPeriodSeconds={applied}: {a.window:.0f} s")
        time.sleep(a.window)  # the measurement itself: a window of wall-clock time
        w1 = time.time()
        st = h.status(k, ns, JOB)
        if st.get("phase") != "Running":
            raise AssertionError(f"{JOB} left Running during the window: {st}")
        h.wait_phase(k, ns, JOB, "Succeeded", 900)
        time.sleep(2)  # the last status write reaches the log
        t_end = time.time()

        ops = []
        for ev in cursor.events():
            ref = ev.get("objectRef") or {}
            if ev.get("verb") not in WRITE_VERBS or ref.get("namespace") != ns or ev.get("stage") != "ResponseComplete":
                continue
            if op.mode == "subprocess":
                # the kubeconfig's user, minus this program's kubectl calls; the control plane's own
                # components (scheduler bindings, kubelet status, endpoint controllers) are system: users
                if ev.get("userAgent", "").startswith("kubectl") or \
                        ev.get("user", {}).get("username", "").startswith("system:"):
                    continue
            elif ev.get("user", {}).get("username") != user:
                continue
            ops.append(ev)
        kinds = Counter(classify(e) for e in ops)
        in_window = [e for e in ops if w0 <= ts(e["requestReceivedTimestamp"]) <= w1]
        # while the job trains healthily nothing but the progress copy changes the status
        progress = [e for e in in_window if classify(e) == "status_writes"]
        history_writes = [e for e in in_window if classify(e) == "history_writes"]
        minutes = (w1 - w0) / 60
        return {
            "progress_period_s": applied,
            "creates": kinds.get("creates", 0),
            "status_writes": kinds.get("status_writes", 0),
            "steady_state_writes_per_min": round(
                (len(in_window) - len(progress) - len(history_writes)) / minutes, 2),
            "progress_writes_per_min": round(len(progress) / minutes, 2),
            "progress_writes": len(progress),
            "history_writes_per_min": round(len(history_writes) / minutes, 2),
            "history_writes": len(history_writes),
            "breakdown": dict(sorted(kinds.items())),
            "total_writes": len(ops),
            "window_s": round(w1 - w0, 1),
            "window_writes": [f"{e['verb']} {e.get('objectRef', {}).get('resource')}"
                              f"{'/' + e['objectRef']['subresource'] if e.get('objectRef', {}).get('subresource') else ''}"
                              for e in in_window],
            "job_seconds": round(t_end - t_apply, 1),
        }
    except BaseException:
        print(h.diagnostics(k, ns, op), file=sys.stderr)
        raise
    finally:
        h.delete_namespace(k, ns)


def progress_writes_allowed(window_s: float, period: int) -> int:
    """The status writes the progress copy may make in a window: one per period, plus one where the window opens just
    before a copy is due; none with progress off (period 0)."""
    return math.floor(window_s / period) + 1 if period > 0 else 0


def history_writes_allowed(window_s: float, period: int) -> int:
    """The metric history's ConfigMap writes in a window: one per FLUSH_SECONDS (each a progress write at least
    that long after the last), plus one where the window opens just before one is due; none with progress off."""
    return math.floor(window_s / max(history.FLUSH_SECONDS, period)) + 1 if period > 0 else 0


def goals_missed(result: dict) -> list[str]:
    """Every goal missed at every period measured, one message each ([]: every goal held)."""
    nodes, out = result["nodes"], []
    for key, r in result["at_progress_period"].items():
        at = f"at progressPeriodSeconds={key}: "
        out += results.goal(r["creates"] <= nodes + 3, at + "creates", r["creates"], f"<= {nodes + 3} (N + 3)")
        out += results.goal(r["steady_state_writes_per_min"] == 0, at + "steady_state_writes_per_min",
                            r["steady_state_writes_per_min"], "0 while healthy, besides progress")
        period = r["progress_period_s"]
        if not isinstance(period, int) or period < 0:
            out += results.goal(False, at + "progress_period_s", period, "the job's spec.progressPeriodSeconds, >= 0")
            continue
        allowed = progress_writes_allowed(r["window_s"], period)
        out += results.goal(r["progress_writes"] <= allowed, at + f"progress_writes in {r['window_s']} s",
                            r["progress_writes"], f"<= {allowed} (one per period)")
        if "history_writes" in r:
            most = history_writes_allowed(r["window_s"], period)
            out += results.goal(r["history_writes"] <= most, at + f"history_writes in {r['window_s']} s",
                                r["history_writes"], f"<= {most} (one per {history.FLUSH_SECONDS:.0f} s)")
    return out


def main() -> int:
    a = parse_args()
    cluster = h.connect()
    k = h.Kubectl(cluster.kubeconfig)
    audit = a.audit_log or (h.embedded.audit_log() if cluster.embedded else None)
    if audit is None or not Path(audit).exists():
        print(json.dumps({"error": "no API audit log: pass --audit-log (the embedded cluster writes "
                                   ".cluster/logs/audit.log)"}))
        return 2
    h.ensure_images(cluster)
    op = h.Operator(cluster, k).start()
    user = op.username()
    periods = [a.progress_period] if a.progress_period is not None else [None, SAMPLE_PERIOD]
    try:
        # side by side: each job has its own namespace, and only its namespace's writes count for it
        with ThreadPoolExecutor(len(periods)) as pool:
            runs = list(pool.map(lambda period: measure(a, k, op, Path(audit), user, period), periods))
    finally:
        op.stop()
    first = runs[0]
    result = {
        "nodes": a.nodes,
        # the first period measured (the CRD's default unless --progress-period): the headline figures
        **{key: first[key] for key in ("progress_period_s", "creates", "status_writes",
                                       "steady_state_writes_per_min", "progress_writes_per_min",
                                       "history_writes_per_min")},
        "default_progress_period_s": DEFAULT_PERIOD,
        "sample_progress_period_s": SAMPLE_PERIOD,
        "at_progress_period": {str(r["progress_period_s"]): r for r in runs},
        "goal": {"creates": a.nodes + 3, "status_writes": "<= 6 + the progress copies (not judged)",
                 "steady_state_writes_per_min": 0,
                 "progress_writes": "<= floor(window_s / progressPeriodSeconds) + 1",
                 "history_writes": f"<= floor(window_s / max({history.FLUSH_SECONDS:.0f}, progressPeriodSeconds)) + 1"},
        "operator_user": user if op.mode != "subprocess" else "(kubeconfig user, non-kubectl)",
    }
    return results.emit_judged("api_writes", result, goals_missed(result), mode="quick" if a.quick else "full",
                               record=a.record and a.progress_period is None)


if __name__ == "__main__":
    sys.exit(main())
