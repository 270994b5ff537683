"""The kopf registrations: what the operator watches and indexes, and which events run a pass.

Every handler hands its job to the one `Reconciler` (reconciler.py), which reads kopf's indexes, plans and acts.
Configuration reaches the handlers through kopf's memo (docs: "memos"), not module globals: __main__ passes
`memo(config)` to kopf.run, the startup handler puts the Reconciler beside the configuration (`memo.reconciler`),
and every resource handler's memo, a shallow copy of that one, holds the same Reconciler.

kopf's own bookkeeping stays in two annotations under ddp.dev (no status.kopf, no finalizers), and only the children's
labels are watched, server-side. The Kueue Workload watch is registered only by `enable_kueue` (--kueue): without
Kueue's CRDs or the RBAC for them there is nothing to watch.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Mapping

import kopf
from kubernetes.client.exceptions import ApiException

from ddp_operator import k8s, leader, names
from ddp_operator.jobs import kept_job, kept_pod
from ddp_operator.kueue import indexed_workload
from ddp_operator.reconciler import RETRY_SECONDS, Config, Reconciler


def memo(config: Config = Config()) -> kopf.Memo:
    """kopf's operator-level memo for this configuration (for kopf.run; tests build one the same way)."""
    return kopf.Memo(config=config)


# --- kopf registrations -------------------------------------------------------------------------------
JOBS = (names.GROUP, names.VERSION, names.PLURAL)
NETWORK_POLICIES = (names.NETWORK_POLICY_API_VERSION, "networkpolicies")
OWNED = {names.LABEL_JOB_NAME: kopf.PRESENT}
LIST_CHUNK = 100  # objects per page of a listing


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: Config = memo.get("config") or Config()
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
    if config.kueue:
        settings.watching.label_selectors[names.KUEUE_API_VERSION, names.WORKLOAD_PLURAL] = names.LABEL_JOB_NAME
    # The initial listings come a page at a time, each processed before the next is read: a namespace crowded with
    # labelled pods is never held in memory all at once (the indexes keep only jobs.kept_pod of each).
    settings.watching.chunk_size = LIST_CHUNK
    settings.execution.max_workers = 16
    settings.networking.request_timeout = 60
    # With leader election, every write is fenced by this replica's Lease (leader.write_fence).
    memo.reconciler = r = Reconciler(k8s.Api(fence=leader.write_fence()), config)
    threading.Thread(target=r.run_ticker, name="ddp-ticker", daemon=True).start()
    threading.Thread(target=r.nodes.run, name="ddp-node-watch", daemon=True).start()


@kopf.on.cleanup()
def cleanup(memo: kopf.Memo, **_: Any) -> None:
    r = memo.get("reconciler")
    if r is not None:
        r.stop()


def _bound(memo: kopf.Memo, kwargs: Mapping[str, Any]) -> Reconciler:
    """The operator's Reconciler, with kopf's indexes (in every handler's kwargs) bound for its ticker."""
    r: Reconciler = memo.reconciler
    r.jobs.bind(kwargs)
    return r


def _pass(r: Reconciler, namespace: str, name: str) -> None:
    try:
        r.reconcile(namespace, name)
    except Exception:
        pass  # logged, and a wake-up is scheduled


def on_the_loop_index(*resource: Any, registry: kopf.OperatorRegistry | None = None,
                      **options: Any) -> Callable[[Callable[..., dict]], Callable[..., dict]]:
    """``kopf.index``, for a pure and quick index function that kopf runs on its event loop. kopf runs a sync handler
    in its thread pool: for each object listed at the start a hand-off to a thread and back (a future, a wake-up of
    the loop), which cost a restarted operator about 8 s of its event loop's time at 10,000 pods. The index keeps the
    function's name (handlers read it by that name), and the function stays a plain one for its tests."""
    def register(fn: Callable[..., dict]) -> Callable[..., dict]:
        async def indexed(**kwargs: Any) -> dict:
            return fn(**kwargs)
        kopf.index(*resource, id=fn.__name__, registry=registry, **options)(indexed)
        return fn
    return register


# The indexes hold every job and every labelled pod of every watched namespace: only what the operator reads of
# them (jobs.kept_job, jobs.kept_pod), never their bulk.
@on_the_loop_index(*JOBS)
def ddpjobs_by_key(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): kept_job(body)}


@on_the_loop_index("v1", "pods", labels=OWNED)
def pods_by_job(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels[names.LABEL_JOB_NAME]): kept_pod(body)}


@on_the_loop_index("v1", "services", labels=OWNED)
def services_by_job(namespace: str, name: str, **_: Any) -> dict:
    return {(namespace, name): True}


@on_the_loop_index(*NETWORK_POLICIES, labels=OWNED)
def network_policies_by_job(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    """(UID, owners' UIDs, spec): the spec is compared with the one the job needs on every pass (netpol.drifted)."""
    owners = tuple(o.get("uid") for o in body["metadata"].get("ownerReferences") or [])
    return {(namespace, name): (body["metadata"]["uid"], owners, copy.deepcopy(dict(body.get("spec") or {})))}


@kopf.on.event(*NETWORK_POLICIES, labels=OWNED)
def on_network_policy(event: Mapping[str, Any], namespace: str, name: str, uid: str, memo: kopf.Memo,
                      **kwargs: Any) -> None:
    """A deleted policy is put back at once (level-based, like every child), even when it was deleted before the
    watch ever showed it to a pass; a changed one is compared with what the job needs (netpol.drifted) at once too."""
    if event.get("type") == "DELETED":
        _child_deleted(event, "NetworkPolicy", namespace, name, uid, memo, kwargs)
        return
    try:
        _bound(memo, kwargs).child_changed(namespace, name)  # coalesced with the job's other events
    except Exception:
        pass  # logged, and a wake-up is scheduled


@kopf.on.event("v1", "services", labels=OWNED)
def on_service(event: Mapping[str, Any], namespace: str, name: str, uid: str, memo: kopf.Memo,
               **kwargs: Any) -> None:
    """Likewise the job's headless Service."""
    _child_deleted(event, "Service", namespace, name, uid, memo, kwargs)


def _child_deleted(event: Mapping[str, Any], kind: str, namespace: str, name: str, uid: str, memo: kopf.Memo,
                   kwargs: Mapping[str, Any]) -> None:
    r = _bound(memo, kwargs)
    if event.get("type") == "DELETED":  # the child is named after its job
        r.jobs.child_gone((namespace, name), kind, uid)
        _pass(r, namespace, name)


@kopf.on.resume(*JOBS)
@kopf.on.create(*JOBS)
@kopf.on.update(*JOBS, field="spec")
@kopf.on.update(*JOBS, field="metadata.labels")  # the Kueue queue (kueue.py)
def on_job(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    r = _bound(memo, kwargs)
    try:
        r.reconcile(namespace, name, copy.deepcopy(dict(body)))
    except ApiException as e:
        raise kopf.TemporaryError(f"API error {e.status}: {e.reason}", delay=RETRY_SECONDS) from e


@kopf.on.event(*JOBS)
def on_job_event(event: Mapping[str, Any], namespace: str, name: str, uid: str, memo: kopf.Memo,
                 **kwargs: Any) -> None:
    r = _bound(memo, kwargs)
    jm = memo.get("job_metrics")  # job_metrics.JobMetrics (__main__): a recovery observed as its status shows it
    if event.get("type") == "DELETED":
        r.jobs.forget((namespace, name), uid)
        if jm is not None:
            jm.forget(uid)
    elif jm is not None and isinstance(event.get("object"), Mapping):
        jm.see(event["object"])


@kopf.on.event("v1", "pods", labels=OWNED)
def on_pod(event: Mapping[str, Any], namespace: str, labels: Mapping[str, str], body: kopf.Body, memo: kopf.Memo,
           **kwargs: Any) -> None:
    r = _bound(memo, kwargs)
    key = (namespace, labels[names.LABEL_JOB_NAME])
    if event.get("type") == "DELETED":
        r.jobs.tombstone(key, body)
    try:
        r.child_changed(*key)  # coalesced: one pass serves every event that came while it waited
    except Exception:
        pass  # logged, and a wake-up is scheduled


# --- Kueue (only with --kueue: without Kueue's CRDs or the RBAC for them there is nothing to watch) ---------
WORKLOADS = (names.KUEUE_GROUP, names.KUEUE_VERSION, names.WORKLOAD_PLURAL)


def workloads_by_job(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    """A Workload being deleted leaves the index (kueue.indexed_workload): it is no job's Workload any more."""
    kept = indexed_workload(body)
    return {} if kept is None else {(namespace, labels[names.LABEL_JOB_NAME]): kept}


def on_workload(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **kwargs: Any) -> None:
    """Kueue admitted, evicted or changed a job's Workload: a pass for its job."""
    _pass(_bound(memo, kwargs), namespace, labels[names.LABEL_JOB_NAME])


def enable_kueue(registry: kopf.OperatorRegistry | None = None) -> None:
    """Register the Workload watch of the Kueue integration (before kopf starts, with Config(kueue=True) in the
    memo): the Workloads the operator owns."""
    registry = registry or kopf.get_default_registry()
    on_the_loop_index(*WORKLOADS, labels=OWNED, registry=registry)(workloads_by_job)
    kopf.on.event(*WORKLOADS, labels=OWNED, registry=registry)(on_workload)
