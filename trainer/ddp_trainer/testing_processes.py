"""The processes of a simulated node (``ddp_trainer.testing``), read from /proc: parents, names, a worker's
LOCAL_RANK, all descendants; whether an agent can have a PID namespace of its own; a free loopback port.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pidns_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "true"], timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_PIDNS: bool | None = None


def pidns_available() -> bool:
    global _PIDNS
    if _PIDNS is None:
        _PIDNS = _pidns_works()
    return _PIDNS


def parent_pid(pid: int | str) -> int | None:
    """The parent of process `pid` from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def process_name(pid: int | str) -> str:
    """/proc/<pid>/comm ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def forked_workers(pids: Iterable[int | str]) -> list[int]:
    """Of `pids`, the workers ddp_trainer.launch forked from its forkserver: named launch.WORKER_NAME by
    run_program, with a parent that is not (a DataLoader worker forked from a worker inherits the name)."""
    from .launch import WORKER_NAME

    return sorted(int(p) for p in pids
                  if process_name(p) == WORKER_NAME and process_name(parent_pid(p) or 0) != WORKER_NAME)


def local_rank(pid: int | str) -> int | None:
    """LOCAL_RANK in the environment of process `pid`, a torchrun worker (None for the agent, or once it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:
        return None
    return next((int(v.partition(b"=")[2]) for v in environ if v.startswith(b"LOCAL_RANK=")), None)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        ppid = parent_pid(entry)
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
