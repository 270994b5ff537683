"""Per-job Prometheus metrics, read at scrape time from the DDPJob bodies the operator already holds (docs/metrics.md).

Every series is labelled {namespace, name} of its job (plus `phase`, `cause` or `fault`) and computed from the job's
status when Prometheus scrapes: a deleted job's series disappear with its body, an operator restart counts nothing
twice (status is level-based), and only jobs this operator knows have series. The one exception is the histogram of
recovery seconds, which status cannot give (status.goodput keeps sums per fault, not a distribution): it is observed
in this process, once per new status.lastRecovery record of a job object, and starts empty after a restart (a
histogram is a set of counters; `increase()` and `histogram_quantile(rate(...))` take resets in their stride).

Status is untrusted (anyone allowed to write it may put anything there): a value that is not a finite number in its
range is left out, a fault name that is not a plain identifier is counted under `Other`, faults per job are capped
(MAX_FAULTS), and nothing raises out of a scrape: a body that cannot be read loses its own series, never the others'.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from ddp_operator import names

log = logging.getLogger("ddp_operator")

Body = Mapping[str, Any]
JOB_LABELS = ("namespace", "name")
CAUSES = ("starting", "queued", "recovering", "redone")  # status.goodput.seconds, besides productive
MAX_FAULTS = 16  # fault label values per job and metric, `Other` included
OTHER_FAULT = "Other"
_FAULT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]{0,62}")
# Seconds from a fault to training again: a hot spare's take-over (seconds) to a pod rescheduled on another node.
RECOVERY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

# name -> (type, help, extra label); counters are exposed with `_total`.
FAMILIES: dict[str, tuple[str, str, str | None]] = {
    "ddpjob_job_phase": ("gauge", "1 for the job's current status.phase, 0 for the other phases.", "phase"),
    "ddpjob_job_step": ("gauge", "The newest step trained (status.progress.step).", None),
    "ddpjob_job_loss": ("gauge", "The loss rank 0 last reported (status.progress.loss).", None),
    "ddpjob_job_samples_per_second": ("gauge", "Rank 0's throughput (status.progress.samplesPerSecond).", None),
    "ddpjob_job_goodput_ratio": ("gauge", "Productive seconds / wall seconds, 0..1 (status.goodput.ratio).", None),
    "ddpjob_job_wall_seconds": ("counter", "The job's wall time so far (status.goodput.wallSeconds).", None),
    "ddpjob_job_productive_seconds": ("counter", "Wall seconds spent training steps that were kept "
                                                 "(status.goodput.seconds.productive).", None),
    "ddpjob_job_lost_seconds": ("counter", "Wall seconds not spent on kept steps, by cause: starting, queued, "
                                           "recovering, redone (status.goodput.seconds).", "cause"),
    "ddpjob_job_recoveries": ("counter", "Recoveries, by fault (status.goodput.byFault[fault].recoveries).", "fault"),
    "ddpjob_job_steps_lost": ("counter", "Steps trained again after recoveries, by fault "
                                         "(status.goodput.byFault[fault].stepsLost).", "fault"),
    "ddpjob_job_fault_seconds": ("counter", "Seconds lost to recoveries, by fault "
                                            "(status.goodput.byFault[fault].seconds).", "fault"),
}
HISTOGRAM = "ddpjob_job_recovery_seconds"
HISTOGRAM_HELP = ("From a fault to training again (status.lastRecovery.seconds), by fault; observed by this operator "
                  "process once per recovery, empty after a restart.")


def _number(value: Any, low: float = -math.inf, high: float = math.inf) -> float | None:
    """value as a float when it is a finite number (not a bool) within [low, high], else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and low <= value <= high else None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def fault_label(name: Any) -> str:
    """The fault label for a name read from status: itself when it is a plain identifier, else `Other`."""
    return name if isinstance(name, str) and _FAULT_NAME.fullmatch(name) else OTHER_FAULT


def fault_labels(faults: Iterable[Any]) -> dict[Any, str]:
    """Each fault name -> its label: at most MAX_FAULTS labels, the names past MAX_FAULTS - 1 (sorted) in `Other`."""
    valid = sorted({f for f in faults if fault_label(f) != OTHER_FAULT})
    kept = set(valid if len(valid) <= MAX_FAULTS else valid[:MAX_FAULTS - 1])
    return {f: (f if f in kept else OTHER_FAULT) for f in faults}


def job_identity(body: Body) -> tuple[str, str, str] | None:
    """(namespace, name, uid) of a body, None when any is not a string."""
    meta = _mapping(body.get("metadata"))
    ident = (meta.get("namespace"), meta.get("name"), meta.get("uid"))
    return ident if all(isinstance(v, str) and v for v in ident) else None  # type: ignore[return-value]


def job_samples(body: Body) -> list[tuple[str, tuple[str, ...], float]]:
    """(family, extra label values, value) of every series of one job, from its status (pure)."""
    status = _mapping(body.get("status"))
    out: list[tuple[str, tuple[str, ...], float]] = []
    phase = status.get("phase")
    if phase in names.PHASES:
        out += [("ddpjob_job_phase", (p,), 1.0 if p == phase else 0.0) for p in names.PHASES]
    progress = _mapping(status.get("progress"))
    for family, key, low in (("ddpjob_job_step", "step", 0.0), ("ddpjob_job_loss", "loss", -math.inf),
                             ("ddpjob_job_samples_per_second", "samplesPerSecond", 0.0)):
        value = _number(progress.get(key), low)
        if value is not None:
            out.append((family, (), value))
    goodput = _mapping(status.get("goodput"))
    for family, value in (("ddpjob_job_goodput_ratio", _number(goodput.get("ratio"), 0.0, 1.0)),
                          ("ddpjob_job_wall_seconds", _number(goodput.get("wallSeconds"), 0.0)),
                          ("ddpjob_job_productive_seconds",
                           _number(_mapping(goodput.get("seconds")).get("productive"), 0.0))):
        if value is not None:
            out.append((family, (), value))
    seconds = _mapping(goodput.get("seconds"))
    for cause in CAUSES:
        value = _number(seconds.get(cause), 0.0)
        if value is not None:
            out.append(("ddpjob_job_lost_seconds", (cause,), value))
    by_fault = _mapping(goodput.get("byFault"))
    sums: dict[tuple[str, str], float] = {}
    for fault, label in fault_labels(by_fault).items():
        record = _mapping(by_fault[fault])
        for family, key in (("ddpjob_job_recoveries", "recoveries"), ("ddpjob_job_steps_lost", "stepsLost"),
                            ("ddpjob_job_fault_seconds", "seconds")):
            value = _number(record.get(key), 0.0)
            if value is not None:  # several names folded into `Other` add up
                sums[family, label] = sums.get((family, label), 0.0) + value
    out += [(family, (label,), value) for (family, label), value in sorted(sums.items())]
    return out


class RecoveryHistogram:
    """The recovery-seconds histogram of every job object (by UID), observed once per new status.lastRecovery.

    A record is new when its (startedAt, seconds) differs from the one this process saw last for the object. The
    record an object already has when this process first sees it is its baseline, never observed: it was written,
    and observed, by the operator process before this one (a new job is first seen at its creation, without one).
    """

    def __init__(self, buckets: tuple[float, ...] = RECOVERY_BUCKETS) -> None:
        self.buckets = buckets
        self._lock = threading.Lock()
        self._last: dict[str, tuple | None] = {}  # uid -> the identity of the record last seen
        # uid -> (namespace, name, {fault label: [count per bucket (+Inf last), sum]})
        self._jobs: dict[str, tuple[str, str, dict[str, list]]] = {}

    def see(self, body: Body) -> None:
        """Observe the body's status.lastRecovery if it is a new record of its job object."""
        ident = job_identity(body)
        if ident is None:
            return
        namespace, name, uid = ident
        record = _mapping(_mapping(body.get("status")).get("lastRecovery"))
        seconds = _number(record.get("seconds"), 0.0)
        key = (record.get("startedAt"), seconds) if record else None
        with self._lock:
            first = uid not in self._last
            changed = not first and key is not None and self._last[uid] != key
            self._last[uid] = key
            if not changed or seconds is None:
                return
            _, _, faults = self._jobs.setdefault(uid, (namespace, name, {}))
            label = fault_label(record.get("fault"))
            if label not in faults and len(faults) >= MAX_FAULTS - (OTHER_FAULT not in faults):
                label = OTHER_FAULT
            counts = faults.setdefault(label, [[0] * (len(self.buckets) + 1), 0.0])
            counts[0][next((i for i, b in enumerate(self.buckets) if seconds <= b), len(self.buckets))] += 1
            counts[1] += seconds

    def forget(self, uid: str) -> None:
        with self._lock:
            self._last.pop(uid, None)
            self._jobs.pop(uid, None)

    def keep_only(self, uids: set[str]) -> None:
        """Forget every job object not in `uids` (the jobs the operator still holds)."""
        with self._lock:
            for uid in [u for u in self._last if u not in uids]:
                self._last.pop(uid, None)
                self._jobs.pop(uid, None)

    def family(self) -> HistogramMetricFamily:
        hist = HistogramMetricFamily(HISTOGRAM, HISTOGRAM_HELP, labels=(*JOB_LABELS, "fault"))
        with self._lock:
            jobs = [(ns, name, {f: ([*c[0]], c[1]) for f, c in faults.items()})
                    for ns, name, faults in self._jobs.values()]
        for ns, name, faults in sorted(jobs):
            for fault, (counts, total) in sorted(faults.items()):
                cumulative, buckets = 0, []
                for bound, count in zip([*map(floatToGoString, self.buckets), "+Inf"], counts):
                    cumulative += count
                    buckets.append((bound, cumulative))
                hist.add_metric([ns, name, fault], buckets, total)
        return hist

    def series(self) -> int:
        """How many series the histogram exposes (buckets with +Inf, _sum and _count per job and fault)."""
        with self._lock:
            return sum(len(f) for _, _, f in self._jobs.values()) * (len(self.buckets) + 3)


def _family(name: str, samples: list[tuple[tuple[str, ...], float]]) -> GaugeMetricFamily | CounterMetricFamily:
    kind, text, extra = FAMILIES[name]
    labels = (*JOB_LABELS, extra) if extra else JOB_LABELS
    family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, text, labels=labels)
    for values, value in samples:
        family.add_metric(list(values), value)
    return family


class JobMetrics(Collector):
    """The per-job metrics of the jobs `bodies()` returns (the bodies in the operator's index), at scrape time."""

    def __init__(self, bodies: Callable[[], Iterable[Body]]) -> None:
        self.bodies = bodies
        self.recoveries = RecoveryHistogram()

    def see(self, body: Body) -> None:
        """A job's body as a watch event brought it: its recovery observed now, not at the next scrape."""
        try:
            self.recoveries.see(body)
        except Exception:  # noqa: BLE001 - never break the event handler over a metric
            log.exception("per-job metrics: a job's body could not be read")

    def forget(self, uid: str) -> None:
        self.recoveries.forget(uid)

    def describe(self) -> Iterator:
        for name in FAMILIES:
            yield _family(name, [])
        yield HistogramMetricFamily(HISTOGRAM, HISTOGRAM_HELP, labels=(*JOB_LABELS, "fault"))

    def collect(self) -> Iterator:
        samples: dict[str, list[tuple[tuple[str, ...], float]]] = {name: [] for name in FAMILIES}
        try:
            bodies = list(self.bodies())
        except Exception:  # noqa: BLE001 - e.g. kopf's index changing under the listing: the next scrape has them
            log.exception("per-job metrics: the jobs could not be listed")
            bodies = None
        uids: set[str] = set()
        for body in bodies or ():
            try:
                ident = job_identity(body)
                if ident is None:
                    continue
                rows = job_samples(body)  # all of a job's series, or none of them
                self.recoveries.see(body)
            except Exception:  # noqa: BLE001 - one unreadable body loses its own series only
                log.exception("per-job metrics: a job's status could not be read")
                continue
            uids.add(ident[2])
            for family, extra, value in rows:
                samples[family].append(((ident[0], ident[1], *extra), value))
        if bodies is not None:
            self.recoveries.keep_only(uids)
        for name, rows in samples.items():
            yield _family(name, rows)
        yield self.recoveries.family()


def register(bodies: Callable[[], Iterable[Body]], registry: CollectorRegistry = REGISTRY) -> JobMetrics:
    """A JobMetrics for `bodies`, registered with `registry` (the one metrics.serve exposes)."""
    collector = JobMetrics(bodies)
    registry.register(collector)
    return collector
