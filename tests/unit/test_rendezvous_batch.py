"""ddpjob-c10d rule 10 (ddp_trainer.rendezvous_batch): an agent announces itself in one small store operation, and
whoever writes the shared state folds every announced agent in, as that agent's own writes would have placed it.

Before it, every agent of a re-form wrote the whole state itself, one compare-and-set after another on one key: at
256 agents 40 of them lost per agent and the re-form did not complete within two minutes (docs/scale.md). The
announcement key is written by every agent of the job, so what it holds is judged line by line: anything that is not
an announcement is skipped, never raised."""

from __future__ import annotations

import random
import types
from datetime import datetime, timedelta, timezone

import pytest

from ddp_trainer import rendezvous_batch as rb
from ddp_trainer import rendezvous_rules as rr
from ddp_trainer import rendezvous_take_over as rt

NOW = 1_800_000_000.0
Node = types.SimpleNamespace  # what announcement() reads of torch's _NodeDesc


# --- the announcement key ------------------------------------------------------------------------------------------

def test_an_announcement_reads_back_as_written_whatever_its_address_and_pod():
    lines = [rb.announcement(Node(addr="agent 1;x\n%", pid=1, local_id=2 ** 31), "pod 3", 7, NOW),
             rb.announcement(Node(addr="10.0.0.2", pid=0, local_id=0), None, -1, NOW + 0.5),
             rb.announcement(Node(addr="h", pid=5, local_id=6), "!", -1, NOW)]
    got = rb.parse("".join(lines).encode())
    assert got == [rb.Announcement("agent 1;x\n%", 1, 2 ** 31, "pod 3", 7, NOW),
                   rb.Announcement("10.0.0.2", 0, 0, None, -1, NOW + 0.5),
                   rb.Announcement("h", 5, 6, "!", -1, NOW)]  # a pod named "!" is not "no pod"


GARBAGE = [
    "", "\n\n", "x", "a 1 2 ! -1", "a 1 2 ! -1 1.0 extra", "a one 2 ! -1 1.0", "a 1 2 ! -1 nan", "a 1 2 ! -1 inf",
    "a -1 2 ! -1 1.0", "a 1 -2 ! -1 1.0", "a 1 2 ! -2 1.0", f"a {2 ** 64} 2 ! -1 1.0", " 1 2 ! -1 1.0",
    "a 1 2  -1 1.0", "%ff%fe 1 2 ! -1 1.0", "a 1 2 %ZZ -1 1.0", "a 1 2 ! 0x1 1.0", "a\t1 2 ! -1 1.0",
]


@pytest.mark.parametrize("line", GARBAGE)
def test_a_line_that_is_not_an_announcement_is_skipped(line):
    good = rb.announcement(Node(addr="b", pid=1, local_id=1), "0", -1, NOW)
    assert [a.addr for a in rb.parse(line + "\n" + good + line)] == ["b"]


def test_any_bytes_at_all_are_read_without_an_exception():
    rng = random.Random(28)
    good = rb.announcement(Node(addr="b", pid=1, local_id=1), "0", -1, NOW).encode()
    for _ in range(500):
        noise = bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
        spaced = b" ".join(noise[i:i + 3] for i in range(0, len(noise), 3))
        for raw in (noise, spaced, noise + b"\n" + good, spaced.replace(b"\xff", b"\n")):
            assert isinstance(rb.parse(raw), list)
    for value in (None, 17, object(), [], b"", "\x00" * 10):
        assert rb.parse(value) == []
        assert rb.heard_in(value, ["a"]) == set()


def test_lines_older_than_asked_are_skipped_before_they_are_decoded():
    old, new = (rb.announcement(Node(addr=a, pid=1, local_id=1), None, -1, t) for a, t in (("a", NOW - 5), ("b", NOW)))
    assert [a.addr for a in rb.parse(old + new + "%ZZ 1 1 ! -1 1.0\n", newer_than=NOW - 3)] == ["b"]


def test_a_flooded_key_costs_a_writer_only_its_newest_lines():
    lines = [rb.announcement(Node(addr=f"a{i}", pid=1, local_id=1), None, -1, NOW) for i in range(1000)]
    got = rb.parse("".join(lines), limit=10)
    assert [a.addr for a in got] == [f"a{i}" for i in range(990, 1000)]


# --- folding: torch's state and the executor's own bookkeeping ------------------------------------------------------

@pytest.fixture(scope="module")
def dr():
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    return dynamic_rendezvous


def _settings(dr, n, keep_alive=1, attempts=3):
    return dr.RendezvousSettings("fold", n, n, dr.RendezvousTimeout(), timedelta(seconds=keep_alive), attempts)


def _executor(dr, settings, state):
    """This backend's executor (rules 1-9, ddpjob-c10d) on a state of its own, no store: its completion is the one a
    fold calls."""
    from ddp_trainer import rendezvous

    ex = rendezvous._executor_class()(dr._NodeDesc("writer", 1, 1), types.SimpleNamespace(sync=lambda: None), settings)
    ex._state = state
    return ex


def _complete_round(dr, n, spares=()):
    """Round 3, complete, n participants with ranks (pods 0..n-1), spares redundant, as this backend leaves it."""
    settings = _settings(dr, n)
    state = dr._RendezvousState()
    state.round = 3
    nodes = [dr._NodeDesc(f"agent-{i}", 1, i) for i in range(n)]
    at = datetime.fromtimestamp(NOW - 1, timezone.utc)
    for i, node in enumerate(nodes):
        state.participants[node] = 0
        state.last_heartbeats[node] = at
    setattr(state, rr._POD, {node: str(i) for i, node in enumerate(nodes)})
    ex = _executor(dr, settings, state)
    ex._mark_rendezvous_complete()
    for s in spares:
        state.redundancy_list.add(s)
        state.last_heartbeats[s] = at
    rr._remember(state, spares)  # as its own write into the redundancy list does (rule 2's order)
    return settings, state, nodes, ex


def _leave(node, round_, t=NOW, pod=None):
    return rb.Announcement(node.addr, node.pid, node.local_id, pod, round_, t)


def _fold(settings, state, ex, announced, now=NOW):
    return rb.fold(state, settings, announced, now, spares=True, complete=ex._mark_rendezvous_complete)


def test_one_write_re_forms_the_group_with_the_lost_agents_replacement(dr):
    n = 16
    settings, state, nodes, ex = _complete_round(dr, n)
    lost, newcomer = nodes[1], dr._NodeDesc("agent-new", 1, 99)
    announced = [_leave(node, 3, pod=str(i)) for i, node in enumerate(nodes) if node is not lost]
    announced.insert(5, rb.Announcement(newcomer.addr, 1, 99, "1", -1, NOW))  # the new agent of pod 1 (rule 4)
    placed = _fold(settings, state, ex, announced)
    assert len(placed) == n and newcomer in placed
    assert state.round == 4 and state.complete
    assert set(state.participants) == (set(nodes) - {lost}) | {newcomer}
    assert sorted(state.participants.values()) == list(range(n)), "every agent ranked once"
    assert not state.wait_list and not state.redundancy_list
    assert rt.taken_over(state, lost) and lost not in state.last_heartbeats
    assert state.last_heartbeats[newcomer] == datetime.fromtimestamp(NOW, timezone.utc)  # its announcement's time
    assert newcomer in getattr(state, rr._BEATS), "its heartbeat key is judged (rule 7)"
    assert getattr(state, rr._READ) == set(), "nobody has heard of the new round yet (rule 5)"


def test_survivors_wait_for_a_silent_member_then_a_spare_takes_its_place_first(dr):
    n = 12
    spare = dr._NodeDesc("spare", 1, 77)
    settings, state, nodes, ex = _complete_round(dr, n, spares=[spare])
    lost = nodes[4]
    _fold(settings, state, ex, [_leave(node, 3) for node in nodes if node is not lost])
    assert state.complete and state.round == 3 and set(state.participants) == {lost}, "the round waits for it"
    assert state.wait_list == set(nodes) - {lost} and state.redundancy_list == {spare}
    # its heartbeats expired (torch's sanitizer), then any write admits by rule 2: survivors, then the spare
    del state.participants[lost], state.last_heartbeats[lost]
    dr._remove_participant_epilogue(state, settings)
    latecomer = dr._NodeDesc("late", 1, 5)
    placed = _fold(settings, state, ex, [rb.Announcement("late", 1, 5, None, -1, NOW)])
    assert placed == [latecomer] and state.complete and state.round == 4
    assert set(state.participants) == (set(nodes) - {lost}) | {spare}
    assert state.redundancy_list == {latecomer}, "the newest agent is the one left out, as a spare (rules 1, 2)"


def test_a_full_round_puts_a_newcomer_in_the_redundancy_list(dr):
    settings, state, nodes, ex = _complete_round(dr, 10)
    placed = _fold(settings, state, ex, [rb.Announcement("extra", 1, 1, None, -1, NOW)])
    assert len(placed) == 1 and state.redundancy_list == set(placed) and set(state.participants) == set(nodes)
    assert not state.wait_list


def test_what_the_state_already_says_or_must_not_say_is_left_alone(dr):
    settings, state, nodes, ex = _complete_round(dr, 10)
    gone = dr._NodeDesc("agent-gone", 1, 1)
    setattr(state, rr._GONE, [gone])
    before = (dict(state.participants), set(state.wait_list), set(state.redundancy_list), state.round)
    expiry = settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt
    announced = [
        _leave(nodes[0], 2),  # leaves an older round: it is in this one already
        _leave(nodes[1], 3, t=NOW - expiry - 1),  # older than the keep-alive expiry: it may be dead
        _leave(nodes[2], 3, t=NOW + expiry + 1),  # from the future: a heartbeat that would never expire
        rb.Announcement("agent-gone", 1, 1, None, -1, NOW),  # taken out by a newer agent of its pod (rule 4)
        rb.Announcement("agent-3", 1, 3, None, -1, NOW),  # a participant that leaves nothing: placed already
    ]
    assert _fold(settings, state, ex, announced) == []
    assert before == (dict(state.participants), set(state.wait_list), set(state.redundancy_list), state.round)
    state.closed = True
    assert _fold(settings, state, ex, [_leave(nodes[5], 3)]) == [] and nodes[5] in state.participants


def test_a_start_forms_in_the_writes_that_fold_the_announced_agents(dr):
    n = 40
    settings = _settings(dr, n)
    state = dr._RendezvousState()
    ex = _executor(dr, settings, state)
    announced = [rb.Announcement(f"agent-{i}", 1, i, str(i), -1, NOW) for i in range(n + 1)]  # one more: a spare
    first = _fold(settings, state, ex, announced[:25])
    assert len(first) == 25 and len(state.participants) == 25 and not state.complete
    assert state.deadline is None, "the last call starts at min_nodes"
    second = _fold(settings, state, ex, announced)  # the same key, read again by the next writer
    assert len(second) == n + 1 - 25 and state.complete and len(state.participants) == n
    assert sorted(state.participants.values()) == list(range(n))
    assert len(state.redundancy_list) == 1 and not state.wait_list, "the one left over waits as a spare (rule 1)"
    assert len(getattr(state, rr._POD)) == n + 1, "every agent's pod is recorded for rule 4"


def test_one_announcement_per_agent_the_latest(dr):
    settings, state, nodes, ex = _complete_round(dr, 10)
    twice = [rb.Announcement("new", 1, 1, None, -1, NOW - 2), rb.Announcement("new", 1, 1, None, -1, NOW - 1)]
    assert len(_fold(settings, state, ex, twice)) == 1
    assert state.last_heartbeats[dr._NodeDesc("new", 1, 1)] == datetime.fromtimestamp(NOW - 1, timezone.utc)


def test_the_heard_key_names_participants_and_nothing_else(dr):
    a, b = dr._NodeDesc("a", 1, 1), dr._NodeDesc("b", 1, 2)
    assert rb.heard_in(b"a_1_1\n\xff\xfegarbage\na_1_1\nc_1_3\n", [a, b]) == {a}



@pytest.mark.parametrize("with_dead", [False, True])
def test_a_stall_before_torchs_sanitizer_reads_its_clock_drops_no_agent_judged_alive(dr, monkeypatch, with_dead):
    """Rules 5 and 7 judge heartbeats by one clock reading. torch's sanitizer reads its own afterwards; on a starved
    process (512 agents on 2 cores) seconds passed in between, and it dropped hundreds of agents judged alive."""
    from ddp_trainer import rendezvous

    settings = _settings(dr, 10)
    holder = dr._BackendRendezvousStateHolder(None, settings)
    now = datetime.now(timezone.utc)
    alive, dead = dr._NodeDesc("alive", 1, 1), dr._NodeDesc("dead", 1, 2)
    holder._state.participants[alive] = 0
    holder._state.last_heartbeats[alive] = now - timedelta(seconds=2.5)  # expiry: 3 s
    if with_dead:
        holder._state.wait_list.add(dead)
        holder._state.last_heartbeats[dead] = now - timedelta(seconds=10)
    assert rendezvous._guard_expiry(holder, dr._NodeDesc("me", 1, 3))

    class Stalled(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) + timedelta(seconds=2)  # torch's reading, 2 s after ours

    monkeypatch.setattr(dr, "datetime", Stalled)
    holder._sanitize()
    assert alive in holder._state.participants and alive in holder._state.last_heartbeats
    assert dead not in holder._state.wait_list and dead not in holder._state.last_heartbeats
