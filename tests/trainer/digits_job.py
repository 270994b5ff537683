"""Constants and helpers shared by the trainer tests (imported as tests.trainer.digits_job)."""

from __future__ import annotations

from ddp_trainer.testing import Event, LocalCluster

# Same seed and world size everywhere: every run must end with the reference's weights, bit for bit.
DIGITS_ARGS = ["--seed", "7", "--epochs", "6", "--patience", "3"]
# Slows steps for kill tests without changing any number the model computes.
SLOW = ["--step-delay", "0.04"]
JOB_TIMEOUT = 300


def final_event(cluster: LocalCluster) -> Event:
    finals = cluster.events("final")
    assert finals, cluster.dump()
    return finals[-1]
