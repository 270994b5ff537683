"""observe_pod: in-place restarts of the trainer container (restartPolicy OnFailure) are not pod ends."""

from ddp_operator.observed import observe_pod

from ddp_builders import rdzv, trainer


def test_failed_container_about_to_restart_is_a_restart_not_an_end():
    s = observe_pod(trainer(1, phase="Running", exit_code=137))
    assert not s.terminal and s.phase == "Running" and s.restarting and not s.running
    assert (s.restarts, s.restart_exit_code, s.exit_code) == (1, 137, None)


def test_restarted_container_reads_last_state():
    summary = "ChildFailedError\n  exitcode  : 3 (pid: 81)\n"
    s = observe_pod(trainer(1, restart_count=2, last_exit_code=1, last_message=summary))
    assert s.running and not s.restarting and s.restarts == 2
    assert s.restart_exit_codes == (1, 3) and s.exit_code is None and s.restart_finished_at is not None


def test_crash_loop_back_off_is_restarting():
    s = observe_pod(trainer(1, restart_count=3, last_exit_code=1, waiting="CrashLoopBackOff"))
    assert s.restarting and not s.running and s.restarts == 3 and not s.terminal


def test_never_pod_and_deleting_pod_end_as_before():
    never = observe_pod(trainer(1, phase="Running", exit_code=1, restart_policy="Never"))
    assert never.terminal and never.phase == "Failed" and never.restarts == 0
    deleting = observe_pod(trainer(1, phase="Running", exit_code=143, deleting_since=None))
    assert deleting.restarting  # not being deleted: the kubelet restarts it
    from ddp_builders import NOW
    gone_soon = observe_pod(trainer(1, phase="Running", exit_code=143, deleting_since=NOW))
    assert gone_soon.terminal and gone_soon.exit_code == 143 and not gone_soon.restarting


def test_exit_0_under_on_failure_is_success():
    s = observe_pod(trainer(0, phase="Succeeded", exit_code=0))
    assert s.succeeded and s.restarts == 0


def test_store_pod_never_has_restarts():
    s = observe_pod(rdzv(phase="Failed", exit_code=137))
    assert s.terminal and s.restarts == 0 and not s.restarting
