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


def _events(text: str):
    from ddp_trainer.log import parse_line
    from ddp_trainer.testing_cluster import Event, parse_stamp

    return [Event("node0", parse_stamp(line.split(" ", 1)[0]), parse_line(line), i)
            for i, line in enumerate(line for line in text.splitlines() if line.strip())]


# CI (2026-12-06 16:44, test_kill_non_host_node_resumes_bitwise[peer-only-two-workers-per-pod]), node0's log: rank 0
# logged step 15 and failed in step 16 (the other pod's worker was killed); its local rank 1, which writes no step
# line, completed step 16 and held it in its resident file; the group restored 16 from it.
FAILED_IN_STEP_16 = """
2026-12-06T16:44:11.289Z ddp_trainer rank=0 event=step step=15 epoch=1 batch=5 loss=0.455423 samples_per_s=1387.7
2026-12-06T16:44:18.732Z ddp_trainer rank=1 event=rank_restored local_rank=1 step=16 held=16 source=resident
2026-12-06T16:44:18.734Z ddp_trainer rank=0 event=resume source=peer step=16 epoch=1 batch=6 from_rank=1 exact=true
2026-12-06T16:44:18.734Z ddp_trainer rank=0 event=rank_restored local_rank=0 step=16 held=15 source=peer
2026-12-06T16:44:18.837Z ddp_trainer rank=0 event=step step=17 epoch=1 batch=7 loss=0.496348
"""


def test_a_step_only_a_silent_local_rank_completed_counts_from_what_it_held():
    from ddp_trainer.testing import held_steps

    evs = _events(FAILED_IN_STEP_16)
    logged = [(e.time, e.int("step")) for e in evs if e.name == "step"]
    resume = next(e for e in evs if e.name == "resume")
    with pytest.raises(StepsLostError):  # the step lines alone: restored ahead of them
        steps_lost(logged, 16, resume.time)
    held = held_steps(evs, evs[0].time, evs[-1].time)
    assert sorted(held) == [15, 16]
    assert steps_lost(logged, 16, resume.time, held=held) == 0
    assert steps_lost(logged, 15, resume.time, held=held) == 1  # a rank held 16, the group restored 15: one lost
    with pytest.raises(StepsLostError):  # still never clamped: nobody completed or held 17
        steps_lost(logged, 17, resume.time, held=held)


def test_held_steps_reads_only_the_restores_lines_in_the_window_and_skips_garbage():
    from ddp_trainer.testing import held_steps

    evs = _events(FAILED_IN_STEP_16 + """
2026-12-06T16:44:19.000Z ddp_trainer rank=1 event=rank_restored local_rank=1 step=16 held=x source=resident
2026-12-06T16:44:19.100Z ddp_trainer rank=1 event=rank_restored local_rank=1 step=16 source=resident
2026-12-06T16:44:30.000Z ddp_trainer rank=1 event=rank_restored local_rank=1 step=40 held=40 source=resident
""")
    assert sorted(held_steps(evs, evs[0].time, evs[4].time)) == [15, 16]
    assert held_steps(evs, evs[4].time, evs[-2].time) == []  # garbage and a line without held: skipped
    assert steps_lost([], 0, 1.0, held=[-1]) is None  # -1: it held nothing
