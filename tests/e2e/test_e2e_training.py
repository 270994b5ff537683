"""Real training on a real cluster: DDPJobs of the digits example run torchrun in the trainer image, and the
operator keeps them alive through pod kills and a scale-up.

Each test is one job in its own namespace. Runs are slowed with the example's step delay only as much as a
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


def test_two_node_digits_job_succeeds_with_accuracy(kubectl, ns):
    h.apply(kubectl, ns, h.digits_job("digits", nodes=2))
    st = h.wait_phase(kubectl, ns, "digits", "Succeeded", SUCCEED_TIMEOUT)
    _assert_accuracy(kubectl, ns, "digits")
    assert st.get("restarts", 0) == 0, st
    conditions = {c["type"]: c["status"] for c in st.get("conditions", [])}
    assert conditions.get("Succeeded") == "True", st
    # Both nodes trained in one group of world size 2.
    assert ((st.get("progress") or {}).get("worldSize")) == 2, st.get("progress")


def _assert_last_recovery(st: dict, rec) -> None:
    """status.lastRecovery tells the user what the logs say: where the state came from and the steps lost."""
    last = st.get("lastRecovery") or {}
    assert last.get("resumedFrom") == rec.source, (last, rec)
    assert last.get("stepsLost") == rec.steps_lost, (last, rec)
    assert last.get("fault") in ("NodeFailed", "NodeDisrupted"), last


def test_killed_worker_pod_is_replaced_and_training_resumes(kubectl, ns):
    h.apply(kubectl, ns, h.digits_job("kw", nodes=2, step_delay=STEP_DELAY))
    rank0, prog = h.wait_rank0_step(kubectl, ns, "kw", KILL_AT_STEP, 240)
    before = _pod_uids(kubectl, ns, "kw")
    victim = next(name for name in before if name != rank0)
    killed_at = h.kill_pod(kubectl, ns, victim)

    # Replaced under the same name (stable DNS identity), by a new pod.
    h.wait_for(lambda: (lambda uids: uids.get(victim) not in (None, before[victim]))(_pod_uids(kubectl, ns, "kw")),
               60, f"a replacement for {victim}")
    rec = h.recovery_after(kubectl, ns, "kw", killed_at, prog["step"], 180)
    assert rec.resumed_from > 0, f"training started over instead of resuming: {rec}"
    # rank 0 survived: the replacement got the state from its peer's snapshot, at most the step in flight lost
    assert rec.source == "peer", rec
    assert rec.steps_lost is not None and rec.steps_lost <= 1, rec

    st = h.wait_phase(kubectl, ns, "kw", "Succeeded", SUCCEED_TIMEOUT)
    assert st.get("restarts") == 1, f"expected exactly one counted restart: {st}"
    _assert_last_recovery(st, rec)
    _assert_accuracy(kubectl, ns, "kw")
    print(f"worker kill at step {prog['step']}: {rec}")


def test_killed_rank0_pod_job_still_succeeds(kubectl, ns):
    h.apply(kubectl, ns, h.digits_job("k0", nodes=2, step_delay=STEP_DELAY))
    rank0, prog = h.wait_rank0_step(kubectl, ns, "k0", KILL_AT_STEP, 240)
    uid = _pod_uids(kubectl, ns, "k0")[rank0]
    killed_at = h.kill_pod(kubectl, ns, rank0)

    h.wait_for(lambda: _pod_uids(kubectl, ns, "k0").get(rank0) not in (None, uid), 60, f"a replacement for {rank0}")
    rec = h.recovery_after(kubectl, ns, "k0", killed_at, prog["step"], 180)
    # the group re-formed around the survivor's state: resumed, not started over
    assert rec.source != "fresh" and rec.resumed_from > 0, f"training started over instead of resuming: {rec}"
    # pod 1 survived with its snapshot and handed it to the new rank 0's pod
    assert rec.source == "peer", rec
    assert rec.steps_lost is not None and rec.steps_lost <= 1, rec
    st = h.wait_phase(kubectl, ns, "k0", "Succeeded", SUCCEED_TIMEOUT)
    assert st.get("restarts") == 1, f"expected exactly one counted restart: {st}"
    _assert_last_recovery(st, rec)
    _assert_accuracy(kubectl, ns, "k0")
    print(f"rank-0 kill at step {prog['step']}: {rec}")


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
