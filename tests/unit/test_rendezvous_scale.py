"""What the ddpjob-c10d rules cost as the group grows (make bench-rdzv-scale measures them with real agents): the work
of a write that completes a round of N stays O(N)."""

from __future__ import annotations

import types

import pytest

from ddp_trainer import rendezvous_rules as rr


class _Counted:
    """``max`` that counts the values it looks at."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, values, default=None):
        values = list(values)
        self.seen += len(values)
        return max(values, default=default)


@pytest.mark.parametrize("n", [128, 512])
def test_remembering_the_participants_of_a_round_looks_at_each_once(monkeypatch, n):
    """rule 2's order of arrival: the write that completes a round of N numbers its participants; it used to scan the
    whole order for every one of them (N²/2 looks: 131,000 at 512, in every round-completing write)."""
    counted = _Counted()
    monkeypatch.setattr(rr, "max", counted, raising=False)
    state = types.SimpleNamespace(**{rr._ORDER: {("old", i): i + 1 for i in range(n)}})
    rr._remember(state, [("new", i) for i in range(n)] + [("old", 0)])
    order = getattr(state, rr._ORDER)
    assert [order[("new", i)] for i in range(n)] == list(range(n + 1, 2 * n + 1))  # after the old ones, in order
    assert order[("old", 0)] == 1  # the first arrival keeps its place
    assert counted.seen <= 2 * n + 2, f"{counted.seen} order entries looked at to remember {n} agents"
