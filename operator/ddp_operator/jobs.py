"""What the shell knows of each job: kopf's in-memory indexes (what the cluster holds) and one `JobRecord` per job
(what the shell remembers), keyed by (namespace, name) in one `JobRegistry`.

A record is made by a job's first pass or wake-up and dropped when the job no longer exists: its DELETED event
(`forget`), or the periodic `sweep` that also catches jobs gone with their namespace while the watch was down. What
belongs to one job *object* rather than to its name (the status last written, the parsed spec, progress, hang and
stall state, the phase) is kept per UID in `JobRecord.objects`, so a job deleted and created again under the same name
never inherits the old one's. Records are changed under `JobRegistry.guard`; a record's `lock` serializes the
job's passes. The registry also puts the operator's diagnostics tools image and store image into every job it parses
(diagnostics.Tools, rdzv_spec.Rendezvous.default_image: operator settings the renderers read from the job, so they
stay pure).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from ddp_operator import metrics, names
from ddp_operator.diagnostics import Tools
from ddp_operator.jsondoc import copied
from ddp_operator.kueue import kept_queue, observe_workload
from ddp_operator.observed import PodState, observe_pod
from ddp_operator.pod import render_trainer_pod
from ddp_operator.rdzv import render_rdzv_pod
from ddp_operator.rdzv_spec import DEFAULT_STORE_IMAGE
from ddp_operator.spec import Job, SpecError, parse_job

if TYPE_CHECKING:
    from ddp_operator.backoff import Refusal
    from ddp_operator.hang import Watch
    from ddp_operator.stall import StallWatch

log = logging.getLogger("ddp_operator")

Key = tuple[str, str]  # (namespace, name)

# kopf's indexes (handlers.py) the shell reads.
INDEXES = ("ddpjobs_by_key", "pods_by_job", "services_by_job", "network_policies_by_job", "workloads_by_job")


# What the indexes and tombstones keep of a pod: the fields observe_pod, the poller and the owner check read. Every
# pod with the job label in every watched namespace is held in memory, so its bulk (annotations, managedFields,
# the containers' spec) must not be: a flood of such pods would otherwise OOM-kill the operator.
_POD_METADATA = ("name", "namespace", "uid", "resourceVersion", "labels", "ownerReferences", "deletionTimestamp")
_POD_ANNOTATIONS = (names.NODES_ANNOTATION,)
_POD_SPEC = ("nodeName", "restartPolicy")
_POD_STATUS = ("phase", "reason", "message", "podIP", "conditions", "containerStatuses", "initContainerStatuses")
# A job's metadata the shell never reads: the server's field bookkeeping and the annotations (kubectl's
# last-applied configuration and kopf's own copy of the spec).
_JOB_DROPPED_METADATA = ("managedFields", "annotations")


def kept_pod(pod: Mapping[str, Any]) -> dict:
    """A private copy of what the operator reads of a pod (tests/unit/test_jobs_memory.py holds it to that)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    kept_meta = {k: copied(meta[k]) for k in _POD_METADATA if k in meta}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k in _POD_ANNOTATIONS}
    if annotations:
        kept_meta["annotations"] = annotations
    return {"metadata": kept_meta, "spec": {k: spec[k] for k in _POD_SPEC if k in spec},
            "status": {k: copied(status[k]) for k in _POD_STATUS if k in status}}


_CHILD_METADATA = ("name", "namespace", "uid", "resourceVersion", "labels", "ownerReferences", "deletionTimestamp")


def kept_child(obj: Mapping[str, Any]) -> dict:
    """What the operator reads of a job's Service or NetworkPolicy: who it is and who owns it; of a NetworkPolicy also
    its spec, which a pass compares with the one the job needs (netpol.drifted)."""
    meta = obj.get("metadata") or {}
    spec = {"spec": copied(obj["spec"])} if obj.get("kind") == "NetworkPolicy" and "spec" in obj else {}
    return {**{k: obj[k] for k in ("apiVersion", "kind") if k in obj},
            "metadata": {k: copied(meta[k]) for k in _CHILD_METADATA if k in meta}, **spec}


def without_managed_fields(body: Mapping[str, Any]) -> dict:
    """A DDPJob as kopf needs it (its spec, status and annotations: kopf keeps its own state there), without the
    server's field bookkeeping, which nobody here reads."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    return {**body, "metadata": meta}


def kept_job(body: Mapping[str, Any]) -> dict:
    """A private copy of a DDPJob without what the shell never reads of it (_JOB_DROPPED_METADATA)."""
    kept = {k: copied(v) for k, v in body.items() if k != "metadata"}
    kept["metadata"] = {k: copied(v) for k, v in (body.get("metadata") or {}).items()
                        if k not in _JOB_DROPPED_METADATA}
    return kept


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether the job with this UID owns obj (labels alone can be put on any pod by anyone)."""
    return any(o.get("uid") == uid for o in obj["metadata"].get("ownerReferences") or [])


@dataclass
class Created:
    """A pod this operator created, until the watch shows it (or CREATED_MEMORY_SECONDS pass)."""
    body: dict
    at: float  # time.monotonic()


@dataclass
class JobObject:
    """What is kept of one job object (one UID)."""
    written: dict | None = None          # the status last written: newer than the watch's copy
    written_at: float = 0.0
    count_writes: int = 0                # count-only status writes in a row (reconciler.coalesce_window)
    phase: str | None = None             # for the per-phase job gauge
    progress_at: float = 0.0             # rank 0 last probed
    progress_ip: str | None = None       # where rank 0 answered last
    progress_written_at: float = 0.0
    history_pending: list[dict] = field(default_factory=list)  # points not yet in the history ConfigMap
    history_flushed_at: float = 0.0
    hang_watch: Watch | None = None
    stall_watch: StallWatch | None = None  # the diagnostics sidecars' answers in this incarnation (stall.watch)
    diagnosed_at: float = 0.0            # the sidecars last asked
    # What parse_job read (a private copy) and what it made of it: the parsed Job, or the SpecError's field and message.
    parsed: tuple[tuple, Job | tuple[str, str]] | None = None


@dataclass
class JobRecord:
    """Everything the shell keeps of one job (namespace, name)."""
    lock: threading.Lock = field(default_factory=threading.Lock)  # one pass of the job at a time
    wakeup: float | None = None          # time.monotonic() of the next pass asked for
    last_pass: float = 0.0
    probing: bool = False                # a progress poll is in the pool
    waiting: bool = False                # a pass for a child's event waits to start (Reconciler.child_changed)
    tombstones: dict[str, dict] = field(default_factory=dict)  # pod UID -> the pod as last seen, until a pass saw it
    # Pod UID -> the pod as the last pass of this process saw it in the index (Reconciler._observe): one that leaves
    # the index before its DELETED event reaches on_pod was deleted in sight, not while the operator was away.
    seen: dict[str, dict] = field(default_factory=dict)
    # Pod UID -> (the resourceVersion a pass observed, its PodState): the next pass observes again only the pods that
    # changed (one of a 1,000-node job's starting passes cost 13-58 ms observing every pod).
    states: dict[str, tuple[str, PodState]] = field(default_factory=dict)
    created: dict[str, Created] = field(default_factory=dict)  # pod name -> created, not yet in the index
    force_deleted: dict[str, float] = field(default_factory=dict)  # pod UID -> when, while the index shows it
    # The Service and NetworkPolicy this operator created, not yet in the index: kind -> (UID, when).
    children_created: dict[str, tuple[str, float]] = field(default_factory=dict)
    conflicts: dict[str, tuple[str, float]] = field(default_factory=dict)  # child name -> (why, when last checked)
    refusals: dict[str, Refusal] = field(default_factory=dict)  # child name -> its create's last refusal
    objects: dict[str, JobObject] = field(default_factory=dict)  # job UID -> what is kept of that object

    def of(self, uid: str) -> JobObject:
        return self.objects.setdefault(uid, JobObject())

    def observe(self, pods: list[dict]) -> tuple[PodState, ...]:
        """observe_pod of each pod, again only for the pods whose resourceVersion moved since the last pass (every
        change of an object moves it; a pod without one is always observed again); called by the job's passes
        only, under its lock."""
        kept, self.states, states = self.states, {}, []
        for p in pods:
            meta = p["metadata"]
            version, known = meta.get("resourceVersion"), kept.get(meta.get("uid"))
            state = known[1] if version and known and known[0] == version else observe_pod(p)
            if version:
                self.states[meta.get("uid")] = (version, state)
            states.append(state)
        return tuple(states)


def _parse_source(body: Mapping[str, Any]) -> tuple:
    """Everything parse_job reads of a body."""
    meta = body.get("metadata") or {}
    return (meta.get("name"), meta.get("namespace"), meta.get("uid"), meta.get("generation"), meta.get("labels"),
            body.get("spec"))


def _with_operator_settings(job: Job, tools: Tools, store_image: str) -> Job:
    """The job with the operator's diagnostics tools image and store image (operator settings, not the job's)."""
    spec = job.spec
    if spec.diagnostics.tools != tools:
        spec = dataclasses.replace(spec, diagnostics=dataclasses.replace(spec.diagnostics, tools=tools))
    if spec.rendezvous.default_image != store_image:
        spec = dataclasses.replace(spec, rendezvous=dataclasses.replace(spec.rendezvous, default_image=store_image))
    return job if spec is job.spec else dataclasses.replace(job, spec=spec)


def _parse(key: Key, body: Mapping[str, Any], tools: Tools = Tools(),
           store_image: str = DEFAULT_STORE_IMAGE) -> Job | tuple[str, str]:
    """parse_job(body) and a trial rendering of its pods, or the (field, message) of why the job cannot run.

    Whatever either raises ends here, as the job's InvalidSpec (a SpecError names its field; anything else is
    a defect or a value nobody foresaw, logged with its traceback): never an exception in every pass."""
    try:
        job = _with_operator_settings(parse_job(body), tools, store_image)
        render_trainer_pod(job, 0, 0)  # a template the renderers cannot use is invalid now, not in a later pass
        render_rdzv_pod(job, 0)
        return job
    except SpecError as e:
        return e.field, e.message
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.exception("[%s/%s] the job's spec could not be read or rendered", *key)
        return "spec.template", (f"could not be turned into pods ({type(e).__name__}: {e}); check the types of "
                                 f"its fields against the Pod API (kubectl explain pod.spec)")


class JobRegistry:
    """kopf's indexes, bound on the first handler call, and the records of every job the shell knows."""

    def __init__(self, tools: Tools = Tools(), store_image: str = DEFAULT_STORE_IMAGE) -> None:
        self.tools = tools  # the diagnostics tools image every parsed job carries
        self.store_image = store_image or DEFAULT_STORE_IMAGE  # and the store image, unless the job names its own
        self.guard = threading.Lock()
        self.indexes: dict[str, Any] | None = None
        self._records: dict[Key, JobRecord] = {}
        self.woken = threading.Event()  # set by a wake-up earlier than the ticker waits for: it looks again
        self._wait_end = math.inf  # what the ticker waits for (wait_for_wakeup); inf while it looks

    # --- kopf's indexes ---------------------------------------------------------------------------
    def bind(self, kwargs: Mapping[str, Any]) -> None:
        """Remember kopf's index objects (the same for every handler call) for the ticker."""
        if self.indexes is None and "ddpjobs_by_key" in kwargs:
            self.indexes = {k: kwargs[k] for k in INDEXES if k in kwargs}

    def values(self, index: str, key: Key) -> list:
        if self.indexes is None:
            return []
        try:
            return list(self.indexes[index][key])
        except KeyError:
            return []

    def keys(self) -> list[Key]:
        if self.indexes is None:
            return []
        return list(self.indexes["ddpjobs_by_key"].keys())

    def body(self, key: Key) -> Mapping[str, Any] | None:
        """The job as the index holds it."""
        values = self.values("ddpjobs_by_key", key)
        return values[0] if values else None

    def exists(self, key: Key) -> bool:
        """True unless the index is bound and holds no such job (unbound: the caller knows best)."""
        return self.indexes is None or bool(self.values("ddpjobs_by_key", key))

    def _uids(self) -> set[str]:
        return {b["metadata"]["uid"] for k in self.keys() for b in self.values("ddpjobs_by_key", k)}

    # --- records ----------------------------------------------------------------------------------
    def get(self, key: Key) -> JobRecord | None:
        with self.guard:
            return self._records.get(key)

    def record(self, key: Key) -> JobRecord:
        """The job's record, made if there is none yet."""
        with self.guard:
            return self._records.setdefault(key, JobRecord())

    def job(self, key: Key, body: Mapping[str, Any]) -> Job:
        """parse_job(body), parsed once per change of what it reads, in the queue of the Workload it still has
        when its queue label was removed (kueue.kept_queue); raises SpecError."""
        source = _parse_source(body)
        with self.guard:
            obj = self._records.setdefault(key, JobRecord()).of(body["metadata"]["uid"])
            parsed = obj.parsed
        if parsed is None or parsed[0] != source:
            parsed = (copied(source), _parse(key, body, self.tools, self.store_image))
            with self.guard:
                obj.parsed = parsed
        if not isinstance(parsed[1], Job):
            raise SpecError(*parsed[1])
        job = parsed[1]
        if job.queue_name is None:  # a job that has a Workload stays gated by it, whatever its labels say now
            workloads = [w for w in self.values("workloads_by_job", key) if owned_by(w, job.uid)]
            if workloads:
                job = kept_queue(job, observe_workload(workloads[0]))
        return job

    def tombstone(self, key: Key, pod: Mapping[str, Any]) -> None:
        """A pod of the job was deleted: the next pass sees it once more, as gone."""
        if not self.exists(key):
            return  # the garbage collector removing a deleted job's pods: nothing will read the tombstone
        with self.guard:
            self._records.setdefault(key, JobRecord()).tombstones[pod["metadata"]["uid"]] = kept_pod(pod)

    def force_deleted(self, key: Key, uid: str) -> None:
        """A pod of the job was force-deleted (gone once the API server answered): passes no longer see it, though the
        index may show it a while (its deletion waits in kopf's queue for that pod) and would hold its replacement."""
        with self.guard:
            self._records.setdefault(key, JobRecord()).force_deleted[uid] = time.monotonic()

    def not_force_deleted(self, key: Key, pods: list[Mapping[str, Any]], memory_seconds: float) -> list:
        """`pods` (of the index) without those force-deleted; one forgotten once the index drops it, or after
        `memory_seconds` (a force deletion that left the pod, e.g. one with a finalizer, is seen again)."""
        with self.guard:
            record = self._records.setdefault(key, JobRecord())
            if not record.force_deleted:
                return pods
            indexed = {p["metadata"]["uid"] for p in pods}
            now = time.monotonic()
            record.force_deleted = {u: t for u, t in record.force_deleted.items()
                                    if u in indexed and now - t <= memory_seconds}
            return [p for p in pods if p["metadata"]["uid"] not in record.force_deleted]

    def just_created(self, key: Key, kind: str, indexed: bool, memory_seconds: float) -> list[str]:
        """[UID] of the child of `kind` (Service, NetworkPolicy) this operator created within `memory_seconds` while
        the index does not show it yet, else []; forgotten once the index shows one (`indexed`)."""
        with self.guard:
            record = self._records.setdefault(key, JobRecord())
            created = record.children_created.get(kind)
            if created and (indexed or time.monotonic() - created[1] > memory_seconds):
                del record.children_created[kind]
            elif created:
                return [created[0]]
        return []

    def child_gone(self, key: Key, kind: str, uid: str) -> None:
        """The job's Service or NetworkPolicy `uid` was deleted: one the operator created and the index never showed
        is not taken for existing any longer, so the next pass puts it back."""
        with self.guard:
            record = self._records.get(key)
            if record is not None and record.children_created.get(kind, ("",))[0] == uid:
                del record.children_created[kind]

    def pace_left(self, key: Key, per_pod: float) -> float:
        """How long until the job's last pass ended `per_pod` seconds per pod it saw ago (<= 0: already)."""
        with self.guard:
            record = self._records.get(key)
            return record.last_pass + len(record.seen) * per_pod - time.monotonic() if record else 0.0

    def wake(self, key: Key, after: float) -> None:
        """Ask for a pass of the job `after` seconds from now (the earliest of those asked for wins)."""
        due = time.monotonic() + max(0.0, after)
        with self.guard:
            record = self._records.setdefault(key, JobRecord())
            if record.wakeup is None or due < record.wakeup:
                record.wakeup = due
                if due < self._wait_end:
                    self.woken.set()

    def next_wakeup(self) -> float | None:
        """The earliest wake-up asked for (time.monotonic()), or None. From here on, until the ticker waits again
        (`wait_for_wakeup`), any wake-up asked for ends that wait at once."""
        with self.guard:
            self._wait_end = math.inf
            self.woken.clear()
            return min((r.wakeup for r in self._records.values() if r.wakeup is not None), default=None)

    def wait_for_wakeup(self, until: float, now: float) -> None:
        """Wait until `until` (time.monotonic()), or until a wake-up earlier than that is asked for."""
        with self.guard:
            self._wait_end = until
        self.woken.wait(until - now)

    def take_due(self, now: float) -> list[Key]:
        """The jobs whose wake-up is due, each wake-up taken."""
        with self.guard:
            due = [k for k, r in self._records.items() if r.wakeup is not None and r.wakeup <= now]
            for k in due:
                self._records[k].wakeup = None
        return due

    def phases(self) -> dict[str, str]:
        """Job UID -> phase, for every job object a pass has seen."""
        with self.guard:
            return {u: o.phase for r in self._records.values() for u, o in r.objects.items() if o.phase}

    def forget(self, key: Key, uid: str | None = None) -> None:
        """Drop what is kept of a job that no longer exists (`uid`: of that object only; other objects under the
        same name stay). A pass still running keeps the job's lock until the next sweep."""
        with self.guard:
            record = self._records.pop(key, None)
            if record is not None:
                left = {u: o for u, o in record.objects.items() if uid is not None and u != uid}
                if left or record.lock.locked():
                    self._records[key] = JobRecord(lock=record.lock, objects=left)
        metrics.set_phases(self.phases())

    def sweep(self) -> None:
        """Forget every job the index no longer holds (missed DELETED events, a deleted namespace)."""
        if self.indexes is None:
            return
        keys = set(self.keys())
        with self.guard:
            stale_keys = [k for k in self._records if k not in keys]
        for k in stale_keys:
            if not self.exists(k):  # looked up again: a job created since the listing keeps its state
                self.forget(k)
        uids = self._uids()
        with self.guard:
            stale = [(k, u) for k, r in self._records.items() for u in r.objects if u not in uids]
        if stale:
            uids = self._uids()  # listed again, likewise
            with self.guard:
                for k, u in stale:
                    if u not in uids and k in self._records:
                        self._records[k].objects.pop(u, None)
            metrics.set_phases(self.phases())
        metrics.set_state_entries(self.tracked())

    def tracked(self) -> dict[str, int]:
        """How much is kept (what a deleted job must not leave behind): records, job objects, polls in flight."""
        with self.guard:
            records = list(self._records.values())
        return {"jobs": len(records), "objects": sum(len(r.objects) for r in records),
                "probing": sum(r.probing for r in records)}
