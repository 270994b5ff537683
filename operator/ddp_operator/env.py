"""The operator -> trainer environment contract (docs/contract.md): what torchrun and the trainer read."""

from __future__ import annotations

from typing import Any

from ddp_operator import names
from ddp_operator.spec import Job

CLUSTER_DOMAIN = "cluster.local"

# Variables the user's template may override (the operator only supplies a default).
OVERRIDABLE = frozenset({names.ENV_OMP_NUM_THREADS, names.ENV_PYTHONUNBUFFERED})


def rdzv_host(job: Job) -> str:
    """Stable DNS name of the rendezvous store pod (resolvable before it is Ready)."""
    return f"{job.name}-{names.RDZV_POD_SUFFIX}.{job.name}.{job.namespace}.svc.{CLUSTER_DOMAIN}"


def rdzv_endpoint(job: Job) -> str:
    return f"{rdzv_host(job)}:{job.spec.torchrun.rdzv_port}"


def rdzv_id(job: Job, group: int) -> str:
    """torchrun rendezvous id: `<job uid>-<group>`. The group no longer changes (a lost store is recreated and
    rejoined under the same id, plan/rdzv_lost.py); it stays in the id for compatibility with running jobs."""
    return f"{job.uid}-{group}"


def rdzv_conf(job: Job) -> str:
    t = job.spec.torchrun
    # is_host=0 everywhere: the store lives in its own pod, so losing any trainer is a membership change.
    return ",".join([
        "is_host=0",
        f"join_timeout={t.join_timeout_seconds}",
        f"last_call_timeout={t.last_call_timeout_seconds}",
        f"keep_alive_interval={t.keep_alive_interval_seconds}",
        f"keep_alive_max_attempt={t.keep_alive_max_attempts}",
    ])


def rdzv_backend(job: Job) -> str:
    """torchrun's --rdzv-backend (spec.torchrun.rdzvBackend): "auto" is ddpjob-c10d for a job with spares (torch's c10d
    livelocks with a spare) or an elastic range (a round closes once spec.nodes agents joined instead of waiting
    lastCallTimeoutSeconds for maxNodes), else c10d."""
    s = job.spec
    if s.torchrun.rdzv_backend != names.RDZV_BACKEND_AUTO:
        return s.torchrun.rdzv_backend
    return names.RDZV_BACKEND_SPARES if s.spares or s.min_nodes < s.max_nodes else names.RDZV_BACKEND


def follows_desired_size(job: Job) -> bool:
    """Whether the job's pods are told spec.nodes (names.NODES_ANNOTATION, a downward API file named by
    ENV_NODES_FILE) for their rendezvous to follow (ddp_trainer.rendezvous, rule 3): where ddpjob-c10d runs, the only
    backend that reads it. pod.py renders it, plan/spares.py keeps it equal to spec.nodes."""
    return rdzv_backend(job) == names.RDZV_BACKEND_SPARES


def extra_arg_env(arg: str) -> tuple[str, str]:
    """`--log-dir=/x` -> ("PET_LOG_DIR", "/x"); a bare `--flag` -> ("PET_FLAG", "1"), as torchrun's env action reads it."""
    option, sep, value = arg[2:].partition("=")
    return names.ENV_PREFIX + option.replace("-", "_").upper(), value if sep else "1"


def _var(name: str, value: Any) -> dict:
    return {"name": name, "value": str(value)}


def trainer_env(job: Job, index: int, group: int) -> list[dict]:
    """The operator's environment for the `trainer` container of pod `index` (ordered, no duplicates)."""
    s = job.spec
    env = [
        _var(names.ENV_NNODES, f"{s.min_nodes}:{s.max_nodes}"),
        _var(names.ENV_NPROC_PER_NODE, s.nproc_per_node),
        _var(names.ENV_RDZV_BACKEND, rdzv_backend(job)),
        _var(names.ENV_RDZV_ENDPOINT, rdzv_endpoint(job)),
        _var(names.ENV_RDZV_ID, rdzv_id(job, group)),
        _var(names.ENV_RDZV_CONF, rdzv_conf(job)),
        {"name": names.ENV_LOCAL_ADDR, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        _var(names.ENV_MAX_RESTARTS, s.torchrun.max_restarts),
        *(_var(*extra_arg_env(a)) for a in s.torchrun.extra_args),
        # Without it the surviving rank-0 agent reuses a stale master address after a membership change
        # and the whole job dies ~60 s later (measured; docs/torchrun-facts.md).
        _var(names.ENV_DISABLE_SHARED_STORE, "1"),
        _var(names.ENV_OMP_NUM_THREADS, s.omp_num_threads),
        _var(names.ENV_PYTHONUNBUFFERED, "1"),
        _var(names.ENV_JOB_NAME, job.name),
        _var(names.ENV_JOB_NAMESPACE, job.namespace),
        _var(names.ENV_POD_INDEX, index),
        # The rendezvous size follows spec.nodes through this file: a round closes at it, and a scale re-forms the
        # group at the new size without new pods (pod.py).
        *([_var(names.ENV_NODES_FILE, f"{names.NODES_DIR}/{names.NODES_FILE}")] if follows_desired_size(job) else []),
        *([_var(names.ENV_CHECKPOINT_DIR, s.checkpoint.mount_path)] if s.checkpoint else []),
        _var(names.ENV_SNAPSHOT_DIR, names.SNAPSHOT_DIR),
        _var(names.ENV_PROGRESS_PORT, names.PROGRESS_PORT),
    ]
    return env


def merge_env(operator_env: list[dict], user_env: list[dict] | None) -> list[dict]:
    """Operator variables first, then the user's. The contract variables always win; the user may
    override OMP_NUM_THREADS / PYTHONUNBUFFERED. No name appears twice."""
    user_env = list(user_env or [])
    user_names = {e.get("name") for e in user_env}
    owned = {e["name"] for e in operator_env} - OVERRIDABLE
    return ([e for e in operator_env if e["name"] not in user_names or e["name"] not in OVERRIDABLE]
            + [e for e in user_env if e.get("name") not in owned])
