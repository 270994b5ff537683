"""The phases of a recovery (tests/benchmarks/recovery_phases.py) from timestamped log lines of one kill."""

from __future__ import annotations

from tests.benchmarks import recovery_phases as rp

KILL = 1000.0


def _session(t: float, rank: int, started: float, init: float) -> tuple[float, str]:
    return t, (f"2026-01-01T00:00:00.000Z ddp_trainer rank={rank} event=session world_size=2 "
               f"process_started={started:.3f} agent_started={started - 3:.3f} init_called={init:.3f} pg_init_s=0.01")


SURVIVOR = [
    (990.0, "I1 api.py:553] [default] Rendezvous complete for workers. Result:"),  # the first round: before the kill
    _session(992.0, 0, 990.5, 991.5),
    (1000.2, "[rank0]: RuntimeError: Connection closed by peer [10.88.0.9]:1. This is typically caused by ..."),
    (1001.6, "E1 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 9) of binary: python3"),
    (1001.7, "I1 api.py:707] [default] Rendezvous'ing worker group"),
    (1003.0, "I1 api.py:553] [default] Rendezvous complete for workers. Result:"),
    _session(1005.0, 0, 1003.1, 1004.8),
]
REPLACEMENT = [
    (1002.0, "I1 run.py:747] Using nproc_per_node=1."),
    (1002.5, "I1 api.py:707] [default] Rendezvous'ing worker group"),
    (1003.1, "I1 api.py:553] [default] Rendezvous complete for workers. Result:"),
    (1005.6, "2026-01-01T00:00:00.000Z ddp_trainer rank=1 event=session world_size=2 process_started=1003.2 "
             "agent_started=1000.9 init_called=1005.2 pg_init_s=0.3"),
]
OPERATOR = [
    (999.0, "[2026-01-01 00:00:00,000] ddp_operator [INFO] [ns/job] created Pod job-1"),
    (1000.3, "[2026-01-01 00:00:00,000] ddp_operator [INFO] [ns/job] phase Running -> Restarting: 1/2 training pods "
             "running; pod job-1 was deleted (Deleted) on node vm; replacing it"),
    (1000.4, "[2026-01-01 00:00:00,000] ddp_operator [INFO] [ns/job] created Pod job-1"),
]


def _milestones(**overrides):
    kwargs = dict(kill=KILL, restored=1007.0, first_step=1007.2, victim="job-1", survivors={"job-0": SURVIVOR},
                  members={"job-0": SURVIVOR, "job-1": REPLACEMENT}, replacement=REPLACEMENT, operator=OPERATOR,
                  scheduled=1000.45)
    kwargs.update(overrides)
    return rp.milestones(**kwargs)


def test_every_milestone_comes_from_the_component_that_saw_it():
    m = rp.since_kill(_milestones())
    assert m == {
        "kill": 0.0, "restored": 7.0, "first_step": 7.2,
        "collective_failed": 0.2,  # the survivor's broken all-reduce
        "survivor_agent_rendezvous": 1.7,  # its worker took 1.5 s to exit
        "operator_saw": 0.3, "replacement_created": 0.4,  # never the create before the kill
        "scheduled": 0.45, "agent_started": 0.9, "agent_rendezvous": 2.5,
        "rendezvous_start": 2.5,  # the later of the survivors' and the replacement's agents
        "round_complete": 3.1,  # the last member's line, never the first round's
        "process_up": 3.2, "init_called": 5.2, "pg_ready": 5.6,  # the slowest worker: the replacement's
    }
    p = rp.phases(m)
    assert list(p) == [name for name, *_ in rp.PHASES]
    assert p["survivor_worker_exit"] == 1.5 and p["agent_up"] == 1.6 and p["rendezvous"] == 0.6
    assert p["worker_imports"] == 2.0 and p["script_setup_and_restore"] == 1.4 and p["first_step"] == 0.2


def test_with_a_spare_the_replacement_is_off_the_path():
    m = _milestones(replacement=None)
    assert m["scheduled"] is None and m["agent_started"] is None and m["agent_rendezvous"] is None
    p = rp.phases(m)
    assert p["container_started"] is None and p["agent_up"] is None
    assert p["rendezvous"] == 1.4  # from the survivors' agents entering it to the last member's round


def test_a_pod_named_like_the_victim_is_not_the_victim():
    other = [(1000.1, "[x] ddp_operator [INFO] [ns/job] pod job-10 was deleted (Deleted)")] + OPERATOR
    assert rp.since_kill(_milestones(operator=other))["operator_saw"] == 0.3


def test_the_operators_json_log_lines_count_too():
    json_lines = [(t, '{"message": "%s", "levelname": "INFO"}' % line.split("] ", 2)[-1]) for t, line in OPERATOR]
    m = rp.since_kill(_milestones(operator=json_lines))
    assert m["operator_saw"] == 0.3 and m["replacement_created"] == 0.4


def test_medians_skip_missing_values():
    assert rp.medians([{"a": 1.0, "b": None}, {"a": 3.0, "b": 2.0}, {"a": 2.0}]) == {"a": 2.0, "b": 2.0}
