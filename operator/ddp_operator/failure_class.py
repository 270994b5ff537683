"""Why a training pod failed: the user's code, the infrastructure, or a hang (docs/recovery.md, "Why it failed").

The class decides which budget a failure spends (failurePolicy.backoffLimit for the user's code and hangs,
failurePolicy.infraBackoffLimit for the infrastructure) and whether the node it ran on is avoided. It is read from
what Kubernetes and torchrun leave behind, most telling first:

1. a disruption (eviction, preemption, node loss: the pod's DisruptionTarget condition or reason) -> Infrastructure;
2. the pod deleted without its trainer exiting (someone or something removed it) -> Infrastructure, PodDeleted;
3. the container OOM-killed (reason OOMKilled) -> Infrastructure, OOMKilled;
4. a network error in a collective, the store or the rendezvous (the log tail names one: connection reset or closed
   by peer, a gloo/NCCL transport error, DistNetworkError, torch's RendezvousConnectionError...) -> Infrastructure,
   NetworkError;
5. a Python exception (the last traceback in the log tail, which the kubelet keeps as the termination message) ->
   UserCode, with the exception type as the reason, its line and the traceback's last lines as the message;
6. a worker or the container killed by a signal with no traceback (SIGKILL from the OOM killer of a worker,
   SIGTERM from outside) -> Infrastructure, Killed;
7. any other non-zero exit -> UserCode, ExitCode.

A pod that never started is no ended pod: its image cannot be pulled or run (a container waiting for a reason in
names.IMAGE_REASONS) -> Infrastructure, ImagePull (`image_pull`, plan/startup.py).

The failing rank comes from torchrun's summary (`rank : 3 (local_rank: 1)`, its root cause first). Every input is
a pod's own text: bounded, never trusted, and nothing here raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddp_operator import names

USER_CODE = "UserCode"
INFRASTRUCTURE = "Infrastructure"
HANG = "Hang"
CLASSES = (USER_CODE, INFRASTRUCTURE, HANG)

REASON_POD_DELETED = "PodDeleted"
REASON_OOM = "OOMKilled"
REASON_NETWORK = "NetworkError"
REASON_KILLED = "Killed"
REASON_EXIT_CODE = "ExitCode"
REASON_IMAGE_PULL = "ImagePull"

MAX_MESSAGE = 1024
TRACEBACK_LINES = 6
_NETWORK = re.compile(
    r"Connection (reset|closed|refused) by peer|Broken pipe|DistNetworkError|DistStoreError|"
    r"Rendezvous(Connection|Timeout)Error|"
    r"\bgloo\b.*(Connection|[Tt]imed out|timeout|Socket)|NCCL (error|WARN).*(remote|network|socket|Connection)|"
    r"ncclRemoteError|ncclSystemError|Socket Timeout|Network is unreachable|No route to host", re.IGNORECASE)
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning|Failure))(?::\s?(.*))?$")
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)
_SIGNAL = re.compile(r"Signal (\d+) \(SIG\w+\) received|exitcode\s*:\s*-(9|15)\b")
# Exceptions that torchrun raises about its workers rather than the user's code raising them.
_AGENT_EXCEPTIONS = {"torch.distributed.elastic.multiprocessing.errors.ChildFailedError", "ChildFailedError",
                     "torch.distributed.elastic.multiprocessing.api.SignalException", "SignalException"}


@dataclass(frozen=True)
class Failure:
    cls: str
    reason: str
    rank: int | None = None
    message: str = ""


def _rank(text: str) -> int | None:
    m = _RANK.search(text)
    return int(m.group(1)) if m and len(m.group(1)) < 7 else None


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")


def _exception(text: str) -> tuple[str, str] | None:
    """(the exception's type, the traceback's last lines) of the last user exception in a log tail (torch prefixes
    each line of a worker's output with `[rankN]:` when asked to)."""
    lines = [_RANK_PREFIX.sub("", ln) for ln in text.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        m = _EXCEPTION.match(lines[i].strip())
        if not m or m.group(1) in _AGENT_EXCEPTIONS or m.group(1).endswith("Warning"):
            continue
        start = max(0, i - TRACEBACK_LINES + 1)
        for j in range(i, max(-1, i - 60), -1):
            if lines[j].startswith("Traceback (most recent call last)"):
                start = max(j, i - TRACEBACK_LINES + 1)
                break
        return m.group(1).rsplit(".", 1)[-1], "\n".join(ln.rstrip() for ln in lines[start:i + 1])
    return None


def classify(*, exit_code: int | None, reason: str, message: str, disruption: str | None,
             deleted: bool = False) -> Failure:
    """The class of one failure of a trainer container (an ended pod or an in-place restart)."""
    text = (message or "")[-8192:]
    rank = _rank(text)
    if disruption:
        return Failure(INFRASTRUCTURE, disruption, rank, f"the pod was disrupted ({disruption})")
    if deleted and exit_code is None:
        return Failure(INFRASTRUCTURE, REASON_POD_DELETED, rank, "the pod was deleted while its trainer ran")
    if reason == REASON_OOM:
        return Failure(INFRASTRUCTURE, REASON_OOM, rank, "the trainer container ran out of memory (OOMKilled): raise "
                       "its memory limit or lower the batch size")
    network = _NETWORK.search(text)
    if network:
        line = next((ln for ln in text.splitlines() if _NETWORK.search(ln)), network.group(0))
        return Failure(INFRASTRUCTURE, REASON_NETWORK, rank, line.strip()[-MAX_MESSAGE:])
    found = _exception(text)
    if found is not None:
        return Failure(USER_CODE, found[0], rank, found[1][-MAX_MESSAGE:])
    if _SIGNAL.search(text) or exit_code in (137, 143):
        return Failure(INFRASTRUCTURE, REASON_KILLED, rank, f"killed by a signal (exit code {exit_code}) with no "
                       f"Python traceback: the OOM killer or something outside the container")
    tail = "\n".join(text.strip().splitlines()[-TRACEBACK_LINES:])
    return Failure(USER_CODE, REASON_EXIT_CODE, rank, (f"exit code {exit_code}" + (f": {tail}" if tail else ""))
                   [-MAX_MESSAGE:])


_RDZV_CLOSED = re.compile(r"\bRendezvousClosedError\b")


def rendezvous_closed(message: str) -> bool:
    """Whether a trainer's torchrun ended because it found its rendezvous closed (torch's RendezvousClosedError in
    the last lines of its log): a consequence of another agent that gave up, not a failure of its own (plan/
    rdzv_closed.py)."""
    lines = (message or "")[-4096:].strip().splitlines()[-TRACEBACK_LINES:]
    return any(_RDZV_CLOSED.search(ln) for ln in lines)


def image_pull(waiting_reason: str, detail: str) -> Failure | None:
    """The class of a pod that cannot start because of its image (the kubelet's waiting reason and message, as
    observed.PodState.startup_error holds them): Infrastructure, ImagePull, the message `<reason>: <kubelet's
    message>`; None for any other reason a pod cannot start (a container config error, Unschedulable)."""
    if waiting_reason not in names.IMAGE_REASONS:
        return None
    message = f"{waiting_reason}: {detail}" if detail else waiting_reason
    return Failure(INFRASTRUCTURE, REASON_IMAGE_PULL, None, message[:MAX_MESSAGE])
