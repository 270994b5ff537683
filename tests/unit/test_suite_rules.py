"""The suite's own rules (tests/support/suite.py; tests/conftest.py's hooks apply them): under CI=true a skip fails
unless it is for a GPU; each tier has its own time limit."""

from types import SimpleNamespace

from tests.support.suite import forbid_skip_in_ci


def _skipped(reason: str) -> SimpleNamespace:
    return SimpleNamespace(skipped=True, outcome="skipped", longrepr=("tests/x.py", 3, f"Skipped: {reason}"))


def test_a_skip_in_ci_fails_unless_it_is_for_a_gpu():
    rep = _skipped("the cluster under test is not available: connection refused")
    forbid_skip_in_ci(rep, in_ci=True)
    assert rep.outcome == "failed" and "connection refused" in rep.longrepr

    gpu = _skipped("needs a CUDA device")
    forbid_skip_in_ci(gpu, in_ci=True)
    assert gpu.outcome == "skipped"


def test_outside_ci_a_skip_stays_a_skip():
    rep = _skipped("shellcheck is not installed")
    forbid_skip_in_ci(rep, in_ci=False)
    assert rep.outcome == "skipped"


def test_each_tier_has_its_own_time_limit():
    from tests.support.suite import REPO, tier_timeout
    assert tier_timeout(REPO / "tests/unit/test_spec.py") == 60
    assert tier_timeout(REPO / "tests/e2e/test_e2e_training.py") == 600
    assert tier_timeout(REPO / "tests/integration/test_operator.py") == 300


def test_session_teardowns_run_once_last_in_first_out():
    from tests.support.suite import Teardowns
    ran = []
    t = Teardowns()
    operator, kueue = t.push(lambda: ran.append("operator")), t.push(lambda: ran.append("kueue"))
    t.run_all()  # before a cluster restart
    t.run(kueue)  # the fixtures' own teardowns at the session's end: nothing left to do
    t.run(operator)
    assert ran == ["kueue", "operator"]
