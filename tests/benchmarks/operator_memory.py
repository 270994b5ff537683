#!/usr/bin/env python3
"""The operator's memory under a flood of labelled pods (`make bench-memory`).

    tests/benchmarks/operator_memory.py [--pods 1500] [--annotation-kib 64] [--baseline REV] [--quick] [--record]

Creates --pods Pending pods (a nodeSelector no node has) carrying the job label ddp.dev/job-name and an annotation of
--annotation-kib KiB each, in one namespace, and no DDPJob: the operator indexes every such pod of every watched
namespace, whoever made it. It runs `python -m ddp_operator` as a local process (tests/support/processes.py) watching
an empty namespace (idle) and then the crowded one, and reads its resident memory from /proc once it has settled:
the settled RSS, the peak (VmHWM) and the growth per pod. --baseline REV runs the operator of another commit (a git
archive of its operator/ directory) the same way in the same run, on the same pods, for the before/after figure.

Where the chart's ValidatingAdmissionPolicy refuses labelled pods from anyone but the operator, the pods are created
as the identity its message names (kubectl --as; the cluster admin may impersonate).

Goal (judged): the operator's peak RSS grows by at most PEAK_PER_POD_GOAL times a pod's annotation size per pod (the
peak is what a memory limit kills: the pods' bulk is not kept, jobs.kept_pod, and listings come a page at a time,
handlers.LIST_CHUNK), and every pod was created. The settled RSS is reported, not judged: memory kopf held while it
processed the events is freed but mostly not given back to the system by the allocator, so it stays near the peak
whatever the operator keeps. The last line is one JSON object; exit status 1 on a missed goal.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks import results  # noqa: E402
from tests.e2e import harness as h  # noqa: E402
from tests.support import processes  # noqa: E402
from tests.support.processes import OperatorProcess  # noqa: E402

# The peak growth per pod over the idle operator, in multiples of a pod's annotation size (the OOM is the peak).
PEAK_PER_POD_GOAL = 3
NOWHERE = {"ddp.dev/bench-node": "nowhere"}
BATCH = 50
# kopf's per-object workers hold their last event until idle for settings.batching.idle_timeout (5 s): measured after.
MIN_SETTLE_S = 20
_AS = re.compile(r"\((system:serviceaccount:[^)\s]+)\)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pods", type=int, default=1500)
    p.add_argument("--annotation-kib", type=int, default=64)
    p.add_argument("--baseline", default="", help="also run the operator of this commit (before/after)")
    p.add_argument("--settle-s", type=float, default=90, help="at most this long for the RSS to settle")
    p.add_argument("--quick", action="store_true", help="300 pods (smoke test)")
    results.add_record_arg(p)
    a = p.parse_args()
    if a.quick:
        a.pods = 300
    return a


def pod(i: int, blob: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"flood-{i:05d}", "labels": {h.LABEL_JOB: f"flood-{i % 10}"},
                         "annotations": {"bench.ddp.dev/blob": blob}},
            "spec": {"nodeSelector": dict(NOWHERE), "automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "localhost/none:0", "command": ["true"]}]}}


def create_pods(k: h.Kubectl, ns: str, count: int, kib: int) -> str | None:
    """Create the pods in batches; the identity used when the admission policy refused the caller (else None)."""
    import json
    blob = "x" * (kib * 1024)
    identity: list[str] = []
    for start in range(0, count, BATCH):
        items = [pod(i, blob) for i in range(start, min(count, start + BATCH))]
        text = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        p = k("create", "-n", ns, *identity, "-f", "-", input=text, check=False, timeout=300)
        if p.returncode != 0 and not identity and (m := _AS.search(p.stderr)):
            identity = [f"--as={m.group(1)}"]
            h.log(f"the admission policy refused the pods; creating them as {m.group(1)}")
            k("delete", "pods", "--all", "-n", ns, "--wait=false", check=False, timeout=300)
            p = k("create", "-n", ns, *identity, "-f", "-", input=text, check=False, timeout=300)
        if p.returncode != 0:
            raise AssertionError(f"creating pods failed: {p.stderr[-2000:]}")
    return identity[0][5:] if identity else None


def count_pods(k: h.Kubectl, ns: str) -> int:
    out = k("get", "pods", "-n", ns, "-l", h.LABEL_JOB, "--no-headers", "-o", "custom-columns=N:.metadata.name",
            timeout=300).stdout
    return sum(1 for line in out.splitlines() if line.strip())


def proc_memory(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


@contextlib.contextmanager
def tree(rev: str):
    """The repository's operator (None), or a git archive of `rev`'s operator/ directory."""
    if not rev:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="ddp-bench-baseline-") as d:
        archive = subprocess.run(["git", "-C", str(results.ROOT), "archive", rev, "operator"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", d], input=archive, check=True)
        yield Path(d)


def settled_rss(op: OperatorProcess, seconds: float) -> tuple[float, float]:
    """The operator's RSS once it stops changing (five samples a second apart within 1 MiB, after MIN_SETTLE_S at
    least), and its peak."""
    samples: list[float] = []
    t0 = time.monotonic()
    while True:
        rss, peak = proc_memory(op.proc.pid)
        samples.append(rss)
        if len(samples) % 5 == 1:
            h.log(f"rss {rss:.1f} MiB, peak {peak:.1f} MiB after {time.monotonic() - t0:.0f} s")
        recent = samples[-5:]
        if (time.monotonic() - t0 >= MIN_SETTLE_S and len(recent) == 5 and max(recent) - min(recent) < 1.0) \
                or time.monotonic() - t0 > seconds:
            return rss, peak
        time.sleep(1)


def measure(cluster, namespace: str, source: Path | None, log: Path, seconds: float) -> tuple[float, float]:
    """Start the operator (of `source`, else this tree) watching `namespace`; its settled RSS and peak."""
    op = OperatorProcess(cluster.kubeconfig, namespace, log, ready_timeout=120)
    saved = processes.REPO
    try:
        if source is not None:  # OperatorProcess runs the operator/ found under REPO (and from there)
            processes.REPO = source
        op.start()
    finally:
        processes.REPO = saved
    try:
        return settled_rss(op, seconds)
    finally:
        op.stop()


def goals_missed(result: dict) -> list[str]:
    out = results.goal(result["pods_found"] == result["pods"], "pods_found", result["pods_found"],
                       f"== {result['pods']} (every pod created)")
    peak, bound = result["operator_peak_kib_per_pod"], PEAK_PER_POD_GOAL * result["annotation_kib"]
    out += results.goal(peak is not None and peak <= bound, "operator_peak_kib_per_pod", peak,
                        f"<= {bound} ({PEAK_PER_POD_GOAL}x a pod's annotations: its bulk is neither kept nor "
                        f"listed all at once)")
    return out


def main() -> int:
    a = parse_args()
    cluster = h.connect()
    k = h.Kubectl(cluster.kubeconfig)
    empty, ns = h.new_namespace(k, "bench-memory-idle"), h.new_namespace(k, "bench-memory")
    logs = Path(tempfile.mkdtemp(prefix="ddp-bench-memory-"))
    variants = {"current": ""} | ({"baseline": a.baseline} if a.baseline else {})
    figures: dict[str, dict] = {}
    try:
        t0 = time.time()
        identity = create_pods(k, ns, a.pods, a.annotation_kib)
        found = count_pods(k, ns)
        created_s = time.time() - t0
        h.log(f"{found} pods of {a.annotation_kib} KiB created in {created_s:.0f} s")
        for variant, rev in variants.items():
            with tree(rev) as source:
                idle, _ = measure(cluster, empty, source, logs / f"{variant}-idle.log", a.settle_s)
                loaded, peak = measure(cluster, ns, source, logs / f"{variant}.log", a.settle_s)
            figures[variant] = {"rss_idle_mib": round(idle, 1), "rss_mib": round(loaded, 1),
                                "peak_mib": round(peak, 1),
                                "kib_per_pod": round((loaded - idle) * 1024 / max(1, found), 1),
                                "peak_kib_per_pod": round((peak - idle) * 1024 / max(1, found), 1)}
            h.log(f"{variant}: {figures[variant]}")
        result = {
            "pods": a.pods,
            "annotation_kib": a.annotation_kib,
            "pods_found": found,
            "operator_peak_kib_per_pod": figures["current"]["peak_kib_per_pod"],
            "operator_kib_per_pod": figures["current"]["kib_per_pod"],
            "operator_rss_mib": figures["current"]["rss_mib"],
            "operator_peak_mib": figures["current"]["peak_mib"],
            "operator_rss_idle_mib": figures["current"]["rss_idle_mib"],
            "goal": {"operator_peak_kib_per_pod": PEAK_PER_POD_GOAL * a.annotation_kib},
            "created_s": round(created_s, 1),
            "created_as": identity,
            **({"baseline": {"rev": a.baseline, **figures["baseline"]}} if a.baseline else {}),
        }
    except BaseException:
        for f in sorted(logs.glob("*.log")):
            print(f"--- {f.name} ---\n" + "\n".join(f.read_text().splitlines()[-40:]), file=sys.stderr)
        raise
    finally:
        for n in (ns, empty):
            h.delete_namespace(k, n, wait=False)
    return results.emit_judged("operator_memory", result, goals_missed(result), mode="quick" if a.quick else "full",
                               record=a.record)


if __name__ == "__main__":
    sys.exit(main())
