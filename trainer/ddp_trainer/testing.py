"""A local multi-node launcher for tests and benchmarks: torchrun agents as simulated pods.

Each node is one torchrun agent with its own loopback address (127.0.0.<n>, its rendezvous identity),
its own snapshot directory (its pod's /dev/shm) and its own log file. Where possible the agent runs in
its own PID namespace (``unshare --pid --fork --kill-child``), so :meth:`LocalCluster.kill` takes down
the agent and every worker at once, as a dying pod does; elsewhere the process tree is killed.
Nothing here sleeps for a fixed time: waits poll the logs for events until a deadline.

The import surface: ``from ddp_trainer.testing import X`` for every name below. The cluster itself is in
``testing_cluster``, the /proc readers and ``free_port`` in ``testing_processes``, the recovery measures
(``steps_lost``) in ``testing_recovery``.
"""

from __future__ import annotations

from .testing_cluster import REPO_TRAINER_DIR, ClusterTimeout, Event, LocalCluster, Node, parse_stamp, torchrun_workers
from .testing_processes import (
    descendants, forked_workers, free_port, local_rank, parent_pid, pidns_available, process_name,
)
from .testing_recovery import StepsLostError, held_steps, recovery_after_kill, restore_after, steps_lost

__all__ = [
    "REPO_TRAINER_DIR",
    "ClusterTimeout",
    "descendants",
    "Event",
    "forked_workers",
    "free_port",
    "held_steps",
    "local_rank",
    "LocalCluster",
    "Node",
    "parent_pid",
    "parse_stamp",
    "pidns_available",
    "process_name",
    "recovery_after_kill",
    "restore_after",
    "steps_lost",
    "StepsLostError",
    "torchrun_workers",
]
