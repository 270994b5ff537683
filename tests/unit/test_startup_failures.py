"""Pods that cannot start and pods on lost nodes (plan/startup.py and plan/nodes.py):
what a user sees in status and Events, when the job gives up, and what is deleted and recreated."""

from ddp_operator import names
from ddp_operator.observed import NodeState, observe_node, observe_pod
from ddp_operator.plan import CREATE, DELETE, FORCE_DELETE, node_lost_candidates, plan

from ddp_builders import NOW, later, make_job, observed, rdzv, trainer


def _acts(p):
    return sorted((a.verb, a.name) for a in p.actions)


def _cond(status, type_):
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def _waiting(pod, reason, message, container="trainer"):
    pod["status"]["containerStatuses"] = [{"name": container, "state": {"waiting": {"reason": reason,
                                                                                    "message": message}}}]
    return pod


PULL = 'Back-off pulling image "localhost/nope:1"'


def _created(job):
    return plan(job, {}, observed(service_exists=False), NOW).status


def _running(**spec):
    job = make_job(**spec)
    status = plan(job, _created(job), observed(rdzv(), trainer(0), trainer(1)), NOW).status
    assert status["phase"] == names.PHASE_RUNNING and "podsPendingSince" not in status
    return job, status


# --- observing --------------------------------------------------------------------------------------------------
def test_a_container_the_kubelet_cannot_start_is_observed_with_its_reason():
    p = observe_pod(_waiting(trainer(0, phase="Pending"), "ImagePullBackOff", PULL))
    assert p.startup_error == ("ImagePullBackOff", f"container trainer: {PULL}")
    config = observe_pod(_waiting(trainer(0, phase="Pending"), "CreateContainerConfigError",
                                  'couldn\'t find key nope in ConfigMap ml/cfg'))
    assert config.startup_error[0] == "CreateContainerConfigError" and "ConfigMap ml/cfg" in config.startup_error[1]
    # A container that did start and crashes is not a startup problem; nor is an ordinary pull in progress.
    assert observe_pod(_waiting(trainer(0), "CrashLoopBackOff", "back-off 10s")).startup_error is None
    assert observe_pod(_waiting(trainer(0, phase="Pending"), "ContainerCreating", "")).startup_error is None
    unschedulable = trainer(0, phase="Pending")
    unschedulable["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                              "message": "0/1 nodes are available: 1 Insufficient cpu."}]
    assert observe_pod(unschedulable).startup_error == ("Unschedulable", "0/1 nodes are available: 1 Insufficient cpu.")


def test_node_readiness_and_since_when():
    since = "2025-01-01T12:00:00Z"
    for status, ready in (("True", True), ("False", False), ("Unknown", False)):
        node = observe_node({"status": {"conditions": [{"type": "Ready", "status": status,
                                                          "lastTransitionTime": since}]}})
        assert node == NodeState(ready=ready, since=NOW)
    assert observe_node(None) == NodeState(ready=False, gone=True)
    # A node whose status is not what the API server's schema says (a hostile or broken apiserver proxy, an
    # aggregated API): not Ready, since unknown; nothing raised.
    for bad in ({}, {"status": None}, {"status": []}, {"status": {"conditions": "Ready"}},
                {"status": {"conditions": [None, "Ready", 7]}}, {"status": {"conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": "yesterday"}]}}, []):
        state = observe_node(bad)
        assert not state.gone and state.since is None, bad


# --- pods that cannot start -------------------------------------------------------------------------------------
def test_image_pull_failure_is_a_condition_an_event_and_the_status_message():
    job = make_job()
    status = _created(job)
    pulling = observed(rdzv(phase="Pending"), _waiting(trainer(0, phase="Pending"), "ErrImagePull", "not found"),
                       trainer(1, phase="Pending"))
    p = plan(job, status, pulling, later(3))
    cond = _cond(p.status, names.COND_PODS_NOT_STARTING)
    assert cond["status"] == "True" and cond["reason"] == "ErrImagePull"
    assert cond["message"] == "ErrImagePull: pod mnist-0, container trainer: not found"
    assert p.status["reason"] == "ErrImagePull"
    assert p.status["message"] == "0/2 training pods running; ErrImagePull: pod mnist-0, container trainer: not found"
    assert [(e.type, e.reason, e.message) for e in p.events] == [("Warning", "ErrImagePull", cond["message"])]
    # The kubelet backs off: the reason flips to ImagePullBackOff and back. The message follows, no new Event.
    backoff = observed(rdzv(phase="Pending"), _waiting(trainer(0, phase="Pending"), "ImagePullBackOff", PULL),
                       _waiting(trainer(1, phase="Pending"), "ImagePullBackOff", PULL))
    p2 = plan(job, p.status, backoff, later(8))
    assert p2.events == ()
    assert _cond(p2.status, names.COND_PODS_NOT_STARTING)["reason"] == "ErrImagePull"
    assert p2.status["reason"] == "ImagePullBackOff"
    assert p2.status["message"].endswith(f"ImagePullBackOff: pod mnist-0, container trainer: {PULL} (and 1 more pod)")
    assert p2.actions == ()  # nothing is recreated: the kubelet keeps retrying the same pods
    # Fixed (the image appeared): the condition turns False with a Normal Event.
    p3 = plan(job, p2.status, observed(rdzv(), trainer(0), trainer(1)), later(20))
    cond = _cond(p3.status, names.COND_PODS_NOT_STARTING)
    assert cond["status"] == "False" and cond["reason"] == names.REASON_PODS_STARTED
    assert ("Normal", names.REASON_PODS_STARTED) in [(e.type, e.reason) for e in p3.events]
    assert p3.status["phase"] == names.PHASE_RUNNING and p3.status["reason"] == names.REASON_RUNNING
    assert "podsPendingSince" not in p3.status


def test_a_config_error_of_the_store_pod_is_reported_too():
    job = make_job()
    obs = observed(_waiting(rdzv(phase="Pending"), "CreateContainerConfigError",
                            "couldn't find key k in ConfigMap ml/cfg", container=names.RDZV_CONTAINER),
                   trainer(0, phase="Pending"), trainer(1, phase="Pending"))
    p = plan(job, _created(job), obs, later(2))
    cond = _cond(p.status, names.COND_PODS_NOT_STARTING)
    assert cond["reason"] == "CreateContainerConfigError" and "pod mnist-rdzv" in cond["message"]
    assert "ConfigMap ml/cfg" in p.status["message"]


def test_a_refused_create_is_a_replica_failure_with_one_event_per_distinct_refusal():
    job = make_job()
    status = _created(job)
    quota = {n: f'cannot create Pod {n}: 403 Forbidden: pods "{n}" is forbidden: exceeded quota: q, '
                f'requested: pods=1, used: pods=1, limited: pods=1' for n in ("mnist-0", "mnist-1")}
    obs = observed(rdzv(phase="Pending"), refusals=quota)
    p = plan(job, status, obs, later(1))
    cond = _cond(p.status, names.COND_REPLICA_FAILURE)
    assert cond["status"] == "True" and cond["reason"] == names.REASON_CREATE_FAILED
    assert "exceeded quota: q" in cond["message"] and "mnist-0" in cond["message"] and "mnist-1" in cond["message"]
    assert p.status["reason"] == names.REASON_CREATE_FAILED and "exceeded quota" in p.status["message"]
    assert [(e.type, e.reason) for e in p.events] == [("Warning", names.REASON_CREATE_FAILED)]
    # The plan still asks for the pods: the shell retries them (with its backoff).
    assert (CREATE, "mnist-0") in _acts(p) and (CREATE, "mnist-1") in _acts(p)
    # Retried and refused the same way: no Event, no status change.
    again = plan(job, p.status, obs, later(5))
    assert again.events == () and again.status == p.status
    # A different refusal of one child: one Event for it alone.
    other = {**quota, "mnist-1": 'cannot create Pod mnist-1: 403 Forbidden: pods "mnist-1" is forbidden: '
                                 'violates PodSecurity "restricted:latest"'}
    changed = plan(job, again.status, observed(rdzv(phase="Pending"), refusals=other), later(9))
    assert [(e.reason, e.message) for e in changed.events] == [(names.REASON_CREATE_FAILED, other["mnist-1"])]
    # The quota is deleted: the pods are created, the condition turns False.
    ok = plan(job, changed.status, observed(rdzv(), trainer(0, phase="Pending"), trainer(1, phase="Pending")),
              later(12))
    cond = _cond(ok.status, names.COND_REPLICA_FAILURE)
    assert cond["status"] == "False" and cond["reason"] == names.REASON_CHILDREN_CREATED
    assert ok.status["reason"] == names.REASON_WAITING and ok.actions == ()


def test_a_foreign_child_and_a_refusal_do_not_fight_over_the_condition():
    job = make_job()
    refusal = {"mnist-1": "cannot create Pod mnist-1: 403 Forbidden: quota"}
    both = plan(job, _created(job), observed(rdzv(phase="Pending"), conflicts={"mnist-0": "pod ml/mnist-0 exists"},
                                             refusals=refusal), later(1))
    assert _cond(both.status, names.COND_REPLICA_FAILURE)["reason"] == names.REASON_CHILD_CONFLICT
    only_refused = plan(job, both.status, observed(rdzv(phase="Pending"), refusals=refusal), later(2))
    cond = _cond(only_refused.status, names.COND_REPLICA_FAILURE)
    assert cond["status"] == "True" and cond["reason"] == names.REASON_CREATE_FAILED
    steady = plan(job, only_refused.status, observed(rdzv(phase="Pending"), refusals=refusal), later(3))
    assert steady.status == only_refused.status and steady.events == ()  # lastTransitionTime does not move


def test_startup_timeout_fails_the_job_with_the_blocking_reason():
    job = make_job(failurePolicy={"startupTimeoutSeconds": 120})
    status = _created(job)
    assert status["podsPendingSince"] == "2025-01-01T12:00:00Z"
    stuck = observed(rdzv(), _waiting(trainer(0, phase="Pending"), "ImagePullBackOff", PULL),
                     _waiting(trainer(1, phase="Pending"), "ImagePullBackOff", PULL))
    p = plan(job, status, stuck, later(30))
    assert p.status["phase"] == names.PHASE_PENDING and p.requeue_after == 90
    assert p.status["podsPendingSince"] == "2025-01-01T12:00:00Z"
    failed = plan(job, p.status, stuck, later(120))
    assert failed.status["phase"] == names.PHASE_FAILED
    assert failed.status["reason"] == names.REASON_STARTUP_TIMEOUT
    assert "spec.failurePolicy.startupTimeoutSeconds=120" in failed.status["message"]
    assert f"ImagePullBackOff: pod mnist-0, container trainer: {PULL}" in failed.status["message"]
    assert ("Warning", names.REASON_STARTUP_TIMEOUT) in [(e.type, e.reason) for e in failed.events]
    assert _acts(failed) == [(DELETE, "mnist-0"), (DELETE, "mnist-1"), (DELETE, "mnist-rdzv")]
    assert "podsPendingSince" not in failed.status
    # Failed stays failed: nothing is created again.
    assert plan(job, failed.status, observed(), later(200)).actions == ()


# --- an image that cannot be pulled: status.lastFailure ---------------------------------------------------------
def test_an_image_pull_failure_is_the_last_failure_of_class_infrastructure_as_soon_as_seen():
    job = make_job(failurePolicy={"startupTimeoutSeconds": 120})
    pulling = observed(rdzv(), _waiting(trainer(0, phase="Pending", node="node-7"), "ErrImagePull", "not found"),
                       trainer(1, phase="Pending"))
    p = plan(job, _created(job), pulling, later(3))
    assert p.status["lastFailure"] == {
        "class": "Infrastructure", "reason": "ImagePull", "pod": "mnist-0", "node": "node-7",
        "message": "ErrImagePull: container trainer: not found", "time": "2025-01-01T12:00:03Z", "budget": "none"}
    assert p.status["restarts"] == 0 and "infraRestarts" not in p.status  # no budget spent: the pod never ran
    assert p.status["phase"] == names.PHASE_PENDING and p.actions == ()  # nothing else changes
    # The kubelet's retries (ImagePullBackOff and back, both pods now), a restarted operator: written once per pod.
    backoff = observed(rdzv(), _waiting(trainer(0, phase="Pending", node="node-7"), "ImagePullBackOff", PULL),
                       _waiting(trainer(1, phase="Pending"), "ErrImagePull", "not found"))
    p2 = plan(job, p.status, backoff, later(8))
    assert p2.status["lastFailure"] == p.status["lastFailure"]
    assert plan(job, p2.status, backoff, later(9)).status == p2.status
    # The job fails for it after startupTimeoutSeconds: the image pull is still the failure, no budget spent.
    failed = plan(job, p2.status, backoff, later(120))
    assert failed.status["reason"] == names.REASON_STARTUP_TIMEOUT
    assert failed.status["lastFailure"] == p.status["lastFailure"]
    assert failed.status["restarts"] == 0 and "infraRestarts" not in failed.status


def test_an_image_pull_replaces_an_older_failure_and_other_startup_problems_are_none():
    job, status = _running()
    oom = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=137,
                                                                    reason="OOMKilled")), later(10))
    assert oom.status["lastFailure"]["reason"] == "OOMKilled"
    # The replacement's image cannot be pulled: that is the last failure now, and it spends nothing more.
    pulling = observed(rdzv(), trainer(0), _waiting(trainer(1, phase="Pending", uid="new"), "InvalidImageName",
                                                    'Failed to apply default image tag "x:"'))
    p = plan(job, oom.status, pulling, later(20))
    assert p.status["lastFailure"]["reason"] == "ImagePull" and p.status["lastFailure"]["pod"] == "mnist-1"
    assert p.status["lastFailure"]["message"].startswith("InvalidImageName: container trainer: Failed to apply")
    assert (p.status["restarts"], p.status.get("infraRestarts")) == \
        (oom.status["restarts"], oom.status.get("infraRestarts"))
    # A container config error, a pod waiting for room: the condition or the timeout says so, no lastFailure.
    config = observed(rdzv(), _waiting(trainer(0, phase="Pending"), "CreateContainerConfigError", "no key k"),
                      trainer(1, phase="Pending"))
    assert "lastFailure" not in plan(job, _created(job), config, later(2)).status


def test_children_that_cannot_be_created_time_out_too():
    job = make_job(failurePolicy={"startupTimeoutSeconds": 60})
    refusal = {"mnist-rdzv": "cannot create Pod mnist-rdzv: 403 Forbidden: exceeded quota: q"}
    p = plan(job, _created(job), observed(trainer(0), trainer(1), refusals=refusal), later(60))
    assert p.status["reason"] == names.REASON_STARTUP_TIMEOUT
    assert "2/2 training pods" in p.status["message"] and "no rendezvous store" in p.status["message"]
    assert "exceeded quota: q" in p.status["message"]
    assert _acts(p) == [(DELETE, "mnist-0"), (DELETE, "mnist-1")]  # the refused store pod is not tried again


def test_startup_timeout_before_the_kubelet_reports_names_where_the_pods_stand():
    # The kubelet posts ErrImagePull only after its first retry: a timeout due before that still says where
    # the first pod stands (its container's waiting reason, or that it has no node), never a bare figure.
    job = make_job(failurePolicy={"startupTimeoutSeconds": 15})
    creating = observed(rdzv(), _waiting(trainer(0, phase="Pending"), "ContainerCreating", ""),
                        _waiting(trainer(1, phase="Pending"), "ContainerCreating", ""))
    failed = plan(job, _created(job), creating, later(15))
    assert failed.status["reason"] == names.REASON_STARTUP_TIMEOUT
    assert failed.status["message"].endswith(
        "startupTimeoutSeconds=15: pod mnist-0 is waiting in ContainerCreating, with no error reported by the "
        "kubelet yet (and 1 more pod not running)"), failed.status["message"]
    # Unscheduled (no node, no Unschedulable verdict yet); a waiting reason that is not one word is not shown.
    hostile = _waiting(trainer(0, phase="Pending", node=""), "Creating\n<b>now</b>", "")
    assert observe_pod(hostile).waiting == ""
    p = plan(job, _created(job), observed(rdzv(phase="Pending"), hostile, trainer(1)), later(15))
    assert "pod mnist-0 is not scheduled to a node yet, with no error reported by the kubelet yet (and 1 more pod " \
        "not running)" in p.status["message"], p.status["message"]
    # Only the store pod is not running: it is named.
    store = plan(job, _created(job), observed(rdzv(phase="Pending"), trainer(0), trainer(1)), later(15))
    assert "0/2" not in store.status["message"] and "pod mnist-rdzv is " in store.status["message"]


def test_startup_timeout_zero_never_fails_and_running_pods_reset_the_clock():
    never = make_job(failurePolicy={"startupTimeoutSeconds": 0})
    p = plan(never, _created(never), observed(rdzv(), trainer(0, phase="Pending"), trainer(1, phase="Pending")),
             later(10**6))
    assert p.status["phase"] == names.PHASE_PENDING and p.requeue_after is None
    # A recovery is a new wait: the clock starts at the failure, not at the job's start.
    job, status = _running(failurePolicy={"startupTimeoutSeconds": 100})
    failed = plan(job, status, observed(rdzv(), trainer(0), trainer(1, phase="Failed", exit_code=1)), later(1000))
    assert failed.status["podsPendingSince"] == "2025-01-01T12:16:40Z" and failed.requeue_after == 100
    back = plan(job, failed.status, observed(rdzv(), trainer(0), trainer(1, uid="new")), later(1050))
    assert back.status["phase"] == names.PHASE_RUNNING and "podsPendingSince" not in back.status


def test_elastic_job_training_with_min_nodes_does_not_time_out():
    job = make_job(nodes=3, minNodes=2, maxNodes=3, failurePolicy={"startupTimeoutSeconds": 60})
    obs = observed(rdzv(), trainer(0), trainer(1), _waiting(trainer(2, phase="Pending"), "ImagePullBackOff", PULL))
    p = plan(job, _created(job), obs, later(3600))
    assert p.status["phase"] != names.PHASE_FAILED and "podsPendingSince" not in p.status
    assert _cond(p.status, names.COND_PODS_NOT_STARTING)["status"] == "True"  # still shown


def test_unschedulable_pods_are_no_condition_but_name_the_timeout():
    job = make_job(failurePolicy={"startupTimeoutSeconds": 60})
    pods = [trainer(i, phase="Pending", node="") for i in range(2)]
    for p in pods:
        p["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                      "message": "0/1 nodes are available: 1 Insufficient cpu."}]
    p = plan(job, _created(job), observed(rdzv(), *pods), later(10))
    assert _cond(p.status, names.COND_PODS_NOT_STARTING) is None and p.events == ()  # an autoscaler may add room
    failed = plan(job, p.status, observed(rdzv(), *pods), later(60))
    assert failed.status["reason"] == names.REASON_STARTUP_TIMEOUT
    assert "Unschedulable: pod mnist-0, 0/1 nodes are available: 1 Insufficient cpu." in failed.status["message"]


def test_suspended_job_has_no_pending_clock():
    job = make_job(runPolicy={"suspend": True})
    p = plan(job, _created(make_job()), observed(), later(5))
    assert p.status["phase"] == names.PHASE_SUSPENDED and "podsPendingSince" not in p.status


# --- node loss --------------------------------------------------------------------------------------------------
def _on_dead_node(i, **kw):
    return trainer(i, node="node-2", ready=False, **kw)


def test_pods_on_a_node_notready_past_the_timeout_are_lost_and_recreated():
    job, status = _running()
    dead = {"node-2": NodeState(ready=False, since=later(0))}
    obs = observed(rdzv(), trainer(0), _on_dead_node(1), nodes=dead)
    assert [p.name for p in node_lost_candidates(obs.pods)] == ["mnist-1"]
    early = plan(job, status, obs, later(30))
    assert early.actions == () and early.requeue_after == 30
    lost = plan(job, status, obs, later(60))
    assert _acts(lost) == [(FORCE_DELETE, "mnist-1")]
    assert lost.status["disruptions"] == 1 and lost.status["restarts"] == 0
    attempt = lost.status["attempts"][-1]
    assert attempt["pod"] == "mnist-1" and attempt["reason"] == names.REASON_NODE_LOST and attempt["disruption"]
    assert attempt["counted"] is False and "node node-2 has been NotReady since" in attempt["message"]
    assert lost.status["phase"] == names.PHASE_RESTARTING
    assert (names.REASON_NODE_LOST, "Warning") in [(e.reason, e.type) for e in lost.events]
    # The DELETED event is late: the same pod seen again is force-deleted again, quietly, and not recorded twice.
    again = plan(job, lost.status, obs, later(61))
    assert _acts(again) == [(FORCE_DELETE, "mnist-1")] and again.events == ()
    assert again.status["disruptions"] == 1 and len(again.status["attempts"]) == 1
    # Gone: recreated under the same name (the scheduler places it once a node is Ready).
    gone = plan(job, again.status, observed(rdzv(), trainer(0), gone=[_on_dead_node(1)]), later(62))
    assert _acts(gone) == [(CREATE, "mnist-1")]


def test_a_lost_node_gets_one_event_naming_its_pods_not_one_per_pod():
    """A storm of 50 lost nodes under a 1,000-node job posted 201 Events, one per pod, ahead of the force deletions
    (1.1 s of the storm's recovery) and into `kubectl describe`. Now one per node, naming its pods."""
    nodes = 12
    job = make_job(nodes=nodes)
    pods = [trainer(i) for i in range(nodes)]
    status = plan(job, _created(job), observed(rdzv(), *pods), NOW).status
    on_a = [trainer(i, node="node-a", ready=False) for i in range(10)]
    on_b = [trainer(i, node="node-b", ready=False) for i in (10, 11)]
    dead = {n: NodeState(ready=False, since=later(0)) for n in ("node-a", "node-b")}
    lost = plan(job, status, observed(rdzv(), *on_a, *on_b, nodes=dead), later(60))
    assert len([a for a in _acts(lost) if a[0] == FORCE_DELETE]) == 12
    events = sorted(e.message for e in lost.events if e.reason == names.REASON_NODE_LOST and "force-deleted" in e.message)
    assert len(events) == 2, events
    assert events[0].startswith("node node-a has been NotReady since") and events[0].endswith(
        "pods mnist-0, mnist-1, mnist-2, mnist-3, mnist-4, mnist-5, mnist-6, mnist-7 and 2 more force-deleted, "
        "to be recreated")
    assert events[1].startswith("node node-b has been NotReady since") and "pods mnist-10, mnist-11 force" in events[1]
    assert len(lost.status["attempts"]) == 12  # every pod's attempt is recorded, as before


def test_node_loss_counts_when_disruptions_count():
    job, status = _running(failurePolicy={"countDisruptions": True})
    obs = observed(rdzv(), trainer(0), _on_dead_node(1), nodes={"node-2": NodeState(ready=False, since=later(0))})
    assert plan(job, status, obs, later(60)).status["restarts"] == 1


def test_the_store_pod_on_a_lost_node_is_lost_too():
    job, status = _running()
    store = rdzv(node="node-2", ready=False)
    p = plan(job, status, observed(store, trainer(0), trainer(1), nodes={"node-2": NodeState(ready=False)}),
             later(600))
    assert p.actions == ()  # no time known: wait
    gone_node = {"node-2": NodeState(ready=False, gone=True)}
    p = plan(job, status, observed(store, trainer(0), trainer(1), nodes=gone_node), later(1))
    assert (FORCE_DELETE, "mnist-rdzv") in _acts(p)
    # From here on it is the store-loss rule's: recorded once, as a disruption.
    assert p.status["attempts"][-1]["pod"] == "mnist-rdzv" and p.status["attempts"][-1]["disruption"]
    assert p.status["disruptions"] == 1


def test_ready_unknown_or_switched_off_leaves_pods_alone():
    job, status = _running()
    for nodes in ({"node-2": NodeState(ready=True, since=later(0))}, {"node-2": None}, {}):
        p = plan(job, status, observed(rdzv(), trainer(0), _on_dead_node(1), nodes=nodes), later(3600))
        assert FORCE_DELETE not in [a.verb for a in p.actions], nodes
    off, status = _running(failurePolicy={"nodeLostTimeoutSeconds": 0})
    p = plan(off, status, observed(rdzv(), trainer(0), _on_dead_node(1),
                                   nodes={"node-2": NodeState(ready=False, since=later(0))}), later(3600))
    assert FORCE_DELETE not in [a.verb for a in p.actions]
