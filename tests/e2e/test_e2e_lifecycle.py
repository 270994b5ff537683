"""A job's life cycle on real pods, as a user drives it without Kueue, and a plain script's permanent failure.

- Scale-down, then suspend and resume: an elastic digits job (1..2 nodes) with a disk checkpoint every 5 steps is
  scaled 2 -> 1 while it trains (the group re-forms at world size 1 and carries on; a scale-down is not a failure),
  then suspended (`spec.runPolicy.suspend: true`: no pod left, phase Suspended) and resumed: the trainer restores
  from its disk checkpoint, at or after the last checkpoint status.progress named, and the job Succeeds.
- A permanent exit code through the real path: a plain torchrun script (no ddp_trainer) exits 3 on rank 1; stock
  torchrun reports it in its ChildFailedError summary ("exitcode : 3"), which reaches the operator as the
  container's termination message (FallbackToLogsOnError); with `failurePolicy.permanentExitCodes: [3]` the job
  fails at once, reason PermanentExitCode, and says so in its status and an Event.
"""

from __future__ import annotations

import copy
import shutil
import time

from tests.e2e import harness as h

STEP_DELAY = 0.15
SUCCEED_TIMEOUT = 300
PERMANENT_EXIT = 3


def _suspend(kubectl, ns: str, name: str, value: bool) -> None:
    kubectl("patch", "ddpj", name, "-n", ns, "--type=merge", "-p",
            '{"spec": {"runPolicy": {"suspend": %s}}}' % str(value).lower())


def test_scale_down_then_suspend_and_resume_from_the_disk_checkpoint(kubectl, ns, request):
    host_dir = f"{h.SHARED_HOST_DIR}/{ns}-checkpoints"
    request.addfinalizer(lambda: shutil.rmtree(host_dir, ignore_errors=True))
    job = h.with_disk_checkpoint(h.digits_job("life", nodes=2, min_nodes=1, max_nodes=2, step_delay=STEP_DELAY,
                                              epochs=5, spec={"torchrun": {"lastCallTimeoutSeconds": 3}}), host_dir)
    h.apply(kubectl, ns, job)
    _, prog = h.wait_rank0_step(kubectl, ns, "life", 15, 240)
    assert prog["worldSize"] == 2, prog

    kubectl("scale", "ddpj/life", "-n", ns, "--replicas=1")
    _, shrunk = h.wait_for(lambda: (lambda r: r if r and r[1].get("worldSize") == 1 else None)(
        h.rank0(kubectl, ns, "life", 1)), 180, "training with world size 1")
    assert shrunk["step"] >= prog["step"], f"training went back after the scale-down: {prog} -> {shrunk}"
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
    assert st.get("restarts", 0) == 0, f"a scale-down and a suspension are not failures: {st}"
    assert (h.final_accuracy(kubectl, ns, "life") or 0) >= 0.9, st.get("progress")
    reasons = [e["reason"] for e in kubectl.json("get", "events", "-n", ns, "--field-selector",
                                                 "involvedObject.kind=DDPJob")["items"]]
    assert {"JobSuspended", "JobResumed"} <= set(reasons), reasons
    print(f"scale-down at step {prog['step']}, suspended after checkpoint {checkpoint_step}: {rec}")


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
    events = kubectl.json("get", "events", "-n", ns, "--field-selector",
                          "involvedObject.kind=DDPJob,involvedObject.name=plain")["items"]
    assert any(e["reason"] == "PermanentExitCode" and e["type"] == "Warning" for e in events), \
        [(e["type"], e["reason"]) for e in events]
    print(f"plain script exit {PERMANENT_EXIT}: {st.get('message')}")
