"""What an observed pod means to the operator: `observe_pod(pod)` reduces a Pod object to a frozen PodState."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

from ddp_operator import names

# torchrun's failure summary: "  exitcode  : 3 (pid: 812)"
_WORKER_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")
MESSAGE_TAIL = 512
STALE_GROUP = -1


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(timezone.utc)


def format_time(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class PodState:
    name: str
    uid: str
    role: str
    index: int | None
    group: int
    phase: str                     # Pending | Running | Succeeded | Failed | Unknown | Gone (tombstone, not ended)
    deleting: bool
    deletion_time: datetime | None  # deletionTimestamp (grace period already included by the API server)
    node: str
    ready: bool
    exit_code: int | None          # the main container's, once terminated
    worker_exit_codes: tuple[int, ...]
    reason: str
    message: str
    disruption: str | None         # disruption reason (eviction, preemption, node loss), or None
    final_report: Mapping[str, Any] | None  # rank 0's termination-log JSON, when present
    finished_at: datetime | None = None     # when the main container terminated
    # Why the pod cannot start, while it cannot: (reason, message) of a container the kubelet cannot create or
    # pull (names.STARTUP_WAITING_REASONS), or of the scheduler's PodScheduled=False. None otherwise.
    startup_error: tuple[str, str] | None = None
    # A tombstone: the pod's last state from its DELETED watch event. The object no longer exists, whatever
    # its last phase says (a pod deleted gracefully usually ends Failed first: torchrun exits on SIGTERM).
    gone: bool = False
    # The trainer container ended but a classic sidecar container keeps the pod running. `phase` is then the
    # trainer's outcome (Succeeded/Failed); the pod itself still needs stopping (cleanPodPolicy). Native sidecars
    # (init containers with restartPolicy Always) are stopped by the kubelet, so they never make a pod linger.
    lingering: bool = False

    @property
    def terminal(self) -> bool:
        return self.gone or self.phase in ("Succeeded", "Failed")

    @property
    def active(self) -> bool:
        return not self.terminal and not self.deleting

    @property
    def running(self) -> bool:
        return self.phase == "Running" and not self.deleting

    @property
    def succeeded(self) -> bool:
        return self.phase == "Succeeded" or (self.terminal and self.exit_code == 0)

    @property
    def exit_codes(self) -> tuple[int, ...]:
        return ((self.exit_code,) if self.exit_code is not None else ()) + self.worker_exit_codes


def _main_container_status(pod: Mapping, container_name: str) -> Mapping:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container_name:
            return cs
    return {}


def _final_report(message: str) -> Mapping[str, Any] | None:
    try:
        report = json.loads(message)
    except (TypeError, ValueError):
        return None
    return report if isinstance(report, dict) and report.get("final") else None


def _disruption(pod: Mapping) -> str | None:
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == names.DISRUPTION_CONDITION and cond.get("status") == "True":
            return cond.get("reason") or names.DISRUPTION_CONDITION
    if status.get("reason") in names.DISRUPTION_REASONS:
        return status["reason"]
    return None


def _startup_error(pod: Mapping) -> tuple[str, str] | None:
    """The first reason the pod cannot start: a container (init containers first) waiting for a reason in
    names.STARTUP_WAITING_REASONS, else the scheduler's Unschedulable."""
    status = pod.get("status") or {}
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in names.STARTUP_WAITING_REASONS:
            message = (waiting.get("message") or "").strip()
            return waiting["reason"], f"container {cs.get('name')}: {message}"[:MESSAGE_TAIL] if message \
                else f"container {cs.get('name')}"
    for cond in status.get("conditions") or []:
        if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                and cond.get("reason") == names.REASON_UNSCHEDULABLE):
            return names.REASON_UNSCHEDULABLE, (cond.get("message") or "").strip()[:MESSAGE_TAIL]
    return None


def _group(label: Any) -> int:
    """The pod's group label; one that is not a number (edited by hand, or a foreign pod) reads as STALE_GROUP,
    which matches no group the operator runs, so the pod is deleted as stale and never counted."""
    if label is None or label == "":
        return 0
    text = str(label)
    return int(text) if text.isdigit() and len(text) < 10 else STALE_GROUP


def observe_pod(pod: Mapping[str, Any], *, gone: bool = False) -> PodState:
    """`gone`: the pod's last state from a DELETED watch event (a tombstone). Its phase becomes "Gone" unless it
    had ended (Succeeded/Failed) before, which keeps its exit for the record; `PodState.gone` is what says the
    object no longer exists."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    role = labels.get(names.LABEL_ROLE, names.ROLE_TRAINER)
    index = labels.get(names.LABEL_NODE_INDEX)
    container = names.TRAINER_CONTAINER if role == names.ROLE_TRAINER else names.RDZV_CONTAINER
    cs = _main_container_status(pod, container)
    terminated = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
    message = (terminated.get("message") or status.get("message") or "").strip()
    exit_code = terminated.get("exitCode")
    reason = terminated.get("reason") or status.get("reason") or ""
    phase = status.get("phase") or "Pending"
    lingering = False
    if role == names.ROLE_TRAINER and phase in ("Pending", "Running") and (cs.get("state") or {}).get("terminated"):
        # Completion is the trainer container's, not the pod's: a sidecar may keep the pod Running for ever.
        phase = "Succeeded" if exit_code == 0 else "Failed"
        lingering = not gone and any(c.get("name") != container and not (c.get("state") or {}).get("terminated")
                                     for c in status.get("containerStatuses") or [])
    if gone:
        phase = "Gone" if phase not in ("Succeeded", "Failed") else phase
        reason = reason or "Deleted"
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return PodState(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        role=role,
        index=int(index) if index is not None and str(index).isdigit() else None,
        group=_group(labels.get(names.LABEL_GROUP)),
        phase=phase,
        deleting=bool(meta.get("deletionTimestamp")),
        deletion_time=parse_time(meta.get("deletionTimestamp")),
        node=(pod.get("spec") or {}).get("nodeName") or "",
        ready=ready and phase == "Running",
        exit_code=exit_code,
        worker_exit_codes=tuple(int(c) for c in _WORKER_EXIT.findall(message)),
        reason=reason,
        message=message[-MESSAGE_TAIL:],
        disruption=_disruption(pod),
        final_report=_final_report(message),
        finished_at=parse_time(terminated.get("finishedAt")),
        startup_error=None if gone or phase not in ("Pending", "Running") else _startup_error(pod),
        gone=gone,
        lingering=lingering,
    )


# --- nodes (the node-loss rule) -------------------------------------------------------------------
@dataclass(frozen=True)
class NodeState:
    """A node as the node-loss rule sees it: Ready or not, and since when (the Ready condition's
    lastTransitionTime; None for a node that no longer exists, or when the API gave no time)."""
    ready: bool
    since: datetime | None = None
    gone: bool = False


def observe_node(node: Mapping[str, Any] | None) -> NodeState:
    """A Node object (None: it does not exist) as a NodeState. Ready is the Ready condition being True; False
    and Unknown (the node controller's mark for a kubelet that stopped reporting) are both NotReady."""
    if node is None:
        return NodeState(ready=False, gone=True)
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            since = cond.get("lastTransitionTime")
            return NodeState(ready=cond.get("status") == "True",
                             since=since if isinstance(since, datetime) else parse_time(since))
    return NodeState(ready=False)
