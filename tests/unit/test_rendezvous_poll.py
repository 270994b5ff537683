"""ddp_trainer.rendezvous_rules.poll_interval: how often a waiting agent reads the rendezvous state from the store.

Every waiting agent reads the whole state (O(N) bytes) each interval, so a fixed interval costs O(N²) bytes a
second; the interval grows with N past 8 nodes (capped at 2 s) and stays at the base (0.1 s) below, so small jobs
keep recovering within a tenth of a second of a round's completion."""

import pytest

from ddp_trainer.rendezvous_rules import POLL_BASE_S, POLL_MAX_S, poll_interval


@pytest.mark.parametrize("nodes, seconds", [(1, 0.1), (2, 0.1), (8, 0.1), (16, 0.2), (64, 0.8), (160, 2.0),
                                            (1024, 2.0)])
def test_the_interval_grows_with_the_nodes_past_eight_up_to_two_seconds(nodes, seconds):
    assert poll_interval(nodes) == pytest.approx(seconds)
    assert (POLL_BASE_S, POLL_MAX_S) == (0.1, 2.0)


def test_jitter_only_shortens_the_interval_by_at_most_a_fifth():
    """Agents that started together do not read in lockstep; a small job's interval never exceeds the join loop's
    0.1 s turn (ddp_trainer.launch), so every turn reads."""
    for nodes in (2, 64, 1024):
        full = poll_interval(nodes)
        values = [poll_interval(nodes, jitter=j / 10) for j in range(10)]
        assert max(values) == full and min(values) >= 0.8 * full - 1e-12
        assert len(set(values)) == 10


def test_the_store_reads_a_second_stay_bounded_as_the_job_grows():
    """N agents each reading every poll_interval(N): at most 80 reads a second from 8 to 160 nodes, N/2 past it
    (a fixed 0.1 s: 10·N)."""
    for nodes in (8, 16, 64, 160):
        assert nodes / poll_interval(nodes) == pytest.approx(80)
    assert 1024 / poll_interval(1024) == pytest.approx(512)


def test_the_base_follows_the_configured_poll_and_a_larger_base_is_never_capped_below_itself():
    assert poll_interval(64, base=0.05) == pytest.approx(0.4)
    assert poll_interval(2, base=0.0) == 0.0
    assert poll_interval(2, base=5.0) == pytest.approx(5.0)
    assert poll_interval(0) == pytest.approx(0.1)  # no size known yet
