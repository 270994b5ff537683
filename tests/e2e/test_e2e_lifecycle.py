"""A job's life cycle on real pods, as a user drives it without Kueue, and a plain script's permanent failure.

- Kill, resize both ways, then suspend and resume: an elastic digits job (1..3 nodes, 2 wanted) with a disk
  checkpoint every 5 steps and a last call of 30 s loses a pod at its desired size: the group re-forms ONCE, at the
  SAME world size, losing at most one step. It is then scaled 2 -> 3 and 3 -> 1 while it trains: each time a group
  formed after the scale call trains at the new size, as the trainers' own lines report (tests/benchmarks/rounds.py,
  the measures `make bench-elastic` uses), growing sooner than the last call could have closed the round (the desired
  size closed it), and counts no failure. Then it is suspended (`spec.runPolicy.suspend: true`: no pod left, phase
  Suspended) and resumed: the trainer restores from its disk checkpoint, at or after the last checkpoint
  status.progress named, and the job Succeeds.
- A permanent exit code through the real path: a plain torchrun script (no ddp_trainer) exits 3 on rank 1; stock
  torchrun reports it in its ChildFailedError summary ("exitcode : 3"), which reaches the operator as the
  container's termination message (FallbackToLogsOnError); with `failurePolicy.permanentExitCodes: [3]` the job
  fails at once, reason PermanentExitCode, and says so in its status and an Event.
"""

from __future__ import annotations

import copy
import shutil
import time

from tests.benchmarks import rounds
from tests.e2e import harness as h

STEP_DELAY = 0.15
SUCCEED_TIMEOUT = 300
PERMANENT_EXIT = 3
# A round closed sooner than this after a kill or a scale call was closed by the desired size (spec.nodes agents in),
# not by the last call: torch's c10d waits lastCallTimeoutSeconds once minNodes joined, however many are wanted.
LAST_CALL = 30
STEPS_AT_SIZE = 5


def _suspend(kubectl, ns: str, name: str, value: bool) -> None:
    kubectl("patch", "ddpj", name, "-n", ns, "--type=merge", "-p",
            '{"spec": {"runPolicy": {"suspend": %s}}}' % str(value).lower())


def _at_size(kubectl, ns: str, after: float, size: int) -> float:
    """Seconds from `after` to rank 0's 5th step in a group formed after it at world size `size`."""
    def check():
        if h.status(kubectl, ns, "life").get("phase") in ("Failed", "Succeeded"):
            raise h.PhaseError(f"life ended: {h.status(kubectl, ns, 'life')}")
        return rounds.nth_step_at_size(h.job_events(kubectl, ns, "life"), after, size, STEPS_AT_SIZE)
    return round(h.wait_for_or_raise(check, 2 * LAST_CALL, f"{STEPS_AT_SIZE} steps at world size {size}",
                                     h.PhaseError) - after, 2)


def test_kill_and_resize_an_elastic_job_then_suspend_and_resume_from_the_disk_checkpoint(kubectl, ns, request):
    host_dir = f"{h.SHARED_HOST_DIR}/{ns}-checkpoints"
    request.addfinalizer(lambda: shutil.rmtree(host_dir, ignore_errors=True))
    job = h.with_disk_checkpoint(h.digits_job("life", nodes=2, min_nodes=1, max_nodes=3, step_delay=STEP_DELAY,
                                              epochs=5, spec={"torchrun": {"lastCallTimeoutSeconds": LAST_CALL}}),
                                 host_dir)
    h.apply(kubectl, ns, job)
    rank0, prog = h.wait_rank0_step(kubectl, ns, "life", 10, 240)
    assert prog["worldSize"] == 2, prog

    # A pod lost at the desired size (2 < maxNodes 3): one re-form, at the same size, no smaller group in between.
    victim = next(p["metadata"]["name"] for p in h.trainer_pods(kubectl, ns, "life") if p["metadata"]["name"] != rank0)
    killed_at = h.kill_pod(kubectl, ns, victim)
    rec = h.recovery_after(kubectl, ns, "life", killed_at, timeout=2 * LAST_CALL)
    took = _at_size(kubectl, ns, killed_at, 2)
    reforms = rounds.Reforms.of(h.job_events(kubectl, ns, "life"), killed_at, 2)
    assert reforms == rounds.Reforms(count=1, world_size_changes=0, sizes=(2,)), reforms
    assert rec.steps_lost is not None and rec.steps_lost <= 1, rec
    assert took < LAST_CALL, f"the kill's round waited for the last call ({took} s), not for the replacement: {rec}"
    failures = rounds.counted_failures(h.status(kubectl, ns, "life"))
    shrunk = prog

    # A resize each way trains at the new size, as soon as the wanted pods are in, and is no failure.
    for before, after in ((2, 3), (3, 1)):
        called = time.time()
        kubectl("scale", "ddpj/life", "-n", ns, f"--replicas={after}")
        took = _at_size(kubectl, ns, called, after)
        reforms = rounds.Reforms.of(h.job_events(kubectl, ns, "life"), called, before)
        assert reforms.sizes and reforms.sizes[-1] == after, reforms
        if after > before:  # a new pod reads the wanted size at its start
            assert took < LAST_CALL, f"{before} -> {after}: the round waited for the last call ({took} s): {reforms}"
        # Shrinking, the survivors learn the wanted size when their kubelet refreshes the pod's downward API file,
        # whose delay the kubelet decides: under load the round has waited the last call (31 s once in CI). The time
        # is a figure of `make bench-elastic` (resize down), not an outcome judged here.
        assert rounds.counted_failures(h.status(kubectl, ns, "life")) == failures, h.status(kubectl, ns, "life")
        _, shrunk = h.wait_rank0_step(kubectl, ns, "life", 1, 30)
        print(f"scale {before} -> {after}: {took} s to {STEPS_AT_SIZE} steps at {after}, {reforms}")
    assert shrunk["worldSize"] == 1 and shrunk["step"] >= prog["step"], f"training went back: {prog} -> {shrunk}"
    h.wait_for(lambda: [p["metadata"]["name"] for p in h.trainer_pods(kubectl, ns, "life")] == ["life-0"], 120,
               "only life-0 left")

    # Trained past a checkpoint at world size 1: status.progress names it.
    h.wait_rank0_step(kubectl, ns, "life", shrunk["step"] + 10, 240)
    checkpoint_step = h.wait_for(
        lambda: (h.status(kubectl, ns, "life").get("progress") or {}).get("lastCheckpointStep"), 60,
        "status.progress.lastCheckpointStep")
    _suspend(kubectl, ns, "life", True)
    st = h.wait_phase(kubectl, ns, "life", "Suspended", 120)
    h.wait_for(lambda: not h.trainer_pods(kubectl, ns, "life"), 120, "no trainer pod while suspended")
    suspended_at = time.time()

    _suspend(kubectl, ns, "life", False)
    rec = h.recovery_after(kubectl, ns, "life", suspended_at, timeout=240)
    assert rec.source == "checkpoint" and rec.resumed_from >= checkpoint_step, (rec, checkpoint_step)

    st = h.wait_phase(kubectl, ns, "life", "Succeeded", SUCCEED_TIMEOUT)
    assert rounds.counted_failures(st) == failures, f"resizes and a suspension are not failures: {st}"
    assert (h.final_accuracy(kubectl, ns, "life") or 0) >= 0.9, st.get("progress")
    reasons = [e["reason"] for e in kubectl.json("get", "events", "-n", ns, "--field-selector",
                                                 "involvedObject.kind=DDPJob")["items"]]
    assert {"JobSuspended", "JobResumed"} <= set(reasons), reasons
    print(f"kill at step {prog['step']}, suspended after checkpoint {checkpoint_step}: {rec}")


FAILING_SCRIPT = f'''\
import os, sys
import torch.distributed as dist

dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR/PORT
if dist.get_rank() == 1:
    print("rank 1: the dataset is not where it should be", file=sys.stderr, flush=True)
    sys.exit({PERMANENT_EXIT})
dist.barrier()  # rank 0 waits for a peer that is gone
'''


def test_a_plain_scripts_permanent_exit_code_fails_the_job_at_once(kubectl, ns):
    kubectl.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "script"},
                   "data": {"train.py": FAILING_SCRIPT}}, ns)
    job = h.digits_job("plain", nodes=2, spec={"failurePolicy": {"permanentExitCodes": [PERMANENT_EXIT]},
                                               "torchrun": {"maxRestarts": 0}})
    pod = job["spec"]["template"]["spec"]
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    trainer["command"] = ["torchrun", "/script/train.py"]  # stock torchrun, the user's script
    trainer["volumeMounts"] = copy.deepcopy(trainer.get("volumeMounts") or []) + \
        [{"name": "script", "mountPath": "/script"}]
    pod["volumes"] = (pod.get("volumes") or []) + [{"name": "script", "configMap": {"name": "script"}}]
    h.apply(kubectl, ns, job)

    st = h.wait_phase(kubectl, ns, "plain", "Failed", 240)
    assert st.get("reason") == "PermanentExitCode", st
    assert f"exit code {PERMANENT_EXIT}" in st.get("message", "") or \
        f"worker exit codes {PERMANENT_EXIT}" in st.get("message", ""), st.get("message")
    failed = next(c for c in st.get("conditions") or [] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "PermanentExitCode", failed
    h.wait_job_event(kubectl, ns, "plain", lambda e: (e.get("type"), e.get("reason")) == ("Warning", "PermanentExitCode"),
                     "Warning PermanentExitCode")
    print(f"plain script exit {PERMANENT_EXIT}: {st.get('message')}")
