"""Steps lost, the one measure every benchmark and test uses (ddp_trainer.testing.steps_lost)."""

from __future__ import annotations

import pytest

from ddp_trainer.testing import StepsLostError, steps_lost

# (log time, step) of event=step lines from two nodes; the group re-forms (restores) at t=10
LINES = [(1.0, 1), (1.1, 1), (2.0, 2), (2.1, 2), (3.0, 3), (9.5, 4), (10.5, 3), (11.0, 4)]


def test_highest_step_any_rank_logged_before_the_restore_minus_the_restored_step():
    # step 4 was finished by a survivor after the kill (t=9.5): lost work, counted
    assert steps_lost(LINES, restored_step=3, restored_at=10.0) == 1
    assert steps_lost(LINES, restored_step=4, restored_at=10.0) == 0
    assert steps_lost(LINES, restored_step=0, restored_at=10.0) == 4  # started over: everything lost


def test_never_clamped_a_restore_ahead_of_the_logged_steps_is_a_bug():
    with pytest.raises(StepsLostError):
        steps_lost(LINES, restored_step=5, restored_at=10.0)


def test_window_starts_at_the_previous_restore_and_nothing_logged_is_unmeasured():
    assert steps_lost(LINES, restored_step=3, restored_at=12.0, since=10.0) == 1
    assert steps_lost(LINES, restored_step=3, restored_at=10.0, since=9.9) is None
    assert steps_lost([], restored_step=0, restored_at=1.0) is None
