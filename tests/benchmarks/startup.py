#!/usr/bin/env python3
"""What the operator adds to a job's start-up (`make bench-startup`).

    tests/benchmarks/startup.py [--rounds 3] [--nodes 2] [--quick] [--record]

Each round, in a fresh namespace each:
- DDPJob: `kubectl apply` of a digits DDPJob -> every training pod Running, and -> the first training step
  (the timestamp of rank 0's first `event=step` log line).
- Baseline: the very same objects applied by hand with `kubectl apply`, without the operator: the headless
  Service, the rendezvous-store pod and the training pods, rendered by the operator's own pure functions
  (ddp_operator.service/rdzv/pod) minus the owner reference, so both runs start identical pods with the
  identical command, environment, image and resources. The difference is what the operator costs: watch
  latency, reconciling, its API calls.

The rounds alternate DDPJob and baseline (the image is cached on the node for both). Medians are reported.
Goal (issue 4): delta_s = apply_to_first_step_s - baseline_first_step_s <= 2 s.
The last line is one JSON object: apply_to_running_s, apply_to_first_step_s, baseline_first_step_s,
baseline_running_s, delta_s, rounds.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "operator"))
from tests.benchmarks import results  # noqa: E402
from tests.e2e import harness as h  # noqa: E402

from ddp_operator import pod as pod_render  # noqa: E402
from ddp_operator import rdzv as rdzv_render  # noqa: E402
from ddp_operator import service as service_render  # noqa: E402
from ddp_operator import spec as spec_model  # noqa: E402

JOB = "st"


def parse_args():
    """--rounds (DDPJob + baseline pairs), --quick, --record, --nodes."""
    return results.rounds_args(__doc__.split("\n")[0], 5,
                               lambda p: p.add_argument("--nodes", type=int, default=2))


def baseline_objects(manifest: dict, namespace: str) -> list[dict]:
    """The DDPJob's children as the operator renders them, as plain objects nobody owns."""
    body = {**manifest, "metadata": {**manifest["metadata"], "namespace": namespace, "uid": str(uuid.uuid4())}}
    job = spec_model.parse_job(body)
    objs = [service_render.render_service(job), rdzv_render.render_rdzv_pod(job, 0)]
    objs += [pod_render.render_trainer_pod(job, i, 0) for i in range(job.spec.nodes)]
    for o in objs:
        o["metadata"].pop("ownerReferences", None)
    return objs


def measure(k: h.Kubectl, ns: str, apply: callable, nodes: int, timeout: float = 300) -> dict:
    """apply() at t0; poll until every training pod runs and rank 0 logged its first step."""
    t0 = time.time()
    apply()
    t_apply_done = time.time()
    running_at = first_step_at = None
    deadline = time.monotonic() + timeout
    while first_step_at is None or running_at is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"no first step in {ns} after {timeout}s:\n" + h.dump_namespace(k, ns))
        pods = h.trainer_pods(k, ns, JOB)
        now = time.time()
        if running_at is None and len(pods) == nodes and all(h.running(p) for p in pods):
            running_at = now
        if running_at is not None:
            for p in pods:
                step = next((e for e in h.events(h.pod_logs(k, ns, p["metadata"]["name"], tail=50))
                             if e.event == "step"), None)
                if step is not None:
                    first_step_at = step.time
                    break
        time.sleep(0.2)
    return {"apply_s": round(t_apply_done - t0, 2), "running_s": round(running_at - t0, 2),
            "first_step_s": round(first_step_at - t0, 2)}


def median(values: list[float]) -> float | None:
    return h.p50(values)


def main() -> int:
    a = parse_args()
    _, k, op = h.start_operator()
    rounds: list[dict] = []
    try:
        for i in range(a.rounds):
            manifest = h.digits_job(JOB, nodes=a.nodes, epochs=1)
            ns = h.new_namespace(k, f"bench-startup-op-{i}")
            try:
                ddpjob = measure(k, ns, lambda: h.apply(k, ns, manifest), a.nodes)
            finally:
                h.delete_namespace(k, ns, wait=True)
            h.log(f"round {i}: DDPJob {ddpjob}")
            ns = h.new_namespace(k, f"bench-startup-base-{i}")
            try:
                objs = baseline_objects(manifest, ns)
                base = measure(k, ns, lambda: h.apply(k, ns, objs), a.nodes)
            finally:
                h.delete_namespace(k, ns, wait=True)
            h.log(f"round {i}: baseline {base}")
            rounds.append({"ddpjob": ddpjob, "baseline": base})
    finally:
        op.stop()
    op_first = median([r["ddpjob"]["first_step_s"] for r in rounds])
    base_first = median([r["baseline"]["first_step_s"] for r in rounds])
    result = {
        "apply_to_running_s": median([r["ddpjob"]["running_s"] for r in rounds]),
        "apply_to_first_step_s": op_first,
        "baseline_running_s": median([r["baseline"]["running_s"] for r in rounds]),
        "baseline_first_step_s": base_first,
        "delta_s": round(op_first - base_first, 2),
        # The same, paired by round (both halves of a round share the machine's load at the time).
        "delta_s_paired_p50": median([r["ddpjob"]["first_step_s"] - r["baseline"]["first_step_s"] for r in rounds]),
        "goal": {"delta_s": 2},
        "nodes": a.nodes,
        "rounds": rounds,
    }
    results.emit("startup", result, mode="quick" if a.quick else "full", record=a.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
