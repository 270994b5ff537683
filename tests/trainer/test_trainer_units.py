"""Fast, single-process tests of the trainer's building blocks (no torchrun)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_trainer import rng, storage
from ddp_trainer.checkpoint import CheckpointStore, validate_dir
from ddp_trainer.env import ConfigError
from ddp_trainer.log import format_line, parse_line
from ddp_trainer.progress import Progress, write_termination_log
from ddp_trainer.sampler import ResumableDistributedSampler
from ddp_trainer.session import process_start_time, read_torchrun_env
from ddp_trainer.snapshot import PeerSnapshots
from ddp_trainer.state import Components, Position, flatten, unflatten


def _state(step: int) -> dict:
    torch.manual_seed(step)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return Components(model, opt, extra={"best": 0.5 + step}).state_dict(Position(step=step, epoch=1, batch=2))


def _equal(a, b) -> bool:
    sa, ta = flatten(a)
    sb, tb = flatten(b)
    return len(ta) == len(tb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb))


def test_storage_detects_truncation_and_bitflips(tmp_path):
    path = str(tmp_path / "f.pt")
    storage.save_file(path, {"x": torch.arange(10)})
    assert torch.equal(storage.load_file(path)["x"], torch.arange(10))
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-5])
    with pytest.raises(storage.CorruptFileError, match="checksum"):
        storage.load_file(path)
    flipped = bytearray(data)
    flipped[-3] ^= 0x01
    open(path, "wb").write(bytes(flipped))
    with pytest.raises(storage.CorruptFileError):
        storage.load_file(path)
    open(path, "wb").write(b"garbage")
    with pytest.raises(storage.CorruptFileError, match="header"):
        storage.load_file(path)


def test_checkpoint_falls_back_past_corrupt_newest(tmp_path):
    warnings = []
    store = CheckpointStore(str(tmp_path / "ck"), keep=3, warn=lambda event, **kw: warnings.append((event, kw)))
    for step in (10, 20, 30, 40):
        store.save_async(step, _state(step))
    store.flush()
    assert store.steps() == [40, 30, 20]  # pruned to keep=3
    with open(store.path(40), "r+b") as f:
        f.seek(100)
        f.write(b"\x00" * 16)
    step, state = store.load_latest()
    assert step == 30 and _equal(state, _state(30))
    assert warnings and warnings[0][0] == "checkpoint_corrupt" and warnings[0][1]["step"] == 40
    assert store.load_latest(newer_than=30) is None
    store.close()


def test_checkpoint_dir_errors(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        validate_dir(str(a_file))
    with pytest.raises(ConfigError, match="cannot be created"):
        validate_dir(str(a_file / "sub"))


def test_snapshot_roundtrip_and_torn_write(tmp_path):
    snaps = PeerSnapshots(str(tmp_path / "shm"), "job/a")
    s1, s2 = _state(1), _state(2)
    snaps.write(1, s1)
    snaps.write(2, s2)
    latest = snaps.read_latest()
    assert latest is not None and latest.step == 2 and _equal(latest.state, s2)
    assert latest.state["extra"] == {"best": 2.5}
    # A writer killed mid-copy leaves the trailer stale: that slot is ignored, the other one is used.
    with open(latest.path, "r+b") as f:
        header = f.read(64)
        data_off, data_len = struct.unpack_from("<QQ", header, 32)
        f.seek(data_off + data_len)
        f.write(struct.pack("<Q", 12345))
    older = PeerSnapshots(str(tmp_path / "shm"), "job/a").read_latest()
    assert older is not None and older.step == 1 and _equal(older.state, s1)
    # Another run's snapshot is never used.
    assert PeerSnapshots(str(tmp_path / "shm"), "job/b").read_latest() is None
    snaps.close(remove=True)
    assert not os.path.exists(tmp_path / "shm")


def test_snapshot_layout_change_between_writes(tmp_path):
    snaps = PeerSnapshots(str(tmp_path / "shm"), "k")
    snaps.write(0, {"a": torch.zeros(3)})
    snaps.write(1, {"a": torch.ones(3), "b": torch.arange(1000, dtype=torch.int64)})
    snaps.write(2, {"a": torch.full((3,), 2.0), "b": torch.arange(1000, dtype=torch.int64), "s": torch.tensor(5)})
    got = snaps.read_latest()
    assert got.step == 2 and torch.equal(got.state["s"], torch.tensor(5)) and got.state["b"][-1] == 999


def test_resumable_sampler_yields_the_rest_of_the_epoch():
    data = list(range(50))
    full = ResumableDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    full.set_epoch(4)
    order = list(full)
    part = ResumableDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    part.set_epoch(4)
    part.set_start(10)
    assert list(part) == order[10:] and len(part) == len(order) - 10
    part.set_epoch(5)
    assert len(list(part)) == len(order)


def test_step_seeds_are_pure():
    rng.seed_step(7, 3, 1)
    a = torch.rand(4)
    rng.seed_step(7, 4, 1)
    rng.seed_step(7, 3, 1)
    assert torch.equal(a, torch.rand(4))
    assert rng.step_seed(7, 3, 0) != rng.step_seed(7, 3, 1) != rng.step_seed(7, 4, 1)


def test_torchrun_env_errors():
    with pytest.raises(ConfigError, match="must be started by torchrun"):
        read_torchrun_env({})
    env = {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match="RANK=2 must be < WORLD_SIZE=2"):
        read_torchrun_env(env)
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not an integer"):
        read_torchrun_env({**env, "WORLD_SIZE": "two"})
    assert read_torchrun_env({**env, "RANK": "1"})["rank"] == 1


def test_log_lines_parse_back():
    line = format_line(0, "step", {"step": 12, "loss": 0.25, "msg": 'a "b" c'})
    fields = parse_line(line)
    assert fields == {"rank": "0", "event": "step", "step": "12", "loss": "0.25", "msg": 'a "b" c'}


def test_termination_log_is_bounded(tmp_path):
    progress = Progress(world_size=2)
    progress.update(step=3, metrics={"testAccuracy": 0.97})
    path = tmp_path / "termination-log"
    assert write_termination_log(str(path), {**progress.snapshot(), "final": True})
    import json

    record = json.loads(path.read_text())
    assert record["final"] is True and record["metrics"] == {"testAccuracy": 0.97} and record["worldSize"] == 2
    assert write_termination_log(str(path), {"metrics": {"x" * 5000: 1}, "step": 1})
    assert len(path.read_text()) <= 4096


def test_non_finite_numbers_are_served_as_valid_json(tmp_path):
    """NaN/Infinity are not JSON: the progress endpoint and the termination log carry null instead, so the
    operator never copies a value the API server rejects."""
    import json
    import urllib.request

    from ddp_trainer.progress import ProgressServer

    progress = Progress(world_size=1)
    progress.update(step=4, loss=float("nan"), samplesPerSecond=float("inf"),
                    metrics={"acc": float("-inf"), "nested": {"x": [1.0, float("nan")]}, "ok": 0.5})
    server = ProgressServer(progress, 0, host="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/progress", timeout=5) as r:
            text = r.read().decode()
    finally:
        server.close()

    def strict(s):
        return json.loads(s, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in {s}"))

    served = strict(text)
    assert served["step"] == 4 and served["loss"] is None and served["samplesPerSecond"] is None
    assert served["metrics"] == {"acc": None, "nested": {"x": [1.0, None]}, "ok": 0.5}
    path = tmp_path / "termination-log"
    assert write_termination_log(str(path), {**progress.snapshot(), "final": True})
    final = strict(path.read_text())
    assert final["loss"] is None and final["final"] is True


def test_flatten_roundtrip():
    tree = {"a": [torch.ones(2), (1, torch.zeros(1))], "b": {"c": "s"}}
    skel, tensors = flatten(tree)
    assert len(tensors) == 2
    back = unflatten(skel, tensors)
    assert back["b"] == {"c": "s"} and back["a"][1][0] == 1 and torch.equal(back["a"][0], torch.ones(2))


def test_high_water_mark_survives_a_reopen_and_ignores_other_runs(tmp_path):
    from ddp_trainer.recovery import HighWaterMark

    mark = HighWaterMark(str(tmp_path), "job/a", local_rank=1)
    assert mark.read() is None  # nothing completed yet
    mark.write(41, at=100.0)
    mark.write(42, at=101.5)
    mark.close()
    again = HighWaterMark(str(tmp_path), "job/a", local_rank=1)  # a restarted worker, same pod
    assert again.read() == (42, 101.5)
    assert HighWaterMark(str(tmp_path), "job/b", local_rank=1).read() is None  # another run's file
    assert HighWaterMark(str(tmp_path), "job/a", local_rank=0).read() is None  # another local rank's
    again.close(remove=True)
    assert not os.path.exists(again.path)


def test_recovery_record_steps_lost_is_the_highest_mark_minus_the_restored_step_never_clamped():
    from ddp_trainer.recovery import complete, recovery_record

    rec, last = recovery_record("peer", 40, [(41, 10.0), (40, 9.0), None], restored_from_pod="job-0")
    assert rec == {"resumedFrom": "peer", "step": 40, "highestStep": 41, "stepsLost": 1,
                   "restoredFromPod": "job-0", "seconds": None, "at": None}
    assert last == 10.0
    done = complete(rec, last, 19.25)
    assert done["seconds"] == 9.25 and done["at"] == 19.25 and done["stepsLost"] == 1
    # a restore ahead of every mark is shown as it is (a bug to see, not to hide)
    assert recovery_record("local", 43, [(41, 1.0)])[0]["stepsLost"] == -2
    # sources in the contract's words
    assert recovery_record("checkpoint", 30, [(37, 1.0)])[0]["resumedFrom"] == "disk"
    assert recovery_record("fresh", 0, [(12, 1.0)])[0] | {} == {
        "resumedFrom": "start", "step": 0, "highestStep": 12, "stepsLost": 12, "restoredFromPod": None,
        "seconds": None, "at": None}
    # no mark survived (every pod replaced) but torchrun restarted the workers: a recovery, cost unknown
    rec, last = recovery_record("fresh", 0, [None, None], restart_count=1)
    assert rec["highestStep"] is None and rec["stepsLost"] is None and last is None
    assert complete(rec, last, 5.0)["seconds"] is None
    # a first start is no recovery
    assert recovery_record("fresh", 0, [None, None]) == (None, None)


def test_progress_report_names_its_rank_and_worker_restarts():
    p = Progress(4, rank=2, worker_restarts=3)
    snap = p.snapshot()
    assert snap["rank"] == 2 and snap["workerRestarts"] == 3 and snap["worldSize"] == 4


def test_process_start_time_is_this_process_start():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.5)
        started = process_start_time(child.pid)
        assert started is not None and before - 0.05 <= started <= before + 0.45
    finally:
        child.kill()
        child.wait()
    assert process_start_time(os.getpid()) < before
    assert process_start_time(2**22 + 12345) is None  # no such process


def test_launch_logs_a_failure_without_importing_dynamo():
    """The agent's log of a failed worker must not import torch._dynamo (seconds on a recovery's critical path),
    and must still carry the traceback."""
    code = (
        "import logging, sys\n"
        "from ddp_trainer import launch\n"
        "launch._tune_torchrun(0.1)\n"
        "from torch.distributed.elastic.utils.logging import get_logger\n"
        "log = get_logger('torch.distributed.elastic.multiprocessing.api')\n"
        "try:\n"
        "    raise RuntimeError('worker failed')\n"
        "except RuntimeError:\n"
        "    log.exception('failed (exitcode: 1)')\n"
        "print('dynamo imported:', 'torch._dynamo' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "trainer"), "LOGLEVEL": "INFO"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert "dynamo imported: False" in p.stdout, p.stdout + p.stderr
    assert "failed (exitcode: 1)" in p.stderr and "RuntimeError: worker failed" in p.stderr, p.stderr


def test_launch_preload_never_touches_cuda():
    """The forkserver's imports must not initialise CUDA or query the driver (a forked worker could not use the
    GPU): nothing in PRELOAD may call torch's device count or lazy CUDA init."""
    code = (
        "import torch, torch.cuda\n"
        "calls = []\n"
        "count, init = torch._C._cuda_getDeviceCount, torch.cuda._lazy_init\n"
        "torch._C._cuda_getDeviceCount = lambda: calls.append('device count') or count()\n"
        "torch.cuda._lazy_init = lambda: calls.append('lazy init') or init()\n"
        "from ddp_trainer import launch\n"
        "for name in launch.PRELOAD:\n"
        "    __import__(name)\n"
        "print('cuda calls:', calls, torch.cuda.is_initialized())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "trainer")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stderr
    assert "cuda calls: [] False" in p.stdout, p.stdout + p.stderr


def _spare_round():
    """torch's rendezvous state after a loss: a new round with the survivor in it and one place left, the spare
    (higher priority) in the redundancy list, the pod recreated for the lost one in the wait list."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from ddp_trainer import rendezvous

    survivor, spare, newcomer = (dr._NodeDesc(f"10.0.0.{i}", 100 + i, 0) for i in range(3))
    state = dr._RendezvousState()
    state.round, state.complete = 3, False
    state.participants = {survivor: 0}
    state.wait_list = {newcomer}
    state.redundancy_list = {spare}
    state.last_heartbeats = {n: datetime.now(timezone.utc) for n in (survivor, spare, newcomer)}
    setattr(state, rendezvous._LAST, {survivor})
    setattr(state, rendezvous._ORDER, {survivor: 1, spare: 2})
    settings = dr.RendezvousSettings("run", 2, 2, dr.RendezvousTimeout(), timedelta(seconds=1), 3)
    join = rendezvous._spare_aware(dr._RendezvousJoinOp())
    ask = lambda node: join(dr._RendezvousContext(node, state, settings), time.monotonic() + 60)  # noqa: E731
    return dr._Action, (survivor, spare, newcomer), state, settings, ask


def test_rendezvous_newcomer_waits_for_a_redundant_spare_with_a_higher_priority():
    """ddpjob-c10d rule 2 on torch's own rendezvous state. The spare still sits in the redundancy list (it moves to
    the wait list only at its next poll): the place is the spare's, so the newcomer waits; the spare takes it."""
    action, (_, spare, newcomer), _, _, ask = _spare_round()
    assert ask(newcomer) in (action.SYNC, action.KEEP_ALIVE)
    assert ask(spare) in (action.REMOVE_FROM_REDUNDANCY_LIST, action.ADD_TO_PARTICIPANTS)


def test_rendezvous_a_spare_moves_between_the_lists_in_one_write():
    """torch moves a redundant agent to the wait list in two state writes, with the agent in no list between them;
    a newcomer deciding rule 2 then would not count the spare and take its place (seen in CI). ddpjob-c10d's
    executor makes each move one write: out of the redundancy list means into the wait list, and back."""
    from ddp_trainer import rendezvous

    action, (survivor, spare, newcomer), state, settings, ask = _spare_round()
    executor = rendezvous._executor_class()(spare, None, settings)
    executor._state = state
    executor._remove_from_redundancy_list()
    assert spare in state.wait_list and spare not in state.redundancy_list
    assert spare in state.last_heartbeats  # torch drops it here; a round completed now would forget the spare
    assert ask(newcomer) in (action.SYNC, action.KEEP_ALIVE)
    assert ask(spare) == action.ADD_TO_PARTICIPANTS

    # A full round completed without it: straight from the wait list into the redundancy list.
    state.participants, state.complete = {survivor: 0, newcomer: 1}, True
    assert ask(spare) == action.ADD_TO_REDUNDANCY_LIST
    executor._add_to_redundancy_list()
    assert spare in state.redundancy_list and spare not in state.wait_list


def test_rendezvous_a_recreated_pods_agent_takes_its_predecessors_place():
    """Rule 4 of ddp_trainer.rendezvous on torch's own rendezvous state, with plain c10d's executor as
    ddp_trainer.launch runs it. A complete round of two lost one agent to a SIGKILL: it could not leave, its
    heartbeat is fresh, and the survivor already rejoined the wait list. Without rule 4 the round stays complete
    until that heartbeat expires (60 s here). The agent of the recreated pod (the same DDPJOB_POD_INDEX) enters and,
    in that same write, takes the dead agent out: the round is over and the survivor and the newcomer form the next
    one at once. The old agent, should it still run, cannot take the place back."""
    from datetime import timedelta

    import pytest
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from ddp_trainer import rendezvous

    survivor, dead, newcomer = (dr._NodeDesc(f"10.0.0.{i}", 100 + i, 0) for i in range(3))
    settings = dr.RendezvousSettings("run", 2, 2, dr.RendezvousTimeout(), timedelta(seconds=30), 2)

    def after_the_loss(pod: str | None):
        state = dr._RendezvousState()
        state.round, state.complete = 5, True
        state.participants = {dead: 1}
        state.wait_list = {survivor}
        state.last_heartbeats = {n: datetime.now(timezone.utc) for n in (survivor, dead)}
        setattr(state, rendezvous._POD, {survivor: "0", dead: "1"})
        return state, executor_of(newcomer, pod, state)

    def executor_of(node, pod: str | None, state):
        executor = rendezvous._executor_class(False)(node, None, settings)
        executor._state, executor.pod = state, pod
        return executor

    def ask(state, node, op=None):
        return (op or dr._RendezvousJoinOp())(dr._RendezvousContext(node, state, settings), time.monotonic() + 60)

    # Without a pod (plain torchrun outside a DDPJob) the newcomer waits behind the dead agent.
    state, executor = after_the_loss(None)
    assert ask(state, newcomer) == dr._Action.ADD_TO_WAIT_LIST
    executor._add_to_wait_list()
    assert state.complete and dead in state.participants and state.round == 5

    state, executor = after_the_loss("1")
    assert ask(state, newcomer) == dr._Action.ADD_TO_WAIT_LIST
    executor._add_to_wait_list()
    assert not state.complete and state.round == 6, "the round the dead agent held is over"
    assert dead not in state.participants and dead not in state.last_heartbeats
    assert getattr(state, rendezvous._POD) == {survivor: "0", newcomer: "1"}
    for node, pod in ((survivor, "0"), (newcomer, "1")):
        assert ask(state, node) == dr._Action.ADD_TO_PARTICIPANTS
        executor_of(node, pod, state)._add_to_participants()
    assert state.complete and set(state.participants) == {survivor, newcomer}

    # The old agent (a pod force-deleted on a node that lost its connection) cannot rejoin.
    with pytest.raises(rendezvous.TakenOver, match="replaced by a newer agent of pod 1"):
        rendezvous._not_taken_over(dr._RendezvousJoinOp(), True, "1")(
            dr._RendezvousContext(dead, state, settings), time.monotonic() + 60)
    assert rendezvous._not_taken_over(dr._RendezvousKeepAliveOp(), False, "1")(
        dr._RendezvousContext(dead, state, settings), time.monotonic() + 60) == dr._Action.FINISH


def test_rendezvous_an_agent_taken_out_stops_at_its_next_look_while_training():
    """Rule 4 while an agent trains, on torch's own handler over a real TCPStore. A frozen node's agent is woken after
    its pod was recreated elsewhere and the replacement took it out; its workers may be blocked in a collective or a
    store wait that ends only at the process group's timeout (a woken agent once outlived its replacement's whole
    job). The agent's every-monitor-interval look at the rendezvous (``num_nodes_waiting``) says TakenOver, so it
    stops with its workers then; until it is taken out the look is torch's count, unchanged."""
    from datetime import timedelta

    import pytest
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from ddp_trainer import rendezvous
    from ddp_trainer.testing import free_port

    store = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    backend = C10dRendezvousBackend(store, "taken")
    timeout = dr.RendezvousTimeout(last_call=timedelta(seconds=0.1))
    handler = dr.DynamicRendezvousHandler.from_backend("taken", store, backend, 1, 2, timeout=timeout,
                                                      keep_alive_interval=1, keep_alive_max_attempt=30)
    assert rendezvous.enable_take_over(handler, "1")
    handler._state_holder._cache_duration = 0  # every look reads the store (torch caches it 1 s)
    handler._op_executor.run(dr._RendezvousJoinOp(), time.monotonic() + 30)  # it trains alone in the round
    assert handler._state_holder.state.complete and handler.num_nodes_waiting() == 0

    replacement = rendezvous._executor_class(False)(
        dr._NodeDesc("10.0.0.9", 1, 7), dr._BackendRendezvousStateHolder(backend, handler._settings, 0),
        handler._settings)
    replacement.pod = "1"
    replacement.run(dr._RendezvousJoinOp(), time.monotonic() + 30)
    assert set(replacement._state_holder.state.participants) == {replacement._node}
    with pytest.raises(rendezvous.TakenOver, match="replaced by a newer agent of pod 1"):
        handler.num_nodes_waiting()

    # Another pod's agent is not affected by it.
    other = dr.DynamicRendezvousHandler.from_backend("taken", store, backend, 1, 2, timeout=timeout)
    assert rendezvous.enable_take_over(other, "0")
    assert other.num_nodes_waiting() == 0


def test_rendezvous_an_agent_restarted_in_place_has_a_name_of_its_own():
    """torch names an agent <address>_<pid>_<n>, n counting handlers per process; a container restarted in place
    runs its agent as PID 1 again at the same pod IP, so it had its predecessor's name (on kind: refused as the agent
    taken out, restart after restart). Rule 4 draws n per agent process instead."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from ddp_trainer import rendezvous

    class Handler:  # the one attribute fresh_identity reads and writes
        def __init__(self) -> None:
            self._this_node = dr._NodeDesc("10.244.1.7", 1, 0)

    names = {rendezvous.fresh_identity(Handler()) for _ in range(20)}
    assert len(names) == 20
    assert all(n.addr == "10.244.1.7" and n.pid == 1 and n.local_id >= 0 for n in names)


def test_rendezvous_a_new_rounds_participants_outlive_a_stall_until_each_read_it(monkeypatch):
    """Rule 5 of ddp_trainer.rendezvous on torch's own state holder over a real TCPStore. Two agents complete a round;
    then one is held up past the keep-alive expiry before it sent a heartbeat in the round (its store client busy, its
    process stopped). torch's sanitizer, run by the other agent's next heartbeat and by its own sync when it wakes,
    drops it: it leaves the round just completed and the other waits for it in vain (on kind: 60 s, then a restart).
    Under rule 5 both keep their places until each has sent a heartbeat in the round, and torch's expiry works again
    afterwards: a participant silent from then on is dropped."""
    from datetime import timedelta
    from threading import Thread

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from ddp_trainer import rendezvous
    from ddp_trainer.testing import free_port

    expiry = 0.4  # keep-alive interval 0.2 s x 2 attempts
    monkeypatch.setattr(dr, "_delay", lambda seconds: time.sleep(0.05))  # the join loop polls faster than the expiry
    settings = dr.RendezvousSettings("run", 2, 2, dr.RendezvousTimeout(), timedelta(seconds=0.2), 2)
    store = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)

    def agents(executor_class, run_id):
        backend = C10dRendezvousBackend(store, run_id)
        made = []
        for i in range(2):
            holder = dr._BackendRendezvousStateHolder(backend, settings, cache_duration=0)
            made.append(executor_class(dr._NodeDesc(f"10.0.0.{i}", 100 + i, 0), holder, settings))
        first = Thread(target=made[0].run, args=(dr._RendezvousJoinOp(), time.monotonic() + 30))
        first.start()
        made[1].run(dr._RendezvousJoinOp(), time.monotonic() + 30)
        first.join(30)
        return made

    def heartbeat(executor):
        executor.run(dr._RendezvousKeepAliveOp(), time.monotonic() + 30)
        return executor._state_holder.state

    def while_stalled(live):  # the other agent is silent past the expiry; this one beats as a healthy agent does
        end = time.monotonic() + expiry + 0.3
        while time.monotonic() < end:
            state = heartbeat(live)
            time.sleep(0.05)
        return state

    # torch's executor: the stalled agent is dropped from the round it completed, and it finds itself out. Its round
    # must first complete, which on a loaded machine a starved joiner can already spoil (the very drop rule 5
    # prevents, at the round's start): formed again under a new run id, a few times at most.
    for attempt in range(5):
        slow, peer = agents(dr._DistributedRendezvousOpExecutor, f"plain-{attempt}")
        if slow._state_holder.state.complete and peer._state_holder.state.complete:
            break
    assert slow._state_holder.state.complete, "torch's executor never completed a round of two here"
    assert set(while_stalled(peer).participants) == {peer._node}, "torch's expiry drops the stalled agent"
    assert slow._node not in heartbeat(slow).participants

    slow, peer = agents(rendezvous._executor_class(False), "rule5")
    state = while_stalled(peer)
    assert state.complete and set(state.participants) == {slow._node, peer._node}, "kept: it has not heard yet"
    assert set(heartbeat(slow).participants) == {slow._node, peer._node}, "its own stale heartbeat is not judged"
    assert getattr(slow._state_holder.state, rendezvous._READ) == {slow._node, peer._node}
    assert set(while_stalled(peer).participants) == {peer._node}, "torch's expiry again once both heard of the round"

    # A participant that never heard of the round is kept ROUND_START_GRACE at most.
    slow, peer = agents(rendezvous._executor_class(False), "grace")
    monkeypatch.setattr(rendezvous, "ROUND_START_GRACE", expiry)
    assert set(while_stalled(peer).participants) == {peer._node}
