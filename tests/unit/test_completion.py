"""Completion is the `trainer` container's, not the pod's: a sidecar that keeps a pod Running neither holds a
finished job in Running nor hides a failed trainer."""

from ddp_operator import names
from ddp_operator.observed import observe_pod
from ddp_operator.plan import CREATE, DELETE, plan

from ddp_builders import later, make_job, observed, rdzv, trainer


def _acts(p):
    return sorted((a.verb, a.name) for a in p.actions)


def _running(**kw):
    job = make_job(**kw)
    first = plan(job, {}, observed(service_exists=False), later(0))
    return job, plan(job, first.status, observed(rdzv(), trainer(0), trainer(1)), later(0)).status


def with_sidecar(pod, native=False):
    """`pod` plus a sidecar still running: a classic one in containers, or a native one (an init container with
    restartPolicy Always). The pod phase stays Running in both cases while the sidecar runs."""
    sidecar = {"name": "log-shipper", "state": {"running": {"startedAt": "2025-01-01T12:00:00Z"}}}
    key = "initContainerStatuses" if native else "containerStatuses"
    pod["status"].setdefault(key, []).append(sidecar)
    return pod


def test_trainer_exit_0_is_success_while_a_sidecar_keeps_the_pod_running():
    state = observe_pod(with_sidecar(trainer(0, phase="Running", exit_code=0)))
    assert state.succeeded and state.terminal and state.lingering and not state.running and not state.ready


def test_classic_sidecar_does_not_keep_the_job_running():
    job, status = _running()
    pods = [with_sidecar(trainer(i, phase="Running", exit_code=0)) for i in range(2)]
    p = plan(job, status, observed(rdzv(), *pods), later(5))
    assert p.status["phase"] == names.PHASE_SUCCEEDED
    # cleanPodPolicy Running (the default): pods still running because of their sidecar are stopped too.
    assert _acts(p) == [(DELETE, "mnist-0"), (DELETE, "mnist-1"), (DELETE, "mnist-rdzv")]
    assert p.status["nodes"]["succeeded"] == 2 and p.status["nodes"]["running"] == 0


def test_native_sidecar_pod_that_ended_is_success_as_before():
    job, status = _running()
    pods = [with_sidecar(trainer(i, phase="Succeeded", exit_code=0), native=True) for i in range(2)]
    p = plan(job, status, observed(rdzv(), *pods), later(5))
    assert p.status["phase"] == names.PHASE_SUCCEEDED
    assert _acts(p) == [(DELETE, "mnist-rdzv")]


def test_native_sidecar_still_stopping_is_success_too():
    """The kubelet stops native sidecars itself: the pods are left to end (and kept, cleanPodPolicy Running)."""
    job, status = _running()
    pods = [with_sidecar(trainer(i, phase="Running", exit_code=0), native=True) for i in range(2)]
    p = plan(job, status, observed(rdzv(), *pods), later(5))
    assert p.status["phase"] == names.PHASE_SUCCEEDED and _acts(p) == [(DELETE, "mnist-rdzv")]


def test_trainer_ended_before_the_pod_phase_caught_up():
    """The kubelet reports the container before the phase: such a pod is not stopped, it ends by itself."""
    state = observe_pod(trainer(0, phase="Running", exit_code=0))
    assert state.succeeded and not state.lingering
    job, status = _running()
    p = plan(job, status, observed(rdzv(), *(trainer(i, phase="Running", exit_code=0) for i in range(2))), later(5))
    assert p.status["phase"] == names.PHASE_SUCCEEDED and _acts(p) == [(DELETE, "mnist-rdzv")]


def test_clean_pod_policy_none_leaves_lingering_pods():
    job, status = _running(runPolicy={"cleanPodPolicy": "None"})
    pods = [with_sidecar(trainer(i, phase="Running", exit_code=0)) for i in range(2)]
    p = plan(job, status, observed(rdzv(), *pods), later(5))
    assert p.status["phase"] == names.PHASE_SUCCEEDED and p.actions == ()


def test_trainer_failure_while_a_sidecar_keeps_the_pod_running_is_restarted_in_place():
    """restartPolicy OnFailure (as rendered): the kubelet restarts the failed trainer container, sidecar or not."""
    job, status = _running()
    failed = with_sidecar(trainer(1, phase="Running", exit_code=3))
    p = plan(job, status, observed(rdzv(), trainer(0), failed), later(5))
    assert p.status["phase"] == names.PHASE_RESTARTING and p.status["restarts"] == 1
    assert p.status["attempts"][-1]["exitCode"] == 3 and p.status["attempts"][-1]["restartCount"] == 1
    assert _acts(p) == []


def test_trainer_failure_while_a_sidecar_keeps_a_never_pod_running_is_a_failure():
    """A template with restartPolicy Never: the pod is replaced, as before."""
    job, status = _running()
    failed = with_sidecar(trainer(1, phase="Running", exit_code=3, restart_policy="Never"))
    p = plan(job, status, observed(rdzv(), trainer(0), failed), later(5))
    assert p.status["phase"] == names.PHASE_RESTARTING and p.status["restarts"] == 1
    assert p.status["attempts"][-1]["exitCode"] == 3
    assert _acts(p) == [(DELETE, "mnist-1")]
    # Still there while its sidecar stops: not replaced yet, not counted again.
    deleting = with_sidecar(trainer(1, phase="Running", exit_code=3, deleting_since=later(5), restart_policy="Never"))
    again = plan(job, p.status, observed(rdzv(), trainer(0), deleting), later(6))
    assert again.status["restarts"] == 1 and (CREATE, "mnist-1") not in _acts(again)


def test_permanent_exit_of_the_trainer_container_fails_the_job_despite_the_pod_phase():
    job, status = _running(failurePolicy={"permanentExitCodes": [3]})
    p = plan(job, status, observed(rdzv(), trainer(0), with_sidecar(trainer(1, phase="Running", exit_code=3))),
             later(5))
    assert p.status["phase"] == names.PHASE_FAILED and p.status["reason"] == names.REASON_PERMANENT_EXIT
    # The job failed: every pod still running is stopped, the failed one with its sidecar included.
    assert _acts(p) == [(DELETE, "mnist-0"), (DELETE, "mnist-1"), (DELETE, "mnist-rdzv")]
