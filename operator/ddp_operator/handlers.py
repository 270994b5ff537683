"""The kopf shell: watches, one reconcile function, and the I/O that carries out a plan.

Every trigger (job created/resumed/updated, an owned pod changed, a time-based wake-up) ends in
`Reconciler.reconcile(namespace, name)`: read the job and its pods from kopf's in-memory indexes, call the
pure `plan.plan`, write the status once (only if it changed), post its Events, then create/delete children.
kopf starts handlers only after the indexes are filled, so a restarted operator sees every existing pod before
it decides anything.

API writes are kept minimal (the bench-api goal): no finalizers (no kopf timers/daemons; wake-ups come from
an in-process ticker), kopf's handler state lives in two annotations under ddp.dev, pod-count-only status
changes are coalesced for STATUS_COALESCE_SECONDS, and progress polling writes at most once per
spec.progressPeriodSeconds, only when the step moved forward.

Hang detection (failurePolicy.hangTimeoutSeconds, hang.py) rides on the progress poll: rank 0 is probed more
often while it is on (every hangTimeout/10, 1-5 s; status.progress is still written at most once per period), the
poll keeps a watch of rank 0's last step, and once it has not changed for the timeout the same pool thread asks
every trainer pod in parallel and runs a pass with their answers, which deletes the stuck pod(s). The ticker
schedules that check at its due time (its own wake-up), so it acts within the timeout + the poll interval + two
probe deadlines.
A child the API server refuses (quota, PodSecurity, a webhook, an invalid field) is retried with a per-child
exponential backoff (CREATE_BACKOFF_INITIAL_SECONDS doubling up to CREATE_BACKOFF_MAX_SECONDS, reset by a success)
while the rest of the pass goes on; the refusals are handed to the plan (Observed.refusals), which reports them
(condition ReplicaFailure, reason FailedCreate, one Event per distinct refusal). A refused NetworkPolicy holds back
the pods it protects. Node states for the node-loss rule are read for the pods plan.node_lost_candidates names,
each node at most once per NODE_CACHE_SECONDS.

One job's pods cannot stall the others: progress probes run on a small thread pool, each with one overall
deadline (progress.py), so the ticker that serves every job's wake-ups (deadlines, TTL, force-deletes) never
waits on a pod; an error in one job's probe or pass is logged and re-armed for that job alone. Every per-job
structure in memory is dropped when the job no longer exists (its DELETED event, or the periodic sweep that
also catches jobs gone with their namespace while the watch was down).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Mapping

import kopf
from kubernetes.client.exceptions import ApiException

from ddp_operator import hang as hangmod
from ddp_operator import metrics, names, progress
from ddp_operator.kueue import WorkloadState, observe_workload
from ddp_operator import crd as crd_defaults
from ddp_operator.k8s import ChildConflict, describe_error
from ddp_operator.netpol import NetworkPolicyConfig
from ddp_operator.observed import NodeState, PodState, observe_pod
from ddp_operator.plan import (
    CREATE, DELETE, DELETE_JOB, FORCE_DELETE, PATCH, PATCH_STATUS, Observed, Plan, invalid, node_lost_candidates, plan,
    stuck_pods,
)
from ddp_operator.spec import SpecError, parse_job
from ddp_operator.status import last_recovery, newer_progress, progress_status

log = logging.getLogger("ddp_operator")

COMPONENT = "ddp-operator"
STATUS_COALESCE_SECONDS = 2.0
CREATED_MEMORY_SECONDS = 30.0
TICK_SECONDS = 1.0
RESYNC_SECONDS = 300.0
RETRY_SECONDS = 5.0
SWEEP_SECONDS = 10.0
PROBE_WORKERS = 8
# A foreign object holding a child's name is looked at again this often (one create, one read).
CONFLICT_RETRY_SECONDS = 30.0
# A refused create is retried after 1 s, 2 s, 4 s, ... per child, at most this far apart; a success resets it.
CREATE_BACKOFF_INITIAL_SECONDS = 1.0
CREATE_BACKOFF_MAX_SECONDS = 60.0
# How long a node's state read for the node-loss rule is reused (one read per node, not per pod or pass).
NODE_CACHE_SECONDS = 5.0
# How long a ResourceFlavor or WorkloadPriorityClass read for Kueue is reused (they rarely change).
FLAVOR_CACHE_SECONDS = 30.0
# Status fields that only count pods: a change in them alone may wait a moment to be batched.
_COUNT_FIELDS = frozenset({"nodes", "nodesReady", "message"})


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether the job with this UID owns obj (labels alone can be put on any pod by anyone)."""
    return any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])


@dataclass
class _Created:
    body: dict
    at: float


@dataclass(frozen=True)
class _Refusal:
    """The last refusal of a child's create: what the API server said, how many in a row, when to retry."""
    message: str
    attempts: int
    retry_at: float  # time.monotonic()


def create_backoff(attempts: int) -> float:
    """Seconds before the next try after `attempts` refusals in a row: 1, 2, 4, ... capped."""
    return min(CREATE_BACKOFF_MAX_SECONDS, CREATE_BACKOFF_INITIAL_SECONDS * 2 ** min(attempts - 1, 30))


class Reconciler:
    """Per-process state of the shell; every method is safe to call from kopf's worker threads."""

    def __init__(self, api: Any, network_policy: NetworkPolicyConfig = NetworkPolicyConfig(), kueue: bool = False):
        self.api = api
        self.network_policy = network_policy
        self.kueue = kueue  # the Kueue integration (kueue.py) is on: Workloads are watched and written
        # Kueue's cluster-scoped objects, read at most once per FLAVOR_CACHE_SECONDS: name -> (what was read, when)
        self._flavors: dict[str, tuple[Mapping[str, Any] | None, float]] = {}  # ResourceFlavors
        self._priorities: dict[str, tuple[tuple[str, int] | str, float]] = {}  # WorkloadPriorityClasses
        # NetworkPolicies created but not yet seen by the watch (key -> uid, when): not created twice.
        self._policies_created: dict[tuple[str, str], tuple[str, float]] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
        self._locks_guard = threading.Lock()
        self._written: dict[str, dict] = {}          # job uid -> status last written (newer than the watch)
        self._written_at: dict[str, float] = {}
        self._tombstones: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
        self._created: dict[tuple[str, str], dict[str, _Created]] = defaultdict(dict)
        self._wakeups: dict[tuple[str, str], float] = {}
        self._last_pass: dict[tuple[str, str], float] = {}
        self._progress_at: dict[str, float] = {}
        self._progress_ip: dict[str, str] = {}
        self._progress_written_at: dict[str, float] = {}
        self._hang_watch: dict[str, hangmod.Watch] = {}
        self._phases: dict[str, str] = {}
        self._create_failed: dict[tuple[str, str], dict[str, _Refusal]] = defaultdict(dict)  # last refusal per child
        self._nodes: dict[str, tuple[NodeState | None, float]] = {}  # node -> (state, when read)
        # child name -> (why it cannot be created, when that was last checked)
        self._conflicts: dict[tuple[str, str], dict[str, tuple[str, float]]] = {}
        self._probing: set[tuple[str, str]] = set()
        self._swept_at = 0.0
        self._guard = threading.Lock()
        self.indexes: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._probes = ThreadPoolExecutor(max_workers=PROBE_WORKERS, thread_name_prefix="ddp-progress")

    # --- indexes ----------------------------------------------------------------------------------
    def bind(self, kwargs: Mapping[str, Any]) -> None:
        """Remember kopf's index objects (the same for every handler call) for the ticker."""
        if self.indexes is None and "ddpjobs_by_key" in kwargs:
            self.indexes = {k: kwargs[k] for k in ("ddpjobs_by_key", "pods_by_job", "services_by_job",
                                                   "network_policies_by_job", "workloads_by_job") if k in kwargs}

    def _values(self, index: str, key: tuple[str, str]) -> list:
        if self.indexes is None:
            return []
        try:
            return list(self.indexes[index][key])
        except KeyError:
            return []

    def _lock(self, key: tuple[str, str]) -> threading.Lock:
        with self._locks_guard:
            return self._locks[key]

    def _job_keys(self) -> list[tuple[str, str]]:
        if self.indexes is None:
            return []
        return list(self.indexes["ddpjobs_by_key"].keys())

    def _job_exists(self, key: tuple[str, str]) -> bool:
        """True unless the index is bound and holds no such job (unbound: the caller knows best)."""
        return self.indexes is None or bool(self._values("ddpjobs_by_key", key))

    # --- triggers ---------------------------------------------------------------------------------
    def pod_deleted(self, key: tuple[str, str], pod: Mapping[str, Any]) -> None:
        if not self._job_exists(key):
            return  # the garbage collector removing a deleted job's pods: nothing will read the tombstone
        with self._guard:
            self._tombstones[key][pod["metadata"]["uid"]] = copy.deepcopy(dict(pod))

    def job_deleted(self, key: tuple[str, str], uid: str) -> None:
        self.forget(key, uids=(uid,))

    def forget(self, key: tuple[str, str], uids: tuple[str, ...] = ()) -> None:
        """Drop every per-job structure of a job that no longer exists."""
        with self._guard:
            for store in (self._tombstones, self._created, self._wakeups, self._last_pass, self._conflicts,
                          self._create_failed, self._policies_created):
                store.pop(key, None)
            for uid in uids:
                for by_uid in (self._written, self._written_at, self._progress_at, self._progress_ip, self._phases,
                               self._progress_written_at, self._hang_watch):
                    by_uid.pop(uid, None)
        with self._locks_guard:
            lock = self._locks.get(key)
            if lock is not None and not lock.locked():  # a pass still running keeps it until the next sweep
                del self._locks[key]
        metrics.set_phases(self._phases)

    def sweep(self) -> None:
        """Forget every job the index no longer holds (missed DELETED events, a deleted namespace)."""
        if self.indexes is None:
            return
        keys = set(self._job_keys())
        uids = {b["metadata"]["uid"] for k in keys for b in self._values("ddpjobs_by_key", k)}
        with self._guard:
            stale_keys = {k for store in (self._tombstones, self._created, self._wakeups, self._last_pass,
                                          self._conflicts, self._create_failed, self._policies_created)
                          for k in store if k not in keys}
            stale_uids = {u for store in (self._written, self._written_at, self._progress_at, self._progress_ip,
                                          self._phases, self._progress_written_at, self._hang_watch)
                          for u in store if u not in uids}
        with self._locks_guard:
            stale_keys |= {k for k in self._locks if k not in keys}
        with self._guard:
            now = time.monotonic()
            for node in [n for n, (_, at) in self._nodes.items() if now - at >= NODE_CACHE_SECONDS]:
                del self._nodes[node]
        for k in stale_keys:
            if not self._job_exists(k):  # looked up again: a job created since the listing keeps its state
                self.forget(k)
        if stale_uids:
            uids = {b["metadata"]["uid"] for k in self._job_keys() for b in self._values("ddpjobs_by_key", k)}
            self.forget(("", ""), uids=tuple(stale_uids - uids))
        metrics.set_state_entries(self.tracked())

    def tracked(self) -> dict[str, int]:
        """Sizes of the per-job structures (what a deleted job must not leave behind)."""
        with self._guard:
            sizes = {"tombstones": len(self._tombstones), "created": len(self._created),
                     "wakeups": len(self._wakeups), "last_pass": len(self._last_pass),
                     "conflicts": len(self._conflicts), "create_failed": len(self._create_failed),
                     "policies_created": len(self._policies_created), "written": len(self._written),
                     "written_at": len(self._written_at), "progress_at": len(self._progress_at),
                     "progress_ip": len(self._progress_ip), "phases": len(self._phases),
                     "progress_written_at": len(self._progress_written_at), "hang_watch": len(self._hang_watch),
                     "probing": len(self._probing)}
        with self._locks_guard:
            sizes["locks"] = len(self._locks)
        return sizes

    def wake(self, key: tuple[str, str], after: float) -> None:
        due = time.monotonic() + max(0.0, after)
        with self._guard:
            if key not in self._wakeups or due < self._wakeups[key]:
                self._wakeups[key] = due

    def tick(self) -> None:
        """Run due wake-ups, a slow resync of every job, progress probes (in the pool) and the sweep.

        Each job's work is isolated: whatever one job raises, every other due wake-up still runs, and the
        failing job's own wake-up is re-armed."""
        now = time.monotonic()
        with self._guard:
            due = [k for k, t in self._wakeups.items() if t <= now]
            for k in due:
                del self._wakeups[k]
        keys = set(due)
        try:
            jobs = self._job_keys()
        except Exception:  # noqa: BLE001 - the wake-ups already taken must run regardless
            log.exception("could not list jobs for the resync")
            jobs = []
        for key in jobs:
            if now - self._last_pass.get(key, 0.0) >= RESYNC_SECONDS:
                keys.add(key)
            self._schedule_probe(key)
        if now - self._swept_at >= SWEEP_SECONDS:
            self._swept_at = now
            try:
                self.sweep()
            except Exception:  # noqa: BLE001
                log.exception("sweep of deleted jobs failed")
        for key in sorted(keys):
            try:
                self.reconcile(*key)
            except Exception:  # noqa: BLE001 - logged by reconcile; this job alone is retried
                self.wake(key, RETRY_SECONDS)

    def run_ticker(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            try:
                self.tick()
            except Exception:
                log.exception("ticker pass failed")

    def stop(self) -> None:
        self._stop.set()
        self._probes.shutdown(wait=False, cancel_futures=True)

    # --- observation ------------------------------------------------------------------------------
    def _observe(self, key: tuple[str, str], uid: str) -> tuple[tuple[PodState, ...], set[str]]:
        live = [p for p in self._values("pods_by_job", key)
                if _owned_by(p, uid)]
        live_names = {p["metadata"]["name"]: p["metadata"]["uid"] for p in live}
        now = time.monotonic()
        with self._guard:
            tombstones = dict(self._tombstones.get(key, {}))
            created = self._created.get(key, {})
            for name, c in list(created.items()):
                if live_names.get(name) == c.body["metadata"]["uid"] or now - c.at > CREATED_MEMORY_SECONDS \
                        or c.body["metadata"]["uid"] in tombstones:
                    del created[name]
            fresh = [c.body for name, c in created.items() if name not in live_names]
        gone = [t for u, t in tombstones.items() if u not in live_names.values()
                and _owned_by(t, uid)]
        states = tuple(observe_pod(p) for p in live + fresh) + tuple(observe_pod(t, gone=True) for t in gone)
        return states, set(tombstones)

    # --- the pass ---------------------------------------------------------------------------------
    def reconcile(self, namespace: str, name: str, body: Mapping[str, Any] | None = None, *,
                  hang_reports: Mapping[str, Mapping[str, Any] | None] | None = None) -> Plan | None:
        key = (namespace, name)
        with self._lock(key):
            started = time.monotonic()
            try:
                result = (self._reconcile(key, body) if hang_reports is None
                          else self._reconcile(key, body, hang_reports))
            except Exception as e:
                metrics.RECONCILES.labels("error").inc()
                log.warning("[%s/%s] reconcile failed, retrying in %.0fs: %s", namespace, name, RETRY_SECONDS,
                            describe_error(e), exc_info=not isinstance(e, ApiException))
                self.wake(key, RETRY_SECONDS)
                raise
            finally:
                if self._job_exists(key):
                    self._last_pass[key] = time.monotonic()
                metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            metrics.RECONCILES.labels("ok").inc()
            return result

    def _job_body(self, key: tuple[str, str], body: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if body is not None:
            return body
        values = self._values("ddpjobs_by_key", key)
        return values[0] if values else None

    def _reconcile(self, key: tuple[str, str], body: Mapping[str, Any] | None,
                   hang_reports: Mapping[str, Mapping[str, Any] | None] | None = None) -> Plan | None:
        body = self._job_body(key, body)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        uid = body["metadata"]["uid"]
        now = _now()
        with self._guard:
            prev = self._written.get(uid)
        if prev is None:
            prev = dict(body.get("status") or {})
        else:
            # The watched object may hold a newer progress than our copy (another writer, a restart): the status
            # written now never carries an older one.
            stored = newer_progress(prev.get("progress"), (body.get("status") or {}).get("progress"))
            if stored is not None and stored != prev.get("progress"):
                prev = {**prev, "progress": stored}
        try:
            job = parse_job(body)
        except SpecError as e:
            result = invalid(int(body["metadata"].get("generation") or 0), prev, str(e), now)
            self._write_status(key, uid, prev, result.status, force=True)
            self._post_events(body, result)
            return result
        pods, seen_tombstones = self._observe(key, uid)
        node_ready = {p.node: self.api.node_ready(p.node) for p in stuck_pods(job, pods, now)}
        nodes = ({p.node: self._node_state(p.node) for p in node_lost_candidates(pods)}
                 if job.spec.failure_policy.node_lost_timeout_seconds else {})
        policies = [uid_ for uid_, owners in self._values("network_policies_by_job", key) if uid in owners]
        with self._guard:
            created = self._policies_created.get(key)
            if created and (policies or time.monotonic() - created[1] > CREATED_MEMORY_SECONDS):
                del self._policies_created[key]
            elif created:
                policies = [created[0]]
            conflicts = {name: why for name, (why, _) in (self._conflicts.get(key) or {}).items()}
            refusals = {name: r.message for name, r in (self._create_failed.get(key) or {}).items()}
        observed = Observed(pods=pods, service_exists=bool(self._values("services_by_job", key)),
                            node_ready=node_ready, network_policy_exists=bool(policies),
                            network_policy_uid=policies[0] if policies else None, conflicts=conflicts,
                            hang_reports=hang_reports, refusals=refusals, nodes=nodes,
                            **(self._observe_kueue(key, uid, job.priority_class) if job.queue_name else {}))
        result = plan(job, prev, observed, now, self.network_policy)
        # Status first: a failure is on record (by pod UID) before the pod is deleted, so a crash between
        # the two never counts it twice.
        # A pass with Events is never coalesced: the next pass would post them again from the same old status.
        self._write_status(key, uid, prev, result.status, force=bool(result.events))
        # Events before the actions: a refused create fails the pass, and the status that carried them is written.
        self._post_events(body, result)
        self._execute(job.namespace, key, body, result)
        with self._guard:
            for u in seen_tombstones:
                self._tombstones.get(key, {}).pop(u, None)
            self._phases[uid] = result.status.get("phase", names.PHASE_PENDING)
        metrics.set_phases(self._phases)
        if result.counted_restarts:
            metrics.RESTARTS.inc(result.counted_restarts)
        if result.status.get("disruptions", 0) > int(prev.get("disruptions") or 0):
            metrics.DISRUPTIONS.inc(result.status["disruptions"] - int(prev.get("disruptions") or 0))
        if result.recovery_seconds is not None:
            metrics.RECOVERY.observe(result.recovery_seconds)
            log.info("[%s/%s] recovered in %.1fs", *key, result.recovery_seconds)
        if result.requeue_after is not None:
            self.wake(key, result.requeue_after + 0.5)
        return result

    def _write_status(self, key: tuple[str, str], uid: str, prev: Mapping, new: Mapping, force: bool = False) -> None:
        if new == prev:
            return
        changed = {k for k in set(prev) | set(new) if prev.get(k) != new.get(k)}
        since = time.monotonic() - self._written_at.get(uid, 0.0)
        if not force and changed <= _COUNT_FIELDS and since < STATUS_COALESCE_SECONDS:
            self.wake(key, STATUS_COALESCE_SECONDS - since)
            return
        patch = {k: new.get(k) for k in changed}  # None removes a key (merge patch)
        self.api.patch_status(key[0], key[1], patch)
        with self._guard:
            self._written[uid] = copy.deepcopy(dict(new))
            self._written_at[uid] = time.monotonic()
        if "phase" in changed:
            log.info("[%s/%s] phase %s -> %s: %s", *key, prev.get("phase"), new.get("phase"), new.get("message", ""))

    def _execute(self, namespace: str, key: tuple[str, str], body: Mapping, result: Plan) -> None:
        self._forget_refusals(key, {a.name for a in result.actions if a.verb == CREATE})
        policy_missing = False  # pods are never created before the NetworkPolicy that protects them
        for action in result.actions:
            if action.verb == CREATE:
                if action.kind == "Pod" and policy_missing:
                    continue
                if self._conflict_checked_recently(key, action.name):
                    continue  # looked at again when its retry is due, not on every pass (two requests each)
                if self._backing_off(key, action.name):
                    policy_missing = policy_missing or action.kind == "NetworkPolicy"
                    continue
                try:
                    created = self._create(key, body, action)
                except ChildConflict as e:
                    self._conflict(key, action.name, str(e))
                    continue
                except ApiException as e:
                    self._refused(key, action, e)
                    policy_missing = policy_missing or action.kind == "NetworkPolicy"
                    continue
                self._resolved(key, action.name)
                if created is not None:
                    log.info("[%s/%s] created %s %s", *key, action.kind, action.name)
                    if action.kind == "Pod":
                        with self._guard:
                            self._created[key][action.name] = _Created(created, time.monotonic())
                    elif action.kind == "NetworkPolicy":
                        with self._guard:
                            self._policies_created[key] = (created["metadata"].get("uid"), time.monotonic())
            elif action.kind == names.WORKLOAD_KIND:
                self._workload_write(namespace, key, action)
            elif action.verb == DELETE and action.kind == "NetworkPolicy":
                log.info("[%s/%s] deleting NetworkPolicy %s", *key, action.name)
                self.api.delete_network_policy(namespace, action.name, action.uid)
            elif action.verb == DELETE:
                log.info("[%s/%s] deleting pod %s", *key, action.name)
                self.api.delete_pod(namespace, action.name, action.uid, grace_seconds=action.grace_seconds)
            elif action.verb == FORCE_DELETE:
                log.warning("[%s/%s] force-deleting pod %s on a NotReady or lost node", *key, action.name)
                self.api.delete_pod(namespace, action.name, action.uid, force=True)
            elif action.verb == PATCH:
                log.info("[%s/%s] patching pod %s: %s", *key, action.name, action.body)
                self.api.patch_pod(namespace, action.name, action.uid, action.body or {})
            elif action.verb == DELETE_JOB:
                log.info("[%s/%s] ttlSecondsAfterFinished expired; deleting the job", *key)
                self.api.delete_job(namespace, action.name, body["metadata"]["uid"])

    def _create(self, key: tuple[str, str], body: Mapping, action: Any) -> dict | None:
        """Create a child; a success ends its refusal backoff (and the next pass clears the condition)."""
        created = self.api.create(action.body)
        with self._guard:
            refused = self._create_failed.get(key, {}).pop(action.name, None)
        if refused is not None:
            log.info("[%s/%s] created %s %s after %d refusal(s)", *key, action.kind, action.name, refused.attempts)
            self.wake(key, 0.0)
        return created

    # --- refused creates ------------------------------------------------------------------------------
    def _refused(self, key: tuple[str, str], action: Any, error: ApiException) -> None:
        """The API server refused a child: retry it after the next backoff step; a refusal that differs from the
        last one is reported at once (a pass right away hands it to the plan), a repeated one only retried."""
        message = f"cannot create {action.kind} {action.name}: {describe_error(error)}"
        with self._guard:
            known = self._create_failed[key].get(action.name)
            attempts = known.attempts + 1 if known else 1
            delay = create_backoff(attempts)
            self._create_failed[key][action.name] = _Refusal(message, attempts, time.monotonic() + delay)
        new = known is None or known.message != message
        if new:
            log.warning("[%s/%s] %s; retrying in %.0fs", *key, message, delay)
        else:
            log.debug("[%s/%s] %s (refusal %d); retrying in %.0fs", *key, message, attempts, delay)
        self.wake(key, 0.0 if new else delay)

    def _backing_off(self, key: tuple[str, str], name: str) -> bool:
        """True while a refused child's retry is not due yet (the retry's wake-up stays armed)."""
        with self._guard:
            refused = (self._create_failed.get(key) or {}).get(name)
        return self._not_due(key, refused.retry_at if refused else None)

    def _forget_refusals(self, key: tuple[str, str], wanted: set[str]) -> None:
        """Drop the refusals of children the plan no longer creates (scaled down, the job finished)."""
        with self._guard:
            known = self._create_failed.get(key) or {}
            stale = [name for name in known if name not in wanted]
            for name in stale:
                del known[name]
        if stale:
            self.wake(key, 0.0)

    # --- Kueue ----------------------------------------------------------------------------------------
    def _observe_kueue(self, key: tuple[str, str], uid: str, priority_class: str | None) -> dict[str, Any]:
        """Observed's Kueue fields for a job with a queue name: its Workload, the flavors its admission names and,
        while it has no Workload yet, its WorkloadPriorityClass."""
        if not self.kueue:
            return {"kueue": False}
        owned = [observe_workload(w) for w in self._values("workloads_by_job", key) if _owned_by(w, uid)]
        workload: WorkloadState | None = owned[0] if owned else None
        flavors = {f: self._flavor(f) for f in workload.flavor_names()} if workload and workload.admitted else {}
        priority = (self._read_cached(self._priorities, priority_class, FLAVOR_CACHE_SECONDS, self.api.workload_priority)
                    if priority_class and workload is None else None)
        return {"kueue": True, "workload": workload, "flavors": flavors, "priority": priority}

    def _flavor(self, name: str) -> Mapping[str, Any] | None:
        """A ResourceFlavor's spec, read at most once per FLAVOR_CACHE_SECONDS."""
        return self._read_cached(self._flavors, name, FLAVOR_CACHE_SECONDS, self.api.resource_flavor)

    def _read_cached(self, store: dict[str, tuple[Any, float]], name: str, seconds: float,
                     read: Callable[[str], Any]) -> Any:
        """read(name), or what it returned less than `seconds` ago."""
        now = time.monotonic()
        with self._guard:
            cached = store.get(name)
        if cached is not None and now - cached[1] < seconds:
            return cached[0]
        value = read(name)
        with self._guard:
            store[name] = (value, now)
        return value

    def _workload_write(self, namespace: str, key: tuple[str, str], action: Any) -> None:
        if action.verb == DELETE:
            log.info("[%s/%s] deleting Kueue workload %s", *key, action.name)
            self.api.delete_workload(namespace, action.name, action.uid)
            return
        status = action.verb == PATCH_STATUS
        log.info("[%s/%s] %s Kueue workload %s: %s", *key, "updating the status of" if status else "patching",
                 action.name, action.body.get("status", action.body.get("spec")))
        if not self.api.patch_workload(namespace, action.name, action.uid, action.body, status=status):
            self.wake(key, RETRY_SECONDS)  # Kueue wrote in between (or it is gone): decided again on fresh state

    # --- nodes ----------------------------------------------------------------------------------------
    def _node_state(self, name: str) -> NodeState | None:
        """A node's state for the node-loss rule, read at most once per NODE_CACHE_SECONDS."""
        return self._read_cached(self._nodes, name, NODE_CACHE_SECONDS, self.api.node_state)

    def _conflict(self, key: tuple[str, str], name: str, message: str) -> None:
        """A foreign object holds a child's name: the next pass reports it (condition + Event); the create is
        tried again every CONFLICT_RETRY_SECONDS, so removing the object is all a user has to do."""
        with self._guard:
            known = self._conflicts.setdefault(key, {})
            new = (known.get(name) or ("", 0.0))[0] != message
            known[name] = (message, time.monotonic())
        if new:
            log.warning("[%s/%s] %s", *key, message)
        self.wake(key, 0.0 if new else CONFLICT_RETRY_SECONDS)

    def _conflict_checked_recently(self, key: tuple[str, str], name: str) -> bool:
        """True if the conflict on `name` was seen less than CONFLICT_RETRY_SECONDS ago (the retry stays armed)."""
        with self._guard:
            known = (self._conflicts.get(key) or {}).get(name)
        return self._not_due(key, known[1] + CONFLICT_RETRY_SECONDS if known else None)

    def _not_due(self, key: tuple[str, str], due: float | None) -> bool:
        """True while a retry due at monotonic time `due` is still ahead; its wake-up is (re-)armed."""
        if due is None:
            return False
        left = due - time.monotonic()
        if left <= 0:
            return False
        self.wake(key, left)
        return True

    def _resolved(self, key: tuple[str, str], name: str) -> None:
        with self._guard:
            known = self._conflicts.get(key)
            if not known or known.pop(name, None) is None:
                return
            if not known:
                del self._conflicts[key]
        self.wake(key, 0.0)

    def _post_events(self, body: Mapping, result: Plan) -> None:
        for event in result.events:
            self.api.post_event(body, event.type, event.reason, event.message, COMPONENT)

    # --- progress ---------------------------------------------------------------------------------
    def _probe_due(self, key: tuple[str, str]) -> tuple[Mapping[str, Any], dict] | None:
        """The job's body and last status if its progress is due for a poll (Running/Restarting, and the poll
        interval up or a hang check due)."""
        values = self._values("ddpjobs_by_key", key)
        if not values:
            return None
        body = values[0]
        uid = body["metadata"]["uid"]
        spec = body.get("spec") or {}
        period = spec.get("progressPeriodSeconds", 30)
        interval = hangmod.poll_interval(period, self._hang_timeout(spec))
        if interval is None:
            return None
        now = time.monotonic()
        if now - self._progress_at.get(uid, 0.0) < interval and not self._hang_check_due(key, body, now):
            return None
        with self._guard:
            status = self._written.get(uid) or dict(body.get("status") or {})
        if status.get("phase") not in (names.PHASE_RUNNING, names.PHASE_RESTARTING):
            return None
        return body, status

    def _schedule_probe(self, key: tuple[str, str]) -> None:
        """Hand a job's due progress poll to the pool unless one is still running for it."""
        if self._probe_due(key) is None:
            return
        with self._guard:
            if key in self._probing:
                return
            self._probing.add(key)
        try:
            self._probes.submit(self._poll_isolated, key)
        except RuntimeError:  # the pool is shut down: the operator is stopping
            with self._guard:
                self._probing.discard(key)

    def _poll_isolated(self, key: tuple[str, str]) -> None:
        try:
            self.poll_progress(key)
        except BaseException as e:  # noqa: BLE001 - RecursionError, OverflowError...: this job only
            log.warning("[%s/%s] progress poll failed: %s", *key, describe_error(e) if isinstance(e, Exception)
                        else type(e).__name__)
        finally:
            with self._guard:
                self._probing.discard(key)

    def poll_progress(self, key: tuple[str, str]) -> None:
        due = self._probe_due(key)
        if due is None:
            return
        body, status = due
        uid = body["metadata"]["uid"]
        self._progress_at[uid] = time.monotonic()
        trainers = self._running_trainers(key, uid)
        found = progress.probe([p["status"]["podIP"] for p in trainers], self._progress_ip.get(uid))
        report = None
        if found is not None:
            self._progress_ip[uid], report = found
        current = hangmod.incarnation(trainers)
        with self._guard:
            self._watch_update(uid, hangmod.watch(self._hang_watch.get(uid), current, report, time.monotonic()))
        if report is not None:
            self._write_progress(key, uid, body, status, report)
        if self._hang_check_due(key, body, time.monotonic()):
            self._hang_check(key, uid, trainers)

    def _watch_update(self, uid: str, w: hangmod.Watch | None) -> None:
        if w is None:
            self._hang_watch.pop(uid, None)
        else:
            self._hang_watch[uid] = w

    def _running_trainers(self, key: tuple[str, str], uid: str) -> list[Mapping[str, Any]]:
        """The job's running trainer pods with an IP (only pods it owns: labels alone can be put on any pod)."""
        return [p for p in self._values("pods_by_job", key)
                if (p.get("status") or {}).get("phase") == "Running" and (p.get("status") or {}).get("podIP")
                and not p["metadata"].get("deletionTimestamp")
                and p["metadata"].get("labels", {}).get(names.LABEL_ROLE) == names.ROLE_TRAINER
                and _owned_by(p, uid)]

    def _write_progress(self, key: tuple[str, str], uid: str, body: Mapping[str, Any], status: Mapping[str, Any],
                        report: Mapping[str, Any]) -> None:
        """status.progress (when the step moved forward, at most once per progressPeriodSeconds) and
        status.lastRecovery (when rank 0's recovery report changes it)."""
        new = progress_status(report)
        spec = body.get("spec") or {}
        period = spec.get("progressPeriodSeconds", 30) or 0
        # Polled faster than the period for hang detection: the writes still keep to the period.
        interval = hangmod.poll_interval(period, self._hang_timeout(spec)) or period
        min_gap = period if interval < period else 0.0
        with self._lock(key):
            with self._guard:
                written = self._written.get(uid)
                base = written or status
                current = base.get("progress") or {}
                recovery = last_recovery(base.get("lastRecovery"), base.get("lastIncident"), report)
            patch: dict[str, Any] = {}
            if (newer_progress(current, new) is new
                    and (new.get("step") != current.get("step") or new.get("final") != current.get("final"))
                    and time.monotonic() - self._progress_written_at.get(uid, 0.0) >= min_gap):
                patch["progress"] = new
            if recovery is not None and recovery != base.get("lastRecovery"):
                patch["lastRecovery"] = recovery
            if not patch or not self._job_exists(key):
                return
            self.api.patch_status(key[0], key[1], patch)
            if "progress" in patch:
                metrics.PROGRESS_WRITES.inc()
                self._progress_written_at[uid] = time.monotonic()
            with self._guard:
                written = self._written.get(uid)
                if written is not None:
                    written.update(patch)

    # --- hang detection ---------------------------------------------------------------------------
    @staticmethod
    def _hang_timeout(spec: Mapping[str, Any]) -> float:
        fp = spec.get("failurePolicy") or {}
        value = fp.get("hangTimeoutSeconds", crd_defaults.DEFAULTS["failurePolicy"]["hangTimeoutSeconds"])
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

    def _hang_check_due(self, key: tuple[str, str], body: Mapping[str, Any], now: float) -> bool:
        uid = body["metadata"]["uid"]
        spec = body.get("spec") or {}
        if not spec.get("progressPeriodSeconds", 30):
            return False
        with self._guard:
            w = self._hang_watch.get(uid)
        if w is None:
            return False
        left = hangmod.due_in(w, w.incarnation, self._hang_timeout(spec), now)
        return left is not None and left <= 0

    def _hang_check(self, key: tuple[str, str], uid: str, trainers: list[Mapping[str, Any]]) -> None:
        """Rank 0's step has not changed for the timeout: ask every trainer pod, then a pass decides."""
        current = hangmod.incarnation(trainers)
        with self._guard:
            w = self._hang_watch.get(uid)
            if w is None or w.incarnation != current:
                return  # the pods changed since: the clock starts again with the next report
            # Checked now: the next check is one timeout later, unless the pods or rank 0's step change first.
            self._hang_watch[uid] = hangmod.Watch(w.incarnation, w.key, time.monotonic())
        reports = progress.probe_each({p["metadata"]["name"]: p["status"]["podIP"] for p in trainers})
        steps = {name: (r or {}).get("step") for name, r in reports.items()}
        log.warning("[%s/%s] rank 0's step has not changed for the hang timeout; pods report %s", *key, steps)
        self.reconcile(*key, hang_reports=reports)


RECONCILER: Reconciler | None = None
# Set by __main__ from its flags before kopf starts.
NETWORK_POLICY = NetworkPolicyConfig()
KUEUE = False  # enable_kueue() sets it


def reconciler() -> Reconciler:
    global RECONCILER
    if RECONCILER is None:
        from ddp_operator.k8s import Api
        RECONCILER = Reconciler(Api(), NETWORK_POLICY, kueue=KUEUE)
    return RECONCILER


# --- kopf registrations -------------------------------------------------------------------------------
JOBS = (names.GROUP, names.VERSION, names.PLURAL)
NETWORK_POLICIES = (names.NETWORK_POLICY_API_VERSION, "networkpolicies")
OWNED = {names.LABEL_JOB_NAME: kopf.PRESENT}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Events are posted by the reconciler, only when a condition changes; kopf's per-handler chatter is off.
    settings.posting.enabled = False
    # kopf's own bookkeeping stays in two annotations of ours instead of status.kopf.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{names.GROUP}/finalizer"
    # Only the children's labels are watched, server-side.
    settings.watching.label_selectors["v1", "pods"] = names.LABEL_JOB_NAME
    settings.watching.label_selectors["v1", "services"] = names.LABEL_JOB_NAME
    settings.watching.label_selectors[NETWORK_POLICIES] = names.LABEL_JOB_NAME
    if KUEUE:
        settings.watching.label_selectors[names.KUEUE_API_VERSION, names.WORKLOAD_PLURAL] = names.LABEL_JOB_NAME
    settings.execution.max_workers = 16
    settings.networking.request_timeout = 60
    r = reconciler()
    threading.Thread(target=r.run_ticker, name="ddp-ticker", daemon=True).start()


@kopf.on.cleanup()
def cleanup(**_: Any) -> None:
    if RECONCILER is not None:
        RECONCILER.stop()


@kopf.index(*JOBS)
def ddpjobs_by_key(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): copy.deepcopy(dict(body))}


@kopf.index("v1", "pods", labels=OWNED)
def pods_by_job(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[names.LABEL_JOB_NAME]): copy.deepcopy(dict(body))}


@kopf.index("v1", "services", labels=OWNED)
def services_by_job(namespace: str, name: str, **_: Any) -> dict:
    return {(namespace, name): True}


@kopf.index(*NETWORK_POLICIES, labels=OWNED)
def network_policies_by_job(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    owners = tuple(o.get("uid") for o in body["metadata"].get("ownerReferences") or [])
    return {(namespace, name): (body["metadata"]["uid"], owners)}


@kopf.on.event(*NETWORK_POLICIES, labels=OWNED)
def on_network_policy(event: Mapping[str, Any], namespace: str, name: str, **kwargs: Any) -> None:
    """A deleted policy is put back at once (level-based, like every child)."""
    r = reconciler()
    r.bind(kwargs)
    if event.get("type") == "DELETED":
        try:
            r.reconcile(namespace, name)
        except Exception:
            pass  # logged, and a wake-up is scheduled


@kopf.on.resume(*JOBS)
@kopf.on.create(*JOBS)
@kopf.on.update(*JOBS, field="spec")
@kopf.on.update(*JOBS, field="metadata.labels")  # the Kueue queue (kueue.py)
def on_job(namespace: str, name: str, body: kopf.Body, **kwargs: Any) -> None:
    r = reconciler()
    r.bind(kwargs)
    try:
        r.reconcile(namespace, name, copy.deepcopy(dict(body)))
    except ApiException as e:
        raise kopf.TemporaryError(f"API error {e.status}: {e.reason}", delay=RETRY_SECONDS) from e


@kopf.on.event(*JOBS)
def on_job_event(event: Mapping[str, Any], namespace: str, name: str, uid: str, **kwargs: Any) -> None:
    reconciler().bind(kwargs)
    if event.get("type") == "DELETED":
        reconciler().job_deleted((namespace, name), uid)


@kopf.on.event("v1", "pods", labels=OWNED)
def on_pod(event: Mapping[str, Any], namespace: str, labels: Mapping[str, str], body: kopf.Body,
           **kwargs: Any) -> None:
    r = reconciler()
    r.bind(kwargs)
    key = (namespace, labels[names.LABEL_JOB_NAME])
    if event.get("type") == "DELETED":
        r.pod_deleted(key, body)
    try:
        r.reconcile(*key)
    except Exception:
        pass  # logged, and a wake-up is scheduled


# --- Kueue (only with --kueue: without Kueue's CRDs or the RBAC for them there is nothing to watch) ---------
WORKLOADS = (names.KUEUE_GROUP, names.KUEUE_VERSION, names.WORKLOAD_PLURAL)


def workloads_by_job(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[names.LABEL_JOB_NAME]): copy.deepcopy(dict(body))}


def on_workload(namespace: str, labels: Mapping[str, str], **kwargs: Any) -> None:
    """Kueue admitted, evicted or changed a job's Workload: a pass for its job."""
    r = reconciler()
    r.bind(kwargs)
    try:
        r.reconcile(namespace, labels[names.LABEL_JOB_NAME])
    except Exception:
        pass  # logged, and a wake-up is scheduled


def enable_kueue(registry: kopf.OperatorRegistry | None = None) -> None:
    """Turn the Kueue integration on (before kopf starts): watch the Workloads the operator owns."""
    global KUEUE
    KUEUE = True
    registry = registry or kopf.get_default_registry()
    kopf.index(*WORKLOADS, labels=OWNED, registry=registry)(workloads_by_job)
    kopf.on.event(*WORKLOADS, labels=OWNED, registry=registry)(on_workload)
