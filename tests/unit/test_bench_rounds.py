"""tests/benchmarks/rounds.py: re-forms, world-size changes and steps at a size, read from trainer log lines in the
format ddp_trainer.log writes them and parsed by the harness's own parser (harness.events)."""

from __future__ import annotations

from tests.benchmarks import rounds
from tests.e2e import harness as h


def line(second: float, rank: int, event: str, **fields) -> str:
    stamp = f"2026-12-05T10:00:{int(second):02d}.{int(round(second * 1000)) % 1000:03d}Z"
    return " ".join([stamp, "ddp_trainer", f"rank={rank}", f"event={event}", *(f"{k}={v}" for k, v in fields.items())])


def log(*lines: str, pod: str = "j-0") -> list[h.Event]:
    return h.events("\n".join(lines), pod)


T0 = h.events(line(0, 0, "x"))[0].time  # 10:00:00 as epoch seconds


def steps(first: float, n: int, start: int, ranks=(0, 1)) -> list[str]:
    return [line(first + i * 0.2, r, "step", step=start + i) for i in range(n) for r in ranks]


def test_a_kill_that_re_forms_once_at_the_same_size():
    evs = log(line(1, 0, "session", world_size=2), line(1, 1, "session", world_size=2), *steps(2, 10, 1),
              # killed at 5 s: one round of 2 (rank 0's line counts once, whatever the other ranks log)
              line(9, 0, "session", world_size=2), line(9, 1, "session", world_size=2),
              line(9.5, 0, "resume", step=10, source="peer"), *steps(10, 6, 11))
    found = rounds.Reforms.of(evs, T0 + 5, before=2)
    assert found == rounds.Reforms(count=1, world_size_changes=0, sizes=(2,))
    assert rounds.nth_step_at_size(evs, T0 + 5, 2, 5) == T0 + 10.8  # the 5th step of rank 0 after the re-form


def test_a_kill_that_re_forms_smaller_first_then_back_counts_two_re_forms_and_two_changes():
    evs = log(line(1, 0, "session", world_size=2), *steps(2, 10, 1),
              line(15, 0, "session", world_size=1), *steps(16, 3, 11, ranks=(0,)),
              line(22, 0, "session", world_size=2), *steps(23, 6, 14))
    assert rounds.Reforms.of(evs, T0 + 5, before=2) == rounds.Reforms(2, 2, (1, 2))
    # steps at size 1 do not count towards 5 steps at size 2, nor do the steps before the kill
    assert rounds.nth_step_at_size(evs, T0 + 5, 2, 5) == T0 + 23.8


def test_steps_of_the_old_group_after_the_scale_call_count_for_nothing():
    evs = log(line(1, 0, "session", world_size=3), *steps(2, 20, 1))  # 2 .. 5.8 s, still at 3 after the call
    assert rounds.nth_step_at_size(evs, T0 + 3, 3, 5) is None  # no group formed after the call
    later = evs + log(line(8, 0, "session", world_size=2), *steps(9, 4, 21))
    assert rounds.nth_step_at_size(later, T0 + 3, 2, 5) is None  # 4 steps at 2 so far
    assert rounds.Reforms.of(later, T0 + 3, before=3) == rounds.Reforms(1, 1, (2,))


def test_the_lines_of_other_ranks_and_other_events_are_not_rounds():
    evs = log(line(1, 1, "session", world_size=2), line(2, 0, "resume", step=3), line(3, 0, "epoch", epoch=1))
    assert rounds.rounds(evs) == []
    # a session line without a world size is a round of unknown size: a change, never a match
    odd = log(line(4, 0, "session"))
    assert rounds.Reforms.of(odd, T0, before=2) == rounds.Reforms(1, 1, (-1,))


def test_counted_failures_adds_restarts_and_counted_attempts_only():
    assert rounds.counted_failures({}) == 0
    st = {"restarts": 1, "attempts": [{"pod": "j-1", "counted": True}, {"pod": "j-2", "counted": False}, "junk"]}
    assert rounds.counted_failures(st) == 2
    assert rounds.counted_failures({"restarts": "x", "attempts": None}) == 0
