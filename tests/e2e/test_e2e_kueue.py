"""DDPJobs behind a real Kueue (hack/kueue.py installs the pinned release into the cluster): all-or-nothing
admission of a whole job, queueing behind a quota that fits one 2-node job, recovery of a killed pod without
Kueue evicting the job, and preemption by a higher-priority job with a resume from the checkpoint the preempted
job's rank 0 wrote on SIGTERM, at most one step behind.

The operator runs with its Kueue integration on (chart value kueue.enabled) from this module on. Each test gets
its own ClusterQueue (cluster-scoped, named after the test namespace), a LocalQueue in its namespace and a
ResourceFlavor with a node label and a toleration, so the tests can see the flavor applied to the pods.
"""

from __future__ import annotations

import shutil
import time

import pytest

from tests.e2e import harness as h

KUEUE_API = h.KUEUE_API
FLAVOR = "ddp-e2e-flavor"
FLAVOR_NODE_LABELS = {"kubernetes.io/os": "linux"}
FLAVOR_TOLERATION = {"key": "ddp.dev/e2e-flavor", "operator": "Exists", "effect": "NoSchedule"}
PRIORITIES = {"ddp-e2e-low": 10, "ddp-e2e-high": 1000}
STEP_DELAY = 0.1
RUN_TIMEOUT = 420


@pytest.fixture(scope="module")
def kueue(kueue_operator, kubectl):
    """Kueue and the operator's Kueue integration (tests/conftest.py `kueue_operator`, once per session), the flavor
    and the priority classes every test here uses."""
    shared = [{"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR},
               "spec": {"nodeLabels": FLAVOR_NODE_LABELS, "tolerations": [FLAVOR_TOLERATION]}}]
    shared += [{"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass", "metadata": {"name": name},
                "value": value, "description": "DDPJob e2e tests"} for name, value in PRIORITIES.items()]
    h.apply(kubectl, "default", shared)
    yield
    for obj in shared:
        kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found", "--wait=false",
                check=False)


@pytest.fixture
def operator(kueue, kueue_operator):
    """This module's operator: the session's, with its Kueue integration on (Kueue's CRDs exist before it watches them)."""
    return kueue_operator


@pytest.fixture
def queue(kubectl, ns):
    """A ClusterQueue whose quota fits one 2-node job (preempting lower priorities) and the LocalQueue `team-a`."""
    cq = h.kueue_queue(kubectl, ns, FLAVOR)
    yield cq
    kubectl("delete", "clusterqueue", cq, "--ignore-not-found", "--wait=false", check=False)


def queued_job(name: str, *, priority: str | None = None, checkpoint: str | None = None, checkpoint_every: int = 5,
               epochs: int = 4, step_delay: float = STEP_DELAY) -> dict:
    """The digits job in LocalQueue team-a; `checkpoint`: a directory of every node that outlives the pods
    (harness.with_disk_checkpoint), with a checkpoint every `checkpoint_every` steps."""
    job = h.digits_job(name, nodes=2, step_delay=step_delay, epochs=epochs)
    return h.queued(h.with_disk_checkpoint(job, checkpoint, every=checkpoint_every) if checkpoint else job, priority)


workload = h.workload


def wl_condition(wl: dict | None, type_: str) -> dict:
    return next((c for c in ((wl or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def suspended_condition(st: dict) -> dict:
    return next((c for c in st.get("conditions") or [] if c["type"] == "Suspended"), {})


def wait_reason(kubectl, ns: str, job: str, reason: str, timeout: float = 120) -> dict:
    def check():
        st = h.status(kubectl, ns, job)
        if st.get("phase") == "Failed":
            raise h.PhaseError(f"{ns}/{job} failed: {st.get('message')}")
        return st if st.get("reason") == reason else None
    return h.wait_for_or_raise(check, timeout, f"{ns}/{job} to have reason {reason}", h.PhaseError)


def test_jobs_queue_for_quota_and_run_one_after_the_other(kubectl, ns, queue):
    """Two 2-node jobs, quota for one: the second waits (Kueue's reason in its status) while the first runs, is
    placed by its flavor, survives a killed pod without Kueue evicting it and succeeds; then the second is
    admitted and succeeds."""
    h.apply(kubectl, ns, queued_job("first"))
    h.wait_rank0_step(kubectl, ns, "first", 1, 240)
    h.apply(kubectl, ns, queued_job("second"))

    st = wait_reason(kubectl, ns, "second", "Queued")
    assert st["phase"] == "Suspended", st
    h.wait_for(lambda: "insufficient" in h.status(kubectl, ns, "second").get("message", "")
               or "quota" in h.status(kubectl, ns, "second").get("message", ""), 60,
               "Kueue's reason (quota) in the queued job's message")
    assert not h.trainer_pods(kubectl, ns, "second"), "a queued job must have no pods"
    assert wl_condition(workload(kubectl, ns, "second"), "QuotaReserved").get("status") == "False"
    # Removing the queue label does not let a queued job past Kueue: its Workload still gates it, and it says so.
    kubectl("label", "ddpj", "second", "-n", ns, "kueue.x-k8s.io/queue-name-")
    h.wait_for(lambda: "was removed" in h.status(kubectl, ns, "second").get("message", ""), 60,
               "the queued job's message to say that its queue label was removed")
    assert not h.trainer_pods(kubectl, ns, "second"), "a job whose queue label was removed must stay held"

    # The first job is admitted as a whole and placed by the flavor Kueue assigned.
    first_st = h.status(kubectl, ns, "first")
    cond = suspended_condition(first_st)
    assert cond.get("status") == "False" and cond.get("reason") == "Admitted" and queue in cond.get("message", ""), \
        first_st
    wl = workload(kubectl, ns, "first")
    assert wl_condition(wl, "Admitted").get("status") == "True", wl
    assert wl["metadata"]["ownerReferences"][0]["kind"] == "DDPJob"
    assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("trainer", 2), ("rdzv", 1)]
    pods = kubectl.json("get", "pods", "-n", ns, "-l", f"{h.LABEL_JOB}=first")["items"]
    assert len(pods) == 3
    for pod in pods:
        assert pod["spec"].get("nodeSelector", {}).items() >= FLAVOR_NODE_LABELS.items(), pod["spec"]
        assert FLAVOR_TOLERATION in pod["spec"].get("tolerations", []), pod["spec"]

    # A killed pod of an admitted job is recovered by the operator; Kueue keeps the admission.
    rank0, prog = h.wait_rank0_step(kubectl, ns, "first", 25, 240)
    victim = next(p["metadata"]["name"] for p in h.trainer_pods(kubectl, ns, "first")
                  if p["metadata"]["name"] != rank0)
    killed_at = h.kill_pod(kubectl, ns, victim)
    rec = h.recovery_after(kubectl, ns, "first", killed_at, prog["step"], 180)
    assert rec.source == "peer" and rec.steps_lost is not None and rec.steps_lost <= 1, rec
    wl = workload(kubectl, ns, "first")
    assert wl_condition(wl, "Admitted").get("status") == "True", wl
    assert wl_condition(wl, "Evicted").get("status") != "True", wl
    assert h.status(kubectl, ns, "second").get("reason") == "Queued"

    done = h.wait_phase(kubectl, ns, "first", "Succeeded", RUN_TIMEOUT)
    assert done.get("infraRestarts") == 1 and done.get("restarts", 0) == 0 and done.get("disruptions", 0) == 0, done
    succeeded_at = time.time()
    h.wait_for(lambda: wl_condition(workload(kubectl, ns, "first"), "Finished").get("status") == "True", 60,
               "the first job's Workload to be Finished")
    assert wl_condition(workload(kubectl, ns, "first"), "Finished")["reason"] == "Succeeded"

    started = h.first_step_after(kubectl, ns, "second", 0, RUN_TIMEOUT)
    second = h.wait_phase(kubectl, ns, "second", "Succeeded", RUN_TIMEOUT)
    assert second.get("restarts", 0) == 0, second
    completion = h.parse_rfc3339(done.get("completionTime")) or succeeded_at
    print(f"kueue: first job Succeeded -> second job's first step: {started - completion:.1f} s")
    # Deleting a job deletes its Workload (owner reference).
    kubectl("delete", "ddpj", "first", "-n", ns, "--wait=true", timeout=120)
    h.wait_for(lambda: workload(kubectl, ns, "first") is None, 60, "the deleted job's Workload to go")


def test_preempted_job_resumes_from_its_checkpoint_after_readmission(kubectl, ns, queue, request):
    """A higher-priority job evicts a running one: its pods go (a disruption, not a failure) with their grace period,
    in which the low job's rank 0 writes a checkpoint of its last completed step (its periodic checkpoint, every 1000
    steps, never comes: the SIGTERM checkpoint is the only one); the high one runs and succeeds, then the evicted job
    is admitted again and resumes from that checkpoint, at most one step behind the highest step it logged."""
    host_dir = f"{h.SHARED_HOST_DIR}/{ns}-checkpoints"  # every node sees it: the job may come back on another
    request.addfinalizer(lambda: shutil.rmtree(host_dir, ignore_errors=True))
    h.apply(kubectl, ns, queued_job("low", priority="ddp-e2e-low", checkpoint=host_dir, checkpoint_every=1000,
                                    epochs=5))
    _, prog = h.wait_rank0_step(kubectl, ns, "low", 20, 240)
    followers = h.follow_logs(kubectl, ns, [p["metadata"]["name"] for p in h.trainer_pods(kubectl, ns, "low")])
    h.apply(kubectl, ns, queued_job("high", priority="ddp-e2e-high", step_delay=0.0, epochs=3))
    evicted_at = time.time()

    st = wait_reason(kubectl, ns, "low", "Evicted")
    assert st["phase"] == "Suspended" and "preempt" in st.get("message", "").lower(), st
    assert st.get("disruptions") == 1 and st.get("restarts", 0) == 0, st
    h.wait_for(lambda: not h.trainer_pods(kubectl, ns, "low"), 120, "the evicted job's pods to go")
    before = sorted((e for f in followers for e in h.events(f.text(), f.pod)), key=lambda e: e.time)
    sigterm = [e for e in before if e.event == "checkpoint" and e.fields.get("reason") == "sigterm"]
    assert sigterm, "the preempted job's rank 0 wrote no checkpoint on SIGTERM"

    high = h.wait_phase(kubectl, ns, "high", "Succeeded", RUN_TIMEOUT)
    assert high.get("restarts", 0) == 0, high
    # Readmitted once the high-priority job finished: it resumes from the SIGTERM checkpoint.
    rec = h.recovery_after(kubectl, ns, "low", evicted_at, None, RUN_TIMEOUT)
    assert rec.source == "checkpoint", rec  # the trainer's log word for the disk
    assert rec.resumed_from == sigterm[-1].int("step") >= prog["step"], (rec, sigterm[-1], prog)
    lost = h.steps_lost([(e.time, e.int("step")) for e in before if e.event == "step"], rec.resumed_from,
                        rec.restored_at)
    assert lost is not None and lost <= 1, (lost, rec)
    low = h.wait_phase(kubectl, ns, "low", "Succeeded", RUN_TIMEOUT)
    assert low.get("disruptions") == 1 and low.get("restarts", 0) == 0, low
    last = low.get("lastRecovery") or {}
    assert last.get("resumedFrom") == "disk", last
    assert last.get("stepsLost") == lost, (last, lost)  # rank 0's mark beside its checkpoint, as the logs say
    assert last.get("fault") == "Evicted", last  # the incident the eviction recorded names the recovery
    # What it cost: the preemption's wait is queued time, not recovering time.
    g = low.get("goodput") or {}
    assert g.get("recoveries") == 1 and g["seconds"]["queued"] > 0 and "Evicted" in g.get("byFault", {}), g
    print(f"kueue preemption: low job evicted at rank 0's step >= {prog['step']}, SIGTERM checkpoint of step "
          f"{rec.resumed_from}, {lost} step(s) lost; readmitted and training {rec.seconds:.1f} s after the "
          f"high-priority job arrived; status.lastRecovery {last}")


def test_scaling_an_admitted_job_follows_kueues_rules(kubectl, ns):
    """An admitted elastic job scaled down keeps its admission (no new Workload, it keeps training); scaled up
    beyond what Kueue admitted, its Workload is replaced by one of the new size and the job runs again once
    Kueue admits that."""
    cq = h.kueue_queue(kubectl, ns, FLAVOR, {"cpu": "450m", "memory": "2200Mi"})  # room for 3 trainers
    try:
        manifest = h.queued(h.digits_job("el", nodes=2, min_nodes=1, max_nodes=3, step_delay=STEP_DELAY, epochs=6))
        h.apply(kubectl, ns, manifest)
        h.wait_rank0_step(kubectl, ns, "el", 10, 240)
        first = workload(kubectl, ns, "el")
        assert [(p["name"], p["count"]) for p in first["spec"]["podSets"]] == [("trainer", 2), ("rdzv", 1)]

        kubectl("scale", "ddpj", "el", "-n", ns, "--replicas=1")
        h.wait_for(lambda: len([p for p in h.trainer_pods(kubectl, ns, "el") if h.running(p)]) == 1, 120,
                   "one trainer pod after the scale-down")
        assert workload(kubectl, ns, "el")["metadata"]["uid"] == first["metadata"]["uid"]
        st = h.status(kubectl, ns, "el")
        assert st["phase"] in ("Running", "Restarting") and suspended_condition(st).get("reason") == "Admitted", st

        kubectl("scale", "ddpj", "el", "-n", ns, "--replicas=3")
        def resized():
            wl = workload(kubectl, ns, "el")
            return wl if wl and wl["metadata"]["uid"] != first["metadata"]["uid"] else None
        second = h.wait_for(resized, 120, "a Workload of the new size")
        assert [(p["name"], p["count"]) for p in second["spec"]["podSets"]] == [("trainer", 3), ("rdzv", 1)]
        h.wait_for(lambda: wl_condition(workload(kubectl, ns, "el"), "Admitted").get("status") == "True", 120,
                   "the resized Workload to be admitted")
        h.wait_for(lambda: len([p for p in h.trainer_pods(kubectl, ns, "el") if h.running(p)]) == 3, 180,
                   "three trainer pods after the scale-up")
        done = h.wait_phase(kubectl, ns, "el", "Succeeded", RUN_TIMEOUT)
        assert done.get("restarts", 0) == 0, done  # a requeue is neither a failure nor a disruption
    finally:
        kubectl("delete", "clusterqueue", cq, "--ignore-not-found", "--wait=false", check=False)
