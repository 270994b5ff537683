"""The shell's side of history.py: each job's metric-history ConfigMap, written from the progress it reports.

Every status.progress the operator writes becomes a point. Points wait in the job's record (a few at most) and
are written at most every history.FLUSH_SECONDS, and at once for the first point and for the final report, as a
read-modify-write of the ConfigMap: read it, take the new points in (history.added), replace it with the read's
resourceVersion as the precondition. So the operator holds no series in memory (a thousand jobs cost nothing
here), a restarted operator simply goes on with what the ConfigMap holds, and a write that loses a race is
retried at the next flush with its points kept. A ConfigMap of that name that is not this job's (another owner)
is left alone and reported once in the log; an API error costs the history a point or two, never the pass.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from ddp_operator import history, names
from ddp_operator.jobs import JobRegistry, Key

log = logging.getLogger(__name__)

# Points kept while the ConfigMap cannot be written (an API outage): the oldest go first.
MAX_PENDING = 64


def _owner(cm: Mapping[str, Any]) -> str | None:
    """The UID of the DDPJob that controls this ConfigMap, if one does."""
    for ref in (cm.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == names.KIND and ref.get("controller"):
            return ref.get("uid")
    return None


class HistoryKeeper:
    def __init__(self, jobs: JobRegistry, api: Any, clock: Callable[[], float] = time.monotonic):
        self.jobs = jobs
        self.api = api
        self.clock = clock
        self._foreign: set[tuple[str, str]] = set()

    def add(self, key: Key, uid: str, progress: Mapping[str, Any] | None, *, final: bool = False) -> None:
        """Take a written status.progress in; flush when due. Call under the job's record lock."""
        p = history.point(progress)
        if p is None:
            return
        record = self.jobs.record(key)
        with self.jobs.guard:
            obj = record.of(uid)
            obj.history_pending = [*obj.history_pending, p][-MAX_PENDING:]
            due = final or self.clock() - obj.history_flushed_at >= history.FLUSH_SECONDS
        if due:
            self.flush(key, uid)

    def flush(self, key: Key, uid: str) -> None:
        record = self.jobs.record(key)
        with self.jobs.guard:
            obj = record.of(uid)
            pending, obj.history_pending = obj.history_pending, []
            obj.history_flushed_at = self.clock()
        if not pending:
            return
        try:
            written = self._write(key, uid, pending)
        except Exception as e:  # the history is a convenience: it never fails a poll or a pass
            log.warning("[%s/%s] metric history not written (kept for the next try): %s", *key, e)
            written = False
        if not written:
            with self.jobs.guard:
                obj.history_pending = [*pending, *obj.history_pending][-MAX_PENDING:]

    def _write(self, key: Key, uid: str, pending: list[dict]) -> bool:
        name = names.history_configmap(key[1])
        cm = self.api.read_config_map(key[0], name)
        owner = _owner(cm) if cm is not None else None
        if cm is not None and owner is None:
            if key not in self._foreign:
                self._foreign.add(key)
                log.warning("[%s/%s] ConfigMap %s exists and is not this job's: no metric history is kept", *key, name)
            return True  # the points are dropped: nothing here is ours to write
        # An earlier job of the same name left its history (its garbage collection is under way): start afresh.
        points, stride = history.from_configmap(cm) if owner == uid else ([], 1)
        return self._put(key, uid, points, stride, pending, cm)

    def _put(self, key: Key, uid: str, points: list[dict], stride: int, pending: list[dict],
             cm: Mapping[str, Any] | None) -> bool:
        for p in pending:
            points, stride = history.added(points, stride, p)
        body = history.configmap(key[0], key[1], uid, points, stride)
        if cm is not None:
            body["metadata"]["resourceVersion"] = (cm.get("metadata") or {}).get("resourceVersion")
        return self.api.write_config_map(body, replace=cm is not None)
