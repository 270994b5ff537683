"""The settings of one run (:class:`~ddp_trainer.run.Run`): read once, from its arguments or the DDPJOB_* environment.

:meth:`RunConfig.from_env` takes each setting from the argument given to ``Run`` or, where it was left out
(:data:`FROM_ENV`), from its environment variable (``env.py``); a value it cannot use raises
:class:`~ddp_trainer.env.ConfigError` naming the variable. A variable is read only for a setting left out, so a bad
value in the environment does not matter where the caller gave the setting. ``None``/0 turns a feature off.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import env as envmod
from .progress import termination_log_path

# The default of every Run argument that may come from the environment: "not given, read the variable".
FROM_ENV: Any = object()


@dataclass(frozen=True)
class RunConfig:
    # DDPJOB_CHECKPOINT_DIR (unset: no disk checkpoints)
    checkpoint_dir: str | None
    # DDPJOB_CHECKPOINT_EVERY steps (default 100; 0: only the final one)
    checkpoint_every: int
    # DDPJOB_KEEP_CHECKPOINTS (default 3)
    keep_checkpoints: int
    # DDPJOB_SNAPSHOT_DIR (default /dev/shm/ddpjob/<run key>: default_dir)
    snapshot_dir: str | None
    # DDPJOB_SNAPSHOT_EVERY steps (default 1), or "auto": None, adaptive (run.py's module doc); 0: no peer snapshots
    snapshot_every: int | None
    # DDPJOB_SNAPSHOT_BUDGET_PCT (default 2): the share of training time snapshots may take when the interval is
    # adaptive...
    snapshot_budget_pct: float
    # ...at most DDPJOB_SNAPSHOT_MAX_EVERY steps (default 50)
    snapshot_max_every: int
    # DDPJOB_SNAPSHOT_RESIDENT, auto (default, None), 1 or 0: every rank's parameters and optimizer state live in its
    # pod's snapshot directory (resident.py), so a failure that leaves one rank whole loses at most one step; only
    # with CPU tensors and peer snapshots on. auto: where K may exceed 1 and the trial of its first commits finds it
    # cheap enough (resident.Trial).
    snapshot_resident: bool | None
    # DDPJOB_PROGRESS_PORT (default 29401; 0: no server)
    progress_port: int
    # DDPJOB_LOG_EVERY steps between step lines (default 1; 0: none)
    log_every: int
    # DDPJOB_TERMINATION_LOG, else /dev/termination-log where it exists (progress.termination_log_path)
    termination_log: str | None

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str],
        run_key: str,
        *,
        checkpoint_dir: str | None = FROM_ENV,
        checkpoint_every: int | None = FROM_ENV,
        keep_checkpoints: int | None = FROM_ENV,
        snapshot_dir: str | None = FROM_ENV,
        snapshot_every: int | str | None = FROM_ENV,
        snapshot_budget_pct: float | None = FROM_ENV,
        snapshot_resident: bool | str | None = FROM_ENV,
        progress_port: int | None = FROM_ENV,
        log_every: int | None = FROM_ENV,
    ) -> RunConfig:
        """The settings given, the others read from ``environ`` (``run_key`` names the default snapshot directory)."""
        if checkpoint_dir is FROM_ENV:
            checkpoint_dir = envmod.get_str(envmod.CHECKPOINT_DIR, env=environ)
        if checkpoint_every is FROM_ENV:
            checkpoint_every = envmod.get_int(envmod.CHECKPOINT_EVERY, 100, minimum=0, env=environ)
        if keep_checkpoints is FROM_ENV:
            keep_checkpoints = envmod.get_int(envmod.KEEP_CHECKPOINTS, 3, minimum=1, env=environ)
        if snapshot_every is FROM_ENV:
            snapshot_every = envmod.get_str(envmod.SNAPSHOT_EVERY, envmod.DEFAULT_SNAPSHOT_EVERY, env=environ)
        if snapshot_budget_pct is FROM_ENV:
            snapshot_budget_pct = envmod.get_float(
                envmod.SNAPSHOT_BUDGET_PCT, envmod.DEFAULT_SNAPSHOT_BUDGET_PCT, minimum=0.0, env=environ
            )
        every = envmod.parse_every("snapshot_every", snapshot_every)
        if snapshot_dir is FROM_ENV:
            snapshot_dir = envmod.get_str(envmod.SNAPSHOT_DIR, env=environ) or default_dir(run_key)
        if snapshot_resident is FROM_ENV:
            snapshot_resident = envmod.get_str(envmod.SNAPSHOT_RESIDENT, env=environ)
        resident_mode = envmod.parse_auto_switch(envmod.SNAPSHOT_RESIDENT, snapshot_resident)
        if progress_port is FROM_ENV:
            progress_port = envmod.get_int(
                envmod.PROGRESS_PORT, envmod.DEFAULT_PROGRESS_PORT, minimum=0, env=environ
            )
        if log_every is FROM_ENV:
            log_every = envmod.get_int(envmod.LOG_EVERY, 1, minimum=0, env=environ)
        max_every = envmod.get_int(
            envmod.SNAPSHOT_MAX_EVERY, envmod.DEFAULT_SNAPSHOT_MAX_EVERY, minimum=1, env=environ
        ) or envmod.DEFAULT_SNAPSHOT_MAX_EVERY
        return cls(
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every or 0,
            keep_checkpoints=keep_checkpoints or 3,
            snapshot_dir=snapshot_dir,
            snapshot_every=every,
            snapshot_budget_pct=float(snapshot_budget_pct or 0.0),
            snapshot_max_every=max_every,
            snapshot_resident=resident_mode,
            progress_port=progress_port or 0,
            log_every=log_every or 0,
            termination_log=termination_log_path(envmod.get_str(envmod.TERMINATION_LOG, env=environ)),
        )


def default_dir(run_key: str, root: str = envmod.DEFAULT_SNAPSHOT_ROOT) -> str:
    """Where a run keeps its snapshots when DDPJOB_SNAPSHOT_DIR is not set."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_key).strip("._") or "run"
    if not os.path.isdir(os.path.dirname(root)):  # no /dev/shm (macOS): fall back to the temp dir
        import tempfile

        root = os.path.join(tempfile.gettempdir(), "ddpjob")
    return os.path.join(root, safe)
