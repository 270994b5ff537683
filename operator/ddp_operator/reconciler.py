"""The pass: one reconcile function, the ticker that runs wake-ups, and the I/O that carries out a plan.

Every trigger (job created/resumed/updated, an owned pod changed, a time-based wake-up) ends in
`Reconciler.reconcile(namespace, name)`: read the job and its pods from kopf's in-memory indexes, call the
pure `plan.plan`, write the status once (only if it changed), post its Events, then create/delete children.
kopf starts handlers only after the indexes are filled, so a restarted operator sees every existing pod before
it decides anything.

API writes are kept minimal (the bench-api goal): no finalizers (no kopf timers/daemons; wake-ups come from
an in-process ticker), kopf's handler state lives in two annotations under ddp.dev (handlers.py), pod-count-only
status changes are coalesced (for STATUS_COALESCE_SECONDS, doubling with each count-only write in a row: coalesce_window), and progress polling (poller.py) writes at most once per
spec.progressPeriodSeconds, only when the step moved forward. A child that cannot be created is retried on its own
schedule (backoff.py) while the rest of the pass goes on. The plan holds every pod back until the job's own
NetworkPolicy exists: a pass creates a missing policy first and plans again on the outcome, so a fresh job still
gets its policy and its pods in one pass (one status write), and a refused or foreign policy is reported at once.
Node states for the node-loss and stuck-Terminating rules come from a watch of the Nodes, or a read where the watch
cannot vouch for a node (node_watch.NodeStates). Each pass's stages are timed (pass_clock.py).

One job cannot stall the others: the ticker that serves every job's wake-ups (deadlines, TTL, force-deletes) never
waits on a pod, and an error in one job's pass is logged and re-armed for that job alone. What is kept per job lives
in its record (jobs.py), dropped when the job no longer exists.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Mapping

from kubernetes.client.exceptions import ApiException

from ddp_operator import metrics, names
from ddp_operator.backoff import CreateBackoff
from ddp_operator.diagnostics import Tools
from ddp_operator.event_passes import EventPasses
from ddp_operator.jobs import Created, JobRegistry, Key, kept_pod, owned_by
from ddp_operator.k8s import ChildConflict, NotLeading, describe_error
from ddp_operator.kueue import WorkloadState, observe_workload
from ddp_operator.netpol import NetworkPolicyConfig
from ddp_operator.node_watch import NodeStates
from ddp_operator.observed import PodState, observe_pod
from ddp_operator.plan import (
    CREATE, DELETE, DELETE_JOB, FORCE_DELETE, PATCH, PATCH_STATUS, Observed, Plan, invalid, node_lost_candidates, plan,
    stuck_pods,
)
from ddp_operator.pass_clock import PassClock
from ddp_operator.poller import ProgressPoller
from ddp_operator.read_cache import ReadCache
from ddp_operator.spec import SpecError
from ddp_operator.stall import Finding, PodDiagnosis
from ddp_operator.status import newer_progress
from ddp_operator.ticker import RESYNC_SECONDS, RESYNCS_PER_TICK, DuePasses, run_ticker
from ddp_operator.writers import post_in_order, side_by_side

log = logging.getLogger("ddp_operator")

COMPONENT = "ddp-operator"
STATUS_COALESCE_SECONDS = 2.0
STATUS_COALESCE_MAX_SECONDS = 30.0
SIDE_BY_SIDE = (CREATE, DELETE, FORCE_DELETE)  # verbs whose runs of pod writes a pass sends side by side
CREATED_MEMORY_SECONDS = 30.0
# A pass for a child's event starts at least this long per pod after the job's last pass (1,000 pods: 0.1 s).
PACE_SECONDS_PER_POD = 0.0001
TICK_SECONDS = 1.0
WAKE_MARGIN_SECONDS = 0.05  # a pass asked for at a due time runs this much after it (clocks read a moment apart)
RETRY_SECONDS = 5.0
SWEEP_SECONDS = 10.0
FLAVOR_CACHE_SECONDS = 30.0  # a Kueue ResourceFlavor or WorkloadPriorityClass read is reused (they rarely change)
# Status fields that only count pods: a change in them alone may wait a moment to be batched.
_COUNT_FIELDS = frozenset({"nodes", "nodesReady", "message"})


def coalesce_window(streak: int) -> float:
    """How long a count-only status change waits to be batched after `streak` count-only writes in a row: doubling
    from STATUS_COALESCE_SECONDS up to STATUS_COALESCE_MAX_SECONDS, so a job that takes long to start (a large one)
    costs a few writes, not one per window."""
    return min(STATUS_COALESCE_MAX_SECONDS, STATUS_COALESCE_SECONDS * 2.0 ** min(streak, 16))


@dataclass(frozen=True)
class Config:
    """The operator's configuration: __main__ reads it from flags and environment, kopf's memo carries it."""
    network_policy: NetworkPolicyConfig = NetworkPolicyConfig()
    kueue: bool = False  # the Kueue integration (kueue.py) is on: Workloads are watched and written
    diagnostics: Tools = Tools()  # the diagnostics tools image (DDPJOB_DIAGNOSTICS_IMAGE): every job carries it
    store_image: str = ""  # --store-image, for every job that names none ("": rdzv_spec.DEFAULT_STORE_IMAGE; jobs.py)


def _now() -> datetime:
    return datetime.now(timezone.utc)


class Reconciler:
    """Per-process state of the shell; every method is safe to call from kopf's worker threads."""

    def __init__(self, api: Any, config: Config = Config()):
        self.api = api
        self.config = config
        self.jobs = JobRegistry(config.diagnostics, config.store_image)
        self.backoff = CreateBackoff(self.jobs, self.jobs.wake)
        self.poller = ProgressPoller(self.jobs, api, self.reconcile)
        self._stop = threading.Event()
        self.nodes = NodeStates(api, self._stop)  # its watch runs in a thread of its own (handlers.configure)
        self.flavors = ReadCache(FLAVOR_CACHE_SECONDS)     # Kueue's ResourceFlavors
        self.priorities = ReadCache(FLAVOR_CACHE_SECONDS)  # Kueue's WorkloadPriorityClasses
        self.due = DuePasses(lambda *key: self.reconcile(*key), self.jobs.wake, RETRY_SECONDS, TICK_SECONDS)
        self.event_passes = EventPasses(lambda *key: self.reconcile(*key),
                                        pace=lambda key: self.jobs.pace_left(key, PACE_SECONDS_PER_POD))
        self._swept_at = 0.0

    @property
    def indexes(self) -> dict[str, Any] | None:
        """kopf's indexes, bound by the first handler call (tests set them)."""
        return self.jobs.indexes

    @indexes.setter
    def indexes(self, indexes: dict[str, Any] | None) -> None:
        self.jobs.indexes = indexes

    # --- the ticker -------------------------------------------------------------------------------
    def tick(self, wait: bool = True) -> None:
        """Run due wake-ups, a slow resync of every job, progress probes (in the pool) and the sweep.

        Each job's work is isolated: the due passes run side by side (ticker.py; `wait`: return once they ended),
        whatever one job raises, every other due wake-up still runs, and the failing job's own wake-up is re-armed."""
        now = time.monotonic()
        keys = set(self.jobs.take_due(now))
        try:
            jobs = self.jobs.keys()
        except Exception:  # noqa: BLE001 - the wake-ups already taken must run regardless
            log.exception("could not list jobs for the resync")
            jobs = []
        stale = []
        for key in jobs:
            last = getattr(self.jobs.get(key), "last_pass", 0.0)  # 0.0: no record yet
            if now - last >= RESYNC_SECONDS:
                stale.append((last, key))
            self.poller.schedule(key)
        keys.update(key for _, key in sorted(stale)[:RESYNCS_PER_TICK])  # the oldest; the rest at the next ticks
        if now - self._swept_at >= SWEEP_SECONDS:
            self._swept_at = now
            try:
                self.nodes.prune()
                self.jobs.sweep()
            except Exception:  # noqa: BLE001
                log.exception("sweep of deleted jobs failed")
        self.due.run(sorted(keys), wait_for_them=wait)

    def run_ticker(self) -> None:
        run_ticker(self._stop, self.jobs, self.tick, self.due, TICK_SECONDS)

    def stop(self) -> None:
        self._stop.set()
        self.jobs.woken.set()  # the ticker's wait ends
        self.poller.stop()
        self.due.stop()
        self.event_passes.stop()

    # --- observation ------------------------------------------------------------------------------
    def _observe(self, key: Key, uid: str) -> tuple[tuple[PodState, ...], set[str]]:
        indexed = self.jobs.values("pods_by_job", key)
        live = self.jobs.not_force_deleted(key, [p for p in indexed if owned_by(p, uid)], CREATED_MEMORY_SECONDS)
        live_names = {p["metadata"]["name"]: p["metadata"]["uid"] for p in live}
        now = time.monotonic()
        record = self.jobs.record(key)
        with self.jobs.guard:
            # kopf drops a deleted pod from the index before on_pod keeps its tombstone: a pass in between must not
            # take a pod this process saw for one that vanished unseen (plan.vanished, NodeMissing).
            in_index = {p["metadata"]["uid"] for p in indexed}
            for u, last in record.seen.items():
                if u not in in_index:
                    record.tombstones.setdefault(u, last)
            record.seen = {p["metadata"]["uid"]: p for p in live}
            tombstones = dict(record.tombstones)
            created = record.created
            for name, c in list(created.items()):
                if live_names.get(name) == c.body["metadata"]["uid"] or now - c.at > CREATED_MEMORY_SECONDS \
                        or c.body["metadata"]["uid"] in tombstones:
                    del created[name]
            fresh = [c.body for name, c in created.items() if name not in live_names]
        gone = [t for u, t in tombstones.items() if u not in live_names.values() and owned_by(t, uid)]
        return record.observe(live + fresh) + tuple(observe_pod(t, gone=True) for t in gone), set(tombstones)

    def _network_policy(self, key: Key, uid: str) -> dict[str, Any]:
        """Observed's fields of the job's NetworkPolicy: the index's (with its spec), or one just created that the watch
        does not show yet (its spec unknown: never taken for drifted)."""
        own = [(u, spec) for u, owners, spec in self.jobs.values("network_policies_by_job", key) if uid in owners]
        created = self.jobs.just_created(key, "NetworkPolicy", bool(own), CREATED_MEMORY_SECONDS)
        policy_uid, spec = (own or [(u, None) for u in created] or [(None, None)])[0]
        return {"network_policy_exists": bool(own or created), "network_policy_uid": policy_uid,
                "network_policy_spec": spec}

    def _service_exists(self, key: Key) -> bool:
        """Whether the job's Service is in the index, or was just created and the watch does not show it yet."""
        indexed = bool(self.jobs.values("services_by_job", key))
        return bool(self.jobs.just_created(key, "Service", indexed, CREATED_MEMORY_SECONDS)) or indexed

    # --- the pass ---------------------------------------------------------------------------------
    def reconcile(self, namespace: str, name: str, body: Mapping[str, Any] | None = None, *,
                  hang_reports: Mapping[str, Mapping[str, Any] | None] | None = None,
                  diagnoses: tuple[PodDiagnosis, ...] | None = None, stall: Finding | None = None) -> Plan | None:
        """A pass of the job. The poller hands in what it found: `hang_reports` (every pod's progress report, the
        training's step stood still for hangTimeoutSeconds) with the pods' `diagnoses`, or a `stall` finding from
        the diagnostics sidecars (poller.py); each reaches the planner as an Observed field."""
        key = (namespace, name)
        record = self.jobs.record(key)
        found = {k: v for k, v in (("hang_reports", hang_reports), ("hang_diagnoses", diagnoses), ("stall", stall))
                 if v is not None}
        with record.lock:
            with self.jobs.guard:
                record.waiting = False  # this pass reads the indexes from here on: it sees every event so far
            started = time.monotonic()
            try:
                result = self._reconcile(key, body, **found)
            except NotLeading as e:  # this replica lost the Lease: it stops leading soon; nothing to retry
                metrics.RECONCILES.labels("error").inc()
                log.warning("[%s/%s] not written: %s", namespace, name, e)
                return None
            except Exception as e:
                metrics.RECONCILES.labels("error").inc()
                log.warning("[%s/%s] reconcile failed, retrying in %.0fs: %s", namespace, name, RETRY_SECONDS,
                            describe_error(e), exc_info=not isinstance(e, ApiException))
                self.jobs.wake(key, RETRY_SECONDS)
                raise
            finally:
                if self.jobs.exists(key):
                    current = self.jobs.record(key)
                    with self.jobs.guard:
                        current.last_pass = time.monotonic()
                metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            metrics.RECONCILES.labels("ok").inc()
            return result

    def child_changed(self, namespace: str, name: str) -> None:
        """A pass for a child's event, run off kopf's worker (event_passes.py), unless one of the job's passes waits
        to start: that one reads the indexes (kopf updates them before it calls a handler) when it starts, so it sees
        this event too. One O(N) pass per pod event cost a job of N pods O(N^2); coalesced, a burst costs the pass
        running and one more, which starts N x PACE_SECONDS_PER_POD after the last one ended at the soonest."""
        record = self.jobs.record((namespace, name))
        with self.jobs.guard:
            if record.waiting:
                return
            record.waiting = True
        self.event_passes.submit((namespace, name))  # off kopf's worker: the pod's next events index at once

    def _reconcile(self, key: Key, body: Mapping[str, Any] | None, **found: Any) -> Plan | None:
        """The pass; `found`: the Observed fields the poller hands in (hang_reports, hang_diagnoses, stall)."""
        body = body if body is not None else self.jobs.body(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        uid = body["metadata"]["uid"]
        now = _now()
        record = self.jobs.record(key)
        with self.jobs.guard:
            prev = record.of(uid).written
        if prev is None:
            prev = dict(body.get("status") or {})
        else:
            # The watched object may hold a newer progress than our copy (another writer, a restart): the status
            # written now never carries an older one.
            stored = newer_progress(prev.get("progress"), (body.get("status") or {}).get("progress"))
            if stored is not None and stored != prev.get("progress"):
                prev = {**prev, "progress": stored}
        try:
            job = self.jobs.job(key, body)
        except SpecError as e:
            result = invalid(int(body["metadata"].get("generation") or 0), prev, str(e), now)
            self._write_status(key, uid, prev, result.status, force=True)
            self._post_events(body, result)
            return result
        clock = PassClock()
        pods, seen_tombstones = self._observe(key, uid)
        clock.lap("observe", len(pods))
        node_ready = {p.node: self.nodes.ready(p.node) for p in stuck_pods(job, pods, now)}
        lost = [p.node for p in node_lost_candidates(pods)] if job.spec.failure_policy.node_lost_timeout_seconds else []
        nodes = {node: self.nodes.get(node) for node in lost}
        clock.lap("nodes", len(nodes) + len(node_ready))
        conflicts, refusals = self.backoff.observed(key)
        observed = Observed(pods=pods, service_exists=self._service_exists(key), node_ready=node_ready,
                            **self._network_policy(key, uid), conflicts=conflicts, refusals=refusals, nodes=nodes,
                            **found,
                            **(self._observe_kueue(key, uid, job.priority_class) if job.queue_name else {}))
        result = plan(job, prev, observed, now, self.config.network_policy)
        if self._policy_first(key, result):
            conflicts, refusals = self.backoff.observed(key)
            observed = replace(observed, **self._network_policy(key, uid), conflicts=conflicts, refusals=refusals)
            result = plan(job, prev, observed, now, self.config.network_policy)
        clock.lap("plan")
        # Status first: a failure is on record (by pod UID) before the pod is deleted, so a crash between
        # the two never counts it twice.
        # A pass with Events is never coalesced: the next pass would post them again from the same old status.
        self._write_status(key, uid, prev, result.status, force=bool(result.events))
        clock.lap("status")
        # Events before the actions: a refused create fails the pass, and the status that carried them is written.
        self._post_events(body, result)
        clock.lap("events", len(result.events))
        self._execute(job.namespace, key, body, result)
        clock.lap("writes", len(result.actions))
        clock.report(*key)
        with self.jobs.guard:
            for u in seen_tombstones:
                record.tombstones.pop(u, None)
            obj = record.of(uid)
            phase = result.status.get("phase", names.PHASE_PENDING)
            moved = obj.phase != phase
            obj.phase = phase
        if moved:  # counted over every job: not on each of a thousand jobs' passes when nothing moved
            metrics.set_phases(self.jobs.phases())
        if result.counted_restarts:
            metrics.RESTARTS.inc(result.counted_restarts)
        if result.status.get("disruptions", 0) > int(prev.get("disruptions") or 0):
            metrics.DISRUPTIONS.inc(result.status["disruptions"] - int(prev.get("disruptions") or 0))
        if result.recovery_seconds is not None:
            metrics.RECOVERY.observe(result.recovery_seconds)
            log.info("[%s/%s] recovered in %.1fs", *key, result.recovery_seconds)
        if result.requeue_after is not None:
            self.jobs.wake(key, result.requeue_after + WAKE_MARGIN_SECONDS)
        return result

    def _write_status(self, key: Key, uid: str, prev: Mapping, new: Mapping, force: bool = False) -> None:
        if new == prev:
            return
        changed = {k for k in set(prev) | set(new) if prev.get(k) != new.get(k)}
        counts_only = changed <= _COUNT_FIELDS
        record = self.jobs.record(key)
        with self.jobs.guard:
            since = time.monotonic() - record.of(uid).written_at
            window = coalesce_window(record.of(uid).count_writes)
        if not force and counts_only and since < window:
            self.jobs.wake(key, window - since)
            return
        patch = {k: new.get(k) for k in changed}  # None removes a key (merge patch)
        self.api.patch_status(key[0], key[1], patch)
        with self.jobs.guard:
            obj = record.of(uid)
            obj.written = copy.deepcopy(dict(new))
            obj.written_at = time.monotonic()
            obj.count_writes = obj.count_writes + 1 if counts_only and not force else 0
        if "progress" in changed and (new.get("progress") or {}).get("final"):  # it closes the metric history
            self.poller.history.add(key, uid, new["progress"], final=True)
        if "phase" in changed:
            log.info("[%s/%s] phase %s -> %s: %s", *key, prev.get("phase"), new.get("phase"), new.get("message", ""))

    def _post_events(self, body: Mapping, result: Plan) -> None:
        def post(event: Any) -> None:
            self.api.post_event(body, event.type, event.reason, event.message, COMPONENT)
        post_in_order(post, list(result.events))

    def _policy_first(self, key: Key, result: Plan) -> bool:
        """Create the NetworkPolicy the plan asks for (it then holds every pod back) ahead of the pass's writes; True
        if the API server was asked, so the pass plans again on what it answered."""
        policy = next((a for a in result.actions if a.verb == CREATE and a.kind == "NetworkPolicy"), None)
        return policy is not None and self._create(key, policy)

    def _create(self, key: Key, action: Any) -> bool:
        """Create a child unless its conflict or refusal is not due for a retry; True if the API server was asked."""
        if self.backoff.conflicting(key, action.name) or self.backoff.backing_off(key, action.name):
            return False
        try:
            created = self.api.create(action.body)
        except ChildConflict as e:
            self.backoff.conflict(key, action.name, str(e))
            return True
        except ApiException as e:
            self.backoff.refused(key, action, e)
            return True
        self.backoff.created(key, action)
        if created is not None:
            self._created(key, action, created)
        return True

    def _execute(self, namespace: str, key: Key, body: Mapping, result: Plan) -> None:
        self.backoff.forget_stale(key, {a.name for a in result.actions if a.verb == CREATE})
        actions, i = list(result.actions), 0
        while i < len(actions):
            j = i + 1
            while j < len(actions) and actions[i].kind == actions[j].kind == "Pod" \
                    and actions[i].verb == actions[j].verb and actions[i].verb in SIDE_BY_SIDE:
                j += 1
            # A run of pod creates or deletes side by side (one after the other, N pods waited N round trips)
            side_by_side(lambda action: self._act(namespace, key, body, action), actions[i:j], "ddp-pods")
            i = j
        if any(a.verb == FORCE_DELETE for a in actions):
            self.child_changed(*key)  # their replacements next, without waiting for the index to drop them

    def _act(self, namespace: str, key: Key, body: Mapping, action: Any) -> None:
        if action.verb == CREATE:
            self._create(key, action)
        elif action.kind == names.WORKLOAD_KIND:
            self._workload_write(namespace, key, action)
        elif action.verb == DELETE and action.kind == "NetworkPolicy":
            log.info("[%s/%s] deleting NetworkPolicy %s", *key, action.name)
            self.api.delete_network_policy(namespace, action.name, action.uid)
        elif action.verb == DELETE:
            log.info("[%s/%s] deleting pod %s", *key, action.name)
            self.api.delete_pod(namespace, action.name, action.uid, grace_seconds=action.grace_seconds)
        elif action.verb == FORCE_DELETE:
            log.warning("[%s/%s] force-deleting pod %s (stuck Terminating, or on a NotReady or lost node)", *key, action.name)
            self.api.delete_pod(namespace, action.name, action.uid, force=True)
            self.jobs.force_deleted(key, action.uid)
        elif action.verb == PATCH:  # a pod's annotation, or a NetworkPolicy put back to what the job needs
            log.info("[%s/%s] patching %s %s: %s", *key, action.kind, action.name, action.body)
            patch = self.api.patch_network_policy if action.kind == "NetworkPolicy" else self.api.patch_pod
            patch(namespace, action.name, action.uid, action.body or {})
        elif action.verb == DELETE_JOB:
            log.info("[%s/%s] ttlSecondsAfterFinished expired; deleting the job", *key)
            self.api.delete_job(namespace, action.name, body["metadata"]["uid"])

    def _created(self, key: Key, action: Any, created: dict) -> None:
        """Remember a created pod, Service or NetworkPolicy until the watch shows it: the next pass does not create it
        again."""
        log.info("[%s/%s] created %s %s", *key, action.kind, action.name)
        record = self.jobs.record(key)
        with self.jobs.guard:
            if action.kind == "Pod":
                record.created[action.name] = Created(kept_pod(created), time.monotonic())
            elif action.kind in ("NetworkPolicy", "Service"):
                record.children_created[action.kind] = (created["metadata"].get("uid"), time.monotonic())

    # --- Kueue ----------------------------------------------------------------------------------------
    def _observe_kueue(self, key: Key, uid: str, priority_class: str | None) -> dict[str, Any]:
        """Observed's Kueue fields for a job with a queue name: its Workload, the flavors its admission names and,
        while it has no Workload yet, its WorkloadPriorityClass."""
        if not self.config.kueue:
            return {"kueue": False}
        owned = [observe_workload(w) for w in self.jobs.values("workloads_by_job", key) if owned_by(w, uid)]
        workload: WorkloadState | None = owned[0] if owned else None
        flavors = ({f: self.flavors.get(f, self.api.resource_flavor) for f in workload.flavor_names()}
                   if workload and workload.admitted else {})
        priority = (self.priorities.get(priority_class, self.api.workload_priority)
                    if priority_class and workload is None else None)
        return {"kueue": True, "workload": workload, "flavors": flavors, "priority": priority}

    def _workload_write(self, namespace: str, key: Key, action: Any) -> None:
        if action.verb == DELETE:
            log.info("[%s/%s] deleting Kueue workload %s", *key, action.name)
            self.api.delete_workload(namespace, action.name, action.uid)
            return
        status = action.verb == PATCH_STATUS
        log.info("[%s/%s] %s Kueue workload %s: %s", *key, "updating the status of" if status else "patching",
                 action.name, action.body.get("status", action.body.get("spec")))
        if not self.api.patch_workload(namespace, action.name, action.uid, action.body, status=status):
            self.jobs.wake(key, RETRY_SECONDS)  # Kueue wrote in between (or it is gone): decided again on fresh state
