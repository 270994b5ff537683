"""The operator against the real API server; the test plays the kubelet by patching pod status."""

from __future__ import annotations

import threading
import time

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from ddp_cluster import GROUP, NS_PREFIX, PLURAL, VERSION, owner_uids, wait_for

PODS = {"job-0", "job-1", "job-rdzv"}


def _uid(k, name):
    return k.pods()[name].metadata.uid


def _running(k, **spec):
    k.create_job(**spec)
    k.wait_pods(PODS)
    k.run_all()
    return k.wait_phase("Running")


def _settled(k, quiet=2.0):
    """The job and its pods once no resourceVersion among them has moved for `quiet` seconds."""
    last = {"rvs": None, "since": time.monotonic()}

    def still():
        job, pods = k.job(), {n: p.metadata.resource_version for n, p in k.pods().items()}
        rvs = (job["metadata"]["resourceVersion"], pods)
        if rvs != last["rvs"]:
            last.update(rvs=rvs, since=time.monotonic())
            return None
        return rvs if time.monotonic() - last["since"] >= quiet else None

    return wait_for(still, interval=0.5, what="the job and its pods holding still")


def test_create_is_idempotent_and_children_are_owned(k, operator):
    job = k.create_job()
    pods = k.wait_pods(PODS)
    svc = k.core.read_namespaced_service("job", k.ns)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses is True
    for p in list(pods.values()) + [svc]:
        assert owner_uids(p) == [job["metadata"]["uid"]]
    assert pods["job-0"].spec.hostname == "job-0" and pods["job-0"].spec.subdomain == "job"
    status = wait_for(lambda: k.status() if k.status().get("nodes", {}).get("active") == 2 else None,
                      what="status counts")
    assert status["phase"] == "Pending" and status["nodesReady"] == "0/2"
    assert [c["type"] for c in status["conditions"]] == ["Created"]
    uids = {n: p.metadata.uid for n, p in pods.items()}
    # Re-submitting the same object changes nothing.
    try:
        k.create_job()
        raise AssertionError("second create should conflict")
    except ApiException as e:
        assert e.status == 409
    time.sleep(1)  # nothing to wait for: asserting that nothing happens
    assert {n: p.metadata.uid for n, p in k.pods().items()} == uids
    assert len(k.core.list_namespaced_service(k.ns).items) == 1
    assert [e.reason for e in k.events()] == ["JobCreated"]


def test_failed_pod_is_replaced_and_counted(k):
    _running(k)
    old = _uid(k, "job-1")
    k.set_phase("job-1", "Failed", exit_code=1)
    status = k.wait_phase("Restarting")
    assert status["restarts"] == 1
    assert status["attempts"][-1]["pod"] == "job-1" and status["attempts"][-1]["exitCode"] == 1
    wait_for(lambda: "job-1" in k.pods() and _uid(k, "job-1") != old, what="replacement pod job-1")
    k.set_phase("job-1", "Running")
    status = k.wait_phase("Running")
    assert status["restarts"] == 1
    for reason in ("JobCreated", "AllNodesRunning", "NodeFailed"):
        k.wait_events(reason)


def test_operator_restart_changes_nothing(k, operator):
    # The write counters are process-wide: earlier tests' namespaces must be gone, or the restarted operator
    # replays their teardown (pods deleted under a live job, creates refused by NamespaceTerminating).
    wait_for(lambda: not [n for n in k.core.list_namespace(label_selector="ddpjob.dev/test=true").items
                          if n.metadata.name.startswith(NS_PREFIX) and n.metadata.name != k.ns],
             300, interval=1, what="earlier test namespaces deleted")
    _running(k)
    # The first operator's last writes (kopf's handled-configuration annotation follows the Running status) must
    # land before the snapshot.
    before_job_rv, before_pods = _settled(k)
    operator.restart()
    # The restarted operator has resumed the job once it has reconciled it.
    wait_for(lambda: (operator.metrics() or {}).get('ddpjob_reconcile_total{result="ok"}', 0) >= 1,
             what="a reconcile pass by the restarted operator")
    time.sleep(2)  # asserting that nothing happens: give stray writes a chance to show
    after = k.job()
    assert after["metadata"]["resourceVersion"] == before_job_rv
    assert {n: p.metadata.resource_version for n, p in k.pods().items()} == before_pods
    writes = {key: v for key, v in (operator.metrics() or {}).items() if key.startswith("ddpjob_api_writes_total")}
    assert writes == {}, writes


def test_budget_exhaustion_fails_the_job(k):
    _running(k, failurePolicy={"backoffLimit": 1, "incidentWindowSeconds": 0})
    k.set_phase("job-1", "Failed", exit_code=1)
    wait_for(lambda: k.status().get("restarts") == 1, what="first restart")
    wait_for(lambda: "job-1" in k.pods() and k.pods()["job-1"].status.phase == "Pending"
             and not k.pods()["job-1"].metadata.deletion_timestamp, what="replacement")
    k.set_phase("job-1", "Failed", exit_code=1)
    status = k.wait_phase("Failed")
    assert status["reason"] == "BackoffLimitExceeded"
    assert "backoffLimit=1" in status["message"]
    # Running pods are stopped; the failed one stays for its logs (cleanPodPolicy Running).
    wait_for(lambda: set(k.pods()) == {"job-1"} and k.pods()["job-1"].status.phase == "Failed",
             what="running pods stopped")
    k.wait_events("BackoffLimitExceeded", lambda e: e.type == "Warning")


def test_permanent_exit_code_fails_at_once(k):
    _running(k, failurePolicy={"permanentExitCodes": [42]})
    k.set_phase("job-0", "Failed", exit_code=42)
    status = k.wait_phase("Failed")
    assert status["reason"] == "PermanentExitCode" and status["restarts"] == 0
    assert "exit code 42" in status["message"]


def test_eviction_does_not_count(k):
    _running(k)
    old = _uid(k, "job-1")
    k.core.create_namespaced_pod_eviction("job-1", k.ns, {
        "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "job-1", "namespace": k.ns}})
    wait_for(lambda: "job-1" in k.pods() and _uid(k, "job-1") != old, what="replacement after eviction")
    status = wait_for(lambda: k.status() if k.status().get("disruptions") == 1 else None, what="disruption")
    assert status["restarts"] == 0
    # A kubelet eviction (phase Failed, reason Evicted) does not count either.
    k.set_phase("job-1", "Running")
    k.wait_phase("Running")
    k.core.patch_namespaced_pod_status("job-0", k.ns, {"status": {"phase": "Failed", "reason": "Evicted",
                                                                  "message": "low memory"}},
                                       _content_type="application/merge-patch+json")
    status = wait_for(lambda: k.status() if k.status().get("disruptions") == 2 else None, what="2nd disruption")
    assert status["restarts"] == 0


def test_suspend_and_resume(k):
    _running(k)
    k.patch_job("job", {"spec": {"runPolicy": {"suspend": True}}})
    status = k.wait_phase("Suspended")
    wait_for(lambda: not k.pods(), what="pods deleted")
    assert "startTime" not in status
    k.patch_job("job", {"spec": {"runPolicy": {"suspend": False}}})
    k.wait_pods(PODS)
    status = k.wait_phase("Pending")
    suspended = [c for c in status["conditions"] if c["type"] == "Suspended"][0]
    assert suspended["status"] == "False" and suspended["reason"] == "JobResumed"
    assert status["restarts"] == 0


def test_deadline(k):
    k.create_job(runPolicy={"activeDeadlineSeconds": 3})
    k.wait_pods(PODS)
    status = k.wait_phase("Failed", timeout=20)
    assert status["reason"] == "DeadlineExceeded"
    wait_for(lambda: not k.pods(), what="pods stopped")


def test_success_and_ttl(k):
    _running(k, runPolicy={"ttlSecondsAfterFinished": 3, "cleanPodPolicy": "Running"})
    k.set_phase("job-0", "Succeeded", exit_code=0,
                message='{"step": 50, "loss": 0.1, "metrics": {"testAccuracy": 0.95}, "final": true}')
    status = wait_for(lambda: k.status() if k.status().get("reason") == "TrainingSucceeded" else None,
                      what="waiting for the other pod")
    assert status["phase"] == "Running"
    k.set_phase("job-1", "Succeeded", exit_code=0)
    status = k.wait_phase("Succeeded")
    assert status["progress"]["metrics"]["testAccuracy"] == 0.95
    wait_for(lambda: "job-rdzv" not in k.pods(), what="store pod cleaned up")
    wait_for(lambda: not k.jobs(), timeout=20, what="TTL deletion")


def test_scale_up_and_down(k):
    _running(k, minNodes=1, maxNodes=3)
    k.custom.patch_namespaced_custom_object_scale("ddp.dev", "v1alpha1", k.ns, "ddpjobs", "job",
                                                  {"spec": {"replicas": 3}},
                                                  _content_type="application/merge-patch+json")
    k.wait_pods(PODS | {"job-2"})
    scale = k.custom.get_namespaced_custom_object_scale("ddp.dev", "v1alpha1", k.ns, "ddpjobs", "job")
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["selector"] == "ddp.dev/job-name=job,ddp.dev/role=trainer"
    k.patch_job("job", {"spec": {"nodes": 1}})
    k.wait_pods({"job-0", "job-rdzv"})
    status = wait_for(lambda: k.status() if k.status().get("nodes", {}).get("desired") == 1 else None,
                      what="scaled status")
    assert status["restarts"] == 0 and status["phase"] == "Running"


def test_rendezvous_store_loss_recreates_the_store_only(k):
    _running(k)
    old = {n: p.metadata.uid for n, p in k.pods().items()}
    k.set_phase("job-rdzv", "Failed", exit_code=137)
    wait_for(lambda: (lambda ps: set(ps) == PODS and ps["job-rdzv"].metadata.uid != old["job-rdzv"])(k.pods()),
             what="a new store pod")
    pods = k.pods()
    # The trainers are untouched: same pods, same group, same rendezvous id.
    assert {n: pods[n].metadata.uid for n in ("job-0", "job-1")} == {n: old[n] for n in ("job-0", "job-1")}
    assert all(p.metadata.labels["ddp.dev/group"] == "0" for p in pods.values())
    status = k.status()
    assert status["group"] == 0 and status["rendezvousId"].endswith("-0")
    assert status["infraRestarts"] == 1 and status["reason"] == "RendezvousStoreLost"
    k.wait_events("RendezvousStoreLost", lambda e: e.type == "Warning")
    # The trainers' containers fail on the lost store and are restarted in place: the same incident.
    for name in ("job-0", "job-1"):
        k.restart_in_place(name, exit_code=1)
    status = wait_for(lambda: (lambda s: s if len(s.get("attempts") or []) == 3 else None)(k.status()),
                      what="the in-place restarts on record")
    assert status["infraRestarts"] == 1 and [a["counted"] for a in status["attempts"]] == [True, False, False]
    k.set_phase("job-rdzv", "Running")
    status = k.wait_phase("Running")
    assert status["infraRestarts"] == 1 and status["group"] == 0
    assert {n: p.metadata.uid for n, p in k.pods().items() if n != "job-rdzv"} == \
        {n: old[n] for n in ("job-0", "job-1")}


def test_in_place_restart_is_counted_once_and_the_pod_kept(k):
    _running(k, failurePolicy={"permanentExitCodes": [3]})
    old = _uid(k, "job-1")
    k.restart_in_place("job-1", exit_code=137, restart_count=1)
    status = wait_for(lambda: (lambda s: s if s.get("infraRestarts") == 1 else None)(k.status()),
                      what="the restart counted")
    att = status["attempts"][-1]
    assert (att["pod"], att["exitCode"], att["restartCount"], att["counted"]) == ("job-1", 137, 1, True)
    k.wait_events("TrainerRestarted", lambda e: "exited 137 and was restarted in place" in e.message)
    time.sleep(1)  # asserting that nothing more happens
    assert _uid(k, "job-1") == old and k.status()["infraRestarts"] == 1
    # A permanent exit code on a later in-place restart fails the job and stops the pods.
    k.restart_in_place("job-1", exit_code=3, restart_count=2)
    status = k.wait_phase("Failed")
    assert status["reason"] == "PermanentExitCode"
    wait_for(lambda: not k.pods(), what="pods stopped")


class Recorder:
    """Watches one namespace's DDPJobs, pods, Services and NetworkPolicies in threads and records every event.

    Each watch starts from the resourceVersion of a list taken when the Recorder is made, so none misses what
    happens after that however late its thread gets going. A watch that raises, or ends before stop(), is kept
    in `dead`; check() fails the test then, since a dead watch sees nothing and "nothing was written" would pass.
    """

    KINDS = ("DDPJob", "Pod", "Service", "NetworkPolicy")
    TIMEOUT_S = 600  # the server ends a watch after this; far longer than any test that records

    def __init__(self, k):
        self.events = []
        self.dead = {}
        self._stopping = threading.Event()
        self._watches = []
        self._threads = {}
        listers = [
            lambda **kw: k.custom.list_namespaced_custom_object(GROUP, VERSION, k.ns, PLURAL, **kw),
            lambda **kw: k.core.list_namespaced_pod(k.ns, **kw),
            lambda **kw: k.core.list_namespaced_service(k.ns, **kw),
            lambda **kw: client.NetworkingV1Api(k.core.api_client).list_namespaced_network_policy(k.ns, **kw),
        ]
        for kind, lister in zip(self.KINDS, listers):
            listed = lister()
            rv = listed["metadata"]["resourceVersion"] if isinstance(listed, dict) else listed.metadata.resource_version
            w = watch.Watch()
            self._watches.append(w)
            t = threading.Thread(target=self._run, args=(w, kind, lister, rv), daemon=True)
            t.start()
            self._threads[kind] = t

    def _run(self, w, kind, lister, rv):
        try:
            for ev in w.stream(lister, resource_version=rv, timeout_seconds=self.TIMEOUT_S):
                obj = ev["object"]
                if not isinstance(obj, dict):
                    obj = obj.to_dict()
                self.events.append((kind, ev["type"], obj))
        except Exception as e:  # noqa: BLE001 - kept for check(): the test fails on it
            if not self._stopping.is_set():
                self.dead[kind] = repr(e)
            return
        if not self._stopping.is_set():
            self.dead[kind] = "the watch ended before stop()"

    def check(self):
        """Fails when a watch raised or ended: what it would have recorded is unknown."""
        dead = dict(self.dead)
        dead.update({kind: "its thread is gone" for kind, t in self._threads.items()
                     if not t.is_alive() and kind not in dead and not self._stopping.is_set()})
        assert not dead, f"the recorder's watches died: {dead}"

    def stop(self):
        """check(), then the watches stopped."""
        try:
            self.check()
        finally:
            self._stopping.set()
            for w in self._watches:
                w.stop()

    def added(self, kind):
        """The UIDs of the objects of `kind` seen created."""
        return {(obj.get("metadata") or {}).get("uid") for seen, type_, obj in self.events
                if seen == kind and type_ == "ADDED"}

    def last_status(self):
        return next((obj.get("status") or {} for kind, _, obj in reversed(self.events) if kind == "DDPJob"), {})

    def status_writes(self):
        """DDPJob MODIFIED events whose status differs from the one before."""
        count, last = 0, None
        for kind, type_, obj in self.events:
            if kind == "DDPJob":
                status = obj.get("status")
                if type_ == "MODIFIED" and status != last:
                    count += 1
                last = status
        return count

    def creates(self):
        return sum(len(self.added(kind)) for kind in ("Pod", "Service", "NetworkPolicy"))


def test_operator_killed_mid_recovery_records_everything_once(k, operator):
    """While the operator is down a pod vanishes (no tombstone will ever be seen) and another's trainer container
    is restarted in place: the restarted operator puts both on record, counts one incident, recreates only the
    missing pod; a second restart changes nothing."""
    _running(k)
    old = {n: p.metadata.uid for n, p in k.pods().items()}
    operator.stop()
    try:
        k.core.delete_namespaced_pod("job-1", k.ns, grace_period_seconds=0)
        wait_for(lambda: "job-1" not in k.pods(), what="job-1 gone")
        k.restart_in_place("job-0", exit_code=137, restart_count=1)
    finally:
        operator.start()
    wait_for(lambda: "job-1" in k.pods() and _uid(k, "job-1") != old["job-1"], what="job-1 recreated")
    status = wait_for(lambda: (lambda s: s if len(s.get("attempts") or []) == 2 else None)(k.status()),
                      what="both on record")
    by_pod = {a["pod"]: a for a in status["attempts"]}
    assert by_pod["job-1"]["reason"] == "NodeMissing" and by_pod["job-0"]["restartCount"] == 1
    assert status["infraRestarts"] == 1
    assert _uid(k, "job-0") == old["job-0"]
    k.set_phase("job-1", "Running")
    status = k.wait_phase("Running")
    operator.restart()
    wait_for(lambda: (operator.metrics() or {}).get('ddpjob_reconcile_total{result="ok"}', 0) >= 1,
             what="a reconcile pass by the restarted operator")
    time.sleep(1)  # asserting that nothing happens
    after = k.status()
    assert after["infraRestarts"] == 1 and after["attempts"] == status["attempts"]
    assert {n: p.metadata.uid for n, p in k.pods().items() if n != "job-1"} == \
        {n: old[n] for n in ("job-0", "job-rdzv")}


def test_api_writes_for_a_clean_job(k):
    """bench-api's budget, observed on the API server: N+3 creates, <= 6 status writes, none while healthy."""
    nodes = 3
    rec = Recorder(k)
    k.create_job(nodes=nodes)
    k.wait_pods({f"job-{i}" for i in range(nodes)} | {"job-rdzv"})
    k.run_all()
    k.wait_phase("Running")
    time.sleep(3)  # let the coalesced count write (<= 2 s) land
    # every watch alive and delivering: it saw what it must have by now
    rec.check()
    assert (len(rec.added("Pod")), len(rec.added("Service")), len(rec.added("NetworkPolicy"))) == (nodes + 1, 1, 1)
    assert rec.last_status().get("phase") == "Running", rec.last_status()
    steady = len(rec.events)
    time.sleep(5)  # asserting that nothing happens while healthy
    rec.check()  # a watch that died in the window would have seen nothing
    assert len(rec.events) == steady, rec.events[steady:]
    for i in range(nodes):
        k.set_phase(f"job-{i}", "Succeeded", exit_code=0)
    k.wait_phase("Succeeded")
    wait_for(lambda: "job-rdzv" not in k.pods(), what="store pod cleaned up")
    time.sleep(1)
    rec.stop()  # check()s first
    # the DDPJob and pod watches delivered past the window (events arrive in order: nothing in it was skipped)
    assert rec.last_status().get("phase") == "Succeeded", rec.last_status()
    assert any(kind == "Pod" and type_ == "DELETED" for kind, type_, _ in rec.events[steady:])
    print(f"\ncreates={rec.creates()} status_writes={rec.status_writes()}")
    assert rec.creates() == nodes + 3  # NetworkPolicy, Service, store pod, N trainer pods
    assert rec.status_writes() <= 6


def test_pod_stuck_terminating_on_a_lost_node_is_force_deleted(k):
    _running(k, failurePolicy={"stuckTerminatingTimeoutSeconds": 2})
    # Bind job-1 to a node that does not exist: no kubelet will ever confirm its deletion.
    k.core.create_namespaced_pod_binding("job-1", k.ns, {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": "job-1"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "lost-node"}}, _preload_content=False)
    old = _uid(k, "job-1")
    k.core.delete_namespaced_pod("job-1", k.ns, grace_period_seconds=1)
    assert k.pods()["job-1"].metadata.deletion_timestamp is not None
    wait_for(lambda: "job-1" in k.pods() and _uid(k, "job-1") != old, timeout=30,
             what="force-deleted pod replaced")
    k.wait_events("StuckPodForceDeleted")


def test_gracefully_deleted_pod_is_replaced_when_it_is_gone(k):
    """`kubectl delete pod job-1` with a grace period: torchrun exits 1 on SIGTERM, then the kubelet removes the
    object. The replacement follows the DELETED event at once, not stuckTerminatingTimeoutSeconds later."""
    _running(k, failurePolicy={"stuckTerminatingTimeoutSeconds": 120})
    # A node name makes the deletion graceful (unscheduled pods go at once); no kubelet finishes it but the test.
    k.core.create_namespaced_pod_binding("job-1", k.ns, {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": "job-1"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "test-node"}}, _preload_content=False)
    old = _uid(k, "job-1")
    k.core.delete_namespaced_pod("job-1", k.ns, grace_period_seconds=30)
    k.set_phase("job-1", "Failed", exit_code=1)  # torchrun's exit on SIGTERM
    status = k.wait_phase("Restarting")
    assert status["restarts"] == 1 and "replacing it" in status["message"]
    # Asserting that nothing happens while it terminates (this also lets any coalesced status write and its
    # wake-up pass, so the replacement below can only come from the DELETED event).
    time.sleep(3)
    assert _uid(k, "job-1") == old and k.pods()["job-1"].metadata.deletion_timestamp is not None
    k.core.delete_namespaced_pod("job-1", k.ns, grace_period_seconds=0)  # the kubelet's final delete
    wait_for(lambda: "job-1" in k.pods() and _uid(k, "job-1") != old, timeout=10,
             what="replacement right after the DELETED event")
    k.set_phase("job-1", "Running")
    status = k.wait_phase("Running")
    assert status["restarts"] == 1 and len(status["attempts"]) == 1
    assert not any(e.reason == "StuckPodForceDeleted" for e in k.events())


def test_running_pod_on_a_node_that_no_longer_exists_is_lost_and_replaced(k, operator):
    """failurePolicy.nodeLostTimeoutSeconds: a Running pod on a node the API server does not know (deleted with
    its machine) and that the node controller marked not Ready is force-deleted at once and recreated, as a
    disruption: not counted. The node watch never showed that node, so the operator reads it before calling it gone
    (a node created a moment ago may not have reached the watch yet)."""
    _running(k)
    reads = _node_reads(operator)
    k.core.create_namespaced_pod_binding("job-1", k.ns, {
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": "job-1"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "ddp-it-vanished-node"}}, _preload_content=False)
    old = _uid(k, "job-1")
    k.core.patch_namespaced_pod_status("job-1", k.ns, {"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "NodeLost"}]}})
    wait_for(lambda: "job-1" in k.pods() and _uid(k, "job-1") != old, timeout=20, what="lost pod replaced")
    k.wait_events("NodeLost", lambda e: "ddp-it-vanished-node no longer exists" in e.message)
    k.set_phase("job-1", "Running")
    status = k.wait_phase("Running")
    assert status["restarts"] == 0 and status["disruptions"] == 1
    assert status["attempts"][-1]["reason"] == "NodeLost" and status["attempts"][-1]["counted"] is False
    assert _node_reads(operator) > reads


def _node_reads(operator):
    return (operator.metrics() or {}).get("ddpjob_node_reads_total", 0)


def test_running_pod_on_a_notready_node_is_lost_when_the_timeout_is_due(k, operator):
    """A Node object with no kubelet behind it (unschedulable and tainted: nothing else lands there), Ready=False
    from now: the operator's node watch shows it NotReady (no read of the node) for the pod the node controller
    marked not Ready; the operator wakes up when nodeLostTimeoutSeconds is due, force-deletes the pod and recreates
    it."""
    import secrets
    from datetime import datetime, timezone
    node = f"ddp-it-notready-{secrets.token_hex(3)}"
    k.core.create_node({"metadata": {"name": node, "labels": {"ddpjob.dev/test": "true"}},
                        "spec": {"unschedulable": True, "taints": [
                            {"key": "ddp.dev/test-node", "value": "fake", "effect": "NoSchedule"}]}})
    try:
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        k.core.patch_node_status(node, {"status": {"conditions": [
            {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "fake",
             "lastHeartbeatTime": now, "lastTransitionTime": now}]}})
        wait_for(lambda: (operator.metrics() or {}).get("ddpjob_nodes_watched", 0) >= 2, 10, what="node watched")
        reads = _node_reads(operator)
        _running(k, failurePolicy={"nodeLostTimeoutSeconds": 4})
        k.core.create_namespaced_pod_binding("job-1", k.ns, {
            "apiVersion": "v1", "kind": "Binding", "metadata": {"name": "job-1"},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}, _preload_content=False)
        old = _uid(k, "job-1")
        k.core.patch_namespaced_pod_status("job-1", k.ns, {"status": {"conditions": [
            {"type": "Ready", "status": "False", "reason": "NodeNotReady"}]}})
        started = time.monotonic()
        wait_for(lambda: "job-1" in k.pods() and _uid(k, "job-1") != old, timeout=30, what="lost pod replaced")
        assert time.monotonic() - started < 15  # nodeLostTimeoutSeconds (4 s) applies, not the 60 s default
        k.wait_events("NodeLost", lambda e: f"node {node} has been NotReady since {now}" in e.message)
        status = k.status()
        assert status["attempts"][-1]["reason"] == "NodeLost" and status["restarts"] == 0
        assert _node_reads(operator) == reads  # the watch's state, not a read
    finally:
        k.core.delete_node(node)


def test_quota_refusal_is_a_condition_backs_off_and_clears_when_the_quota_goes(k):
    k.core.create_namespaced_resource_quota(k.ns, {"metadata": {"name": "one-pod"}, "spec": {"hard": {"pods": "1"}}})
    wait_for(lambda: k.core.read_namespaced_resource_quota("one-pod", k.ns).status.hard, what="quota status")
    job = k.create_job()

    def refused():
        cond = [c for c in k.status().get("conditions", []) if c["type"] == "ReplicaFailure"]
        return cond[0] if cond and cond[0]["status"] == "True" else None
    cond = wait_for(refused, 15, what="ReplicaFailure=True")
    assert cond["reason"] == "FailedCreate" and "exceeded quota: one-pod" in cond["message"], cond
    assert "exceeded quota" in k.status()["message"]
    time.sleep(8)  # retries at 1, 2, 4 s... post no Event each
    refusals = [e for e in k.events() if e.reason == "FailedCreate"]
    assert len(refusals) == 1, [e.message for e in refusals]
    k.core.delete_namespaced_resource_quota("one-pod", k.ns)
    k.wait_pods(PODS, timeout=30)
    wait_for(lambda: not refused() and [c for c in k.status()["conditions"] if c["type"] == "ReplicaFailure"],
             15, what="ReplicaFailure False")
    assert k.job()["metadata"]["uid"] == job["metadata"]["uid"]


def test_network_policy_follows_the_spec_and_comes_back_when_deleted(k):
    job = k.create_job()
    net = client.NetworkingV1Api(k.core.api_client)
    policy = wait_for(lambda: net.read_namespaced_network_policy("job", k.ns), what="NetworkPolicy job")
    assert owner_uids(policy) == [job["metadata"]["uid"]]
    assert policy.spec.pod_selector.match_labels == {"ddp.dev/job-name": "job"}
    assert policy.spec.policy_types == ["Ingress"]
    # Edited by someone ("allow from everywhere"): its rules put back in place, the same object (netpol.drifted).
    rules = net.read_namespaced_network_policy("job", k.ns).to_dict()["spec"]["ingress"]
    net.patch_namespaced_network_policy("job", k.ns, {"spec": {"ingress": [{}]}})
    wait_for(lambda: net.read_namespaced_network_policy("job", k.ns).to_dict()["spec"]["ingress"] == rules,
             what="the NetworkPolicy's rules put back")
    assert net.read_namespaced_network_policy("job", k.ns).metadata.uid == policy.metadata.uid
    # Deleted by someone: put back (a new object).
    net.delete_namespaced_network_policy("job", k.ns)
    wait_for(lambda: net.read_namespaced_network_policy("job", k.ns).metadata.uid != policy.metadata.uid,
             what="the NetworkPolicy recreated")
    # Disabled in the spec: deleted, and not recreated.
    k.custom.patch_namespaced_custom_object("ddp.dev", "v1alpha1", k.ns, "ddpjobs", "job",
                                            {"spec": {"networkPolicy": {"enabled": False}}})
    wait_for(lambda: not net.list_namespaced_network_policy(k.ns).items, what="the NetworkPolicy deleted")
    time.sleep(1)  # asserting that nothing happens
    assert not net.list_namespaced_network_policy(k.ns).items
# --- one job's pods cannot wedge the operator ---------------------------------------------------------------------
def test_final_report_with_nan_loss_succeeds(k):
    _running(k)
    k.set_phase("job-0", "Succeeded", exit_code=0,
                message='{"step": 50, "loss": NaN, "samplesPerSecond": Infinity, "metrics": {"acc": NaN, '
                        '"testAccuracy": 0.9}, "final": true}')
    k.set_phase("job-1", "Succeeded", exit_code=0)
    status = k.wait_phase("Succeeded")
    assert status["progress"]["step"] == 50 and "loss" not in status["progress"]
    assert status["progress"]["metrics"] == {"testAccuracy": 0.9}


def test_pod_with_a_garbage_group_label_is_replaced_not_a_crash(k, operator):
    _running(k)
    old = _uid(k, "job-1")
    k.core.patch_namespaced_pod("job-1", k.ns, {"metadata": {"labels": {"ddp.dev/group": "not-a-number"}}})
    wait_for(lambda: "job-1" in k.pods() and _uid(k, "job-1") != old, what="stale pod job-1 replaced")
    k.set_phase("job-1", "Running")
    status = k.wait_phase("Running")
    assert status["restarts"] == 0
    assert "ValueError" not in operator.log_tail(400)


def test_foreign_pod_holding_a_child_name_is_a_condition_and_an_event(k):
    from ddp_cluster import NOWHERE
    foreign = k.core.create_namespaced_pod(k.ns, {
        "metadata": {"name": "job-0", "labels": {"app": "someone-elses"}},
        "spec": {"nodeSelector": dict(NOWHERE), "containers": [{"name": "c", "image": "x"}]}})
    job = k.create_job()

    def conflict():
        cond = [c for c in k.status().get("conditions", []) if c["type"] == "ReplicaFailure"]
        return cond[0] if cond and cond[0]["status"] == "True" else None
    cond = wait_for(conflict, 30, what="ReplicaFailure condition")
    assert cond["reason"] == "ChildConflict"
    assert f"pod {k.ns}/job-0 already exists and is not owned by this DDPJob" in cond["message"]
    assert "delete or rename it" in cond["message"]
    warnings = k.wait_events("ChildConflict")
    assert warnings[0].type == "Warning" and "job-0" in warnings[0].message
    # The job's other children are there; the foreign pod is left alone.
    wait_for(lambda: {"job-1", "job-rdzv"} <= set(k.pods()), what="the job's other pods")
    assert k.core.read_namespaced_pod("job-0", k.ns).metadata.uid == foreign.metadata.uid
    # Removing the foreign pod is all it takes: the operator creates its own and clears the condition.
    k.core.delete_namespaced_pod("job-0", k.ns, grace_period_seconds=0)
    mine = wait_for(lambda: (lambda p: p if p and owner_uids(p) == [job["metadata"]["uid"]] else None)(
        k.pods().get("job-0")), 90, interval=1, what="the job's own job-0")
    assert mine.metadata.uid != foreign.metadata.uid
    wait_for(lambda: not conflict() and [c for c in k.status()["conditions"] if c["type"] == "ReplicaFailure"],
             30, what="ReplicaFailure False")


def _state_entries(operator):
    return sum(v for key, v in (operator.metrics() or {}).items()
               if key.startswith("ddpjob_operator_state_entries{"))


def test_a_hundred_jobs_created_and_deleted_leave_the_operators_memory_where_it_was(k, operator):
    # Other tests' namespaces (and their jobs) must be gone first, or their teardown moves the baseline.
    wait_for(lambda: not [n for n in k.core.list_namespace(label_selector="ddpjob.dev/test=true").items
                          if n.metadata.name.startswith(NS_PREFIX) and n.metadata.name != k.ns],
             180, interval=1, what="earlier test namespaces deleted")
    # No job is left in any watched namespace, so once the sweep ran nothing per-job is held.
    wait_for(lambda: operator.metrics() is not None and _state_entries(operator) == 0, 60, interval=1,
             what="no per-job state before the test")
    # Round one warms the process up (imports, allocator arenas, client pools); round two must not grow it.
    rss = [_rss_kib(operator)]
    for round_ in range(2):
        names_ = [f"m{round_}-{i:03d}" for i in range(100)]
        for name in names_:
            k.create_job(name=name, nodes=1, minNodes=1, maxNodes=1)
        expected = {f"{n}-0" for n in names_} | {f"{n}-rdzv" for n in names_}
        wait_for(lambda: expected <= set(k.pods()), 240, interval=2, what="200 pods of 100 jobs")
        # The measure can see jobs: while they exist, their state is held.
        wait_for(lambda: _state_entries(operator) >= 100, 60, interval=1, what="per-job state held")
        for name in names_:
            k.custom.delete_namespaced_custom_object(GROUP, VERSION, k.ns, PLURAL, name)
        wait_for(lambda: not k.jobs() and not k.pods(), 240, interval=2, what="jobs and pods gone")
        wait_for(lambda: _state_entries(operator) == 0, 60, interval=1, what="per-job state back to none")
        rss.append(_rss_kib(operator))
    print(f"operator RSS (KiB): {rss[0]} before, {rss[1]} after 100 jobs, {rss[2]} after 100 more")
    # Measured: +19 MiB in the warm-up round, +0.6 MiB in the second. A per-job leak (tombstones are whole pod
    # objects) would repeat the first round's growth.
    assert rss[2] - rss[1] < 10 * 1024, rss


def _rss_kib(operator):
    with open(f"/proc/{operator.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
