"""Checkpoint on eviction, on real pods: every trainer pod of a job evicted at once through the eviction API (what
`kubectl drain` does to each pod, and what a node-pressure eviction or a spot-node notice handler does: SIGTERM, then
the pod's grace period).

A 2-node digits job with a checkpoint volume (`spec.checkpoint`, a hostPath of the node) whose periodic checkpoint is
so rare (every 1000 steps) that it never helps: only the checkpoint ddp_trainer writes on SIGTERM, of the last
completed step, can bring the job back near where it was. Both pods are evicted once rank 0 is past step 20, and no
`/dev/shm` snapshot survives them. The replacements must resume from the disk, at most one step behind the highest
step any rank logged before the eviction (ddp_trainer.testing.steps_lost over the evicted pods' own logs, followed
until they ended), `status.lastRecovery` must say so (`resumedFrom: disk`, and the same `stepsLost`: the mark rank 0
left beside its checkpoint), the evictions are disruptions that spend no backoffLimit, and the job ends with weights
bitwise equal to those of an untouched job of the same seed, trained side by side.

The node is never cordoned or drained (the embedded cluster has one node, shared with the other tests): the eviction
API is called per pod, as `kubectl drain` does.
"""

from __future__ import annotations

import shutil

from tests.e2e import harness as h

STEP_DELAY = 0.15
EVICT_AT_STEP = 22  # past the first epoch's last step (20), well before the end
CHECKPOINT_EVERY = 1000  # never reached: only the SIGTERM checkpoint is on the disk when the pods go
EPOCHS = 4  # 20 steps each
SUCCEED_TIMEOUT = 240


def _digest(kubectl, ns: str, job: str) -> str | None:
    final = [e for e in h.job_events(kubectl, ns, job) if e.event == "final"]
    return final[-1].fields.get("weights_sha256") if final else None


def test_every_pod_evicted_resumes_from_the_sigterm_checkpoint_losing_at_most_one_step(kubectl, ns, request):
    host_dir = f"{h.SHARED_HOST_DIR}/{ns}-checkpoints"
    request.addfinalizer(lambda: shutil.rmtree(host_dir, ignore_errors=True))
    job = h.with_disk_checkpoint(h.digits_job("ev", nodes=2, step_delay=STEP_DELAY, epochs=EPOCHS), host_dir,
                                 every=CHECKPOINT_EVERY)
    h.apply(kubectl, ns, [job, h.digits_job("same", nodes=2, epochs=EPOCHS)])  # `same`: never interrupted

    _, prog = h.wait_rank0_step(kubectl, ns, "ev", EVICT_AT_STEP, 240)
    old = {p["metadata"]["name"]: p["metadata"]["uid"] for p in h.trainer_pods(kubectl, ns, "ev")}
    followers = h.follow_logs(kubectl, ns, sorted(old))
    evicted_at = h.evict_pods(kubectl, ns, sorted(old))
    h.log(f"evicted {sorted(old)} at rank 0's step >= {prog['step']}")

    # Every evicted pod ends (its containers exit: the followers' streams close); the operator replaces each.
    before = sorted((e for f in followers for e in h.events(f.text(), f.pod)), key=lambda e: e.time)
    sigterm = [e for e in before if e.event == "checkpoint" and e.fields.get("reason") == "sigterm"]
    assert sigterm, "rank 0 wrote no checkpoint on SIGTERM:\n" + "\n".join(
        f"{e.pod} {e.event} {e.fields}" for e in before if e.time >= evicted_at - 1)
    saved = sigterm[-1].int("step")
    rec = h.recovery_after(kubectl, ns, "ev", evicted_at, timeout=180)
    pods = h.trainer_pods(kubectl, ns, "ev")
    assert {p["metadata"]["name"] for p in pods} == set(old) and not {p["metadata"]["uid"] for p in pods} & \
        set(old.values()), "the evicted pods were not replaced under their names"
    assert rec.source == "checkpoint", rec  # the trainer's log word for the disk
    assert rec.resumed_from == saved >= prog["step"], (rec, saved, prog)
    logged = [(e.time, e.int("step")) for e in before if e.event == "step"]
    lost = h.steps_lost(logged, rec.resumed_from, rec.restored_at)
    assert lost is not None and lost <= 1, (lost, rec, max(s for _, s in logged))

    st = h.wait_phase(kubectl, ns, "ev", "Succeeded", SUCCEED_TIMEOUT)
    last = st.get("lastRecovery") or {}
    assert last.get("resumedFrom") == "disk" and last.get("fault") == "NodeDisrupted", last
    # rank 0's mark beside its checkpoint says what the logs say: no rank gets past the step rank 0 reaches
    assert last.get("stepsLost") == lost, (last, lost)
    assert st.get("disruptions") == len(old) and st.get("restarts", 0) == 0, st  # no backoffLimit spent
    evictions = [a for a in st.get("attempts") or [] if a.get("uid") in old.values()]
    assert len(evictions) == len(old) and not any(a.get("counted") for a in evictions), st.get("attempts")
    failure = st.get("lastFailure") or {}  # an eviction is the infrastructure's, and spends no budget
    assert (failure.get("class"), failure.get("budget")) == ("Infrastructure", "none"), failure

    h.wait_phase(kubectl, ns, "same", "Succeeded", SUCCEED_TIMEOUT)
    digests = {name: _digest(kubectl, ns, name) for name in ("ev", "same")}
    assert digests["ev"] and digests["ev"] == digests["same"], f"the evicted job's weights differ: {digests}"
    print(f"eviction at rank 0's step >= {prog['step']}: SIGTERM checkpoint of step {saved} "
          f"(by the {sigterm[-1].fields.get('by', 'worker')}, {sigterm[-1].fields.get('seconds')} s), training again "
          f"{rec.seconds} s after the eviction, {lost} step(s) lost; status.lastRecovery {last}")
