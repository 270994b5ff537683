"""Stalls (docs/diagnostics.md): stall.py's reading of the sidecars' answers, its clocks and its findings."""

import math

from ddp_operator import names, stall
from ddp_operator.stall import Diagnosis, PodDiagnosis, Worker


def worker(rank, *, env_rank=None, world=2, phase="init", frame=None, user=None, digest="d", cpu=1.0, pid=None):
    return Worker(pid=pid or 40 + (rank or 0), rank=rank, env_rank=rank if env_rank is None else env_rank,
                  local_rank=0, world_size=world, cpu_seconds=cpu, phase=phase, frame=frame, user_frame=user,
                  digest=digest)


def pod(index, *workers, stacks="ok", silent=False):
    return PodDiagnosis(uid=f"uid-{index}", name=f"j-{index}", index=index,
                        diagnosis=None if silent else Diagnosis(stacks, tuple(workers)))


INIT_FRAME = "_new_process_group_helper (torch/distributed/distributed_c10d.py:2011)"


# --- one answer ----------------------------------------------------------------------------------------------------
def test_a_valid_answer_is_read_field_by_field():
    answer = {"version": 1, "time": 1733400000.5, "stacks": "ok",
              "workers": [{"pid": 41, "rank": 0, "envRank": 0, "localRank": 0, "worldSize": 2, "cpuSeconds": 12.4,
                           "phase": "init", "frame": INIT_FRAME, "userFrame": "main (train.py:42)", "digest": "9c1f"}]}
    d, invalid = stall.valid_diagnosis(answer)
    assert invalid == ()
    assert d == Diagnosis("ok", (Worker(41, 0, 0, 0, 2, 12.4, "init", INIT_FRAME, "main (train.py:42)", "9c1f"),))


def test_hostile_answers_are_bounded_and_never_raise():
    assert stall.valid_diagnosis("nope") == (None, ())
    assert stall.valid_diagnosis(None) == (None, ())
    assert stall.valid_diagnosis([1, 2]) == (None, ())
    d, invalid = stall.valid_diagnosis({"stacks": 7, "workers": "many"})
    assert d == Diagnosis("not reported", ()) and set(invalid) == {"stacks", "workers"}
    huge = "x" * 10 ** 6
    d, invalid = stall.valid_diagnosis({"stacks": huge, "workers": [
        {"pid": 1, "rank": -1, "envRank": True, "localRank": 2 ** 80, "worldSize": 0, "cpuSeconds": math.nan,
         "phase": "dancing", "frame": huge, "userFrame": ["a"], "digest": {"a": 1}},
        {"pid": "1"}, "not a worker", {"pid": 1, "rank": 3, "phase": "running"},  # a second pid 1: whose is it?
        {"pid": 2, "rank": 1.0, "worldSize": 4.0, "cpuSeconds": 1e300, "phase": "collective", "frame": "f\x00\n"}]})
    assert len(d.stacks) == stall.MAX_TEXT
    first, second = d.workers
    assert first == Worker(1, None, None, None, None, None, "unknown", "x" * stall.MAX_TEXT, None, None)
    assert second == Worker(2, 1, None, None, 4, None, "collective", "f??", None, None)
    assert set(invalid) == {"workers[0].rank", "workers[0].envRank", "workers[0].localRank", "workers[0].worldSize",
                            "workers[0].cpuSeconds", "workers[0].phase", "workers[0].userFrame", "workers[0].digest",
                            "workers[1].pid", "workers[2]", "workers[3].pid", "workers[4].cpuSeconds"}
    many = [{"pid": i + 1, "rank": i, "phase": "running"} for i in range(10 ** 4)]
    d, invalid = stall.valid_diagnosis({"stacks": "ok", "workers": many})
    assert len(d.workers) == stall.MAX_WORKERS and "workers" in invalid
    bad = [{"pid": 0} for _ in range(10 ** 3)]
    d, invalid = stall.valid_diagnosis({"stacks": "ok", "workers": bad})
    assert d.workers == () and len(invalid) == stall.MAX_INVALID_SHOWN + 1


# --- the clocks ----------------------------------------------------------------------------------------------------
INC = ("uid-0", "uid-1")


def test_workers_still_in_their_own_code_before_init_have_not_formed_the_group():
    """Every rank loading its data before init_process_group looks like ranks training between collectives: only a
    collective seen proves the group formed. The start-up clock starts once a rank waits in init (a slow import or
    data load on a busy node is not the group failing to form) and catches the rank that never comes."""
    loading = [pod(0, worker(0, phase="running", user="load (train.py:5)")),
               pod(1, worker(1, phase="running", user="wait_for_data (train.py:12)"))]
    w = stall.watch(None, INC, loading, reporting=False, now=100.0)
    assert not w.formed and stall.formed(loading) is None and w.init_since is None
    assert not stall.startup_due(stall.watch(w, INC, loading, reporting=False, now=1000.0), 300, 10 ** 6)
    waiting = [pod(0, worker(0)), pod(1, worker(1, phase="running", user="wait_for_data (train.py:12)"))]
    w = stall.watch(w, INC, waiting, reporting=False, now=150.0)
    assert not w.formed and w.init_since == 150.0
    assert not stall.startup_due(w, 300, 449.0) and stall.startup_due(w, 300, 450.0)
    # the clock stays with the first rank seen in init, whatever the later probes see
    assert stall.watch(w, INC, loading, reporting=False, now=200.0).init_since == 150.0
    assert "global rank 1 of 2 never joined" in stall.startup_finding(waiting, 2).message
    training = [pod(0, worker(0, phase="collective")), pod(1, worker(1, phase="running"))]
    assert stall.watch(w, INC, training, reporting=False, now=160.0).formed


def test_a_reported_training_step_proves_the_group_formed():
    """A script that reports progress formed its group, whatever the samples show (a worker sleeping between steps
    is never seen in a collective): the start-up clock stops, and the poller stops asking the sidecars."""
    sleeping = [pod(0, worker(0, phase="running", user="step (train.py:9)")),
                pod(1, worker(1, phase="running", user="step (train.py:9)"))]
    w = stall.watch(None, INC, sleeping, reporting=False, now=100.0)
    assert not w.formed
    w = stall.watch(w, INC, sleeping, reporting=True, now=102.0)
    assert w.formed and not stall.startup_due(w, 300, 10 ** 6)
    assert stall.watch(None, INC, [pod(0, silent=True)], reporting=True, now=1.0).formed


def test_startup_is_due_only_while_not_formed_past_the_timeout():
    starting = [pod(0, worker(0)), pod(1, worker(1, phase="running", user="wait_for_data (train.py:12)"))]
    w = stall.watch(None, INC, starting, reporting=False, now=100.0)
    assert not w.formed
    assert not stall.startup_due(w, 300, 399.0) and stall.startup_due(w, 300, 400.0)
    assert not stall.startup_due(w, 0, 10 ** 6)  # off
    assert not stall.startup_due(None, 300, 10 ** 6)
    # a new incarnation (pods replaced) starts the clock again
    again = stall.watch(w, ("uid-0", "uid-2"), starting, reporting=False, now=500.0)
    assert again.init_since == 500.0 and not stall.startup_due(again, 300, 700.0)
    # once formed, it stays formed in this incarnation
    up = [pod(0, worker(0, phase="collective")), pod(1, worker(1, phase="collective"))]
    w = stall.watch(w, INC, up, reporting=False, now=200.0)
    assert w.formed and not stall.startup_due(w, 300, 10 ** 6)
    assert stall.watch(w, INC, starting, reporting=False, now=210.0).formed


def test_a_slow_start_that_cannot_be_told_never_forms_nor_stalls():
    # no stacks (no ptrace): phases unknown; nothing answering; no worker yet (torchrun in its rendezvous)
    for diagnoses in ([pod(0, worker(0, phase="unknown")), pod(1, worker(1, phase="unknown"))],
                      [pod(0, silent=True), pod(1, silent=True)], [pod(0), pod(1)]):
        assert stall.formed(diagnoses) is None
        assert stall.startup_finding(diagnoses, 2) is None
        w = stall.watch(None, INC, diagnoses, reporting=False, now=0.0)
        assert not w.formed and not stall.silent_hang_due(w, 10, 10 ** 6)


def test_the_silent_hang_clock_restarts_on_a_new_stack_or_cpu_and_never_runs_for_reporting_jobs():
    still = lambda cpu, digest="d": [pod(0, worker(0, phase="collective", cpu=cpu, digest=digest)),  # noqa: E731
                                     pod(1, worker(1, phase="running", cpu=cpu, digest=digest))]
    w = stall.watch(None, INC, still(10.0), reporting=False, now=0.0)
    assert w.formed and w.since == 0.0
    w = stall.watch(w, INC, still(10.5), reporting=False, now=10.0)  # +1 CPU s in 10 s: a tenth of a core -> still
    assert w.since == 0.0 and not stall.silent_hang_due(w, 30, 29.0) and stall.silent_hang_due(w, 30, 30.0)
    moved = stall.watch(w, INC, still(20.0), reporting=False, now=20.0)  # 10 CPU s in 20 s: working
    assert moved.since == 20.0 and not stall.silent_hang_due(moved, 30, 30.0)
    other = stall.watch(w, INC, still(10.5, digest="e"), reporting=False, now=20.0)  # another stack
    assert other.since == 20.0
    nobody = stall.watch(w, INC, [pod(0, silent=True), pod(1, silent=True)], reporting=False, now=25.0)
    assert nobody.since == 0.0 and nobody.fingerprint == w.fingerprint  # a failed probe moves nothing
    assert not stall.silent_hang_due(w, 0, 10 ** 6)  # off
    reporting = stall.watch(w, INC, still(10.5), reporting=True, now=26.0)
    assert not stall.silent_hang_due(reporting, 30, 10 ** 6)  # the progress rule's job
    assert stall.watch(reporting, INC, still(10.5), reporting=False, now=27.0).reporting  # sticky


def test_the_expected_world_size_is_nodes_times_nproc():
    assert stall.expected_world_size(2, 4) == 8


# --- start-up findings ---------------------------------------------------------------------------------------------
def test_a_rank_that_never_joined_and_a_rank_claimed_twice_in_one_line():
    # pod j-1's worker (RANK=1) passes rank=LOCAL_RANK: it claims rank 0 too; global rank 1 never joins
    diagnoses = [pod(0, worker(0, frame=INIT_FRAME)), pod(1, worker(0, env_rank=1, frame=INIT_FRAME))]
    f = stall.startup_finding(diagnoses, 2)
    assert f.reason == names.REASON_PG_NEVER_FORMED
    assert f.message == ("global rank 1 of 2 never joined (pod j-1: its worker with RANK=1 claims rank 0); "
                         "rank 0 claimed twice (pods j-0, j-1)")
    assert f.stuck == ("uid-0", "uid-1")
    assert f.ranks == ({"rank": 0, "pod": "j-0", "phase": "init", "frame": INIT_FRAME},
                       {"rank": 0, "pod": "j-1", "phase": "init", "frame": INIT_FRAME})


def test_a_rank_that_waits_before_init_is_named_with_its_frame():
    diagnoses = [pod(0, worker(0, frame=INIT_FRAME)),
                 pod(1, worker(1, phase="running", frame="read (socket.py:7)", user="wait_for_data (train.py:12)"))]
    f = stall.startup_finding(diagnoses, 2)
    assert f.message == "global rank 1 of 2 never joined (pod j-1: waits in wait_for_data (train.py:12))"
    assert "wait_for_data (train.py:12)" in [r.get("userFrame") for r in f.ranks]


def test_a_claimed_world_size_that_is_not_the_jobs_is_said():
    diagnoses = [pod(0, worker(0, world=4)), pod(1, worker(1, world=4))]
    f = stall.startup_finding(diagnoses, 2)
    assert f.message == "world size 4 claimed (pods j-0, j-1), the job's is 2"
    # without the job's world size, the one the workers claim: ranks 2 and 3 are missing
    f = stall.startup_finding(diagnoses, None)
    assert f.message.startswith("global rank 2 of 4 never joined (no worker has it); global rank 3 of 4 never")


def test_missing_ranks_on_a_silent_or_idle_pod_and_many_missing_ranks_stay_one_short_line():
    f = stall.startup_finding([pod(0, worker(0)), pod(1, silent=True)], 2)
    assert f.message == "global rank 1 of 2 never joined (the diagnostics sidecar of pod j-1 did not answer)"
    f = stall.startup_finding([pod(0, worker(0)), pod(1)], 2)
    assert f.message == "global rank 1 of 2 never joined (no worker runs in pod j-1)"
    f = stall.startup_finding([pod(0, worker(0, world=4096))], 4096)
    assert f.message.endswith("global ranks 4, 5, 6, 7, 8, 9, 10, 11 and 4084 more of 4096 never joined either")
    assert len(f.message) <= stall.MAX_MESSAGE


def test_every_rank_joined_but_init_never_completed_points_at_the_network():
    diagnoses = [pod(0, worker(0, frame=INIT_FRAME)), pod(1, worker(1, frame=INIT_FRAME))]
    f = stall.startup_finding(diagnoses, 2)
    assert f.message.startswith(f"every rank of 2 joined but init_process_group did not complete (waits in "
                                f"{INIT_FRAME})")


def test_the_signature_is_the_same_for_the_same_fault_after_a_restart_and_differs_otherwise():
    before = [pod(0, worker(0, frame="a (x:1)", digest="1")), pod(1, worker(0, env_rank=1, digest="2"))]
    after = [PodDiagnosis("new-0", "j-0", 0, Diagnosis("ok", (worker(0, frame="b (x:2)", pid=90, digest="3"),))),
             PodDiagnosis("new-1", "j-1", 1, Diagnosis("ok", (worker(0, env_rank=1, pid=91),)))]
    assert stall.startup_finding(before, 2).signature == stall.startup_finding(after, 2).signature
    other = [pod(0, worker(0)), pod(1, worker(1, phase="running"))]
    assert stall.startup_finding(other, 2).signature != stall.startup_finding(before, 2).signature


def test_no_startup_finding_once_formed():
    assert stall.startup_finding([pod(0, worker(0, phase="collective")), pod(1, worker(1, phase="running"))],
                                 2) is None


# --- hang findings -------------------------------------------------------------------------------------------------
ALLREDUCE = "allreduce (torch/distributed/distributed_c10d.py:2501)"


def test_the_hung_rank_is_the_one_outside_the_collective():
    diagnoses = [pod(0, worker(0, phase="collective", frame=ALLREDUCE)),
                 pod(1, worker(1, phase="running", frame="sleep (time.py:1)", user="load (train.py:30)")),
                 pod(2, worker(2, phase="collective", frame=ALLREDUCE))]
    f = stall.hang_finding(diagnoses)
    assert f.reason == names.REASON_HANG and f.stuck == ("uid-1",)
    assert f.message == ("global rank 1 (pod j-1) stands still in load (train.py:30); "
                         f"the other ranks wait in {ALLREDUCE}")
    assert [r["rank"] for r in f.ranks] == [0, 1, 2]


def test_a_silent_sidecar_is_stuck_only_if_another_answered_else_the_highest_index():
    f = stall.hang_finding([pod(0, worker(0, phase="collective", frame=ALLREDUCE)), pod(1, silent=True)])
    assert f.stuck == ("uid-1",) and "pod j-1: its diagnostics sidecar did not answer" in f.message
    assert stall.hang_finding([pod(0, silent=True), pod(1, silent=True)]) is None
    assert stall.hang_finding([]) is None
    every = stall.hang_finding([pod(0, worker(0, phase="collective")), pod(1, worker(1, phase="collective"))])
    assert every.stuck == ("uid-1",) and "highest index" in every.message
    both_out = stall.hang_finding([pod(0, worker(0, phase="running")), pod(1, worker(1, phase="running"))])
    assert both_out.stuck == ("uid-1",)
    # a spare (its torchrun waits in the rendezvous: no worker) is never the stuck pod
    spare = stall.hang_finding([pod(0, worker(0, phase="collective")), pod(1, worker(1, phase="collective")), pod(2)])
    assert spare.stuck == ("uid-1",)


def test_formed_finding_clears_the_stall():
    f = stall.formed_finding()
    assert f.reason == names.REASON_PG_FORMED and f.stuck == ()


def test_describe_is_bounded():
    big = [pod(i, *(worker(i * 64 + k, pid=k + 1, frame="f" * 600) for k in range(64))) for i in range(4)]
    entries = stall.describe(big)
    assert len(entries) == stall.MAX_RANKS and [e["rank"] for e in entries] == list(range(64))
