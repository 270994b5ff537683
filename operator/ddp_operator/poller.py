"""Progress polling and hang detection: the shell's side of progress.py and hang.py.

The ticker offers every job to `schedule` each tick; a job whose poll is due (Running or Restarting, and its poll
interval up or a hang check due) is handed to a small thread pool, one poll per job at a time, each probe with one
overall deadline (progress.py), so the ticker that serves every job's wake-ups never waits on a pod. An error in one
job's poll, or in deciding whether it is due, is logged and that job is polled again next interval: it never stops
the other jobs' polls.

A poll asks every trainer pod at once (each probe with its own deadline: a pod that never answers costs one
deadline and hides no other), takes global rank 0's report and writes status.progress (only when the step moved
forward, at most once per spec.progressPeriodSeconds) and status.lastRecovery (when rank 0's recovery report
changes it). Only a report's valid fields are used (report.valid_report); one with invalid fields gets an
InvalidReport Warning Event, once per pod and set of fields. Hang detection (failurePolicy.hangTimeoutSeconds)
rides on it: the pods are polled more often while it is on (every hangTimeout/10, 1-5 s), the poll keeps a watch
of the training's progress (hang.Watch, in the job's record: reset by rank 0's report changing or by a newer step
from any pod), and once it has not moved for the timeout the same pool thread runs a pass with every pod's answer
(the `reconcile` callable, the answers keyed by pod UID), which deletes the stuck pod(s). The ticker schedules that
check at its due time, so it acts within the timeout + the poll interval + one probe deadline.

The spec's values are the parsed job's (spec.parse_job, cached in the record), never read from the raw spec again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from ddp_operator import hang, metrics, names, progress
from ddp_operator.jobs import JobRecord, JobRegistry, Key, owned_by
from ddp_operator.k8s import describe_error
from ddp_operator.spec import Job, SpecError
from ddp_operator.report import valid_report
from ddp_operator.status import invalid_report_event, last_recovery, newer_progress, progress_status

log = logging.getLogger("ddp_operator")

PROBE_WORKERS = 8
# InvalidReport Events already posted, (job uid, pod uid, fields): the most recent this many are remembered.
INVALID_REPORTS_REMEMBERED = 1024
COMPONENT = "ddp-operator"  # the Events' source, as the reconciler's (reconciler.COMPONENT; a test checks)


def _poll_interval(job: Job) -> float | None:
    return hang.poll_interval(job.spec.progress_period_seconds, job.spec.failure_policy.hang_timeout_seconds)


class ProgressPoller:
    """Polls the progress of every running job on a thread pool; `reconcile(namespace, name, hang_reports=...)`
    runs the pass that acts on a hang."""

    def __init__(self, jobs: JobRegistry, api: Any, reconcile: Callable[..., Any]):
        self.jobs = jobs
        self.api = api
        self.reconcile = reconcile
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
        """The job's body, parsed job and last status if its progress is due for a poll (Running/Restarting, and
        the poll interval up or a hang check due)."""
        body = self.jobs.body(key)
        job = self._job(key, body) if body is not None else None
        if body is None or job is None:
            return None
        interval = _poll_interval(job)
        if interval is None:
            return None
        record = self.jobs.record(key)
        with self.jobs.guard:
            obj = record.of(job.uid)
            progress_at, written = obj.progress_at, obj.written
        now = time.monotonic()
        if now - progress_at < interval and not self.hang_check_due(key, body, now):
            return None
        status = written or dict(body.get("status") or {})
        if status.get("phase") not in (names.PHASE_RUNNING, names.PHASE_RESTARTING):
            return None
        return body, job, status

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
        try:
            self.poll(key)
        except BaseException as e:  # noqa: BLE001 - RecursionError, OverflowError...: this job only
            log.warning("[%s/%s] progress poll failed: %s", *key, describe_error(e) if isinstance(e, Exception)
                        else type(e).__name__)
        finally:
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
            progress_ip = obj.progress_ip
        trainers = self._running_trainers(key, uid)
        answers = progress.probe_each({p["metadata"]["uid"]: p["status"]["podIP"] for p in trainers})
        reports = {pod: self._checked(key, body, trainers, pod, answer) for pod, answer in answers.items()}
        ips = {p["metadata"]["uid"]: p["status"]["podIP"] for p in trainers}
        preferred = next((pod for pod, ip in ips.items() if ip == progress_ip), None)
        found = progress.rank0(reports, preferred)
        report = found[1] if found is not None else None
        current = hang.incarnation(trainers)
        with self.jobs.guard:
            if found is not None:
                obj.progress_ip = ips[found[0]]
            others = [r for pod, r in reports.items() if found is None or pod != found[0]]
            obj.hang_watch = hang.watch(obj.hang_watch, current, report, time.monotonic(), others)
        if report is not None:
            self._write_progress(key, job, status, report)
        if self.hang_check_due(key, body, time.monotonic()):
            self._hang_check(key, uid, trainers, reports)

    def _checked(self, key: Key, body: Mapping[str, Any], trainers: list[Mapping[str, Any]], pod: str,
                 answer: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """A pod's answer with its valid fields alone; invalid ones get an InvalidReport Event, once."""
        report, invalid = valid_report(answer)
        if invalid:
            seen = (body["metadata"].get("uid", ""), pod, invalid)
            with self.jobs.guard:
                new = seen not in self._invalid_reported
                self._invalid_reported[seen] = None
                self._invalid_reported.move_to_end(seen)
                while len(self._invalid_reported) > INVALID_REPORTS_REMEMBERED:
                    self._invalid_reported.popitem(last=False)
            if new:
                name = next((p["metadata"]["name"] for p in trainers if p["metadata"]["uid"] == pod), pod)
                event = invalid_report_event(name, invalid, "progress report")
                log.warning("[%s/%s] %s", *key, event.message)
                self.api.post_event(body, event.type, event.reason, event.message, COMPONENT)
        return report

    def _running_trainers(self, key: Key, uid: str) -> list[Mapping[str, Any]]:
        """The job's running trainer pods with an IP (only pods it owns: labels alone can be put on any pod)."""
        return [p for p in self.jobs.values("pods_by_job", key)
                if (p.get("status") or {}).get("phase") == "Running" and (p.get("status") or {}).get("podIP")
                and not p["metadata"].get("deletionTimestamp")
                and p["metadata"].get("labels", {}).get(names.LABEL_ROLE) == names.ROLE_TRAINER
                and owned_by(p, uid)]

    def _write_progress(self, key: Key, job: Job, status: Mapping[str, Any], report: Mapping[str, Any]) -> None:
        """status.progress (when the step moved forward, at most once per progressPeriodSeconds) and
        status.lastRecovery (when rank 0's recovery report changes it)."""
        new = progress_status(report)
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
                recovery = last_recovery(base.get("lastRecovery"), base.get("lastIncident"), report)
                written_at = obj.progress_written_at
            patch: dict[str, Any] = {}
            if (newer_progress(current, new) is new
                    and (new.get("step") != current.get("step") or new.get("final") != current.get("final"))
                    and time.monotonic() - written_at >= min_gap):
                patch["progress"] = new
            if recovery is not None and recovery != base.get("lastRecovery"):
                patch["lastRecovery"] = recovery
            if not patch or not self.jobs.exists(key):
                return
            self.api.patch_status(key[0], key[1], patch)
            if "progress" in patch:
                metrics.PROGRESS_WRITES.inc()
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

    def _hang_check(self, key: Key, uid: str, trainers: list[Mapping[str, Any]],
                    reports: Mapping[str, Mapping[str, Any] | None]) -> None:
        """The training's step has not moved for the timeout: a pass decides with every pod's answer (by UID)."""
        current = hang.incarnation(trainers)
        record = self.jobs.record(key)
        with self.jobs.guard:
            obj = record.of(uid)
            w = obj.hang_watch
            if w is None or w.incarnation != current:
                return  # the pods changed since: the clock starts again with the next report
            # Checked now: the next check is one timeout later, unless the pods or the training's step change first.
            obj.hang_watch = dataclasses.replace(w, since=time.monotonic())
        names_ = {p["metadata"]["uid"]: p["metadata"]["name"] for p in trainers}
        steps = {names_.get(pod, pod): (r or {}).get("step") for pod, r in reports.items()}
        log.warning("[%s/%s] the training's step has not changed for the hang timeout; pods report %s", *key, steps)
        self.reconcile(*key, hang_reports=reports)
