"""Real training on a real cluster: DDPJobs of the digits example run torchrun in the trainer image, and the
operator keeps them alive through pod kills and a scale-up.

Each test runs in its own namespace; jobs that mostly wait on their pods run side by side. Runs are slowed with the example's step delay only as much as a
kill or a scale-up in the middle of training needs: the machine has two cores, shared with the control
plane. "Rank 0" is whichever pod serves the progress endpoint (torch elastic assigns ranks at rendezvous,
not by pod index).
"""

from __future__ import annotations

from tests.e2e import harness as h

MIN_ACCURACY = 0.90
# 2 nodes x batch 32 over digits' 1258 training samples: 20 steps per epoch; early stopping (patience 3)
# usually ends a run after 6-10 epochs.
SUCCEED_TIMEOUT = 300
STEP_DELAY = 0.15  # s per step: a few seconds of training before and after a kill
KILL_AT_STEP = 25  # far enough in for a peer snapshot to exist, early enough to leave training after


def _pod_uids(kubectl, ns, job):
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in h.trainer_pods(kubectl, ns, job)}


def _assert_accuracy(kubectl, ns, job):
    acc = h.final_accuracy(kubectl, ns, job)
    assert acc is not None, f"no test accuracy in status.progress or in the logs: {h.status(kubectl, ns, job)}"
    assert acc >= MIN_ACCURACY, f"test accuracy {acc} < {MIN_ACCURACY}"
    return acc


def _assert_last_recovery(st: dict, rec) -> None:
    """status.lastRecovery tells the user what the logs say: where the state came from and the steps lost."""
    last = st.get("lastRecovery") or {}
    assert last.get("resumedFrom") == rec.source, (last, rec)
    assert last.get("stepsLost") == rec.steps_lost, (last, rec)
    assert last.get("fault") in ("NodeFailed", "NodeDisrupted"), last


def _kill(kubectl, ns, job, rank0_pod: bool) -> tuple[str, float, dict, str]:
    """Kill job's rank-0 pod or its other pod once rank 0 reached KILL_AT_STEP: (victim, killed at, progress, uid)."""
    rank0, prog = h.wait_rank0_step(kubectl, ns, job, KILL_AT_STEP, 240)
    before = _pod_uids(kubectl, ns, job)
    victim = rank0 if rank0_pod else next(name for name in before if name != rank0)
    return victim, h.kill_pod(kubectl, ns, victim), prog, before[victim]


def test_killed_pods_are_replaced_and_training_resumes_and_an_untouched_job_succeeds(kubectl, ns):
    """Three digits jobs side by side (they mostly wait on their pods): `digits` untouched, `kw` loses its worker
    pod (rank 0 survives), `k0` its rank-0 pod. Each killed pod is replaced under the same name by a new pod, the
    group resumes from the survivor's peer snapshot with at most the step in flight lost, exactly one restart is
    counted, status.lastRecovery says what the logs say, and every job reaches its accuracy."""
    for job, delay in (("digits", 0.0), ("kw", STEP_DELAY), ("k0", STEP_DELAY)):
        h.apply(kubectl, ns, h.digits_job(job, nodes=2, step_delay=delay))
    kills = {job: _kill(kubectl, ns, job, rank0_pod=job == "k0") for job in ("kw", "k0")}

    for job, (victim, killed_at, prog, uid) in kills.items():
        # Replaced under the same name (stable DNS identity), by a new pod.
        h.wait_for(lambda: _pod_uids(kubectl, ns, job).get(victim) not in (None, uid), 60,
                   f"{job}: a replacement for {victim}")
        rec = h.recovery_after(kubectl, ns, job, killed_at, prog["step"], 180)
        # the group re-formed around the survivor's state: resumed, not started over; the state came from the
        # surviving pod's snapshot (for k0, pod 1 handed it to the new rank 0's pod)
        assert rec.source == "peer" and rec.resumed_from > 0, f"{job}: training started over instead of resuming: {rec}"
        assert rec.steps_lost is not None and rec.steps_lost <= 1, rec
        st = h.wait_phase(kubectl, ns, job, "Succeeded", SUCCEED_TIMEOUT)
        # A killed pod is the infrastructure's: it spends infraBackoffLimit, never the user's backoffLimit.
        assert (st.get("infraRestarts"), st.get("restarts", 0)) == (1, 0), f"{job}: expected one counted restart: {st}"
        _assert_last_recovery(st, rec)
        _assert_accuracy(kubectl, ns, job)
        print(f"{job}: {'rank-0' if job == 'k0' else 'worker'} kill at step {prog['step']}: {rec}")

    st = h.wait_phase(kubectl, ns, "digits", "Succeeded", SUCCEED_TIMEOUT)
    _assert_accuracy(kubectl, ns, "digits")
    assert st.get("restarts", 0) == 0, st
    conditions = {c["type"]: c["status"] for c in st.get("conditions", [])}
    assert conditions.get("Succeeded") == "True", st
    # Both nodes trained in one group of world size 2.
    assert ((st.get("progress") or {}).get("worldSize")) == 2, st.get("progress")


def test_scale_two_to_three_mid_run(kubectl, ns):
    job = h.digits_job("sc", nodes=2, min_nodes=2, max_nodes=3, step_delay=STEP_DELAY,
                       spec={"torchrun": {"lastCallTimeoutSeconds": 3}})
    h.apply(kubectl, ns, job)
    _, prog = h.wait_rank0_step(kubectl, ns, "sc", KILL_AT_STEP, 240)
    assert prog["worldSize"] == 2, prog
    kubectl("scale", "ddpj/sc", "-n", ns, "--replicas=3")
    assert h.job(kubectl, ns, "sc")["spec"]["nodes"] == 3

    # The third pod joins and the group re-forms with three nodes, resuming where it was.
    _, grown = h.wait_for(lambda: (lambda r: r if r and r[1].get("worldSize") == 3 else None)(
        h.rank0(kubectl, ns, "sc", 1)), 180, "training with world size 3")
    assert grown["step"] >= prog["step"], (prog, grown)
    pods = h.trainer_pods(kubectl, ns, "sc")
    assert sorted(p["metadata"]["name"] for p in pods) == ["sc-0", "sc-1", "sc-2"]

    st = h.wait_phase(kubectl, ns, "sc", "Succeeded", SUCCEED_TIMEOUT)
    _assert_accuracy(kubectl, ns, "sc")
    assert st.get("restarts", 0) == 0, f"a scale-up is not a failure: {st}"
