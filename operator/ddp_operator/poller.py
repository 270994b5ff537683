"""Progress polling and hang detection: the shell's side of progress.py and hang.py.

The ticker offers every job to `schedule` each tick; a job whose poll is due (Running or Restarting, and its poll
interval up or a hang check due) is handed to a small thread pool, one poll per job at a time, each probe with one
overall deadline (progress.py), so the ticker that serves every job's wake-ups never waits on a pod. An error in one
job's poll, or in deciding whether it is due, is logged and that job is polled again next interval: it never stops
the other jobs' polls.

A poll asks every trainer pod at once (each probe with its own deadline: a pod that never answers costs one deadline
and hides no other), takes global rank 0's report and writes status.progress (only when the step moved forward, at
most once per spec.progressPeriodSeconds; each also becomes a point of the job's metric history, history_keeper) and
status.lastRecovery (when rank 0's recovery report changes it). Only a report's valid fields are used
(report.valid_report); one with invalid fields gets an InvalidReport Warning Event, once per pod and set of fields.
Hang detection (failurePolicy.hangTimeoutSeconds) rides on it: the pods are polled more often while it is on (every hangTimeout/10, 1-5 s), the poll keeps a watch
of the training's progress (hang.Watch, in the job's record: reset by rank 0's report changing or by a newer step
from any pod), and once it has not moved for the timeout the same pool thread runs a pass with every pod's answer
(the `reconcile` callable, the answers keyed by pod UID), which deletes the stuck pod(s). The ticker schedules that
check at its due time, so it acts within the timeout + the poll interval + one probe deadline.

Stalls (docs/diagnostics.md, stall.py) ride on the same poll, for jobs whose pods carry the diagnostics sidecar
(spec.diagnostics) while the job is Running: every running trainer pod's sidecar is asked at once (each with its
own deadline, diagnose_each), its answer validated (stall.valid_diagnosis; invalid fields: an InvalidReport Event
once), and a stall.StallWatch kept in the record beside the hang watch. It is asked while the watch needs it: until
the incarnation's process group formed (processGroupTimeoutSeconds, or a Stalled condition to clear), while a
formed group of a script that never reported progress may hang silently (hangTimeoutSeconds), and for a progress
hang check (the pods' diagnoses go with the reports). Meanwhile the sidecars are asked every tenth of the clock's
timeout (1-5 s before the group formed, 1-30 s for the silent-hang clock: every ask is a py-spy dump of each worker)
whatever progressPeriodSeconds says, and a poll is due the moment a clock's deadline is, so a stall is acted on
within that pace and a probe deadline of it (progressPeriodSeconds 0 still turns every poll off). Before handing a ProcessGroupNeverFormed or Hang
finding to a pass (`reconcile(..., stall=finding)`) the pods are asked again with `?log=<reason>`, which puts
every worker's full stacks into the sidecars' logs, and that answer decides; a job whose condition Stalled is True
and whose group is seen formed gets stall.formed_finding().

The spec's values are the parsed job's (spec.parse_job, cached in the record), never read from the raw spec again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from datetime import datetime, timezone
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from ddp_operator import goodput, hang, metrics, names, progress, stall
from ddp_operator.history_keeper import HistoryKeeper
from ddp_operator.jobs import JobRecord, JobRegistry, Key, owned_by
from ddp_operator.k8s import describe_error
from ddp_operator.spec import Job, SpecError
from ddp_operator.report import valid_report
from ddp_operator.status import (
    Event, get_condition, invalid_report_event, last_recovery, newer_progress, progress_status,
)

log = logging.getLogger("ddp_operator")

PROBE_WORKERS = 8
DIAGNOSIS = "diagnosis"  # the source of a diagnostics sidecar's answer, as InvalidReport Events tell it
# InvalidReport Events already posted, (job uid, pod uid, fields): the most recent this many are remembered.
INVALID_REPORTS_REMEMBERED = 1024
COMPONENT = "ddp-operator"  # the Events' source, as the reconciler's (reconciler.COMPONENT; a test checks)


def _index(pod: Mapping[str, Any]) -> int:
    """A trainer pod's index (its label; -1 when it holds no number)."""
    value = (pod["metadata"].get("labels") or {}).get(names.LABEL_NODE_INDEX, "")
    return int(value) if isinstance(value, str) and value.isdigit() and len(value) < 10 else -1


def _poll_interval(job: Job) -> float | None:
    return hang.poll_interval(job.spec.progress_period_seconds, job.spec.failure_policy.hang_timeout_seconds)


def _stalled(status: Mapping[str, Any]) -> bool:
    return (get_condition(list(status.get("conditions") or []), names.COND_STALLED) or {}).get("status") == "True"


# The silent-hang clock of a formed group is asked about less often than the start-up one: it runs as long as the
# training does, and each answer costs a py-spy dump of every worker (acted on within hangTimeoutSeconds + this).
SILENT_HANG_MAX_POLL_SECONDS = 30.0


def _paced(timeout: float, most: float = hang.MAX_POLL_SECONDS) -> float:
    return max(hang.MIN_POLL_SECONDS, min(most, timeout / 10.0))


def stall_interval(job: Job, status: Mapping[str, Any], w: stall.StallWatch | None,
                   current: tuple[str, ...]) -> float | None:
    """Seconds between asks of the sidecars while a stall clock needs them (a tenth of its timeout: 1-5 s until the
    group formed, 1-30 s for a formed group's silent-hang clock), or None when none does: no sidecar, not Running,
    no polling at all (progressPeriodSeconds 0 turns every poll off), or a formed group that reports progress (or
    whose hang rule is off)."""
    if not job.spec.diagnostics.enabled or not job.spec.progress_period_seconds or not current or \
            status.get("phase") != names.PHASE_RUNNING:
        return None
    policy = job.spec.failure_policy
    if w is None or w.incarnation != current or not w.formed:
        if policy.process_group_timeout_seconds:
            return _paced(policy.process_group_timeout_seconds)
        return hang.MAX_POLL_SECONDS if _stalled(status) else None  # to see it form, and clear Stalled
    if not w.reporting and policy.hang_timeout_seconds:
        return _paced(policy.hang_timeout_seconds, SILENT_HANG_MAX_POLL_SECONDS)
    return None


def stall_check_due(job: Job, w: stall.StallWatch | None, current: tuple[str, ...], now: float) -> bool:
    """A stall clock's deadline is up for the current incarnation."""
    if w is None or w.incarnation != current or not (job.spec.diagnostics.enabled and job.spec.progress_period_seconds):
        return False
    policy = job.spec.failure_policy
    return stall.startup_due(w, policy.process_group_timeout_seconds, now) or \
        stall.silent_hang_due(w, policy.hang_timeout_seconds, now)


class ProgressPoller:
    """Polls the progress (and the diagnostics sidecars) of every running job on a thread pool; `reconcile(namespace,
    name, hang_reports=..., diagnoses=...)` runs the pass that acts on a hang, `reconcile(..., stall=...)` the one
    that acts on a stall."""

    def __init__(self, jobs: JobRegistry, api: Any, reconcile: Callable[..., Any]):
        self.jobs = jobs
        self.api = api
        self.reconcile = reconcile
        self.history = HistoryKeeper(jobs, api)
        self._pool = ThreadPoolExecutor(max_workers=PROBE_WORKERS, thread_name_prefix="ddp-progress")
        self._invalid_reported: OrderedDict[tuple[str, str, tuple[str, ...]], None] = OrderedDict()

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _job(self, key: Key, body: Mapping[str, Any]) -> Job | None:
        try:
            return self.jobs.job(key, body)
        except SpecError:
            return None  # the pass reports it; nothing to poll

    def due(self, key: Key) -> tuple[Mapping[str, Any], Job, dict] | None:
        """The job's body, parsed job and last status if it is due for a poll (Running/Restarting, and the poll
        interval up, the stall clocks' pace up, or a hang or stall check due)."""
        body = self.jobs.body(key)
        job = self._job(key, body) if body is not None else None
        if body is None or job is None:
            return None
        record = self.jobs.record(key)
        with self.jobs.guard:
            obj = record.of(job.uid)
            progress_at, diagnosed_at, written, w = obj.progress_at, obj.diagnosed_at, obj.written, obj.stall_watch
        status = written or dict(body.get("status") or {})
        if status.get("phase") not in (names.PHASE_RUNNING, names.PHASE_RESTARTING):
            return None
        interval = _poll_interval(job)
        if interval is None:
            return None
        now = time.monotonic()
        if now - progress_at >= interval or self.hang_check_due(key, body, now):
            return body, job, status
        if self._diagnosis_due(key, job, status, w, diagnosed_at, now):
            return body, job, status
        return None

    def _diagnosis_due(self, key: Key, job: Job, status: Mapping[str, Any], w: stall.StallWatch | None,
                       diagnosed_at: float, now: float) -> bool:
        """Whether the sidecars are due to be asked: a stall clock needs them and its pace is up, or its deadline is."""
        if not job.spec.diagnostics.enabled:
            return False
        current = hang.incarnation(self._running_trainers(key, job.uid))
        pace = stall_interval(job, status, w, current)
        return pace is not None and (now - diagnosed_at >= pace or stall_check_due(job, w, current, now))

    def schedule(self, key: Key) -> None:
        """Hand a job's due progress poll to the pool unless one is still running for it. Never raises: the
        ticker offers every job in turn, and one job's trouble must not stop the others' polls."""
        try:
            self._schedule(key)
        except Exception as e:  # noqa: BLE001 - this job only; it is offered again next tick
            log.warning("[%s/%s] could not schedule its progress poll: %s", *key, describe_error(e))

    def _schedule(self, key: Key) -> None:
        if self.due(key) is None:
            return
        record = self.jobs.record(key)
        with self.jobs.guard:
            if record.probing:
                return
            record.probing = True
        try:
            self._pool.submit(self._poll_isolated, key, record)
        except RuntimeError:  # the pool is shut down: the operator is stopping
            with self.jobs.guard:
                record.probing = False

    def _poll_isolated(self, key: Key, record: JobRecord) -> None:
        started = time.monotonic()
        try:
            self.poll(key)
        except BaseException as e:  # noqa: BLE001 - RecursionError, OverflowError...: this job only
            log.warning("[%s/%s] progress poll failed: %s", *key, describe_error(e) if isinstance(e, Exception)
                        else type(e).__name__)
        finally:
            metrics.PROGRESS_POLL_SECONDS.observe(time.monotonic() - started)
            with self.jobs.guard:
                record.probing = False

    def poll(self, key: Key) -> None:
        due = self.due(key)
        if due is None:
            return
        body, job, status = due
        uid = job.uid
        record = self.jobs.record(key)
        with self.jobs.guard:
            obj = record.of(uid)
            obj.progress_at = time.monotonic()
            progress_ip, w, diagnosed_at = obj.progress_ip, obj.stall_watch, obj.diagnosed_at
        trainers = self._running_trainers(key, uid)
        current = hang.incarnation(trainers)
        ips = {p["metadata"]["uid"]: p["status"]["podIP"] for p in trainers}
        asking = self._diagnosis_due(key, job, status, w, diagnosed_at, time.monotonic())
        if asking:
            with self.jobs.guard:
                obj.diagnosed_at = time.monotonic()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddp-diagnose") as side:
            # The sidecars are asked while the progress endpoints are: one poll costs one deadline, not two. The
            # progress is acted on first: a sidecar that does not answer (its pod frozen) never delays a hang check.
            asked = side.submit(self.diagnose, key, body, trainers) if asking else None
            answers = progress.probe_each(ips)
            reports = {pod: self._checked(key, body, trainers, pod, answer) for pod, answer in answers.items()}
            preferred = next((pod for pod, ip in ips.items() if ip == progress_ip), None)
            found = progress.rank0(reports, preferred)
            report = found[1] if found is not None else None
            with self.jobs.guard:
                if found is not None:
                    obj.progress_ip = ips[found[0]]
                others = [r for pod, r in reports.items() if found is None or pod != found[0]]
                obj.hang_watch = hang.watch(obj.hang_watch, current, report, time.monotonic(), others)
            if report is not None:
                pod = next((p["metadata"]["name"] for p in trainers if p["metadata"]["uid"] == found[0]), None)
                self._write_progress(key, job, status, report, pod)
            hung = self.hang_check_due(key, body, time.monotonic())
            if hung:
                self._hang_check(key, job, body, trainers, reports)
            diagnoses = asked.result() if asked is not None else None
        if diagnoses is not None:
            reporting = any(r is not None and "step" in r for r in reports.values())
            with self.jobs.guard:
                obj.stall_watch = stall.watch(obj.stall_watch, current, diagnoses, reporting, time.monotonic())
            if not hung:
                self._stall_check(key, job, body, status, trainers, diagnoses)

    def _invalid(self, key: Key, body: Mapping[str, Any], trainers: list[Mapping[str, Any]], pod: str,
                 invalid: tuple[str, ...], source: str) -> None:
        """An InvalidReport Event for a pod's answer with invalid fields, once per job, pod, source and fields."""
        seen = (body["metadata"].get("uid", ""), pod, (source, *invalid))
        with self.jobs.guard:
            new = seen not in self._invalid_reported
            self._invalid_reported[seen] = None
            self._invalid_reported.move_to_end(seen)
            while len(self._invalid_reported) > INVALID_REPORTS_REMEMBERED:
                self._invalid_reported.popitem(last=False)
        if new:
            name = next((p["metadata"]["name"] for p in trainers if p["metadata"]["uid"] == pod), pod)
            event = invalid_report_event(name, invalid, source)
            if source == DIAGNOSIS:
                event = Event(event.type, event.reason, f"pod {name}: its diagnostics sidecar's answer has invalid "
                                                        f"field(s) {', '.join(invalid)}: ignored (docs/diagnostics.md "
                                                        f"says what each may hold)")
            log.warning("[%s/%s] %s", *key, event.message)
            self.api.post_event(body, event.type, event.reason, event.message, COMPONENT)

    def _checked(self, key: Key, body: Mapping[str, Any], trainers: list[Mapping[str, Any]], pod: str,
                 answer: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """A pod's answer with its valid fields alone; invalid ones get an InvalidReport Event, once."""
        report, invalid = valid_report(answer)
        if invalid:
            self._invalid(key, body, trainers, pod, invalid, "progress report")
        return report

    # --- the diagnostics sidecars (stall.py) ------------------------------------------------------
    def diagnose(self, key: Key, body: Mapping[str, Any], trainers: list[Mapping[str, Any]],
                 log_reason: str | None = None, timeout: float | None = None) -> tuple[stall.PodDiagnosis, ...]:
        """Every running trainer pod's diagnosis, its sidecars asked at once (`log_reason`: they log full stacks
        first; `timeout`: each one's deadline, else progress.fetch_diagnosis's); invalid fields are dropped, with an
        InvalidReport Event once."""
        answers = progress.diagnose_each({p["metadata"]["uid"]: p["status"]["podIP"] for p in trainers}, log_reason,
                                         timeout)
        out = []
        for p in trainers:
            pod = p["metadata"]["uid"]
            diagnosis, invalid = stall.valid_diagnosis(answers.get(pod))
            if invalid:
                self._invalid(key, body, trainers, pod, invalid, DIAGNOSIS)
            out.append(stall.PodDiagnosis(pod, p["metadata"]["name"], _index(p), diagnosis))
        return tuple(out)

    def _confirmed(self, key: Key, body: Mapping[str, Any], trainers: list[Mapping[str, Any]],
                   diagnoses: tuple[stall.PodDiagnosis, ...], reason: str,
                   find: Callable[[tuple[stall.PodDiagnosis, ...]], stall.Finding | None]) -> stall.Finding | None:
        """The finding, from the pods asked again with ?log=<reason> (their full stacks into the sidecars' logs);
        a pod that does not answer that time counts with its first answer. None when it no longer holds."""
        if find(diagnoses) is None:
            return None
        again = self.diagnose(key, body, trainers, reason)
        first = {d.uid: d for d in diagnoses}
        merged = tuple(d if d.diagnosis is not None or d.uid not in first else first[d.uid] for d in again)
        return find(merged)

    def _stall_check(self, key: Key, job: Job, body: Mapping[str, Any], status: Mapping[str, Any],
                     trainers: list[Mapping[str, Any]], diagnoses: tuple[stall.PodDiagnosis, ...]) -> None:
        """Hand a pass the stall the watch shows: a group that did not form in time, a silent hang, or a Stalled job
        that formed. A clock that fired starts again (the next finding is one timeout later unless the pods change)."""
        current = hang.incarnation(trainers)
        record = self.jobs.record(key)
        with self.jobs.guard:
            obj = record.of(job.uid)
            w = obj.stall_watch
        if w is None or w.incarnation != current:
            return
        policy, now = job.spec.failure_policy, time.monotonic()
        finding, timeout = None, 0
        if stall.startup_due(w, policy.process_group_timeout_seconds, now):
            world = stall.expected_world_size(job.spec.nodes, job.spec.nproc_per_node)
            finding = self._confirmed(key, body, trainers, diagnoses, names.REASON_PG_NEVER_FORMED,
                                      lambda ds: stall.startup_finding(ds, world))
            restarted = dataclasses.replace(w, init_since=time.monotonic())
            timeout = policy.process_group_timeout_seconds
        elif stall.silent_hang_due(w, policy.hang_timeout_seconds, now):
            finding = self._confirmed(key, body, trainers, diagnoses, names.REASON_HANG, stall.hang_finding)
            restarted = dataclasses.replace(w, since=time.monotonic())
            timeout = policy.hang_timeout_seconds
        elif w.formed and _stalled(status):
            log.info("[%s/%s] the process group formed: every rank joined", *key)
            self.reconcile(*key, stall=stall.formed_finding())
            return
        if finding is None:
            return
        with self.jobs.guard:
            if obj.stall_watch is w:
                obj.stall_watch = restarted
        what = ("the process group did not form within processGroupTimeoutSeconds"
                if finding.reason == names.REASON_PG_NEVER_FORMED else
                "no worker's stack nor CPU time moved for hangTimeoutSeconds (the script reports no progress)")
        log.warning("[%s/%s] %s=%s: %s (full stacks: kubectl logs <pod> -c %s)", *key, what, timeout, finding.message,
                    names.DIAGNOSTICS_CONTAINER)
        self.reconcile(*key, stall=finding)

    def _running_trainers(self, key: Key, uid: str) -> list[Mapping[str, Any]]:
        """The job's running trainer pods with an IP (only pods it owns: labels alone can be put on any pod)."""
        return [p for p in self.jobs.values("pods_by_job", key)
                if (p.get("status") or {}).get("phase") == "Running" and (p.get("status") or {}).get("podIP")
                and not p["metadata"].get("deletionTimestamp")
                and p["metadata"].get("labels", {}).get(names.LABEL_ROLE) == names.ROLE_TRAINER
                and owned_by(p, uid)]

    def _write_progress(self, key: Key, job: Job, status: Mapping[str, Any], report: Mapping[str, Any],
                        pod: str | None = None) -> None:
        """status.progress (when the step moved forward, at most once per progressPeriodSeconds; `pod`: the one
        that answered as global rank 0) and status.lastRecovery (when rank 0's recovery report changes it)."""
        new = {**progress_status(report), **({"pod": pod} if pod else {})}
        period = job.spec.progress_period_seconds
        # Polled faster than the period for hang detection: the writes still keep to the period.
        interval = _poll_interval(job) or period
        min_gap = period if interval < period else 0.0
        record = self.jobs.record(key)
        with record.lock:
            with self.jobs.guard:
                obj = record.of(job.uid)
                base = obj.written or status
                current = base.get("progress") or {}
                # Before this write's progress: the last step seen before the fault (a start-over's estimate).
                recovery = last_recovery(base.get("lastRecovery"), base.get("lastIncident"), report, current)
                written_at = obj.progress_written_at
            patch: dict[str, Any] = {}
            if (newer_progress(current, new) is new
                    and (new.get("step") != current.get("step") or new.get("final") != current.get("final"))
                    and time.monotonic() - written_at >= min_gap):
                patch["progress"] = new
            if recovery is not None and recovery != base.get("lastRecovery"):
                patch["lastRecovery"] = recovery
            if patch:  # the goodput's ratio refreshed in the same write (goodput.py): no request of its own
                g = goodput.derive(base.get("goodput"), created=job.created, now=datetime.now(timezone.utc),
                                   phase=base.get("phase") or "", prev_phase=base.get("phase"), progress=new,
                                   prev_progress=current, recovery=patch.get("lastRecovery") or base.get(
                                       "lastRecovery"), refresh=True)
                if g is not None and g != base.get("goodput"):
                    patch["goodput"] = g
            if not patch or not self.jobs.exists(key):
                return
            self.api.patch_status(key[0], key[1], patch)
            if "progress" in patch:
                metrics.PROGRESS_WRITES.inc()
                self.history.add(key, job.uid, patch["progress"])
            with self.jobs.guard:
                if "progress" in patch:
                    obj.progress_written_at = time.monotonic()
                if obj.written is not None:
                    obj.written.update(patch)

    def hang_check_due(self, key: Key, body: Mapping[str, Any], now: float) -> bool:
        job = self._job(key, body)
        if job is None or not job.spec.progress_period_seconds:
            return False
        record = self.jobs.get(key)
        with self.jobs.guard:
            obj = record.objects.get(job.uid) if record is not None else None
            w = obj.hang_watch if obj is not None else None
        if w is None:
            return False
        left = hang.due_in(w, w.incarnation, job.spec.failure_policy.hang_timeout_seconds, now)
        return left is not None and left <= 0

    def _hang_check(self, key: Key, job: Job, body: Mapping[str, Any], trainers: list[Mapping[str, Any]],
                    reports: Mapping[str, Mapping[str, Any] | None]) -> None:
        """The training's step has not moved for the timeout: a pass decides with every pod's answer (by UID), and
        with the pods' diagnoses (asked with ?log=Hang: the full stacks in the sidecars' logs) when they have the
        sidecar."""
        current = hang.incarnation(trainers)
        record = self.jobs.record(key)
        with self.jobs.guard:
            obj = record.of(job.uid)
            w = obj.hang_watch
            if w is None or w.incarnation != current:
                return  # the pods changed since: the clock starts again with the next report
            # Checked now: the next check is one timeout later, unless the pods or the training's step change first.
            obj.hang_watch = dataclasses.replace(w, since=time.monotonic())
        names_ = {p["metadata"]["uid"]: p["metadata"]["name"] for p in trainers}
        steps = {names_.get(pod, pod): (r or {}).get("step") for pod, r in reports.items()}
        log.warning("[%s/%s] the training's step has not changed for the hang timeout; pods report %s", *key, steps)
        if not job.spec.diagnostics.enabled:
            self.reconcile(*key, hang_reports=reports)
            return
        diagnoses = self.diagnose(key, body, trainers, names.REASON_HANG, progress.HANG_DIAGNOSIS_DEADLINE_SECONDS)
        frames = {d.name: stall.frame_of(d.diagnosis) for d in diagnoses}
        log.warning("[%s/%s] the pods stand in %s (full stacks: kubectl logs <pod> -c %s)", *key, frames,
                    names.DIAGNOSTICS_CONTAINER)
        self.reconcile(*key, hang_reports=reports, diagnoses=diagnoses)
