"""What an observed pod means to the operator: `observe_pod(pod)` reduces a Pod object to a frozen PodState.

Training pods run with restartPolicy OnFailure (pod.py): a trainer container that exits non-zero is restarted
by the kubelet inside the same pod, which stays Running. Such a failure is not an end of the pod: it shows as
`restarts` (how many times the trainer container failed and was, or is about to be, restarted in place: its
`restartCount`, plus one while the failed container waits for its restart) and `restart_*` (the newest such
failure, from `state.terminated` before the restart and `lastState.terminated` after it), and `restarting`
while the trainer container is down for it (terminated, or waiting out the kubelet's CrashLoopBackOff).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

from ddp_operator import names
from ddp_operator.report import valid_report

# torchrun's failure summary: "  exitcode  : 3 (pid: 812)" (an exit code, or minus a signal number: a few digits)
_WORKER_EXIT = re.compile(r"exitcode\s*:\s*(-?\d{1,9})(?!\d)")
_INDEX = re.compile(r"[0-9]{1,9}")
# A kubelet waiting reason (ContainerCreating, PodInitializing, ...): one CamelCase word, else not shown.
_WAITING_REASON = re.compile(r"[A-Za-z][A-Za-z0-9]{0,63}")
MESSAGE_TAIL = 512
# A trainer's termination message (the kubelet keeps at most 4096 bytes: the log's tail) is kept whole, so that the
# failing worker's traceback above torchrun's summary can be read (failure_class.py).
TERMINATION_MESSAGE_TAIL = 4096
STALE_GROUP = -1


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 time from a pod, a status or a report, or None when absent or malformed (never raises)."""
    if not value or not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.astimezone(timezone.utc)


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
    final_report: Mapping[str, Any] | None  # rank 0's termination-log JSON, when present: its valid fields
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
    # In-place restarts of the trainer container (restartPolicy OnFailure): see the module docstring.
    restarts: int = 0
    restart_exit_code: int | None = None
    restart_worker_exit_codes: tuple[int, ...] = ()
    restart_reason: str = ""
    restart_message: str = ""
    restart_finished_at: datetime | None = None
    restarting: bool = False
    # The number of training nodes the pod was told (names.NODES_ANNOTATION; jobs with spares), or None.
    nodes_annotation: str | None = None
    # The fields of the termination-log report that were invalid and dropped (status.valid_report).
    report_invalid: tuple[str, ...] = ()
    # The main container's waiting reason while it waits without a startup error (ContainerCreating,
    # PodInitializing; a reason that is not one word is dropped), else "": the startup timeout names it.
    waiting: str = ""

    @property
    def terminal(self) -> bool:
        return self.gone or self.phase in ("Succeeded", "Failed")

    @property
    def active(self) -> bool:
        return not self.terminal and not self.deleting

    @property
    def running(self) -> bool:
        """Running, and its trainer container is up (not down for an in-place restart)."""
        return self.phase == "Running" and not self.deleting and not self.restarting

    @property
    def succeeded(self) -> bool:
        return self.phase == "Succeeded" or (self.terminal and self.exit_code == 0)

    @property
    def exit_codes(self) -> tuple[int, ...]:
        return ((self.exit_code,) if self.exit_code is not None else ()) + self.worker_exit_codes

    @property
    def restart_exit_codes(self) -> tuple[int, ...]:
        """Exit codes of the newest in-place restart: the trainer container's and its workers'."""
        return ((self.restart_exit_code,) if self.restart_exit_code is not None else ()) + \
            self.restart_worker_exit_codes


def rdzv_backend_missing(message: str) -> bool:
    """Whether a trainer's termination message (a log tail) ends with torch's refusal of the ddpjob-c10d backend: the
    image has no ddp_trainer. Believed only as the last line, where torchrun's traceback ends it (a script quoting
    it earlier is an ordinary failure)."""
    lines = (message or "").rstrip().splitlines()
    return bool(lines) and lines[-1].startswith(names.RDZV_BACKEND_MISSING_TEXT)


def torch_unsupported(message: str) -> bool:
    """Whether a trainer's termination message ends with ddp_trainer's refusal of the image's torch (outside the range
    its launcher and rendezvous backend are tested with). Believed only as the last line, as rdzv_backend_missing."""
    lines = (message or "").rstrip().splitlines()
    return bool(lines) and lines[-1].startswith(names.TORCH_UNSUPPORTED_TEXT)


def _main_container_status(pod: Mapping, container_name: str) -> Mapping:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container_name:
            return cs
    return {}


def _final_report(message: str) -> tuple[Mapping[str, Any] | None, tuple[str, ...]]:
    """The termination message as the trainer's final report (its valid fields) and the invalid fields dropped.
    A message that is not a JSON object with `final` (a log tail) is no report; nothing in it raises (JSON nested
    thousands deep, numbers no float holds)."""
    if not message.startswith("{") or '"final"' not in message:
        return None, ()
    try:
        report = json.loads(message)
    except (TypeError, ValueError, RecursionError):
        return None, ()
    if not isinstance(report, dict) or "final" not in report:
        return None, ()
    clean, invalid = valid_report(report)
    return (clean if clean is not None and clean.get("final") is True else None), invalid


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
    state = cs.get("state") or {}
    phase = status.get("phase") or "Pending"
    deleting = bool(meta.get("deletionTimestamp"))
    restart_count = int(cs.get("restartCount") or 0)
    # The kubelet restarts a failed container of a pod that is not being deleted when the pod's policy says so.
    in_place = ((pod.get("spec") or {}).get("restartPolicy") or "Always") in ("OnFailure", "Always")
    current = state.get("terminated") or {}
    last = (cs.get("lastState") or {}).get("terminated") or {}
    restarting = False
    if (role == names.ROLE_TRAINER and in_place and not gone and not deleting and phase in ("Pending", "Running")
            and current and current.get("exitCode") != 0):
        # Failed, and the kubelet restarts it (restartCount moves when the new container is created).
        restart_count, last, current, restarting = restart_count + 1, current, {}, True
    elif restart_count and state.get("waiting"):
        restarting = True  # CrashLoopBackOff, or the new container being created
    terminated = current
    message = (terminated.get("message") or status.get("message") or "").strip()
    exit_code = terminated.get("exitCode")
    reason = terminated.get("reason") or status.get("reason") or ""
    lingering = False
    if role == names.ROLE_TRAINER and phase in ("Pending", "Running") and terminated:
        # Completion is the trainer container's, not the pod's: a sidecar may keep the pod Running for ever.
        phase = "Succeeded" if exit_code == 0 else "Failed"
        lingering = not gone and any(c.get("name") != container and not (c.get("state") or {}).get("terminated")
                                     for c in status.get("containerStatuses") or [])
    last_message = (last.get("message") or "").strip()
    if gone:
        phase = "Gone" if phase not in ("Succeeded", "Failed") else phase
        reason = reason or "Deleted"
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    final_report, report_invalid = _final_report(message)
    nodes_annotation = (meta.get("annotations") or {}).get(names.NODES_ANNOTATION)
    return PodState(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        role=role,
        index=int(index) if isinstance(index, str) and _INDEX.fullmatch(index) else None,
        group=_group(labels.get(names.LABEL_GROUP)),
        phase=phase,
        deleting=deleting,
        deletion_time=parse_time(meta.get("deletionTimestamp")),
        node=(pod.get("spec") or {}).get("nodeName") or "",
        ready=ready and phase == "Running",
        exit_code=exit_code,
        worker_exit_codes=tuple(int(c) for c in _WORKER_EXIT.findall(message)),
        reason=reason,
        message=message[-TERMINATION_MESSAGE_TAIL:],
        disruption=_disruption(pod),
        final_report=final_report,
        finished_at=parse_time(terminated.get("finishedAt")),
        startup_error=None if gone or phase not in ("Pending", "Running") else _startup_error(pod),
        gone=gone,
        lingering=lingering,
        restarts=restart_count if role == names.ROLE_TRAINER else 0,
        restart_exit_code=last.get("exitCode"),
        restart_worker_exit_codes=tuple(int(c) for c in _WORKER_EXIT.findall(last_message)),
        restart_reason=last.get("reason") or "",
        restart_message=last_message[-TERMINATION_MESSAGE_TAIL:],
        restart_finished_at=parse_time(last.get("finishedAt")),
        restarting=restarting and role == names.ROLE_TRAINER,
        nodes_annotation=nodes_annotation if isinstance(nodes_annotation, str) and len(nodes_annotation) <= 16
        else None,
        report_invalid=report_invalid,
        waiting=_waiting_reason(state),
    )


def _waiting_reason(state: Mapping[str, Any]) -> str:
    waiting = state.get("waiting")
    reason = waiting.get("reason") if isinstance(waiting, Mapping) else None
    return reason if isinstance(reason, str) and _WAITING_REASON.fullmatch(reason) else ""


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
    status = node.get("status") if isinstance(node, Mapping) else None
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    for cond in conditions if isinstance(conditions, list) else []:
        if isinstance(cond, Mapping) and cond.get("type") == "Ready":
            since = cond.get("lastTransitionTime")
            return NodeState(ready=cond.get("status") == "True",
                             since=since if isinstance(since, datetime) else parse_time(since))
    return NodeState(ready=False)
