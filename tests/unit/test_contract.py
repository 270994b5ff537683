"""The operator and the trainer agree on every string and number they share (docs/contract.md).

They ship in separate images (the operator image holds only ddp_operator, the trainer image only ddp_trainer), so
neither imports the other: each defines the contract once, and this test holds the two definitions equal.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from ddp_operator import names
from ddp_trainer import env, progress, recovery, rendezvous, torch_version

TRAINER_PROJECT = Path(__file__).resolve().parents[2] / "trainer" / "pyproject.toml"

PAIRS = {
    # the environment the operator sets and the trainer reads
    "job name variable": (names.ENV_JOB_NAME, env.JOB_NAME),
    "job namespace variable": (names.ENV_JOB_NAMESPACE, env.JOB_NAMESPACE),
    "pod index variable": (names.ENV_POD_INDEX, env.POD_INDEX),
    "nodes-file variable": (names.ENV_NODES_FILE, env.NODES_FILE),
    "checkpoint dir variable": (names.ENV_CHECKPOINT_DIR, env.CHECKPOINT_DIR),
    "snapshot dir variable": (names.ENV_SNAPSHOT_DIR, env.SNAPSHOT_DIR),
    "progress port variable": (names.ENV_PROGRESS_PORT, env.PROGRESS_PORT),
    # the progress channel: where the operator probes, where the trainer serves (and its resumedFrom values)
    "progress port": (names.PROGRESS_PORT, env.DEFAULT_PROGRESS_PORT),
    "progress path": (names.PROGRESS_PATH, progress.PATH),
    "resumedFrom values": (sorted(names.RESUMED_FROM), sorted(recovery.RESUMED_FROM.values())),
    # the pod's terminationMessagePath and where the trainer writes its final record by default
    "termination log": (names.TERMINATION_LOG, env.DEFAULT_TERMINATION_LOG),
    # hot spares: the rendezvous backend the operator selects, and the line a released spare ends its log with
    "spares rendezvous backend": (names.RDZV_BACKEND_SPARES, rendezvous.BACKEND),
    "spare-released marker": (names.SPARE_RELEASED_MARKER, rendezvous.SPARE_RELEASED),
    # the last line of a trainer that refused its image's torch (the job fails at once, reason UnsupportedTorch)
    "unsupported-torch marker": (names.TORCH_UNSUPPORTED_TEXT, torch_version.MARKER),
}


@pytest.mark.parametrize("what", sorted(PAIRS))
def test_operator_and_trainer_agree(what):
    operator_side, trainer_side = PAIRS[what]
    assert operator_side == trainer_side


def test_the_spares_backend_is_registered_under_its_name():
    """torchrun finds the backend the operator names through the trainer distribution's entry point
    (trainer/pyproject.toml; pip writes it into the installed package's metadata)."""
    entry_points = tomllib.loads(TRAINER_PROJECT.read_text())["project"]["entry-points"]
    assert entry_points["torchrun.handlers"] == {names.RDZV_BACKEND_SPARES: "ddp_trainer.rendezvous:get_handler"}
