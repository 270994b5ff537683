#!/usr/bin/env python3
"""What the operator adds to a job's start-up (`make bench-startup`).

    tests/benchmarks/startup.py [--rounds 3] [--nodes 2] [--quick] [--record]

Each round, in a fresh namespace each:
- DDPJob: `kubectl apply` of a digits DDPJob -> every training pod Running, and -> the first training step
  (the timestamp of rank 0's first `event=step` log line).
- DDPJob without diagnostics: the same with `spec.diagnostics.enabled: false` (no sidecar, no tools init container):
  what the diagnostics sidecar costs a start, paired by round (diagnostics_cost_s_paired_p50).
- Baseline: the very same objects applied by hand with `kubectl apply`, without the operator: the headless
  Service, the rendezvous-store pod and the training pods, rendered by the operator's own pure functions
  (ddp_operator.service/rdzv/pod) minus the owner reference, so both runs start identical pods with the
  identical command, environment, image and resources. The difference is what the operator costs: watch
  latency, reconciling, its API calls.

The rounds alternate DDPJob and baseline (the image is cached on the node for both). Medians are reported.
Goal (issue 4): delta_s = apply_to_first_step_s - baseline_first_step_s <= 2 s (a timing: reported, not judged).

Judged (goals_missed; the exit status is 1 when one is missed): every round of both kinds reached its first step, and
in every DDPJob round the operator made each child exactly once -- its Service, the rendezvous-store pod, the N
training pods and the NetworkPolicy where it makes one (in the rounds without diagnostics too): the UIDs seen under each name (every pod of the job at every
poll, every child once more when the first step was logged) number one, nothing else carries the job's label, no
container restarted and the job's status.attempts is empty (the operator saw no pod end). The pods are listed by
the poll that waits for the first step anyway (one list call for all of them, in both kinds of round), the rest in
one list call after it: nothing is waited for.
The last line is one JSON object: apply_to_running_s, apply_to_first_step_s, baseline_first_step_s,
baseline_running_s, delta_s, no_diagnostics_first_step_s, diagnostics_cost_s_paired_p50, rounds, goals_missed.
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

from ddp_operator import netpol as netpol_render  # noqa: E402
from ddp_operator import pod as pod_render  # noqa: E402
from ddp_operator import rdzv as rdzv_render  # noqa: E402
from ddp_operator import service as service_render  # noqa: E402
from ddp_operator import spec as spec_model  # noqa: E402

JOB = "st"
TIMEOUT = 300.0  # seconds from apply to the first step


def parse_args():
    """--rounds (DDPJob + baseline pairs), --quick, --record, --nodes."""
    return results.rounds_args(__doc__.split("\n")[0], 5,
                               lambda p: p.add_argument("--nodes", type=int, default=2))


def _parsed(manifest: dict, namespace: str) -> spec_model.Job:
    return spec_model.parse_job({**manifest, "metadata": {**manifest["metadata"], "namespace": namespace,
                                                          "uid": str(uuid.uuid4())}})


def baseline_objects(manifest: dict, namespace: str) -> list[dict]:
    """The DDPJob's children as the operator renders them, as plain objects nobody owns."""
    job = _parsed(manifest, namespace)
    objs = [service_render.render_service(job), rdzv_render.render_rdzv_pod(job, 0)]
    objs += [pod_render.render_trainer_pod(job, i, 0) for i in range(job.spec.nodes)]
    for o in objs:
        o["metadata"].pop("ownerReferences", None)
    return objs


def child_key(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def expected_children(manifest: dict) -> tuple[list[str], list[str]]:
    """(the children every DDPJob round must have, the one it may have: the NetworkPolicy, which the operator makes
    unless configured not to), named as the operator's own pure functions name them."""
    job = _parsed(manifest, "default")
    return (sorted(child_key(o) for o in baseline_objects(manifest, "default")),
            [child_key(netpol_render.render_network_policy(job, netpol_render.NetworkPolicyConfig()))])


class Children:
    """Every object labelled as the job's, over every look: the UIDs seen under each name ("Kind/name") and the most
    restarts its containers showed. A child made twice shows two UIDs, even where the first was gone by the end."""

    def __init__(self) -> None:
        self.uids: dict[str, set[str]] = {}
        self.restarts: dict[str, int] = {}

    def note(self, objs: list[dict]) -> None:
        for o in objs:
            key = child_key(o)
            self.uids.setdefault(key, set()).add(o["metadata"]["uid"])
            n = sum(c.get("restartCount", 0) for c in (o.get("status") or {}).get("containerStatuses") or [])
            self.restarts[key] = max(self.restarts.get(key, 0), n)

    def look(self, k: h.Kubectl, ns: str) -> None:
        """The job's pods, Services and NetworkPolicies now: one list call, no wait."""
        self.note(k.json("get", "pods,services,networkpolicies", "-n", ns, "-l", f"{h.LABEL_JOB}={JOB}")["items"])

    def summary(self) -> dict[str, dict[str, int]]:
        """"Kind/name" -> created (UIDs seen), restarts."""
        return {key: {"created": len(uids), "restarts": self.restarts[key]} for key, uids in sorted(self.uids.items())}


def measure(k: h.Kubectl, ns: str, apply: callable, nodes: int, seen: Children | None = None) -> dict:
    """apply() at t0; poll until every training pod runs and rank 0 logged its first step (first_step_s None: not
    within TIMEOUT). Every poll lists all the job's pods (the store pod too) and notes them in `seen`."""
    t0 = time.time()
    apply()
    t_apply_done = time.time()
    running_at = first_step_at = None
    seen = Children() if seen is None else seen
    deadline = time.monotonic() + TIMEOUT
    while first_step_at is None or running_at is None:
        if time.monotonic() > deadline:
            h.log(f"no first step in {ns} after {TIMEOUT} s:\n" + h.dump_namespace(k, ns))
            break
        every = k.json("get", "pods", "-n", ns, "-l", f"{h.LABEL_JOB}={JOB}")["items"]
        seen.note(every)
        pods = sorted((p for p in every if p["metadata"].get("labels", {}).get(h.LABEL_ROLE) == "trainer"),
                      key=lambda p: p["metadata"]["name"])
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
    return {"apply_s": round(t_apply_done - t0, 2), "running_s": results.difference(running_at, t0),
            "first_step_s": results.difference(first_step_at, t0)}


def without_diagnostics(manifest: dict) -> dict:
    """The job with spec.diagnostics.enabled false: no diagnostics sidecar, no tools init container."""
    return {**manifest, "spec": {**manifest["spec"], "diagnostics": {"enabled": False}}}


def ddpjob_round(k: h.Kubectl, manifest: dict, label: str, nodes: int) -> dict:
    """One DDPJob round in a fresh namespace: its times, the children the operator made and its attempts."""
    ns = h.new_namespace(k, label)
    try:
        seen = Children()
        out = measure(k, ns, lambda: h.apply(k, ns, manifest), nodes, seen)
        seen.look(k, ns)  # the Service and the NetworkPolicy, which no poll lists
        out["children"] = seen.summary()
        out["attempts"] = len(h.status(k, ns, JOB).get("attempts") or [])
        return out
    finally:
        h.delete_namespace(k, ns, wait=True)


def goals_missed(result: dict) -> list[str]:
    """Every round reached its first step; in every DDPJob round each child was made exactly once, nothing else
    carries the job's label, no container restarted and the operator recorded no attempt ([]: all held)."""
    expected, optional = set(result["children_expected"]), set(result["children_optional"])
    out = []
    for i, r in enumerate(result["rounds"]):
        for side in ("ddpjob", "no_diagnostics", "baseline"):
            out += results.goal(r[side]["first_step_s"] is not None, f"round {i} {side}: first_step_s",
                                r[side]["first_step_s"], f"a first step within {TIMEOUT:.0f} s")
        for side in ("ddpjob", "no_diagnostics"):
            op = r[side]
            made = op["children"]
            for key in sorted(expected | set(made)):
                c = made.get(key, {"created": 0, "restarts": 0})
                at = f"round {i} {side}: {key}"
                if key in expected or key in optional:
                    want = "exactly once" if key in expected else "exactly once where the operator makes one"
                    out += results.goal(c["created"] == 1, f"{at} created", c["created"], want)
                else:
                    out += results.goal(False, f"{at} created", c["created"], "0: not a child the operator makes")
                out += results.goal(c["restarts"] == 0, f"{at} restarts", c["restarts"], "0")
            out += results.goal(op["attempts"] == 0, f"round {i} {side}: status.attempts", op["attempts"],
                                "0 (no pod ended)")
    return out


def median(values: list[float | None]) -> float | None:
    return h.p50(results.measured(values))


def main() -> int:
    a = parse_args()
    _, k, op = h.start_operator()
    rounds: list[dict] = []
    try:
        for i in range(a.rounds):
            manifest = h.digits_job(JOB, nodes=a.nodes, epochs=1)
            ddpjob = ddpjob_round(k, manifest, f"bench-startup-op-{i}", a.nodes)
            h.log(f"round {i}: DDPJob {ddpjob}")
            bare = ddpjob_round(k, without_diagnostics(manifest), f"bench-startup-nodiag-{i}", a.nodes)
            h.log(f"round {i}: DDPJob without diagnostics {bare}")
            ns = h.new_namespace(k, f"bench-startup-base-{i}")
            try:
                objs = baseline_objects(manifest, ns)
                base = measure(k, ns, lambda: h.apply(k, ns, objs), a.nodes)
            finally:
                h.delete_namespace(k, ns, wait=True)
            h.log(f"round {i}: baseline {base}")
            rounds.append({"ddpjob": ddpjob, "no_diagnostics": bare, "baseline": base})
    finally:
        op.stop()
    op_first = median([r["ddpjob"]["first_step_s"] for r in rounds])
    base_first = median([r["baseline"]["first_step_s"] for r in rounds])
    expected, optional = expected_children(h.digits_job(JOB, nodes=a.nodes, epochs=1))
    result = {
        "apply_to_running_s": median([r["ddpjob"]["running_s"] for r in rounds]),
        "apply_to_first_step_s": op_first,
        "baseline_running_s": median([r["baseline"]["running_s"] for r in rounds]),
        "baseline_first_step_s": base_first,
        "delta_s": results.difference(op_first, base_first),
        # The same, paired by round (both halves of a round share the machine's load at the time).
        "delta_s_paired_p50": median([results.difference(r["ddpjob"]["first_step_s"], r["baseline"]["first_step_s"])
                                      for r in rounds]),
        # What the diagnostics sidecar costs a start (its tools init container and the sidecar), paired by round.
        "no_diagnostics_first_step_s": median([r["no_diagnostics"]["first_step_s"] for r in rounds]),
        "diagnostics_cost_s_paired_p50": median([results.difference(r["ddpjob"]["first_step_s"],
                                                                    r["no_diagnostics"]["first_step_s"])
                                                 for r in rounds]),
        "goal": {"delta_s": 2, "children": "each created exactly once, none restarted"},
        "nodes": a.nodes,
        "children_expected": expected,
        "children_optional": optional,
        "rounds": rounds,
    }
    return results.emit_judged("startup", result, goals_missed(result), mode="quick" if a.quick else "full",
                               record=a.record)


if __name__ == "__main__":
    sys.exit(main())
