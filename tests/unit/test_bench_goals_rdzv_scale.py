"""make bench-rdzv-scale's judging (tests/benchmarks/rdzv_scale.goals_missed and round_facts), on synthetic results:
each outcome passes on a good value and fails, with one message naming the figure, on a forced bad one. Times are
never judged."""

from __future__ import annotations

import pytest

from tests.benchmarks import rdzv_scale
from tests.unit.test_bench_goals import changed, one_miss

RUNS = ["c10d:replace", "ddpjob-c10d:spare"]


def _round(n: int, newcomer: bool | None = None) -> dict:
    got = {aid: {"rank": aid, "world": n, "round": 1, "t": 0.0} for aid in range(n)}
    return {**rdzv_scale.round_facts(got, list(range(n)), n, 0 if newcomer else None), "s": 1.0, "ops_total": 10 * n,
            "cas_lost": n, "store_cpu_s": 0.1, "state_bytes": 100 * n}


def good(agents=(8, 32)) -> dict:
    runs = {}
    for run in RUNS:
        runs[run] = {}
        for n in agents:
            form = {**_round(n), "rounds": [0]}
            if run.endswith(":spare"):
                form["spares_waiting"] = 1
            runs[run][str(n)] = {"agents": n, "form": form, "reform": {**_round(n, True), "after_form_round": True}}
    result = {"agents": list(agents), "runs": runs}
    result.update(rdzv_scale.summarize(runs, list(agents)))
    return result


def test_a_good_result_misses_nothing_and_has_every_key_per_n():
    r = good()
    assert rdzv_scale.goals_missed(r) == []
    assert set(r["reform_s_by_agents"]) == {"8", "32"} and set(r["reform_s_by_agents"]["32"]) == set(RUNS)
    assert r["store_ops_per_agent_by_agents"]["32"]["c10d:replace"] == 10.0


def test_round_facts_see_a_member_left_behind_and_a_duplicate_rank():
    got = {0: {"rank": 0, "world": 3, "round": 2, "t": 0}, 1: {"rank": 0, "world": 3, "round": 2, "t": 0},
           2: None, 3: {"error": "RendezvousTimeoutError: x", "t": 0}}
    facts = rdzv_scale.round_facts(got, [0, 1, 2], 3, newcomer=2)
    assert facts["left_behind"] == [2] and facts["duplicate_ranks"] == 1 and not facts["ranks_complete"]
    assert facts["newcomer_ranked"] is False and facts["errors"] == ["RendezvousTimeoutError: x"]


@pytest.mark.parametrize("path, value, figure", [
    (("runs", "c10d:replace", "32", "reform", "ranked"), 30, "reform ranked"),
    (("runs", "c10d:replace", "8", "form", "duplicate_ranks"), 1, "form duplicate_ranks"),
    (("runs", "c10d:replace", "8", "form", "ranks_complete"), False, "form ranks_complete"),
    (("runs", "ddpjob-c10d:spare", "32", "reform", "rounds"), [1, 2], "reform rounds"),
    (("runs", "ddpjob-c10d:spare", "32", "reform", "worlds"), [31], "reform worlds"),
    (("runs", "ddpjob-c10d:spare", "8", "reform", "newcomer_ranked"), False, "newcomer_ranked"),
    (("runs", "ddpjob-c10d:spare", "8", "reform", "after_form_round"), False, "after_form_round"),
    (("runs", "ddpjob-c10d:spare", "8", "form", "spares_waiting"), 0, "spares_waiting"),
    (("runs", "c10d:replace", "32", "reform"), None, "reform"),
    (("reform_s_by_agents", "8"), {"c10d:replace": 1.0}, "reform_s_by_agents[8]"),
    (("store_ops_per_agent_by_agents", "32"), {}, "store_ops_per_agent_by_agents[32]"),
])
def test_each_outcome_missed_is_named(path, value, figure):
    one_miss(rdzv_scale.goals_missed(changed(good(), path, value)), figure)


def test_a_run_not_measured_for_an_n_is_a_miss():
    r = good()
    del r["runs"]["c10d:replace"]["8"]
    missed = rdzv_scale.goals_missed(r)
    assert any("c10d:replace N=8 run" in m for m in missed), missed


def test_times_are_never_judged():
    r = changed(changed(good(), ("runs", "c10d:replace", "8", "reform", "s"), 999.0), ("reform_s_by_agents", "8",
                                                                                          "c10d:replace"), None)
    assert rdzv_scale.goals_missed(r) == []


def test_slopes_say_linear_and_quadratic():
    assert rdzv_scale._slope(100, 400, 128, 512) == 1.0
    assert rdzv_scale._slope(100, 1600, 128, 512) == 2.0
    assert rdzv_scale._slope(None, 1600, 128, 512) is None
    assert good()["slopes"]["state_bytes"]["c10d:replace"] == 1.0


def test_the_store_is_the_rdzv_pods_program_on_loopback():
    """By default the store image's entrypoint (python -m ddp_store, its port from DDPJOB_RDZV_PORT as in the pod);
    torch's own server only when asked, for the comparison."""
    command, env = rdzv_scale.store_command(12345)
    assert command[1:] == ["-m", "ddp_store", "--host", "127.0.0.1"]
    assert env["DDPJOB_RDZV_PORT"] == "12345" and env["PYTHONPATH"].split(":")[0].endswith("/store")
    command, env = rdzv_scale.store_command(12345, "torch")
    assert 'TCPStore("127.0.0.1", port' in command[-1] and "0.0.0.0" not in command[-1]
    with pytest.raises(ValueError):
        rdzv_scale.store_command(12345, "redis")
