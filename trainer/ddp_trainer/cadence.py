"""The cadence of the peer snapshot copies: K, how many steps apart they are, chosen from their cost and the budget.

A copy costs training its own time or what it adds to the step it overlaps (:class:`StepCost`); with an adaptive
interval K is the fewest steps between copies that keeps that cost within ``DDPJOB_SNAPSHOT_BUDGET_PCT`` of the
training time (:func:`choose_interval`), kept while it stays within a band around the target so that it does not
flip with every noisy estimate (:func:`settle_interval`). A failure loses at most K steps.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any


def choose_interval(copy_s: float, step_s: float, budget_pct: float, max_every: int = 50) -> int:
    """The snapshot interval K: the fewest steps between snapshots that keeps their cost within budget.

    ``copy_s`` is what one snapshot costs training (the save point's synchronous part plus the background
    copy's CPU time: on a CPU the copy takes a core and memory bandwidth from training, so the whole copy
    is counted even though it overlaps the next step), ``step_s`` the time of one training step. K = ceil(copy_s / (step_s * budget_pct / 100)), within 1..max_every. Steps lost per failure are
    at most K (the newest valid snapshot is never more than K steps behind the newest logged step).
    """
    if max_every < 1:
        raise ValueError(f"max_every={max_every} must be >= 1")
    if not (copy_s > 0.0) or not (step_s > 0.0) or not (budget_pct > 0.0):
        # nothing measured yet (or a zero budget): a zero budget means as rarely as allowed
        return max_every if budget_pct <= 0.0 and copy_s > 0.0 else 1
    k = math.ceil(copy_s / (step_s * budget_pct / 100.0) - 1e-9)
    return max(1, min(max_every, k))


# K is chosen for this share of the budget: the budget is a ceiling, not a target. The estimates of a snapshot's cost
# and of the step are medians of noisy samples, and they see only rank 0's own cost (not the memory bandwidth its copy
# takes from the other ranks on the machine): at ~100M parameters on 2 cores, a K chosen for 75 % of a 2 % budget
# measured 2.06 % (docs/recovery.md).
TARGET_SHARE_OF_BUDGET = 0.5


def settle_interval(k: int, copy_s: float, step_s: float, budget_pct: float, max_every: int = 50) -> int:
    """Keep the interval ``k`` while its snapshots cost at most the budget and at least half the target; else choose
    anew, the smallest K within the target (``TARGET_SHARE_OF_BUDGET`` of the budget).

    The band stops K flipping with every noisy estimate (K is what a user reads as the steps a failure may lose):
    a K chosen for the target costs between half the target and the target, so K only moves when the measured cost
    goes over the budget or below half the target."""
    target_pct = budget_pct * TARGET_SHARE_OF_BUDGET
    if k >= 1 and copy_s > 0.0 and step_s > 0.0 and budget_pct > 0.0 and k <= max_every:
        share_pct = 100.0 * copy_s / (k * step_s)
        if share_pct <= budget_pct and (k == 1 or share_pct >= target_pct / 2):
            return k
    return choose_interval(copy_s, step_s, target_pct, max_every)


class StepCost:
    """What one snapshot costs training: its copy's own time, or what it adds to the step it overlaps.

    On a CPU a snapshot's copy runs during the next step (whose optimizer step waits for it) and can slow that step
    by more than the copy's own CPU time (memory bandwidth, caches). ``step(dt, after)`` takes every step's time
    and what it follows (None, "snapshot" or "checkpoint"); ``copy(s)`` every finished copy's own cost. Steps that
    follow no save point are the clean steps; steps after a checkpoint count for neither. ``cost_s()`` is the larger
    of the median copy and (median step after a snapshot - median clean step): medians over recent windows, so one
    step slowed by another process moves neither the cost nor K."""

    def __init__(self, window: int = 9, clean_window: int = 49) -> None:
        self._clean: deque[float] = deque(maxlen=clean_window)
        self._after: deque[float] = deque(maxlen=window)
        self._copies: deque[float] = deque(maxlen=window)

    @property
    def clean_s(self) -> float | None:
        return statistics.median(self._clean) if self._clean else None

    def step(self, dt: float, after: str | None) -> None:
        if after is None:
            self._clean.append(dt)
        elif after == "snapshot" and self._clean:
            self._after.append(dt)

    def copy(self, seconds: float) -> None:
        self._copies.append(seconds)

    def extra_s(self) -> float | None:
        """Median slowdown of the step after a snapshot (None until both kinds of step were seen)."""
        if not self._after or not self._clean:
            return None
        return max(0.0, statistics.median(self._after) - statistics.median(self._clean))

    def cost_s(self) -> float | None:
        if not self._copies:
            return None
        return max(statistics.median(self._copies), self.extra_s() or 0.0)


class Cadence:
    """K, the interval of a pod's snapshot copies in force: fixed, or adaptive (starts at 1 until a copy has been
    measured, then settled at every copy). Times the training steps it weighs the copies against."""

    def __init__(self, every: int | None, budget_pct: float, max_every: int) -> None:
        self.adaptive = every is None
        self.every = 1 if every is None else every
        self.budget_pct = budget_pct
        self.max_every = max_every
        self._next_step = 0
        self._step_avg: float | None = None  # moving average of the time between steps
        self._copy_seen: int | None = None
        # What one snapshot costs training: its copy's own time or what it adds to the step it overlaps (medians).
        self._cost = StepCost()
        self._logged = False

    def step_timed(self, dt: float, after: str | None) -> None:
        """A step took ``dt`` seconds; ``after``: the save point it followed (None, "snapshot" or "checkpoint")."""
        self._step_avg = dt if self._step_avg is None else 0.9 * self._step_avg + 0.1 * dt
        self._cost.step(dt, after)

    @property
    def step_s(self) -> float | None:
        """A training step's time: the median clean step, else the moving average (None before the second step)."""
        return self._cost.clean_s or self._step_avg

    def due(self, step: int) -> bool:
        """Whether the save point after ``step`` steps writes a copy."""
        if not self.every:
            return False
        if self.adaptive:
            return step >= self._next_step
        return step % self.every == 0

    def settle(self, step: int, copy_s: float | None, copy_step: int | None) -> dict[str, Any] | None:
        """At the save point of a copy, the previous copy complete (``copy_s``: its cost, ``copy_step``: its step):
        K for the copies from here on. Returns what a ``snapshot_interval`` line says when K changed or was measured
        for the first time."""
        if not self.adaptive:
            return None
        k = self.every
        if copy_s is not None and copy_step != self._copy_seen:
            self._copy_seen = copy_step
            self._cost.copy(copy_s)
        # one copy's cost is noisy (page cache, other processes): StepCost takes medians of the recent ones
        cost_s = self._cost.cost_s()
        step_s = self.step_s
        if cost_s is not None and step_s is not None:
            k = settle_interval(k, cost_s, step_s, self.budget_pct, self.max_every)
        measured = cost_s is not None and self._step_avg is not None
        line = None
        if k != self.every or (measured and not self._logged):
            self._logged = True
            line = {
                "every": k,
                "previous": self.every,
                "copy_ms": round(cost_s * 1e3, 3) if cost_s is not None else None,
                "step_ms": round(step_s * 1e3, 3) if step_s is not None else None,
            }
        self.every = k
        self._next_step = step + k
        return line
