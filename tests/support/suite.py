"""The suite's own rules, applied by tests/conftest.py's hooks: each tier's time limit, and under CI=true no skip
but the allowed ones. Pure functions, so tests/unit/test_suite_rules.py checks them without a session."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() == "true"

# Each tier's time limit per test (pytest-timeout; it counts the test's fixtures too, so the first test of a tier pays
# for its session fixtures): a hung test fails in minutes, not after half an hour. A test that needs more says so with
# its own @pytest.mark.timeout. docs/testing.md has what each tier takes. The metrics tier's first test may build the
# pinned Prometheus (a few minutes cold), as the bootstrap tier builds etcd.
TIER_TIMEOUTS = {"unit": 60, "bootstrap": 900, "trainer": 300, "gpu": 600, "cluster": 600, "integration": 300,
                 "chart": 600, "e2e": 600, "benchmarks": 1500, "metrics": 900}


# The namespaces of the tests that run operators of their own (the integration tier, its leader election test, the
# kwok simulation of tests/benchmarks/scale_sim.py); the e2e tests' shared operator excludes them (chart value
# watch.exclude), so those tests run beside the e2e tier in `make test`.
INTEGRATION_NS_PREFIX = "ddp-it-"
LEADER_ELECTION_NS_PREFIX = "ddp-le-"  # tests/integration/test_leader_election.py: its replicas alone
SIM_NS_PREFIX = "ddp-sim-"
RELEASE_NS_PREFIX = "ddp-rel-"  # tests/chart/test_release.py: a released operator installed from a registry
OWN_OPERATOR_NS_PREFIXES = (INTEGRATION_NS_PREFIX, LEADER_ELECTION_NS_PREFIX, SIM_NS_PREFIX, RELEASE_NS_PREFIX)


def tier_timeout(path: Path) -> int:
    """The time limit of a test in `path` (a file under tests/), by its tier (directory)."""
    parts = path.resolve().relative_to(REPO / "tests").parts
    return TIER_TIMEOUTS.get(parts[0], 600) if len(parts) > 1 else 600


# The only reasons a test may skip under CI=true: the CI machine has no GPU. Any other skip there would hide a
# regression behind a green run, so it fails the test instead.
CI_ALLOWED_SKIPS = ("needs a CUDA device",)


def skip_reason(rep) -> str:
    """The reason text of a skipped report (pytest keeps it as (file, line, "Skipped: reason"))."""
    longrepr = rep.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def forbid_skip_in_ci(rep, in_ci: bool = IN_CI) -> None:
    """Under CI, turn a skip whose reason is not allowed into a failure that says why."""
    if not (in_ci and rep.skipped) or hasattr(rep, "wasxfail"):
        return
    reason = skip_reason(rep)
    if not reason.startswith(CI_ALLOWED_SKIPS):
        rep.outcome = "failed"
        rep.longrepr = (f"skipped under CI=true: {reason!r}; only skips starting with {CI_ALLOWED_SKIPS} are "
                        "allowed in CI (tests/support/suite.py CI_ALLOWED_SKIPS)")


class Teardowns:
    """Teardowns of session-wide things (the shared operator, Kueue), each run once: when the session ends, or
    earlier, all of them, before a test that restarts the cluster (after it they would meet a cluster that lost
    them). Run last-in, first-out, like pytest's own."""

    def __init__(self) -> None:
        self._fns: list = []

    def push(self, fn):
        self._fns.append(fn)
        return fn

    def run(self, fn) -> None:
        """`fn` now, unless it already ran."""
        if fn in self._fns:
            self._fns.remove(fn)
            fn()

    def run_all(self) -> None:
        while self._fns:
            self._fns.pop()()
