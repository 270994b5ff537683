"""Environment variable names the trainer reads, and parsing them into typed values.

Every name the operator sets (see docs/contract.md) or torchrun sets is a constant here; nothing else in
the package spells an environment variable by hand. Parsing errors raise :class:`ConfigError` with a
message that names the variable and says what to do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# torchrun -> worker
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
RUN_ID = "TORCHELASTIC_RUN_ID"

TORCHRUN_REQUIRED = (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)

# operator -> trainer (docs/contract.md)
JOB_NAME = "DDPJOB_NAME"
JOB_NAMESPACE = "DDPJOB_NAMESPACE"
POD_INDEX = "DDPJOB_POD_INDEX"
CHECKPOINT_DIR = "DDPJOB_CHECKPOINT_DIR"
SNAPSHOT_DIR = "DDPJOB_SNAPSHOT_DIR"
PROGRESS_PORT = "DDPJOB_PROGRESS_PORT"
NODES_FILE = "DDPJOB_NODES_FILE"  # jobs with spares: the wanted group size (ddp_trainer.rendezvous, rule 3)

# trainer-only knobs (not set by the operator; useful in tests and for users)
CHECKPOINT_EVERY = "DDPJOB_CHECKPOINT_EVERY"
KEEP_CHECKPOINTS = "DDPJOB_KEEP_CHECKPOINTS"
SNAPSHOT_EVERY = "DDPJOB_SNAPSHOT_EVERY"
SNAPSHOT_BUDGET_PCT = "DDPJOB_SNAPSHOT_BUDGET_PCT"
SNAPSHOT_MAX_EVERY = "DDPJOB_SNAPSHOT_MAX_EVERY"
SNAPSHOT_RESIDENT = "DDPJOB_SNAPSHOT_RESIDENT"  # ddp_trainer.resident: auto (default) | 1 | 0
RUN_KEY = "DDPJOB_RUN_KEY"
TERMINATION_LOG = "DDPJOB_TERMINATION_LOG"
PG_TIMEOUT = "DDPJOB_PG_TIMEOUT"
LOG_EVERY = "DDPJOB_LOG_EVERY"
RDZV_POLL = "DDPJOB_RDZV_POLL_SECONDS"  # ddp_trainer.launch
FORKSERVER = "DDPJOB_FORKSERVER"  # ddp_trainer.launch: fork (default) | exec
LEAVE_ON_SIGNAL = "DDPJOB_LEAVE_ON_SIGNAL"  # ddp_trainer.launch: 1 (default) | 0
TAKE_OVER = "DDPJOB_TAKE_OVER"  # ddp_trainer.rendezvous rule 4: 1 (default) | 0
ALLOW_UNSUPPORTED_TORCH = "DDPJOB_ALLOW_UNSUPPORTED_TORCH"  # ddp_trainer.torch_version: 1 starts on any torch

DEFAULT_PROGRESS_PORT = 29401
DEFAULT_SNAPSHOT_ROOT = "/dev/shm/ddpjob"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
DEFAULT_PG_TIMEOUT_S = 120.0
AUTO = "auto"
# Every step by default: at most one step lost per failure, the contract the e2e tests hold. Large models opt
# into the adaptive interval (auto), which keeps snapshots within DDPJOB_SNAPSHOT_BUDGET_PCT of training time.
DEFAULT_SNAPSHOT_EVERY = "1"
DEFAULT_SNAPSHOT_BUDGET_PCT = 2.0
DEFAULT_SNAPSHOT_MAX_EVERY = 50


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says which setting and how."""


def get_str(name: str, default: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    value = env.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip()


def get_int(
    name: str,
    default: int | None = None,
    *,
    minimum: int | None = None,
    env: Mapping[str, str] | None = None,
) -> int | None:
    raw = get_str(name, None, env)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def get_float(
    name: str,
    default: float | None = None,
    *,
    minimum: float | None = None,
    env: Mapping[str, str] | None = None,
) -> float | None:
    raw = get_str(name, None, env)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def parse_every(name: str, raw: str | int | None) -> int | None:
    """A snapshot interval: ``auto`` (or unset) is None (adaptive), else an int >= 0 (0: off)."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", AUTO)):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected {AUTO} or a number of steps (0: off)") from None
    if value < 0:
        raise ConfigError(f"{name}={value} must be >= 0 (0: off) or {AUTO}")
    return value


def parse_auto_switch(name: str, raw: str | bool | None) -> bool | None:
    """``auto`` (or unset) is None (the trainer decides), else on (1/true) or off (0/false)."""
    if raw is None or isinstance(raw, bool):
        return raw
    value = raw.strip().lower()
    if value in ("", AUTO):
        return None
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected {AUTO}, 1 or 0")


def run_key(env: Mapping[str, str] | None = None) -> str:
    """What identifies one training run, so a snapshot from another run is never resumed.

    Under the operator the snapshot directory is a per-pod emptyDir, so the job name is enough; under a
    bare torchrun the rendezvous id is (``--standalone`` makes a fresh one per launch).
    """
    env = os.environ if env is None else env
    explicit = get_str(RUN_KEY, None, env)
    if explicit:
        return explicit
    name = get_str(JOB_NAME, None, env)
    if name:
        return f"{get_str(JOB_NAMESPACE, 'default', env)}/{name}"
    return get_str(RUN_ID, "none", env) or "none"
